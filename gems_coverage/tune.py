"""`gems-coverage tune MODEL`: tune a model's GEMMs once, before serving or training.

Gems tunes a GEMM bucket (M, N, K rounded up to powers of two, dtype, layouts, batch, bias: gems/ops/blas/matmul.py)
the first time a call of that bucket arrives: every Triton config and cuBLAS are timed, and the choice is
stored in the on-disk autotune cache (`$GEMS_CACHE_DIR/autotune/<arch>/`, default ~/.cache/gems). A model's
first step therefore pays the tuning, and a server would pay it on its first requests. `tune` runs each
workload once with Gems on (a prefill forward, a training step with the optimizer, or a short generate),
so that every bucket those calls reach is tuned and stored, and reports what was added: per tuner, the
buckets newly tuned and how many chose cuBLAS ("aten faster"). Later processes on the same GPU
architecture read the cache and tune nothing. Decode GEMMs (M <= 16) are never tuned (they always run
Triton); a generate's prompt forward is.

Tune with the shapes you will run: buckets round M, N and K up to powers of two, so a batch or sequence
length in another power-of-two range is another bucket. With `--patch` the patched model's calls are tuned
(the fused linear cross-entropy's chunk GEMMs differ from the unpatched loss's).

On a backend that cannot time kernels (the CPU interpreter) nothing is tuned or stored; the command still
runs the workloads and says so.

`--layers N` builds the model N layers deep: every layer makes the same calls, so a shallow copy meets the
same buckets in a fraction of the time and memory. `--table` runs TABLE_WORKLOADS, the workloads whose
picks Gems ships (`python scripts/ship_tuned.py` then copies them into gems/runtime/tuned/<arch>/); a GPU
test runs them again in an empty cache and requires that nothing is tuned.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

# The workloads whose buckets the shipped tables cover: the models of docs/perf.md at its sizes, plain and
# patched. Each entry is tune()'s keyword arguments.
TABLE_WORKLOADS = tuple(
    dict(spec, patch=patch) for spec in (
        dict(model="llama2", workloads=("prefill", "decode"), seq_len=2048),
        dict(model="llama-1.1b", workloads=("train",), batch=4, seq_len=1024),
        dict(model="bert", workloads=("train",), batch=32, seq_len=128),
        dict(model="gpt2-medium", workloads=("train",), batch=8, seq_len=1024),
        # gems-coverage distributed's Aquila-7B recipe: FSDP2 gathers each layer's weights before its GEMMs,
        # so every rank meets the single-GPU buckets of its own batch (1 x 128 tokens)
        dict(model="aquila", workloads=("train",), batch=1, seq_len=128),
    ) for patch in (False, True))


def table_model(name: str) -> str:
    """A TABLE_WORKLOADS model name as tune() takes it: a built-in name, or a config under
    benchmarks/configs/ (the families beyond the built-ins)."""
    from gems_models import ModelError, resolve
    try:
        resolve(name)
        return name
    except ModelError:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / f"{name}.json"
        if not path.is_file():
            raise ModelError(f"tune --table: {name} is neither a built-in nor {path}") from None
        return str(path)


def _snapshot(root: Path) -> dict:
    """{tuner name: {bucket: config}} of the autotune cache files under `root`."""
    out = {}
    for p in sorted(root.glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            out[p.stem] = {}
    return out


def _added(before: dict, after: dict) -> dict:
    """{tuner: {"tuned": n, "aten": n}} for the buckets in `after` that `before` lacks."""
    out = {}
    for name, buckets in after.items():
        new = [cfg for k, cfg in buckets.items() if k not in before.get(name, {})]
        if new:
            out[name] = {"tuned": len(new), "aten": sum(1 for c in new if isinstance(c, dict) and c.get("aten"))}
    return out


def tune(model: str, *, workloads=("prefill", "train"), device: str = "cuda", size: Optional[str] = None,
         dtype: Optional[str] = None, batch: int = 1, seq_len: Optional[int] = None, new_tokens: int = 4,
         optimizer: str = "adamw", patch=False, layers: Optional[int] = None,
         progress: Callable[[str], None] = lambda s: None) -> dict:
    """Run each workload of `model` once with Gems on; returns what the autotune cache gained (see the
    module docstring)."""
    import torch

    import gems
    import gems_models as M
    from gems.runtime.autotune import cache_dir
    from gems.runtime.backends import backend

    from .bench import WORKLOADS, validate, Workload
    from .runner import patch_options, patch_report, patched
    if not workloads:
        raise M.ModelError(f"tune: no workload given ({', '.join(WORKLOADS)})")
    popts, patch = patch_options(patch), patched(patch)
    checked = [(w, validate(model, w, device, optimizer, new_tokens, None, None, command="tune")) for w in workloads]
    recipe, on_cuda = checked[0][1]
    size, dtype_name, _, seq_len = M.run_defaults("cuda" if on_cuda else "cpu", size, dtype, seq_len)
    be = backend()
    root = cache_dir() / "autotune" / be.arch
    res = {"model": recipe.name, "device": device, "size": size, "dtype": dtype_name, "batch": batch,
           "seq_len": seq_len, "layers": layers, "patched": bool(patch), "cache": str(root), "backend": be.name,
           "can_tune": bool(be.can_benchmark), "workloads": [], "notes": []}
    if not be.can_benchmark:
        res["notes"].append(f"the {be.name} backend cannot time kernels: nothing is tuned or stored "
                            f"(each bucket takes the first config)")
    if on_cuda and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    progress(f"building {recipe.name} ({size}, {dtype_name}{f', {layers} layers' if layers else ''}) on {device}")
    bundle = M.build(recipe, size=size, device=device, dtype=dtype_name, batch=batch, seq_len=seq_len, seed=0,
                     dropout=0.0 if "train" in workloads else None, layers=layers)
    if patch:
        patch_report(bundle.model, popts, model)   # a model gems.patch refuses: bad input, before any run
    try:
        for w, _ in checked:
            progress(f"{w}: one run with Gems on")
            before = _snapshot(root)
            # no agreement run: the starting weights are not copied (a 7B model's would be 13 GiB)
            wl = Workload(bundle, w, new_tokens, optimizer, None, None, patch, popts, keep_start=False)
            t0 = time.perf_counter()
            wl.first(True)
            seconds = time.perf_counter() - t0
            added = _added(before, _snapshot(root))
            res["workloads"].append({"workload": w, "seconds": round(seconds, 2), "added": added,
                                     "tuned": sum(v["tuned"] for v in added.values()),
                                     "aten": sum(v["aten"] for v in added.values())})
            del wl
    finally:
        gems.disable()
    res["cache_entries"] = {k: len(v) for k, v in _snapshot(root).items()}
    return res


def format_result(r: dict, fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps(r, indent=1) + "\n"
    from tabulate import tabulate
    rows = [[w["workload"], w["seconds"], w["tuned"], w["aten"],
             ", ".join(f"{k} {v['tuned']}" for k, v in w["added"].items()) or "-"] for w in r["workloads"]]
    depth = f", {r['layers']} layers" if r.get("layers") else ""
    head = (f"gems-coverage tune {r['model']} ({r['size']}, {r['dtype']}, batch {r['batch']}, seq {r['seq_len']}"
            f"{depth}{', patched' if r['patched'] else ''}) on {r['device']}: cache {r['cache']}\n")
    table = tabulate(rows, headers=["workload", "seconds", "buckets tuned", "chose cuBLAS", "per tuner"])
    total = ", ".join(f"{k}: {n}" for k, n in r["cache_entries"].items()) or "empty"
    return head + table + f"\ncache now holds: {total}\n" + "".join(f"note: {n}\n" for n in r["notes"])
