"""``gems-coverage``: trace, report, roadmap, parity, bench, bench-plot, ops.

Results go to stdout (or ``--output FILE``), progress to stderr. Exit codes: 0 ok, 1 a gate failed
(``--fail-under``, parity mismatch), 2 bad input (unknown model, malformed config, bad option; one line on
stderr), 3 an unexpected error while running the model (one line; ``GEMS_COVERAGE_DEBUG=1`` shows the
traceback).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

PROG = "gems-coverage"


class UsageError(Exception):
    pass


class GateFailed(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def _positive_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{s}'") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{s}'")
    return v


def _nonneg_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got '{s}'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got '{s}'")
    return v


def _positive_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{s}'") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{s}'")
    return v


def _unit_interval(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got '{s}'") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got '{s}'")
    return v


def _pct(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got '{s}'") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage between 0 and 100, got '{s}'")
    return v


def build_parser() -> argparse.ArgumentParser:
    from . import report as R
    from .runner import OPTIMIZERS
    p = _Parser(prog=PROG, description="Which ATen ops a model calls, which Gems covers, what is missing, "
                                       "and whether the model gives the same answers with Gems on.")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress, warnings or profiler lines on stderr (errors still)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def run_opts(sp, default_modes=None):
        sp.add_argument("--device", default="meta", help="meta (default; full size, no data), cpu (tiny by "
                                                       "default), cuda")
        sp.add_argument("--size", choices=("full", "tiny"), default=None,
                        help="full-size architecture or its tiny variant (default: tiny on cpu, else full)")
        sp.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on meta "
                                                      "and cuda, float32 on cpu)")
        sp.add_argument("--batch", type=_positive_int, default=1)
        sp.add_argument("--seq-len", type=_positive_int, default=None,
                        help="text tokens (default 128 full size, 8 tiny)")
        sp.add_argument("--new-tokens", type=_positive_int, default=None,
                        help="tokens for --mode generate (default 4; only with generate)")

    def sample_opts(sp):
        sp.add_argument("--sample", action="store_true",
                        help="generate by sampling (transformers' temperature/top-k/top-p warpers, softmax, "
                             "multinomial) instead of greedy argmax; only with generate")
        sp.add_argument("--temperature", type=_positive_float, default=None,
                        help="--sample: logits divided by this (default 0.7; 1: off)")
        sp.add_argument("--top-k", type=_nonneg_int, default=None,
                        help="--sample: keep the k most likely tokens (default 50; 0: off)")
        sp.add_argument("--top-p", type=_unit_interval, default=None,
                        help="--sample: keep the smallest set of tokens reaching probability p (default 0.9; "
                             "1: off)")

    def out_opts(sp, formats=R.FORMATS):
        sp.add_argument("--format", choices=formats, default="table")
        sp.add_argument("--output", "-o", default=None, help="write the result to FILE instead of stdout")

    t = sub.add_parser("trace", help="trace one model: every ATen op, covered or not, gaps by cost")
    t.add_argument("model", help="built-in name or alias (llama2, bert, llava, aquila), a config.json, a "
                                 "model folder, or module:function (a function returning (model, inputs), "
                                 "its module importable: in the current folder, on PYTHONPATH or installed)")
    t.add_argument("--mode", choices=("inference", "generate", "training"), default="inference")
    run_opts(t)
    sample_opts(t)
    g = t.add_mutually_exclusive_group()
    g.add_argument("--gems", dest="gems", action="store_true", default=None,
                   help="run with Gems enabled and record served/fallback per op (default on cpu/cuda when "
                        "Gems has a backend there)")
    g.add_argument("--no-gems", dest="gems", action="store_false")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="--mode training's step: adamw (default: AdamW with foreach=True, what CUDA users run), "
                        "adamw-loop (foreach=False), adamw-fused (fused=True; not on meta) or sgd")
    t.add_argument("--no-profile", action="store_true", help="skip the torch.profiler timing run")
    t.add_argument("--fail-under", type=_pct, default=None, metavar="PCT",
                   help="exit 1 when compute-op coverage is below PCT")
    out_opts(t)

    r = sub.add_parser("report", help="op x model matrix for several models and modes")
    r.add_argument("models", nargs="*", help="models (default: the four built-ins)")
    r.add_argument("--modes", default="inference,training", help="comma-separated (default inference,training)")
    run_opts(r)
    sample_opts(r)
    r.add_argument("--all-ops", action="store_true", help="include view/creation/other ops in the matrix")
    r.add_argument("--fail-under", type=_pct, default=None, metavar="PCT")
    out_opts(r)

    m = sub.add_parser("roadmap", help="record a coverage snapshot and render docs/roadmap.md + PNG under the "
                                       "current folder (or --root)")
    m.add_argument("--root", default=None, help="folder the docs/roadmap* files are read from and written under "
                                                "(default: the current folder)")
    m.add_argument("--history", default=None, help="history file (default docs/roadmap/history.jsonl)")
    m.add_argument("--markdown", default=None, help="page to render (default docs/roadmap.md)")
    m.add_argument("--png", default=None, help="plot to render (default docs/roadmap/coverage.png)")
    m.add_argument("--no-record", action="store_true", help="only render from the existing history")
    m.add_argument("--date", default=None, help="snapshot date (default: today, UTC)")
    m.add_argument("--commit", default=None, help="snapshot commit (default: git HEAD)")
    m.add_argument("--models", default=None, help="comma-separated models (default: the four built-ins)")
    m.add_argument("--gpu-time", action="store_true",
                   help="also trace each model on CUDA under the profiler and record the share of compute "
                        "time in ops Gems registers (full size: needs a large GPU)")

    pa = sub.add_parser("parity", help="run with and without Gems, compare, name the first divergent op")
    pa.add_argument("model")
    pa.add_argument("--mode", choices=("inference", "training", "all"), default="all")
    pa.add_argument("--device", default="cpu", help="cpu (tiny, Triton interpreter; default) or cuda")
    pa.add_argument("--size", choices=("full", "tiny"), default=None)
    pa.add_argument("--dtype", default=None)
    pa.add_argument("--batch", type=_positive_int, default=1)
    pa.add_argument("--seq-len", type=_positive_int, default=None)
    pa.add_argument("--new-tokens", type=_positive_int, default=None,
                    help="greedy tokens of the generate check of --mode inference/all (default 4)")
    pa.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                    help="optimizer of the training step (default sgd: its update is linear in the gradient)")
    pa.add_argument("--no-shadow", action="store_true", help="skip the op-by-op shadow comparison")
    pa.add_argument("--include", default=None, help="comma-separated ATen names Gems serves (default all)")
    pa.add_argument("--exclude", default=None, help="comma-separated ATen names left to ATen")
    pa.add_argument("--patch", action="store_true",
                    help="the Gems run also patches the model with gems.patch (fused RMSNorm, RoPE, SwiGLU, "
                         "losses, ...); the ATen run stays unpatched")
    _patch_options_arg(pa)
    out_opts(pa, ("table", "json", "markdown"))

    b = sub.add_parser("bench", help="a workload with ATen and with Gems: time, tokens/s, peak memory, "
                                     "agreement, per-op cost")
    b.add_argument("model", help="built-in name or alias (llama2, bert, llava, aquila, llama-1.1b), a "
                                 "config.json, a model folder, or module:function")
    b.add_argument("--workload", choices=("prefill", "decode", "train"), default="prefill",
                   help="prefill: forward under no_grad; decode: greedy one-token steps with the KV cache after "
                        "a --seq-len prompt; train: forward with labels, backward, optimizer step")
    b.add_argument("--device", default="cpu", help="cuda (full size, bf16) or cpu (tiny, Triton interpreter; "
                                                    "timings meaningless; default)")
    b.add_argument("--size", choices=("full", "tiny"), default=None,
                   help="default: tiny on cpu, full on cuda")
    b.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    b.add_argument("--batch", type=_positive_int, default=1)
    b.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sequence (decode: the prompt; default 128 full size, 8 tiny)")
    b.add_argument("--new-tokens", type=_positive_int, default=None,
                   help="decode: tokens generated per run (>= 2; default 16; only with --workload decode)")
    b.add_argument("--steps", type=_positive_int, default=None,
                   help="timed runs per mode (default 5 on cuda, 1 on cpu)")
    b.add_argument("--warmup", type=_nonneg_int, default=None,
                   help="untimed runs per mode before the timed ones (default 2 on cuda, 1 on cpu)")
    b.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="train: AdamW with foreach=True (default; what CUDA users run), adamw-loop "
                        "(foreach=False), adamw-fused (fused=True), or sgd")
    b.add_argument("--include", default=None, help="comma-separated ATen names Gems serves (default all)")
    b.add_argument("--exclude", default=None, help="comma-separated ATen names left to ATen")
    b.add_argument("--fresh-lengths", action="store_true",
                   help="each warm-up and timed run meets sequence lengths no earlier run met. decode: a "
                        "prompt --new-tokens shorter than the last, so every token meets KV-cache lengths Gems "
                        "has not planned (a server's prompts of many lengths); prefill/train: the inputs one "
                        "position shorter than the last (dynamic padding). Without it the timed runs repeat "
                        "the warm-up's lengths")
    b.add_argument("--no-attribution", action="store_true", help="skip the profiled per-op attribution")
    b.add_argument("--patch", action="store_true",
                   help="the Gems turns also run the model patched by gems.patch (fused ops); the ATen turns "
                        "run it unpatched")
    _patch_options_arg(b)
    b.add_argument("--top", type=_positive_int, default=25, help="attribution rows shown (JSON has all)")
    b.add_argument("--plot", default=None, metavar="FILE",
                   help="also draw the attribution as a bar chart (PNG; needs matplotlib: pip install "
                        "'gems[plot]'); `bench-plot` draws it from a saved JSON")
    out_opts(b, ("table", "json", "markdown"))

    tu = sub.add_parser("tune", help="run a model's workloads once with Gems on so that every GEMM bucket they "
                                     "call is tuned and stored on disk before serving or training")
    tu.add_argument("model", help="built-in model or alias (llama2, bert, llava, aquila, llama-1.1b), a "
                                  "config.json or a model folder")
    tu.add_argument("--workloads", default="prefill,train",
                    help="comma-separated, some of prefill, train, decode (default prefill,train)")
    tu.add_argument("--device", default=None, help="default: cuda when available, else cpu (which tunes nothing)")
    tu.add_argument("--size", choices=("full", "tiny"), default=None, help="default: tiny on cpu, full on cuda")
    tu.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    tu.add_argument("--batch", type=_positive_int, default=1)
    tu.add_argument("--seq-len", type=_positive_int, default=None,
                    help="tokens per sequence: tune with the sizes you will run (default 128 full size, 8 tiny)")
    tu.add_argument("--new-tokens", type=_positive_int, default=None, help="decode: tokens generated (default 4)")
    tu.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    tu.add_argument("--patch", action="store_true", help="tune the calls of the model patched by gems.patch")
    _patch_options_arg(tu)
    out_opts(tu, ("table", "json"))

    bp = sub.add_parser("bench-plot", help="draw a saved `bench --format json` result as a bar chart (PNG)")
    bp.add_argument("json", help="a file written by `gems-coverage bench ... --format json -o FILE`")
    bp.add_argument("--output", "-o", required=True, help="the chart to write (PNG)")
    bp.add_argument("--top", type=_positive_int, default=25, help="ops shown, largest difference first")

    sub.add_parser("distributed", help="train MODEL with DDP/FSDP2 on N processes (torchrun), ATen vs Gems "
                                       "loss per step: gems-coverage distributed [--nproc N] MODEL ...")
    o = sub.add_parser("ops", help="the Gems registry: overload, category, dtypes, backward")
    o.add_argument("--category", default=None, help="only this Gems category")
    out_opts(o)
    for sp in sub.choices.values():   # -q also after the subcommand
        sp.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress, warnings or profiler lines on stderr (errors still)")
    return p


# ------------------------------------------------------------------------------------------ helpers
class _Ctx:
    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, msg: str):
        if not self.quiet:
            print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


def _emit(text: str, output: Optional[str], ctx: _Ctx):
    if output:
        path = Path(output)
        _check_parent(path)
        try:
            path.write_text(text)
        except OSError as e:
            raise UsageError(f"cannot write {output}: {e.strerror or e}") from None
        ctx.say(f"wrote {output}")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _check_parent(path: Path):
    """An output's folder must exist: a typo in a path is an error, never a silently created tree."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {path}: folder {parent} does not exist (create it first)")


