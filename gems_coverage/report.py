"""Turn traces into the JSON document, tables (plain, markdown, CSV) and the op x model matrix."""
from __future__ import annotations

import csv
import io
import json
from typing import Optional

from . import SCHEMA_VERSION
from . import classify as C
from . import gemsinfo

FORMATS = ("table", "json", "markdown", "csv")


def _pct(n: int, d: int) -> float:
    return round(100.0 * n / d, 1) if d else 0.0


# ----------------------------------------------------------------------------------------- one trace
def trace_to_dict(res) -> dict:
    """The JSON document of one trace (schema: docs/coverage-schema.md)."""
    info: gemsinfo.GemsInfo = res.gems
    timed = res.times is not None
    total_time = sum(res.times.values()) if timed else 0.0
    ops = []
    for st in res.ops.values():
        impl = info.impls.get(st.name)
        served = (res.served or {}).get(st.name) if res.gems_enabled else None
        t = res.times.get(st.name, 0.0) if timed else None
        ops.append({
            "name": st.name,
            "category": st.category,
            "calls": st.calls,
            "covered": impl is not None,
            "dtypes": sorted(st.dtypes),
            "devices": sorted(st.devices),
            "example_shapes": st.example,
            "distinct_shapes": len(st.shapes),
            "first_call": st.first_call,
            "gems_category": impl.category if impl else None,
            "backward": impl.backward if impl else None,
            "dtype_supported": gemsinfo.dtype_supported(impl, st.first_dtypes),
            "served": (served or {}).get("served", 0) if res.gems_enabled else None,
            "fallback": (served or {}).get("fallback", 0) if res.gems_enabled else None,
            "fallback_reasons": (served or {}).get("reasons", {}) if res.gems_enabled else None,
            "time_us": round(t, 3) if timed else None,
            "time_share_pct": round(100.0 * t / total_time, 2) if timed and total_time else (0.0 if timed else None),
        })
    ops.sort(key=lambda o: _rank_key(o, timed))
    compute = [o for o in ops if o["category"] == C.COMPUTE]
    covered = [o for o in compute if o["covered"]]
    gaps = [o for o in compute if not o["covered"]]
    summary = {
        "distinct_ops": len(ops),
        "compute_ops": len(compute),
        "covered_compute_ops": len(covered),
        "coverage_pct": _pct(len(covered), len(compute)),
        "total_calls": sum(o["calls"] for o in ops),
        "compute_calls": sum(o["calls"] for o in compute),
        "covered_compute_calls": sum(o["calls"] for o in covered),
        "calls_coverage_pct": _pct(sum(o["calls"] for o in covered), sum(o["calls"] for o in compute)),
        "by_category": {c: sum(1 for o in ops if o["category"] == c) for c in C.CATEGORIES},
    }
    if timed:
        ct = sum(o["time_us"] for o in compute)
        summary["compute_time_us"] = round(ct, 3)
        summary["time_coverage_pct"] = round(100.0 * sum(o["time_us"] for o in covered) / ct, 1) if ct else 0.0
    if res.gems_enabled:
        summary["served_compute_ops"] = sum(1 for o in compute if o["served"])
        summary["fallback_compute_ops"] = sum(1 for o in compute if o["fallback"] and not o["served"])
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "gems-coverage",
        "model": res.model,
        "model_source": res.source,
        "size": res.size,
        "parameters": res.params,
        "mode": res.mode,
        "device": res.device,
        "dtype": res.dtype,
        "batch": res.batch,
        "seq_len": res.seq_len,
        "new_tokens": res.new_tokens,
        "gems": {
            "available": info.available,
            "version": info.version or None,
            "registered_ops": info.registered_ops,
            "backend": info.backend,
            "enabled": res.gems_enabled,
            "note": info.error or None,
        },
        "timed": timed,
        "time_source": res.time_source or None,
        "trace_seconds": round(res.seconds, 3),
        "summary": summary,
        "gaps": [o["name"] for o in gaps],
        "notes": list(res.notes),
        "ops": ops,
    }


def _rank_key(o, timed):
    # compute first, then by cost (time share when timed, else calls), then name
    cat = C.CATEGORIES.index(o["category"]) if o["category"] in C.CATEGORIES else 9
    cost = (o["time_us"] or 0.0) if timed else o["calls"]
    return (cat, -cost, -o["calls"], o["name"])


