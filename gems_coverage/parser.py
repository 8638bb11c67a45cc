"""The gems-coverage command line: every command, its options and their help (the commands run in
gems_coverage.cli)."""
import argparse

from .arguments import ArgParser, nonneg_int, percentage, positive_float, positive_int, unit_interval

PROG = "gems-coverage"


def build_parser() -> argparse.ArgumentParser:
    from . import report as R
    from .runner import OPTIMIZERS
    p = ArgParser(prog=PROG, description="Which ATen ops a model calls, which Gems covers, what is missing, "
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
        sp.add_argument("--batch", type=positive_int, default=1)
        sp.add_argument("--seq-len", type=positive_int, default=None,
                        help="text tokens (default 128 full size, 8 tiny)")
        sp.add_argument("--new-tokens", type=positive_int, default=None,
                        help="tokens for --mode generate (default 4; only with generate)")

    def sample_opts(sp):
        sp.add_argument("--sample", action="store_true",
                        help="generate by sampling (transformers' temperature/top-k/top-p warpers, softmax, "
                             "multinomial) instead of greedy argmax; only with generate")
        sp.add_argument("--temperature", type=positive_float, default=None,
                        help="--sample: logits divided by this (default 0.7; 1: off)")
        sp.add_argument("--top-k", type=nonneg_int, default=None,
                        help="--sample: keep the k most likely tokens (default 50; 0: off)")
        sp.add_argument("--top-p", type=unit_interval, default=None,
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
    t.add_argument("--fail-under", type=percentage, default=None, metavar="PCT",
                   help="exit 1 when compute-op coverage is below PCT")
    out_opts(t)

    r = sub.add_parser("report", help="op x model matrix for several models and modes")
    r.add_argument("models", nargs="*", help="models (default: the four built-ins)")
    r.add_argument("--modes", default="inference,training", help="comma-separated (default inference,training)")
    run_opts(r)
    sample_opts(r)
    r.add_argument("--all-ops", action="store_true", help="include view/creation/other ops in the matrix")
    r.add_argument("--fail-under", type=percentage, default=None, metavar="PCT")
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
    pa.add_argument("--batch", type=positive_int, default=1)
    pa.add_argument("--seq-len", type=positive_int, default=None)
    pa.add_argument("--new-tokens", type=positive_int, default=None,
                    help="greedy tokens of the generate check of --mode inference/all (default 4)")
    pa.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                    help="optimizer of the training step (default sgd: its update is linear in the gradient)")
    pa.add_argument("--no-shadow", action="store_true", help="skip the op-by-op shadow comparison")
    pa.add_argument("--include", default=None, help="comma-separated ATen names Gems serves (default all)")
    pa.add_argument("--exclude", default=None, help="comma-separated ATen names left to ATen")
    pa.add_argument("--patch", action="store_true",
                    help="the Gems run also patches the model with gems.patch (fused RMSNorm, RoPE, SwiGLU, "
                         "losses, ...); the ATen run stays unpatched")
    add_patch_options(pa)
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
    b.add_argument("--batch", type=positive_int, default=1)
    b.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (decode: the prompt; default 128 full size, 8 tiny)")
    b.add_argument("--new-tokens", type=positive_int, default=None,
                   help="decode: tokens generated per run (>= 2; default 16; only with --workload decode)")
    b.add_argument("--steps", type=positive_int, default=None,
                   help="timed runs per mode (default 5 on cuda, 1 on cpu)")
    b.add_argument("--warmup", type=nonneg_int, default=None,
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
    b.add_argument("--cold", action="store_true",
                   help="time to the first step instead: ATen, Gems (kernels compiling in the background) and "
                        "Gems after gems.warmup, each in a fresh process with empty Triton and Gems cache "
                        "folders; first and second step times")
    b.add_argument("--cold-modes", default=None, metavar="MODES",
                   help="--cold: the modes to run, comma-separated, some of aten, gems, gems+warmup, "
                        "gems+inline (GEMS_COMPILE=inline: every kernel compiled at its first launch), gems+again (after gems: "
                        "a second process on the caches gems left); default the first three; each is a fresh "
                        "process that builds the model and compiles from nothing)")
    b.add_argument("--patch", action="store_true",
                   help="the Gems turns also run the model patched by gems.patch (fused ops); the ATen turns "
                        "run it unpatched")
    add_patch_options(b)
    b.add_argument("--compile", action="store_true",
                   help="both modes run the model through torch.compile (default mode; after gems.patch with "
                        "--patch): compiled Gems against compiled ATen; see docs/torch-compile.md")
    b.add_argument("--cuda-graphs", action="store_true",
                   help="decode through model.generate: ATen's eager steps on a static cache against Gems with "
                        "gems.decode.graphed (one-token steps replayed from CUDA graphs), ms per token; "
                        "transformers' compiled static-cache decode as a peer; see docs/decode.md")
    b.add_argument("--top", type=positive_int, default=25, help="attribution rows shown (JSON has all)")
    b.add_argument("--wide", action="store_true",
                   help="the attribution table with every column and full op names (the default fits ~120 "
                        "columns: calls as ATen/Gems, no device columns on CPU, long op names shortened)")
    b.add_argument("--plot", default=None, metavar="FILE",
                   help="also draw the attribution as a bar chart (PNG; needs matplotlib: pip install "
                        "'gems[plot]'); `bench-plot` draws it from a saved JSON")
    out_opts(b, ("table", "json", "markdown"))

    tu = sub.add_parser("tune", help="run a model's workloads once with Gems on so that every GEMM bucket they "
                                     "call is tuned and stored on disk before serving or training")
    tu.add_argument("model", nargs="?", help="built-in model or alias (llama2, bert, llava, aquila, llama-1.1b), "
                                             "a config.json or a model folder (none with --table)")
    tu.add_argument("--table", action="store_true",
                    help="tune the workloads whose picks Gems ships (the models of docs/perf.md, plain and patched); "
                         "then `python scripts/ship_tuned.py` copies them into the shipped table")
    tu.add_argument("--layers", type=positive_int, default=None,
                    help="build the model this many layers deep: every layer makes the same calls, so the buckets "
                         "are the full model's, in a fraction of the time and memory")
    tu.add_argument("--workloads", default="prefill,train",
                    help="comma-separated, some of prefill, train, decode (default prefill,train)")
    tu.add_argument("--device", default=None, help="default: cuda when available, else cpu (which tunes nothing)")
    tu.add_argument("--size", choices=("full", "tiny"), default=None, help="default: tiny on cpu, full on cuda")
    tu.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    tu.add_argument("--batch", type=positive_int, default=1)
    tu.add_argument("--seq-len", type=positive_int, default=None,
                    help="tokens per sequence: tune with the sizes you will run (default 128 full size, 8 tiny)")
    tu.add_argument("--new-tokens", type=positive_int, default=None, help="decode: tokens generated (default 4)")
    tu.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    tu.add_argument("--patch", action="store_true", help="tune the calls of the model patched by gems.patch")
    add_patch_options(tu)
    out_opts(tu, ("table", "json"))

    bp = sub.add_parser("bench-plot", help="draw a saved `bench --format json` result as a bar chart (PNG)")
    bp.add_argument("json", help="a file written by `gems-coverage bench ... --format json -o FILE`")
    bp.add_argument("--output", "-o", required=True, help="the chart to write (PNG)")
    bp.add_argument("--top", type=positive_int, default=25, help="ops shown, largest difference first")

    sub.add_parser("distributed", help="train MODEL with DDP/FSDP2 on N processes (torchrun), ATen vs Gems "
                                       "loss per step: gems-coverage distributed [--nproc N] MODEL ...")
    o = sub.add_parser("ops", help="the Gems registry: overload, category, dtypes, backward")
    o.add_argument("--category", default=None, help="only this Gems category")
    out_opts(o)
    for sp in sub.choices.values():   # -q also after the subcommand
        sp.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress, warnings or profiler lines on stderr (errors still)")
    return p


def add_patch_options(p):
    p.add_argument("--patch-options", default=None, metavar="NAME=on|off,...",
                   help="gems.patch's options (implies --patch), e.g. layer_norm=on,cross_entropy=off: "
                        "measure or check the fused parts one by one")