def _patch_options_arg(p):
    p.add_argument("--patch-options", default=None, metavar="NAME=on|off,...",
                   help="gems.patch's options (implies --patch), e.g. layer_norm=on,cross_entropy=off: "
                        "measure or check the fused parts one by one")


def _patch_arg(a):
    """--patch / --patch-options as the `patch=` argument of bench and parity: False, True or a dict."""
    if a.patch_options is None:
        return a.patch
    out = {}
    for item in _split(a.patch_options) or []:
        name, sep, value = item.partition("=")
        v = value.strip().lower()
        if not sep or v not in ("on", "off", "1", "0", "true", "false"):
            raise UsageError(f"--patch-options: '{item}' is not NAME=on or NAME=off")
        out[name.strip()] = v in ("on", "1", "true")
    return out


def _split(s: Optional[str]):
    if s is None:
        return None
    return [x.strip() for x in s.split(",") if x.strip()]


# ----------------------------------------------------------------------------------------- commands
def _new_tokens(a, applies: bool, where: str, default: int = 4) -> int:
    """--new-tokens where it applies (its default when not given); given where it does not: bad input."""
    if a.new_tokens is None:
        return default
    if not applies:
        raise UsageError(f"--new-tokens applies to {where} only")
    return a.new_tokens


def _sampling(a, applies: bool, where: str):
    """The runner.Sampling that --sample (and its knobs) ask for, None for greedy; a knob without
    --sample, or --sample where nothing generates, is bad input."""
    knobs = [f for f, v in (("--temperature", a.temperature), ("--top-k", a.top_k), ("--top-p", a.top_p))
             if v is not None]
    if not getattr(a, "sample", False):
        if knobs:
            raise UsageError(f"{knobs[0]} applies with --sample only")
        return None
    if not applies:
        raise UsageError(f"--sample applies to {where} only")
    from .runner import Sampling
    d = Sampling()
    return Sampling(temperature=d.temperature if a.temperature is None else a.temperature,
                    top_k=d.top_k if a.top_k is None else a.top_k,
                    top_p=d.top_p if a.top_p is None else a.top_p)