def _covered_cell(o, gems_enabled):
    if not o["covered"]:
        return "no" if o["category"] == C.COMPUTE else "-"
    if gems_enabled:
        s, f = o["served"] or 0, o["fallback"] or 0
        if s and f:
            return f"served {s}, fell back {f}"
        if s:
            return f"served {s}"
        if f:
            return f"fell back {f}"
    if o["dtype_supported"] is False:
        return "yes (dtype falls back)"
    return "yes"


def _header_lines(d: dict) -> list[str]:
    g = d["gems"]
    size = d["size"]
    params = f"{d['parameters'] / 1e9:.2f}B" if d["parameters"] >= 1e9 else f"{d['parameters'] / 1e6:.1f}M"
    shape = f"batch {d['batch']}, seq {d['seq_len']}"
    if d.get("new_tokens"):
        shape += f", {d['new_tokens']} new tokens"
    lines = [f"model   {d['model']} ({size}, {params} params)",
             f"run     {d['mode']} on {d['device']}, {d['dtype']}, {shape}"]
    if g["available"]:
        gl = f"gems    {g['registered_ops']} registered overloads" + (
            f" on backend '{g['backend']}'" if g.get("backend") else " (all backends: no backend here)")
        if g["enabled"]:
            gl += ", enabled (served / fell back per op)"
        else:
            gl += "; covered = registered" + (f" ({g['note']})" if g["note"] else "")
    else:
        gl = f"gems    unavailable: {g['note']}"
    lines.append(gl)
    return lines


def _op_rows(d: dict, categories=None):
    rows = []
    timed = d["timed"]
    for o in d["ops"]:
        if categories and o["category"] not in categories:
            continue
        row = [o["name"], C.CATEGORY_LABELS.get(o["category"], o["category"]), o["calls"]]
        if timed:
            row.append(f"{o['time_share_pct']:.1f}")
        row += [",".join(o["dtypes"]), _shorten(o["example_shapes"], 46), _covered_cell(o, d["gems"]["enabled"])]
        rows.append(row)
    head = ["op", "category", "calls"] + (["time %"] if timed else []) + ["dtypes", "example shapes", "gems"]
    return head, rows


