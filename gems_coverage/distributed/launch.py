"""Running the recipe: `main` is what torchrun starts on every rank (plan, process group, the runs, the
verdict, rank 0 writes the result); `launch_main` is `gems-coverage distributed`, which checks the options
and then starts torchrun."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

from ..arguments import UsageError
from .data import describe_data
from .options import PROG, Env, Plan, build_parser, check_same_options, launch_env, plan
from .table import format_table
from .training import train
from .verdict import agreement, faults, op_report


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


def run(a, argv, env: Env, p: Plan, say) -> int:
    import torch
    import torch.distributed as dist
    say(f"{env.world} ranks on {env.backend}; {p.recipe.name} ({p.size}), {a.strategy}, global batch {p.batch} "
        f"({p.micro} per rank) x {p.seq_len}")
    check_same_options(argv, env)
    d = {"model": p.recipe.name, "size": p.size, "strategy": a.strategy, "world_size": env.world,
         "backend": env.backend, "device": env.device.split(":")[0],
         "device_kind": torch.cuda.get_device_name(env.local_rank) if env.backend == "nccl" else "cpu",
         "param_dtype": str(p.param_dtype).replace("torch.", ""),
         "compute_dtype": str(p.compute_dtype).replace("torch.", ""), "mixed_precision": a.mixed_precision,
         "checkpointing": a.checkpointing, "batch": p.batch, "micro_batch_per_rank": p.micro, "seq_len": p.seq_len,
         "steps": a.steps, "warmup": p.warmup, "seed": a.seed, "lr": a.lr, "clip": a.clip,
         "optimizer": "torch.optim.AdamW(lr, weight_decay=0.01), PyTorch's defaults (foreach on CUDA)",
         "gems": a.gems, "include": p.include, "exclude": p.exclude, "patch": a.patch, "compile": a.compile,
         "data": None, "runs": {}, "agreement": None, "throughput_ratio": None, "ops": None, "faults": [],
         "first_divergence": None, "divergences": [], "shadow_ran": False, "shadow_calls": 0,
         "notes": list(p.notes), "verdict": None,
         "versions": {"torch": torch.__version__, "triton": _version("triton"),
                      "transformers": _version("transformers"), "gems": _version("gems")}}
    if env.backend == "gloo":
        d["notes"].append("cpu/gloo: timings are meaningless" +
                          ("" if a.gems == "off" else " (Gems runs through the Triton interpreter)"))
    trace = not a.no_trace and a.gems != "off"
    runs = {}
    if a.fp32_reference:
        say("fp32 reference: ATen, parameters and compute in fp32")
        runs["fp32"] = train(a, p, env, "fp32", say, param_dtype=torch.float32, mixed=False)
    if a.gems in ("off", "both"):
        say("ATen run (Gems not registered)")
        runs["aten"] = train(a, p, env, "aten", say)
    if a.gems in ("on", "both"):
        say("Gems run (gems.enable())")
        runs["gems"] = train(a, p, env, "gems", say, shadow=a.shadow == "on", trace=trace)
        d["shadow_ran"] = a.shadow == "on"
    d["data"] = describe_data(p, a.data)
    for m, r in runs.items():
        d["runs"][m] = {"losses": r.losses, "grad_norms": r.grad_norms, "step_ms": r.step_ms,
                        "tokens_per_s": r.tokens_per_s, "peak_mib_per_rank": r.peak_mib, "peak_kind": r.peak_kind,
                        "gems_stats_per_rank": r.served if m == "gems" else None, "patched": r.patched}
        d["runs"][m]["peak_mib"] = r.peak_mib
    ok = True
    if "gems" in runs:
        import gems
        registered = set(gems.registered_ops())
        if trace:
            enabled = set(gems.use_gems(include=p.include, exclude=p.exclude).cfg)
            d["ops"] = op_report(runs["gems"], registered, enabled, a.strategy)
        d["faults"] = faults(runs["gems"])
        if d["faults"]:
            d["notes"].append("Gems errors fell back to ATen on the rank that met them (not GEMS_STRICT); the "
                              "other ranks were not affected")
    if "gems" in runs and "aten" in runs:
        ag = agreement(runs["aten"], runs["gems"], p.compute_dtype, runs.get("fp32"))
        d["agreement"] = ag
        ok = ag["ok"]
        if runs["aten"].tokens_per_s and runs["gems"].tokens_per_s:
            d["throughput_ratio"] = round(runs["gems"].tokens_per_s / runs["aten"].tokens_per_s, 4)
        if not ok and a.shadow == "auto":
            n = min(a.shadow_steps, a.steps)
            say(f"losses disagree from step {ag['first_failing_step']}: shadow check of the Gems run's first "
                f"{n} step(s) on every rank")
            sh = train(a, p, env, "gems", say, steps=n, shadow=True)
            runs["gems"].divergences, runs["gems"].shadow_calls = sh.divergences, sh.shadow_calls
            d["shadow_ran"] = True
        d["verdict"] = "PASS" if ok else "FAIL"
    if "gems" in runs and d["shadow_ran"]:
        divs = []
        for rank, lst in enumerate(runs["gems"].divergences):
            divs += [dict(x, rank=rank) for x in lst]
        d["divergences"] = divs
        d["shadow_calls"] = sum(runs["gems"].shadow_calls)
        if divs:
            first = min(divs, key=lambda x: (int(x["phase"].split()[-1]), x["index"], x["rank"]))
            d["first_divergence"] = first
            if ok and d["agreement"] is not None:     # as in parity: an op over tolerance fails the run
                ok = False
                d["verdict"] = "FAIL"
                d["notes"].append("the losses agree, but the shadow check found an op over its tolerance")
        elif not ok:
            d["notes"].append(f"the shadow check found no single op over tolerance in the first "
                              f"{min(a.shadow_steps, a.steps)} step(s): the losses drift apart by accumulated "
                              f"rounding, or a divergence starts later (--shadow-steps)")
    if env.rank == 0:
        text = json.dumps(d, indent=1) + "\n" if a.format == "json" else format_table(d)
        sys.stdout.write(text)
        sys.stdout.flush()
        if a.output:
            Path(a.output).write_text(json.dumps(d, indent=1) + "\n")
            say(f"wrote {a.output}")
    dist.barrier()
    return 0 if ok else 1


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    debug = os.environ.get("GEMS_COVERAGE_DEBUG", "") not in ("", "0")
    rank = os.environ.get("RANK", "?")
    try:
        a = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return int(e.code or 0)
    started = False
    try:
        env = launch_env(a.device)
        if env.backend == "gloo":
            os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton
        import datetime
        import warnings
        import torch
        import torch.distributed as dist
        warnings.filterwarnings("ignore", message=".*(invalid value|overflow|divide by zero) encountered.*")
        quiet = a.quiet or env.rank != 0

        def say(msg):
            if not quiet:
                print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)
        p = plan(a, env)      # bad input is found on every rank alike, before any rank waits on another
        if env.backend == "nccl":
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(env.backend, timeout=datetime.timedelta(seconds=a.timeout),
                                **({"device_id": torch.device(env.device)} if env.backend == "nccl" else {}))
        started = True
        return run(a, argv, env, p, say)
    except UsageError as e:
        if rank in ("0", "?"):
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line per failing rank unless asked for the traceback
        if debug:
            raise
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        print(f"{PROG}: rank {rank}: error while running: {type(e).__name__}: {msg} "
              f"(GEMS_COVERAGE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 3
    finally:
        if started:
            import torch.distributed as dist
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def launch_main(argv: list) -> int:
    """`gems-coverage distributed [--nproc N] MODEL ...`: check the options here (bad input: exit 2, before
    any process starts), then run this recipe under torchrun (standalone: one node, a free port) with N
    processes (default: the GPUs here, or 2 on CPU). torchrun ends with 1 whenever a process fails, so
    the launcher returns 1 for disagreement and for errors alike (the JSON's verdict tells which)."""
    import subprocess
    argv = list(argv)
    n = None
    for flag in ("--nproc-per-node", "--nproc"):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
                print(f"{PROG}: error: {flag} needs a positive integer", file=sys.stderr)
                return 2
            n = int(argv[i + 1])
            del argv[i:i + 2]
    if "-h" in argv or "--help" in argv:
        print("usage: gems-coverage distributed [--nproc N] MODEL [options]   (torchrun with N processes)\n")
        print(build_parser().format_help())
        return 0
    try:
        a = build_parser().parse_args(argv)
        cpu = a.device == "cpu" or (a.device is None and not _has_cuda())
        if cpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")     # before gems imports triton (here and below)
        if n is None:
            import torch
            n = 2 if cpu else torch.cuda.device_count()
        for k, v in dict(RANK="0", WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(n),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT="0").items():
            os.environ.setdefault(k, v)
        try:
            plan(a, launch_env(a.device))
        finally:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(k, None)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", PROG, *argv]
    return 1 if subprocess.call(cmd, env=dict(os.environ)) else 0


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False