def cmd_trace(a, ctx):
    from . import report as R
    from . import tracer
    new_tokens = _new_tokens(a, a.mode == "generate", "--mode generate")
    sampling = _sampling(a, a.mode == "generate", "--mode generate")
    if a.optimizer is not None and a.mode != "training":
        raise UsageError("--optimizer applies with --mode training only")
    res = tracer.trace(a.model, mode=a.mode, device=a.device, dtype=a.dtype, batch=a.batch, seq_len=a.seq_len,
                       size=a.size, new_tokens=new_tokens, use_gems=a.gems,
                       profile=False if a.no_profile else None, progress=ctx.say, sampling=sampling,
                       optimizer=a.optimizer or "adamw")
    d = R.trace_to_dict(res)
    _emit(R.format_trace(d, a.format), a.output, ctx)
    if a.fail_under is not None and d["summary"]["coverage_pct"] < a.fail_under:
        raise GateFailed(f"coverage {d['summary']['coverage_pct']:.1f}% is below --fail-under {a.fail_under:g}%")


def collect(models_, modes, a, ctx, info=None):
    """Trace every (model, mode) pair; returns the JSON documents."""
    from . import gemsinfo
    from . import report as R
    from . import tracer
    info = info or gemsinfo.load()
    docs = []
    for m in models_:
        for mode in modes:
            if mode == "generate":
                import gems_models as M
                if M.resolve(m).kind not in ("causal_lm", "llava"):
                    continue
            ctx.say(f"{m}: {mode}")
            res = tracer.trace(m, mode=mode, device=a.device, dtype=a.dtype, batch=a.batch, seq_len=a.seq_len,
                               size=a.size, new_tokens=a.new_tokens or 4, use_gems=False, profile=False,
                               gems_info=info, sampling=getattr(a, "sampling", None) if mode == "generate" else None)
            docs.append(R.trace_to_dict(res))
    return docs, info