def _shorten(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _summary_line(d: dict) -> str:
    s = d["summary"]
    line = (f"coverage {s['covered_compute_ops']}/{s['compute_ops']} compute ops = {s['coverage_pct']:.1f}%"
            f"  ({s['calls_coverage_pct']:.1f}% of compute calls")
    if "time_coverage_pct" in s:
        line += f", {s['time_coverage_pct']:.1f}% of compute time"
    line += f"; {s['distinct_ops']} distinct ops, {s['total_calls']} calls)"
    if "served_compute_ops" in s:
        line += f"; Gems served {s['served_compute_ops']} compute ops"
    return line


def _gaps_lines(d: dict, limit: int = 12) -> list[str]:
    gaps = [o for o in d["ops"] if o["category"] == C.COMPUTE and not o["covered"]]
    if not gaps:
        return ["gaps    none: Gems registers every compute op this run calls"]
    how = "time share" if d["timed"] else "calls"
    parts = []
    for o in gaps[:limit]:
        cost = f"{o['time_share_pct']:.1f}%" if d["timed"] else f"{o['calls']}"
        parts.append(f"{o['name']} ({cost})")
    more = f" ... and {len(gaps) - limit} more" if len(gaps) > limit else ""
    return [f"gaps    by {how}, most expensive first: " + ", ".join(parts) + more]


_PER_ALIGN = ("left", "left", "left", "left", "right", "right", "right", "right")


def _op_align(head):
    # keep "0.0" as written (tabulate would parse it to 0); numbers right-aligned
    return tuple("right" if h in ("calls", "time %") else "left" for h in head)


def format_trace(d: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(d, indent=2) + "\n"
    head, rows = _op_rows(d)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        cols = ["name", "category", "calls", "covered", "dtypes", "example_shapes", "served", "fallback",
                "time_us", "time_share_pct"]
        w.writerow(["model", "mode", "device", "dtype"] + cols)
        for o in d["ops"]:
            w.writerow([d["model"], d["mode"], d["device"], d["dtype"]] +
                       [";".join(o[c]) if isinstance(o[c], list) else ("" if o[c] is None else o[c])
                        for c in cols])
        return buf.getvalue()
    from tabulate import tabulate
    if fmt == "markdown":
        out = [f"## {d['model']}: {d['mode']} on {d['device']}", ""]
        out += [f"- {ln}" for ln in _header_lines(d)]
        out += [f"- {_summary_line(d)}", f"- {_gaps_lines(d)[0]}", ""]
        out.append(tabulate(rows, headers=head, tablefmt="github", colalign=_op_align(head), disable_numparse=True))
        return "\n".join(out) + "\n"
    out = _header_lines(d)
    out.append(_summary_line(d))
    out += _gaps_lines(d)
    out.append("")
    out.append(tabulate(rows, headers=head, tablefmt="simple", colalign=_op_align(head), disable_numparse=True))
    for n in d["notes"]:
        out.append(f"note: {n}")
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------------- model matrix
def matrix(docs: list[dict], info: gemsinfo.GemsInfo, all_ops: bool = False) -> dict:
    """Op x (model, mode) matrix from several trace documents."""
    cols = [f"{d['model']}|{d['mode']}" for d in docs]
    ops: dict[str, dict] = {}
    for d, col in zip(docs, cols):
        for o in d["ops"]:
            if not all_ops and o["category"] != C.COMPUTE:
                continue
            e = ops.setdefault(o["name"], {"name": o["name"], "category": o["category"],
                                           "covered": o["covered"], "calls": {}})
            e["calls"][col] = o["calls"]
    rows = sorted(ops.values(), key=lambda e: (e["covered"], C.CATEGORIES.index(e["category"]),
                                                -sum(e["calls"].values()), e["name"]))
    per = [{"model": d["model"], "mode": d["mode"], "device": d["device"], "dtype": d["dtype"],
            **{k: d["summary"][k] for k in ("distinct_ops", "compute_ops", "covered_compute_ops",
                                            "coverage_pct")}} for d in docs]
    compute = [e for e in ops.values() if e["category"] == C.COMPUTE]
    cov = [e for e in compute if e["covered"]]
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "gems-coverage",
        "kind": "report",
        "registered_ops": info.registered_ops,
        "columns": cols,
        "per_model": per,
        "overall": {"compute_ops": len(compute), "covered_compute_ops": len(cov),
                    "coverage_pct": _pct(len(cov), len(compute))},
        "ops": rows,
    }


def format_matrix(m: dict, fmt: str, header: Optional[list] = None) -> str:
    if fmt == "json":
        return json.dumps(m, indent=2) + "\n"
    import gems_models
    cols = m["columns"]
    short = []
    for c in cols:
        model, mode = c.split("|")
        short.append(f"{gems_models.short_name(model)} {'train' if mode == 'training' else mode[:3] if mode == 'generate' else 'inf'}")
    head = ["op", "gems"] + short
    rows = [[e["name"], "yes" if e["covered"] else "no"] + [e["calls"].get(c, "") for c in cols]
            for e in m["ops"]]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["op", "category", "covered"] + cols)
        for e in m["ops"]:
            w.writerow([e["name"], e["category"], int(e["covered"])] + [e["calls"].get(c, 0) for c in cols])
        return buf.getvalue()
    from tabulate import tabulate
    per_head = ["model", "mode", "device", "dtype", "distinct ops", "compute ops", "covered", "coverage %"]
    per_rows = [[p["model"], p["mode"], p["device"], p["dtype"], p["distinct_ops"], p["compute_ops"],
                 p["covered_compute_ops"], f"{p['coverage_pct']:.1f}"] for p in m["per_model"]]
    ov = m["overall"]
    overall = (f"overall: {ov['covered_compute_ops']}/{ov['compute_ops']} distinct compute ops covered "
               f"({ov['coverage_pct']:.1f}%), Gems registers {m['registered_ops']} overloads")
    gaps = [e for e in m["ops"] if e["category"] == C.COMPUTE and not e["covered"]]
    gap_line = "gaps (by calls over all models): " + (", ".join(
        f"{e['name']} ({sum(e['calls'].values())})" for e in
        sorted(gaps, key=lambda e: -sum(e["calls"].values()))) or "none")
    if fmt == "markdown":
        tf = "github"
        out = list(header or [])
        out += ["## Coverage per model", "", tabulate(per_rows, headers=per_head, tablefmt=tf, colalign=_PER_ALIGN, disable_numparse=True), "",
                f"**{overall}.**", "", "## Gaps", "", gap_line, "",
                "## Op x model matrix (calls; compute ops, uncovered first)", "",
                tabulate(rows, headers=head, tablefmt=tf), ""]
        return "\n".join(out)
    out = [tabulate(per_rows, headers=per_head, tablefmt="simple", colalign=_PER_ALIGN, disable_numparse=True), "", overall, gap_line, "",
           tabulate(rows, headers=head, tablefmt="simple")]
    return "\n".join(out) + "\n"
