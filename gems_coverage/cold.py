"""`gems-coverage bench MODEL --cold`: time to the first step on a machine that has compiled nothing.

Each mode runs in a process of its own, with a fresh, empty TRITON_CACHE_DIR (Triton's binaries) and
GEMS_CACHE_DIR (Gems' tuning picks) in a temporary folder, so nothing an earlier mode or run compiled,
loaded or tuned helps it:
- aten: the model with Gems unregistered (cuBLAS / ATen have no per-process compile step to speak of);
- gems: gems enabled as a user gets it: a functional op's call whose kernel is not compiled yet is
  answered by ATen while the kernel compiles on a thread pool (gems/runtime/background.py); after the
  two steps, the wait for the compiles still queued and a third step, with Gems serving what compiled,
  are reported too, and how many calls ATen answered meanwhile;
- gems+warmup: gems.warmup(model, inputs) first (its own time reported), then the steps, kernels
  compiling at their first launch (GEMS_COMPILE=inline). Warmup runs the model's forward (train: and
  backward) on the bench's inputs: the optimizer's kernels, and decode's one-token steps, still compile
  in the first step;
- gems+inline (only when asked for): GEMS_COMPILE=inline, every kernel compiled on the calling thread
  at its first launch, one after the other;
- gems+again (only when asked for, after gems): the gems mode once more in a fresh process on the cache
  folders gems left: a user's second run, its binaries and tuning picks on disk.
With --patch the Gems modes run the model patched by gems.patch (warmup too); aten runs it unpatched.
Per mode: the first and second step's wall time (decode: the whole first run, prompt and tokens; the
second run's per-token time is in the regular bench; prefill and train: enter_s, the part of the first
step's time spent entering the mode, gems.enable and gems.patch), and for gems+warmup the warmup's time
and kernel count. Model building is outside every timing. The child prints one JSON line, prefixed COLD_TAG.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ("aten", "gems", "gems+warmup")             # the default
ALL_MODES = MODES + ("gems+inline", "gems+again")
COLD_TAG = "GEMS_COLD_RESULT "


def modes_error(modes) -> str | None:
    """What is wrong with a list of cold modes, or None."""
    bad = [m for m in modes or [""] if m not in ALL_MODES]
    if bad:
        return f"unknown mode(s) {bad}; some of {', '.join(ALL_MODES)}"
    if "gems+again" in modes and "gems" not in modes[:list(modes).index("gems+again")]:
        return "gems+again reruns the gems mode on the caches it left: name gems before it"
    return None


def cold_bench(model: str, *, workload: str = "prefill", device: str = "cpu", size=None, dtype=None, batch: int = 1,
               seq_len=None, new_tokens: int = 16, optimizer: str = "adamw", include=None, exclude=None,
               patch=False, modes=None, timeout_s: float = 3600.0, progress=lambda s: None) -> dict:
    """Run each of `modes` in a fresh process with empty cache folders; {"model", ..., "modes": {mode: row}}.
    `patch` (True or gems.patch's options): the Gems modes run the model patched, as bench --patch."""
    from .runner import patch_options, patched
    spec = {"model": model, "workload": workload, "device": device, "size": size, "dtype": dtype, "batch": batch,
            "seq_len": seq_len, "new_tokens": new_tokens, "optimizer": optimizer, "include": include,
            "exclude": exclude, "patch": patch_options(patch) if patched(patch) else None}
    out = {**spec, "modes": {}}
    modes = tuple(modes or MODES)
    why = modes_error(modes)
    if why is not None:
        raise ValueError(why)
    with tempfile.TemporaryDirectory(prefix="gems-cold-") as tmp:
        for mode in modes:
            again = mode == "gems+again"
            progress(f"cold: {mode} in a fresh process with " + ("gems' caches" if again else "empty caches"))
            env = dict(os.environ)
            folder = os.path.join(tmp, "gems" if again else mode)
            env["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
            env["GEMS_CACHE_DIR"] = os.path.join(folder, "gems")
            env.pop("GEMS_QUIET", None)
            env["GEMS_COMPILE"] = "background" if mode in ("gems", "gems+again") else "inline"
            # the child's stderr is the user's: Gems' own progress notes (compiling, tuning) show as they come
            proc = subprocess.run([sys.executable, "-m", "gems_coverage.cold", json.dumps({**spec, "mode": mode})],
                                  env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
            rows = [line[len(COLD_TAG):] for line in proc.stdout.splitlines() if line.startswith(COLD_TAG)]
            if proc.returncode != 0 or not rows:
                tail = proc.stdout.strip().splitlines()[-5:]
                raise RuntimeError(f"cold {mode}: the child process failed (exit {proc.returncode}; its errors "
                                   f"are printed above)" + (": " + " | ".join(tail) if tail else ""))
            row = out["modes"][mode] = json.loads(rows[-1])
            progress(f"cold: {mode}: {_summary(row)}")
    return out


def _summary(row: dict) -> str:
    w = row.get("warmup_s")
    warm = f"warmup {w:.2f} s ({row.get('kernels', '?')} kernels), then " if w is not None else ""
    bg = (f"; {row['aten_answers']} calls answered by ATen while {row['kernels']} kernels compiled, "
          f"{row['drain_s']:.2f} s more for the last ones, third step {row['third_s']:.2f} s"
          if "third_s" in row else "")
    enter = f" ({row['enter_s']:.2f} s of it entering the mode)" if "enter_s" in row else ""
    return f"{warm}first step {row['first_s']:.2f} s{enter}, second {row['second_s']:.2f} s{bg}"


def format_cold(r: dict) -> str:
    """A plain table of a cold_bench result."""
    head = (f"cold start: {r['model']} {r['workload']} on {r['device']} (each mode in a fresh process, empty "
            f"Triton and Gems cache folders; model build not timed)")
    lines = [head, f"{'mode':<13} {'warmup s':>9} {'kernels':>8} {'1st step s':>11} {'to 1st step s':>14} "
                   f"{'2nd step s':>11}"]
    for mode, row in r["modes"].items():
        w = row.get("warmup_s")
        lines.append(f"{mode:<13} {'' if w is None else f'{w:.2f}':>9} {row.get('kernels', ''):>8} "
                     f"{row['first_s']:>11.3f} {row['first_s'] + (w or 0.0):>14.3f} {row['second_s']:>11.3f}")
    for mode, row in r["modes"].items():
        if "third_s" in row:
            loaded = f", {row['loaded']} loaded from disk on the calling thread" if row.get("loaded") else ""
            lines.append(f"{mode}: {row['aten_answers']} calls answered by ATen while {row['kernels']} kernels "
                         f"compiled{loaded}; {row['drain_s']:.2f} s more for the last ones after the second step, "
                         f"then a third step in {row['third_s']:.3f} s")
        if "inline_compiles" in row:
            slow = "; ".join(f"{k} {v:.2f} s" for k, v in list(row["inline_slowest"].items())[:5]) or "-"
            lines.append(f"{mode}: in the first step the calling thread waited {row['inline_compile_s']:.2f} s for "
                         f"{row['inline_compiles']} kernel compiles or disk loads (slowest: {slow}) and "
                         f"{row['tune_s']:.2f} s for {row['tuned']} first tunings")
        if "enter_s" in row and mode != "aten":
            lines.append(f"{mode}: {row['enter_s']:.3f} s of the first step entering the mode (gems.enable, "
                         f"gems.patch)")
        for i, rnd in enumerate(row.get("warmup_rounds") or (), 1):
            if rnd.get("kernels"):
                lines.append(f"{mode} round {i}: {rnd['kernels']} kernels compiled in {rnd['compile_s']:.2f} s; "
                             f"slowest: {'; '.join(rnd.get('slowest') or ()) or '-'}")
    if r["device"] == "cpu":
        lines.append("(CPU: kernels are interpreted, nothing compiles; timings say nothing about a GPU)")
    return "\n".join(lines)


def _child(spec: dict) -> dict:
    """One mode, in this (fresh) process: build, [warm up], two timed runs."""
    # the caches this mode starts from: the parent made fresh folders; a reused one would not be cold
    row = {"mode": spec["mode"], "caches_empty": all(not os.path.isdir(d) or not os.listdir(d) for d in (
        os.environ.get("TRITON_CACHE_DIR", ""), os.environ.get("GEMS_CACHE_DIR", "")))}
    import gems
    import gems_models as M
    from .bench import Workload, validate
    recipe, on_cuda = validate(spec["model"], spec["workload"], spec["device"], spec["optimizer"],
                               spec["new_tokens"], spec["include"], spec["exclude"])
    size, dtype_name, _, seq_len = M.run_defaults("cuda" if on_cuda else "cpu", spec["size"], spec["dtype"],
                                                   spec["seq_len"])
    train = spec["workload"] == "train"
    bundle = M.build(recipe, size=size, device=spec["device"], dtype=dtype_name, batch=spec["batch"],
                     seq_len=seq_len, seed=0, dropout=0.0 if train else None)
    popts = spec.get("patch")
    if popts is not None:   # refuses a model gems.patch replaces nothing in, before anything is timed
        from .runner import patch_report
        row["patched"] = patch_report(bundle.model, popts, spec["model"])["replaced"]
    wl = Workload(bundle, spec["workload"], spec["new_tokens"], spec["optimizer"], spec["include"], spec["exclude"],
                  patch=popts is not None, patch_options=popts, keep_start=False)
    on = spec["mode"] != "aten"
    row.update(size=size, dtype=dtype_name)
    if spec["mode"] == "gems+warmup":
        info = wl.compile_ahead()
        row["warmup_s"], row["kernels"], row["warmup_failed"] = info["seconds"], info["kernels"], info["failed"]
        row["warmup_rounds"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                                for r in info["per_round"]]
    for name in ("first_s", "second_s"):
        wl.sync()
        t0 = time.perf_counter()
        ms, _ = wl.timed(on)
        row[name] = time.perf_counter() - t0
        if name == "first_s" and on:
            # what the calling thread itself waited for in the first step: compiles (in-place and out=
            # calls, fused modules, GEMS_COMPILE=inline) and first tunings
            from gems.runtime import progress
            t = progress.totals()
            row["inline_compiles"], row["inline_compile_s"] = t["compile"][0], round(t["compile"][1], 3)
            row["tuned"], row["tune_s"] = t["tune"][0], round(t["tune"][1], 3)
            row["inline_slowest"] = dict(sorted(((k, round(v[1], 3)) for k, v in t["kernels"].items()),
                                                key=lambda kv: -kv[1])[:12])
        if name == "first_s" and spec["workload"] != "decode":
            # of the first step's time, what went to entering the mode (gems.enable, gems.patch) rather
            # than to the step itself (timed inside it)
            row["enter_s"] = max(0.0, row[name] - ms / 1e3)
    from gems.runtime import settings
    if on and settings.BACKGROUND_COMPILE:
        from gems.runtime import background
        row["background"] = True
        row["aten_answers"] = sum(st["reasons"].get(r, 0) for st in gems.stats().values() for r in st["reasons"]
                                  if "not compiled yet" in r)
        t0 = time.perf_counter()
        background.wait()
        row["drain_s"] = time.perf_counter() - t0
        st = background.stats()
        row["kernels"], row["background_failed"], row["loaded"] = st["compiled"], st["failed"], st["loaded"]
        wl.sync()
        t0 = time.perf_counter()
        wl.timed(on)
        row["third_s"] = time.perf_counter() - t0
    gems.disable()
    return row


if __name__ == "__main__":
    print(COLD_TAG + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