def _modes(s):
    modes = _split(s) or []
    for m in modes:
        if m not in ("inference", "generate", "training"):
            raise UsageError(f"unknown mode '{m}' in --modes (inference, generate, training)")
    if not modes:
        raise UsageError("--modes is empty")
    return modes


def cmd_report(a, ctx):
    import gems_models as M
    from . import report as R
    names = a.models or M.builtin_names()
    recipes = [M.resolve(n) for n in names]   # fail fast on a bad name, before tracing anything
    modes = _modes(a.modes)
    _new_tokens(a, "generate" in modes, "--modes with generate")
    a.sampling = _sampling(a, "generate" in modes, "--modes with generate")
    if "generate" in modes and not any(r.kind in ("causal_lm", "llava") for r in recipes):
        raise UsageError("--modes generate needs a causal LM (or Llava); none of the models is one: "
                         + ", ".join(f"{r.name} ({r.kind})" for r in recipes))
    docs, info = collect(names, modes, a, ctx)
    mtx = R.matrix(docs, info, all_ops=a.all_ops)
    header = None
    if a.format == "markdown":
        header = _report_header(a, mtx)
    _emit(R.format_matrix(mtx, a.format, header), a.output, ctx)
    if a.fail_under is not None and mtx["overall"]["coverage_pct"] < a.fail_under:
        raise GateFailed(f"overall coverage {mtx['overall']['coverage_pct']:.1f}% is below --fail-under "
                         f"{a.fail_under:g}%")


