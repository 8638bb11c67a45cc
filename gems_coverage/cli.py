"""``gems-coverage``: trace, report, roadmap, parity, bench, bench-plot, tune, ops, distributed.

Results go to stdout (or ``--output FILE``), progress to stderr. Exit codes: 0 ok, 1 a gate failed
(``--fail-under``, parity mismatch), 2 bad input (unknown model, malformed config, bad option; one line on
stderr), 3 an unexpected error while running the model (one line; ``GEMS_COVERAGE_DEBUG=1`` shows the
traceback).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

from .arguments import GateFailed, UsageError
from .parser import PROG, build_parser


# ------------------------------------------------------------------------------------------ helpers
class _Ctx:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.lead = ""   # a line the result starts with (text formats)
        self.pending = ""   # a line said before the first progress line (bad input stays one line)

    def say(self, msg: str):
        if self.pending:
            first, self.pending = self.pending, ""
            self.say(first)
        if not self.quiet:
            print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


def _emit(text: str, output: Optional[str], ctx: _Ctx):
    text = ctx.lead + text
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
        header = _report_header(a, names)
    _emit(R.format_matrix(mtx, a.format, header), a.output, ctx)
    if a.fail_under is not None and mtx["overall"]["coverage_pct"] < a.fail_under:
        raise GateFailed(f"overall coverage {mtx['overall']['coverage_pct']:.1f}% is below --fail-under "
                         f"{a.fail_under:g}%")


def _report_header(a, names):
    """The page's header: the command line that was run and the models it covered (the checked-in
    docs/coverage.md is this command's output for the built-ins)."""
    import datetime
    import shlex

    import gems_models as M
    from . import roadmap
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commit = roadmap.git_commit(roadmap.repo_root()) or "unknown"
    cmd = " ".join(shlex.quote(x) for x in [PROG, *getattr(a, "argv", ["report"])])
    title = "the supported models" if not a.models else ", ".join(M.short_name(n) for n in names)
    size = a.size or ("tiny" if a.device == "cpu" else "full-size")
    aquila = (" Aquila-7B is built as `LlamaForCausalLM` with Aquila's config values."
              if "BAAI/Aquila-7B" in [M.resolve(n).name for n in names] else "")
    return [
        f"# Gems coverage of {title}",
        "",
        f"Generated by `{cmd}` on {date} at commit `{commit}` (device `{a.device}`, {size} architectures "
        f"with random weights; models: {', '.join(names)}). Do not edit by hand: run the command again.",
        "",
        "A compute op is *covered* when Gems registers that exact ATen overload. View/metadata "
        "(view, t, transpose, expand, slice, ...), creation/random (zeros, ones, arange, ...) and other ops "
        "(host syncs) are listed by `gems-coverage trace` but do not count. The meta device takes the math "
        "path for attention (`bmm` + `_safe_softmax`); on CPU and CUDA, `scaled_dot_product_attention` "
        "picks fused kernels instead, so trace on the device you care about "
        "(`gems-coverage trace MODEL --device cuda`). Training = forward, backward and one AdamW step "
        "(`foreach=True`, what CUDA users run: the `_foreach_*` ops). Generate = a prefill and one-token "
        "steps with the KV cache (with `--sample`: transformers' temperature / top-k / top-p warpers and "
        "`torch.multinomial`, else the argmax)." + aquila,
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
    from .bench_result import format_result
    if a.plot:   # before the run: a long GPU run must not end without its chart
        if a.no_attribution:
            raise UsageError("--plot draws the per-op attribution: drop --no-attribution")
        _plot_available()
    new_tokens = _new_tokens(a, a.workload == "decode", "--workload decode", 16)
    if a.cold and a.compile:
        raise UsageError("--cold and --compile do not combine (--cold times eager first steps)")
    if a.cuda_graphs and (a.cold or a.workload != "decode"):
        raise UsageError("--cuda-graphs times decode steps: --workload decode, without --cold")
    if a.cold_modes is not None and not a.cold:
        raise UsageError("--cold-modes selects the modes of --cold: give --cold too")
    if a.cold:   # first-step times from empty caches: its own runs, no attribution or agreement
        from .cold import MODES, cold_bench, format_cold, modes_error
        modes = _split(a.cold_modes) if a.cold_modes is not None else list(MODES)
        why = modes_error(modes)
        if why is not None:
            raise UsageError(f"--cold-modes: {why}")
        r = cold_bench(a.model, workload=a.workload, device=a.device, size=a.size, dtype=a.dtype, batch=a.batch,
                       seq_len=a.seq_len, new_tokens=new_tokens, optimizer=a.optimizer, include=_split(a.include),
                       exclude=_split(a.exclude), patch=_patch_arg(a), modes=modes, progress=ctx.say)
        _emit(json.dumps(r, indent=1) if a.format == "json" else format_cold(r), a.output, ctx)
        return
    r = B.bench(a.model, workload=a.workload, device=a.device, size=a.size, dtype=a.dtype, batch=a.batch,
                seq_len=a.seq_len, new_tokens=new_tokens, steps=a.steps, warmup=a.warmup, optimizer=a.optimizer,
                include=_split(a.include), exclude=_split(a.exclude), attribution=not a.no_attribution,
                patch=_patch_arg(a), fresh_lengths=a.fresh_lengths, compile=a.compile,
                cuda_graphs=a.cuda_graphs, progress=ctx.say)
    _emit(format_result(r, a.format, a.top, a.wide), a.output, ctx)
    if a.plot:
        _write_bench_plot(a.plot, r.to_dict(), a.top, ctx)
    if not r.agree:
        raise GateFailed("bench: Gems and ATen disagree: " + "; ".join(
            f"{c['check']}: {c['detail']}" for c in r.agreement if not c["ok"]))


def cmd_tune(a, ctx):
    import torch

    from . import tune as T
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.table:
        if a.model:
            raise UsageError("tune --table runs the shipped table's workloads: give no MODEL with it")
        results = []
        for i, spec in enumerate(T.TABLE_WORKLOADS, 1):
            ctx.say(f"table workload {i}/{len(T.TABLE_WORKLOADS)}: {spec['model']} {','.join(spec['workloads'])}"
                    f"{' patched' if spec['patch'] else ''}")
            results.append(T.tune(T.table_model(spec["model"]), **{k: v for k, v in spec.items() if k != "model"},
                                  device=device, dtype=a.dtype, layers=a.layers, progress=ctx.say))
        out = (json.dumps(results, indent=1) + "\n" if a.format == "json"
               else "".join(T.format_result(r, a.format) for r in results))
        _emit(out, a.output, ctx)
        return
    if not a.model:
        raise UsageError("tune: give a MODEL, or --table")
    wls = _split(a.workloads) or []
    r = T.tune(a.model, workloads=wls, device=device, size=a.size, dtype=a.dtype, batch=a.batch,
               seq_len=a.seq_len, new_tokens=_new_tokens(a, "decode" in wls, "--workloads with decode"),
               optimizer=a.optimizer, patch=_patch_arg(a), layers=a.layers, progress=ctx.say)
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
def _interpreter_warnings():
    """The Triton interpreter computes every lane of a masked block in numpy, the masked-off ones too:
    their divide-by-zero and invalid-value RuntimeWarnings say nothing about the results (masked lanes
    are never stored). Ignored for that module only, while a command runs on the interpreter."""
    with warnings.catch_warnings():
        if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter$")
        yield


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


def _tiny_note(a) -> Optional[str]:
    """The line that says a user's own config is built tiny (the CPU default: the interpreter is slow),
    not at the dims it gives; None when the size was chosen, or the model is a built-in or a function."""
    if getattr(a, "size", "") is not None or not isinstance(getattr(a, "model", None), str):
        return None
    device = a.device
    if device is None:   # tune: cuda when available
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    import gems_models as M
    try:
        r = M.resolve(a.model)
        if r.source != "config" or not device.startswith("cpu"):
            return None
    except M.ModelError:   # the command reports it
        return None
    return (f"note: {a.model} is built as a tiny variant of its architecture on --device cpu (hidden 64, "
            f"2 layers, vocab 256), not at its config's dims; --size full builds those")


COMMANDS = {"trace": cmd_trace, "report": cmd_report, "roadmap": cmd_roadmap, "parity": cmd_parity,
            "bench": cmd_bench, "bench-plot": cmd_bench_plot, "tune": cmd_tune, "ops": cmd_ops}


def main(argv: Optional[list] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # torch.profiler's kineto logs each start and stop as "USDT:... profiler_start" on stderr (its
    # USDT level, 5, sits above ERROR (4), so no level keeps kineto's errors and drops these): every
    # profiled run would print two such lines. Quiet unless the user sets KINETO_LOG_LEVEL (0-5 shows
    # kineto's lines, its errors included).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # the timed, parity and training runs measure Gems' kernels from their first call: kernels compile
    # as they are met, not in the background with ATen answering meanwhile (bench --cold's children
    # set their own mode)
    os.environ.setdefault("GEMS_COMPILE", "inline")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distributed"]:   # torchrun launcher; its options go to gems_coverage.distributed
        from .distributed.launch import launch_main
        return launch_main(argv[1:])
    debug = os.environ.get("GEMS_COVERAGE_DEBUG", "") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:   # --help
        return int(e.code or 0)
    args.argv = argv   # report's header names the command that was run
    ctx = _Ctx(args.quiet)
    try:
        for opt in ("output", "plot"):   # before a long run, not after it
            if getattr(args, opt, None):
                _check_parent(Path(getattr(args, opt)))
        from . import gemsinfo
        gemsinfo.prepare_interpreter_env()
        import gems_models
        try:
            note = _tiny_note(args)
            if note:   # first: atop stderr's progress lines and a text result
                ctx.pending = note
                fmt = getattr(args, "format", None)
                ctx.lead = {"table": f"{note}\n", "markdown": f"> {note}\n\n"}.get(fmt, "")
            with _quiet_stderr(args.quiet), _interpreter_warnings():
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
