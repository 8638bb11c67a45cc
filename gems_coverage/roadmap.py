"""Coverage over time: snapshots in docs/roadmap/history.jsonl, rendered to docs/roadmap.md; the plot's
data comes from here and is drawn by gems_coverage.plot (matplotlib, optional)."""
from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Callable, Optional

MODES = ("inference", "training")


def repo_root() -> Path:
    """The checkout this tool lives in (the parent of the gems_coverage package): its commit is the code a
    snapshot measured. Snapshots are written under the folder the user names, never here."""
    return Path(__file__).resolve().parent.parent


def git_commit(root: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def snapshot(docs: list, mtx: dict, info, date: Optional[str] = None, commit: Optional[str] = None,
             gpu_time: Optional[dict] = None) -> dict:
    """One history line. ``gpu_time`` (from gpu_time_coverage) adds each model and mode's share of compute
    time and the GPU it was measured on."""
    import torch
    cov: dict = {}
    for d in docs:
        cov.setdefault(d["model"], {})[d["mode"]] = {
            "coverage_pct": d["summary"]["coverage_pct"],
            "covered": d["summary"]["covered_compute_ops"],
            "compute_ops": d["summary"]["compute_ops"],
        }
    extra = {}
    if gpu_time:
        extra["gpu"] = gpu_time["gpu"]
        for (model, mode), pct in gpu_time["pct"].items():
            cov.setdefault(model, {}).setdefault(mode, {})["time_coverage_pct"] = pct
    return {**extra,
        "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit or "unknown",
        "registered_ops": info.registered_ops,
        "device": docs[0]["device"] if docs else "meta",
        "torch": torch.__version__.split("+")[0],
        "coverage": cov,
        "overall_pct": mtx["overall"]["coverage_pct"],
        "overall_covered": mtx["overall"]["covered_compute_ops"],
        "overall_compute_ops": mtx["overall"]["compute_ops"],
        "gaps": [e["name"] for e in mtx["ops"] if e["category"] == "compute" and not e["covered"]],
    }


def gpu_time_coverage(names: list, info, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Trace each model in inference and training on CUDA (full size, bf16, ATen alone) under the
    profiler: the share of compute-op device time spent in ops Gems registers. Ops say what Gems can
    serve; time says how much of the GPU's work that is (a model's few GEMMs outweigh its many
    pointwise ops). Returns {"gpu": name, "pct": {(model, mode): pct}}."""
    import torch
    import gems_models as M
    from . import report as R
    from . import tracer
    if not torch.cuda.is_available():
        raise M.ModelError("--gpu-time: no CUDA device on this machine")
    pct = {}
    for name in names:
        for mode in MODES:
            progress(f"{name}: {mode} on cuda (profiled)")
            res = tracer.trace(name, mode=mode, device="cuda", use_gems=False, profile=True, gems_info=info)
            pct[(res.model, mode)] = R.trace_to_dict(res)["summary"].get("time_coverage_pct")
            del res
            torch.cuda.empty_cache()   # the next full-size model needs the memory back
    return {"gpu": torch.cuda.get_device_name(), "pct": pct}


def load_history(path: Path) -> list:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: malformed history line ({e.msg})") from None
    return out


def record(path: Path, snap: dict) -> list:
    """Append a snapshot; one with the same date and commit replaces the earlier one (re-runs are idempotent)."""
    path = Path(path)
    hist = [h for h in load_history(path) if (h.get("date"), h.get("commit")) != (snap["date"], snap["commit"])]
    hist.append(snap)
    hist.sort(key=lambda h: h.get("date", ""))   # stable: same-day snapshots keep their order
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(h, sort_keys=True) + "\n" for h in hist))
    return hist


def _series_keys(history: list) -> list:
    keys = []
    for h in history:
        for model, modes in h.get("coverage", {}).items():
            for mode in modes:
                if (model, mode) not in keys:
                    keys.append((model, mode))
    import gems_models as M
    builtin = M.builtin_names()
    order = [m for m in builtin if any(k[0] == m for k in keys)]
    for m, _ in keys:
        if m not in order:
            order.append(m)
    return sorted(keys, key=lambda k: (order.index(k[0]), MODES.index(k[1]) if k[1] in MODES else 9))


def short_commit(commit: str) -> str:
    return (commit or "?")[:7]


def display_name(model: str) -> str:
    """The name a plot shows: the repository part of a hub id (Llama-2-7b, bert-base-uncased, ...)."""
    return model.rsplit("/", 1)[-1]


def plot_series(history: list) -> list:
    """What the roadmap plot draws: one dict per model x mode, oldest snapshot first, with `ops` (compute-op
    coverage %) and `time` (GPU-time coverage %), None where a snapshot has no value."""
    out = []
    for model, mode in _series_keys(history):
        cells = [(h.get("coverage", {}).get(model) or {}).get(mode) or {} for h in history]
        out.append({"model": model, "mode": mode, "label": f"{display_name(model)} {mode}",
                    "ops": [c.get("coverage_pct") for c in cells],
                    "time": [c.get("time_coverage_pct") for c in cells]})
    return out


def plot_xlabels(history: list) -> list:
    """One x tick per snapshot: its date over its short commit (several snapshots can share a date)."""
    return [f"{h.get('date', '?')}\n{short_commit(h.get('commit', ''))}" for h in history]


def render_markdown(history: list, png_rel: str) -> str:
    import gems_models as M
    last = history[-1]
    keys = _series_keys(history)
    timed = any(c.get("time_coverage_pct") is not None for m in last.get("coverage", {}).values()
                for c in m.values())
    lines = [
        "# Roadmap: Gems coverage of the supported models over time",
        "",
        "Generated by `gems-coverage roadmap` from `docs/roadmap/history.jsonl` (one snapshot per line: date, "
        "commit, registered-op count, coverage per model and mode). Do not edit by hand: run "
        "`gems-coverage roadmap` after a change to the registry to record a snapshot and render this page.",
        "",
        "Coverage = compute ops of the model (full size, traced on the meta device) whose exact ATen overload "
        "Gems registers, in % of the compute ops it calls. Training = forward, backward and one AdamW step.",
        "",
        f"![coverage over time]({png_rel})",
        "",
        "Top panel: compute ops covered; bottom panel: share of the compute ops' GPU time (ATen alone, "
        "`torch.profiler`) in ops Gems registers, recorded by `gems-coverage roadmap --gpu-time` on a CUDA "
        "machine. One line per model and mode, one point per snapshot (date and commit on the x axis); the "
        "latest values are written at the right edge.",
        "",
        f"## Latest snapshot: {last['date']}, commit `{last['commit']}`",
        "",
        f"Gems registers **{last['registered_ops']}** ATen overloads. Over the union of the compute ops of all "
        f"models and modes: **{last.get('overall_covered', 0)}/{last.get('overall_compute_ops', 0)} = "
        f"{last.get('overall_pct', 0):.1f}%**.",
        "",
        "| model | mode | covered / compute ops | coverage |" + (f" GPU time covered ({last.get('gpu')}) |"
                                                                  if timed else ""),
        "|---|---|---|---|" + ("---|" if timed else ""),
    ]
    for model, mode in keys:
        c = (last.get("coverage", {}).get(model) or {}).get(mode)
        if c and "coverage_pct" in c:
            t = c.get("time_coverage_pct")
            lines.append(f"| {model} | {mode} | {c['covered']}/{c['compute_ops']} | {c['coverage_pct']:.1f}% |"
                         + ((" -- |" if t is None else f" {t:.1f}% |") if timed else ""))
    gaps = last.get("gaps") or []
    lines += ["", "Uncovered compute ops, most called first over all models and modes (calls per model in "
                  "`docs/coverage.md`): " + (", ".join(f"`{g}`" for g in gaps) if gaps else "none"), ""]
    lines += ["## History", ""]
    head = ["date", "commit", "registered ops"] + [f"{M.short_name(m)} {'inf' if mo == 'inference' else 'train'}"
                                                    for m, mo in keys] + ["overall"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for h in reversed(history):
        row = [h.get("date", ""), f"`{h.get('commit', '')}`", str(h.get("registered_ops", ""))]
        for model, mode in keys:
            row.append(_history_cell((h.get("coverage", {}).get(model) or {}).get(mode) or {}))
        row.append(f"{h.get('overall_pct', 0):.1f}%")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return "\n".join(lines)


def _history_cell(c: dict) -> str:
    ops, t = c.get("coverage_pct"), c.get("time_coverage_pct")
    cell = "" if ops is None else f"{ops:.1f}%"
    return cell + ("" if t is None else f" (time {t:.1f}%)")


def latest_line(history: list) -> str:
    h = history[-1]
    return (f"roadmap: {len(history)} snapshot(s); latest {h['date']} {h['commit']}: {h['registered_ops']} "
            f"registered ops, overall compute coverage {h.get('overall_pct', 0):.1f}%")