def _report_header(a, mtx):
    import datetime
    from . import roadmap
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commit = roadmap.git_commit(roadmap.repo_root()) or "unknown"
    cmd = "gems-coverage report"
    if a.modes != "inference,training":
        cmd += f" --modes {a.modes}"
    if getattr(a, "sample", False):
        cmd += " --sample"
    return [
        "# Gems coverage of the supported models",
        "",
        f"Generated by `{cmd} --format markdown --output docs/coverage.md` on {date} at "
        f"commit `{commit}` (device `{a.device}`, full-size architectures with random weights). Do not "
        "edit by hand: run the command again.",
        "",
        "A compute op is *covered* when Gems registers that exact ATen overload. View/metadata "
        "(view, t, transpose, expand, slice, ...), creation/random (zeros, ones, arange, ...) and other ops "
        "(host syncs) are listed by `gems-coverage trace` but do not count. The meta device takes the math "
        "path for attention (`bmm` + `_safe_softmax`); on CPU and CUDA, `scaled_dot_product_attention` "
        "picks fused kernels instead, so trace on the device you care about "
        "(`gems-coverage trace MODEL --device cuda`). Training = forward, backward and one AdamW step "
        "(`foreach=True`, what CUDA users run: the `_foreach_*` ops). Generate = a prefill and one-token "
        "steps with the KV cache (with `--sample`: transformers' temperature / top-k / top-p warpers and "
        "`torch.multinomial`, else the argmax). Aquila-7B is built as `LlamaForCausalLM` "
        "with Aquila's config values.",
        "",
        "Coverage says which ops Gems serves, not whether the model gets faster: `gems-coverage bench MODEL "
        "--device cuda --workload prefill|decode|train` runs a workload with ATen and with Gems and "
        "attributes the throughput difference per ATen op (host and device time); see "
        "[coverage-schema.md](coverage-schema.md#bench) and [perf.md](perf.md).",
        "",
    ]


def cmd_roadmap(a, ctx):
    import gems_models as M
    from . import report as R
    from . import roadmap
    root = Path(a.root) if a.root else Path.cwd()
    hist = Path(a.history) if a.history else root / "docs" / "roadmap" / "history.jsonl"
    md = Path(a.markdown) if a.markdown else root / "docs" / "roadmap.md"
    png = Path(a.png) if a.png else root / "docs" / "roadmap" / "coverage.png"
    if a.root and not root.is_dir():
        raise UsageError(f"--root {a.root}: no such folder")
    for given, path in ((a.history, hist), (a.markdown, md), (a.png, png)):
        if given:
            _check_parent(path)
    if a.gpu_time and a.no_record:
        raise UsageError("--gpu-time records a snapshot: drop --no-record")
    if not a.no_record:
        from . import gemsinfo
        names = _split(a.models) or M.builtin_names()
        for n in names:
            M.resolve(n)
        info = gemsinfo.load()
        # the GPU first: no CUDA device is bad input, found before anything else runs
        gpu_time = roadmap.gpu_time_coverage(names, info, ctx.say) if a.gpu_time else None
        a.device, a.dtype, a.batch, a.seq_len, a.size, a.new_tokens = "meta", None, 1, None, None, 4
        docs, info = collect(names, ["inference", "training"], a, ctx, info)
        mtx = R.matrix(docs, info)
        snap = roadmap.snapshot(docs, mtx, info, date=a.date, commit=a.commit or roadmap.git_commit(roadmap.repo_root()),
                                gpu_time=gpu_time)
        roadmap.record(hist, snap)
        ctx.say(f"recorded snapshot {snap['date']} {snap['commit']} in {hist}")
    try:
        history = roadmap.load_history(hist)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not history:
        raise UsageError(f"{hist}: no snapshots yet (run without --no-record)")
    try:
        png_rel = os.path.relpath(png, md.parent)
    except ValueError:
        png_rel = str(png)
    text = roadmap.render_markdown(history, png_rel)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    ctx.say(f"wrote {md}")
    from . import plot
    missing = None
    try:
        plot.write_roadmap(png, history)
        ctx.say(f"wrote {png}")
    except plot.PlotUnavailable as e:   # the page is the result; the picture is optional
        missing = f"roadmap: {png} not drawn: {e}"
    print(roadmap.latest_line(history))
    if missing:   # with the result on stdout, where -q (which silences stderr) does not hide it
        print(missing)


def cmd_parity(a, ctx):
    from . import parity as P
    modes = ("inference", "training") if a.mode == "all" else (a.mode,)
    new_tokens = _new_tokens(a, "inference" in modes, "--mode inference or all (its generate check)")
    r = P.parity(a.model, modes=modes, device=a.device, size=a.size, dtype=a.dtype, batch=a.batch,
                 seq_len=a.seq_len, new_tokens=new_tokens, shadow=not a.no_shadow,
                 include=_split(a.include), exclude=_split(a.exclude), optimizer=a.optimizer,
                 patch=_patch_arg(a), progress=ctx.say)
    _emit(P.format_result(r, a.format), a.output, ctx)
    if not r.ok:
        if r.divergences:
            d = r.divergences[0]
            raise GateFailed(f"parity FAILED: first divergent op aten::{d.op} ({d.inputs})")
        raise GateFailed("parity FAILED: " + "; ".join(f"{c.phase} {c.name}" for c in r.checks if not c.ok))


def cmd_bench(a, ctx):
    from . import bench as B
    if a.plot:   # before the run: a long GPU run must not end without its chart
        if a.no_attribution:
            raise UsageError("--plot draws the per-op attribution: drop --no-attribution")
        _plot_available()
    new_tokens = _new_tokens(a, a.workload == "decode", "--workload decode", 16)
    r = B.bench(a.model, workload=a.workload, device=a.device, size=a.size, dtype=a.dtype, batch=a.batch,
                seq_len=a.seq_len, new_tokens=new_tokens, steps=a.steps, warmup=a.warmup, optimizer=a.optimizer,
                include=_split(a.include), exclude=_split(a.exclude), attribution=not a.no_attribution,
                patch=_patch_arg(a), fresh_lengths=a.fresh_lengths, progress=ctx.say)
    _emit(B.format_result(r, a.format, a.top), a.output, ctx)
    if a.plot:
        _write_bench_plot(a.plot, r.to_dict(), a.top, ctx)
    if not r.agree:
        raise GateFailed("bench: Gems and ATen disagree: " + "; ".join(
            f"{c['check']}: {c['detail']}" for c in r.agreement if not c["ok"]))


def cmd_tune(a, ctx):
    import torch

    from . import tune as T
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    wls = _split(a.workloads) or []
    r = T.tune(a.model, workloads=wls, device=device, size=a.size, dtype=a.dtype, batch=a.batch,
               seq_len=a.seq_len, new_tokens=_new_tokens(a, "decode" in wls, "--workloads with decode"),
               optimizer=a.optimizer, patch=_patch_arg(a), progress=ctx.say)
    _emit(T.format_result(r, a.format), a.output, ctx)


def _plot_available():
    from . import plot
    try:
        plot.require()
    except plot.PlotUnavailable as e:
        raise UsageError(str(e)) from None


def _write_bench_plot(path, d: dict, top: int, ctx):
    from . import plot
    try:
        plot.write_bench(path, d, top)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    ctx.say(f"wrote {path}")


def cmd_bench_plot(a, ctx):
    import json
    _plot_available()
    try:
        d = json.loads(Path(a.json).read_text())
    except OSError as e:
        raise UsageError(f"cannot read {a.json}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{a.json}: not JSON ({e.msg}, line {e.lineno})") from None
    from . import plot
    try:
        plot.check_bench(d)
    except ValueError as e:
        raise UsageError(f"{a.json}: {e}") from None
    _write_bench_plot(a.output, d, a.top, ctx)


def cmd_ops(a, ctx):
    from . import gemsinfo
    info = gemsinfo.load()
    if not info.available:
        raise UsageError(info.error)
    if a.category is not None:
        from gems.registry import CATEGORIES
        if a.category not in CATEGORIES:
            raise UsageError(f"unknown category '{a.category}' ({', '.join(CATEGORIES)})")
    rows = []
    for im in info.impls.values():
        if a.category and im.category != a.category:
            continue
        rows.append({"name": im.name, "category": im.category,
                     "dtypes": [str(d).replace("torch.", "") for d in im.dtypes], "backward": im.backward})
    if a.format == "json":
        import json
        text = json.dumps({"registered_ops": len(rows), "backend": info.backend, "ops": rows}, indent=2) + "\n"
    elif a.format == "csv":
        text = "name,category,dtypes,backward\n" + "".join(
            f"{r['name']},{r['category']},{';'.join(r['dtypes'])},{int(r['backward'])}\n" for r in rows)
    else:
        from tabulate import tabulate
        from .tracer import short_dtype
        table = [[r["name"], r["category"], ",".join(short_dtype(d) for d in r["dtypes"]),
                  "yes" if r["backward"] else ""] for r in rows]
        tf = "github" if a.format == "markdown" else "simple"
        text = tabulate(table, headers=["overload", "category", "dtypes", "backward"], tablefmt=tf) + "\n"
        text += f"\n{len(rows)} overloads" + (f", backend '{info.backend}'" if info.backend else
                                             f" ({info.error})" if info.error else "") + "\n"
    _emit(text, a.output, ctx)


@contextlib.contextmanager
def _quiet_stderr(quiet: bool):
    """-q: nothing on stderr while a command runs (Python warnings; and the lines torch's profiler and
    other native code write to file descriptor 2); the tool's own error line comes after, as usual."""
    if not quiet:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):   # no usable descriptor 2: Python warnings are silenced at least
            yield
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)


COMMANDS = {"trace": cmd_trace, "report": cmd_report, "roadmap": cmd_roadmap, "parity": cmd_parity,
            "bench": cmd_bench, "bench-plot": cmd_bench_plot, "tune": cmd_tune, "ops": cmd_ops}


def main(argv: Optional[list] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distributed"]:   # torchrun launcher; its options go to gems_coverage.distributed
        from .distributed import launch_main
        return launch_main(argv[1:])
    debug = os.environ.get("GEMS_COVERAGE_DEBUG", "") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:   # --help
        return int(e.code or 0)
    ctx = _Ctx(args.quiet)
    try:
        for opt in ("output", "plot"):   # before a long run, not after it
            if getattr(args, opt, None):
                _check_parent(Path(getattr(args, opt)))
        from . import gemsinfo
        gemsinfo.prepare_interpreter_env()
        import gems_models
        try:
            with _quiet_stderr(args.quiet):
                COMMANDS[args.command](args, ctx)
        except gems_models.ModelError as e:
            raise UsageError(str(e)) from None
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except GateFailed as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, never a traceback, unless asked for
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{PROG}: error while running: {type(e).__name__}: {msg} (GEMS_COVERAGE_DEBUG=1 shows the "
              f"traceback)", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
