"""The torchrun recipe's options, and everything decided from them before any process group starts:
torchrun's environment checked against the machine (Env) and the run's plan (model, dtypes, batch, faults).
Bad input raises UsageError on every rank alike, so no rank waits on another that gave up."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..arguments import ArgParser, UsageError, nonneg_int, positive_int

PROG = "gems_coverage.distributed"
STRATEGIES = ("ddp", "fsdp2")
GEMS_MODES = ("on", "off", "both")


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog=f"torchrun --nproc-per-node N -m {PROG}",
                  description="Train a built-in model with DDP or FSDP2, with and without Gems; compare losses.")
    p.add_argument("model", help="built-in model or alias (aquila, llama2, llama-1.1b, ...), a config.json or "
                                 "model folder (causal or masked LMs: Llama, Aquila, BERT, ...)")
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    p.add_argument("--steps", type=positive_int, default=50)
    p.add_argument("--warmup", type=nonneg_int, default=None,
                   help="steps left out of tokens/s (default 3 on cuda, 1 on cpu; at least 1 while tracing)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="global batch in sequences, divided evenly over the ranks (default: one per rank)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default 128 full, 8 tiny)")
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on cuda, tiny on cpu")
    p.add_argument("--dtype", default=None, help="parameter dtype (default bf16 on cuda, fp32 on cpu); with "
                                                 "--mixed-precision the compute dtype")
    p.add_argument("--mixed-precision", action="store_true",
                   help="fp32 parameters, compute in --dtype (FSDP2 MixedPrecisionPolicy with fp32 gradient "
                        "reduction; DDP torch.autocast)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--gems", choices=GEMS_MODES, default="both",
                   help="both: ATen, then gems.enable() on the same seed and data (default)")
    p.add_argument("--include", default=None, help="comma-separated ATen names Gems serves (default all)")
    p.add_argument("--exclude", default=None, help="comma-separated ATen names left to ATen")
    p.add_argument("--patch", action="store_true",
                   help="the Gems run also gems.patch(model) (fused ops); the ATen and fp32 runs stay unpatched")
    p.add_argument("--compile", action="store_true",
                   help="the Gems run also torch.compile(model) (after --patch: compile(patch(model))); the ATen "
                        "and fp32 runs stay eager, so its losses are checked against eager ATen")
    p.add_argument("--data", default=None, help="a torch.save'd integer tensor of token ids (default: synthetic)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: none; the norm is "
                                                            "reported either way)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL; default when a GPU is present) or cpu (gloo, Triton interpreter)")
    p.add_argument("--fp32-reference", action="store_true",
                   help="bf16/fp16: also run ATen in fp32 for parity's low-precision rule")
    p.add_argument("--no-trace", action="store_true", help="do not trace step 0's ops")
    p.add_argument("--shadow", choices=("auto", "on", "off"), default="auto",
                   help="op-by-op shadow check: auto = after a disagreement, on the first --shadow-steps steps; "
                        "on = during the whole Gems run (slow)")
    p.add_argument("--shadow-steps", type=positive_int, default=1)
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds a collective may wait (default 600)")
    p.add_argument("--inject-fault", action="append", default=None, metavar="OP@RANK[:raise|wrong]",
                   help="test aid: replace Gems' implementation of OP on RANK in the Gems run (repeatable)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", "-o", default=None, help="write the JSON result to FILE (rank 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


NOT_LAUNCHED = (f"{PROG} is a torchrun script: no RANK/WORLD_SIZE in the environment. Launch it as\n"
                f"  torchrun --standalone --nproc-per-node N -m {PROG} MODEL [options]\n"
                f"(or python -m torch.distributed.run --standalone --nproc-per-node N -m {PROG} ...); "
                f"--device cpu runs N processes on gloo")


@dataclass
class Env:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: str          # "cuda:<i>" or "cpu"
    backend: str         # nccl / gloo


def launch_env(device: Optional[str]) -> Env:
    """Read torchrun's environment and check it against the machine; raises UsageError (before any
    process group exists, so every rank fails alike and none waits)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise UsageError(NOT_LAUNCHED)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    import torch
    import torch.distributed as dist
    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device on this machine (--device cpu trains on gloo)")
        if not dist.is_nccl_available():
            raise UsageError("--device cuda needs NCCL, which this torch build lacks (a CPU build?); "
                             "--device cpu trains on gloo")
        n = torch.cuda.device_count()
        if local_world > n or local_rank >= n:
            raise UsageError(f"{local_world} processes on this node but {n} GPU(s) visible: launch with "
                             f"--nproc-per-node {n} (or fewer), one process per GPU")
        return Env(rank, world, local_rank, local_world, f"cuda:{local_rank}", "nccl")
    if not dist.is_gloo_available():
        raise UsageError("--device cpu needs the gloo backend, which this torch build lacks")
    return Env(rank, world, local_rank, local_world, "cpu", "gloo")


@dataclass
class Plan:
    """Everything decided from the arguments before the process group starts."""

    recipe: object
    size: str
    param_dtype: object
    compute_dtype: object
    seq_len: int
    batch: int
    micro: int
    warmup: int
    include: Optional[list]
    exclude: Optional[list]
    faults: list                         # --inject-fault: (op, rank, kind)
    tokens: Optional[object] = None      # user data, flattened
    notes: list = field(default_factory=list)


def split_names(s):
    """--include / --exclude: comma-separated names as a list (None when not given)."""
    return None if s is None else [x.strip() for x in s.split(",") if x.strip()]


# model kinds whose forward takes (input_ids, labels=input_ids) and returns a loss: next-token for causal
# LMs, every position predicted (labels = the tokens) for masked LMs such as BERT
TRAINABLE = ("causal_lm", "masked_lm")


def plan(a, env: Env) -> Plan:
    import torch
    import gems_models as M
    from .. import runner
    dev_type = "cuda" if env.device.startswith("cuda") else "cpu"
    try:
        recipe = M.resolve(a.model)
        if recipe.kind not in TRAINABLE:
            raise UsageError(f"{recipe.name}: the distributed recipe trains causal and masked LMs (this is "
                             f"{recipe.kind})")
        size, dtype_name, dt, seq_len = M.run_defaults(dev_type, a.size, a.dtype, a.seq_len)
        runner.check_model(recipe, size, mode="training", seq_len=seq_len)
    except M.ModelError as e:
        raise UsageError(str(e)) from None
    low = dt in (torch.bfloat16, torch.float16)
    if a.mixed_precision and not low:
        raise UsageError("--mixed-precision computes in --dtype: give --dtype bf16 (or fp16)")
    param_dt = torch.float32 if a.mixed_precision else dt
    if a.fp32_reference and not low:
        raise UsageError("--fp32-reference is the reference of the low-precision rule: only with --dtype bf16/fp16")
    if dev_type == "cpu" and dt == torch.bfloat16 and a.gems != "off":
        raise UsageError("the Triton interpreter leaves bf16 to ATen, so Gems would serve nothing: use --dtype "
                         "fp32 (or fp16) on cpu, bf16 on cuda")
    batch = a.batch if a.batch is not None else env.world
    if batch % env.world:
        raise UsageError(f"--batch {batch} does not divide over {env.world} ranks: give a multiple of {env.world}")
    warmup = a.warmup if a.warmup is not None else (3 if dev_type == "cuda" else 1)
    if not a.no_trace and a.gems != "off":
        warmup = max(warmup, 1)     # the traced step is not timed
    if warmup >= a.steps:
        raise UsageError(f"--steps {a.steps} leaves no timed step after {warmup} warm-up step(s)")
    faults_ = []
    for spec in a.inject_fault or ():
        op, _, rest = spec.partition("@")
        r, _, kind = rest.partition(":")
        kind = kind or "raise"
        if not op or not r.isdigit() or kind not in ("raise", "wrong"):
            raise UsageError(f"--inject-fault {spec}: expected OP@RANK[:raise|wrong], e.g. mm.default@1")
        if int(r) >= env.world:
            raise UsageError(f"--inject-fault {spec}: rank {r} does not exist (world size {env.world})")
        faults_.append((op, int(r), kind))
    if a.patch:
        import gems
        if not hasattr(gems, "patch"):
            raise UsageError("--patch: gems.patch is not available in this Gems")
    p = Plan(recipe, size, param_dt, dt, seq_len, batch, batch // env.world, warmup, split_names(a.include),
             split_names(a.exclude), faults_)
    if a.gems != "off":
        _check_gems(p, dev_type, a)
    if a.data:
        p.tokens = _load_tokens(a.data, seq_len)
    if a.output:
        parent = Path(a.output).parent
        if str(parent) and not parent.is_dir():
            raise UsageError(f"cannot write {a.output}: folder {parent} does not exist")
    return p


def _check_gems(p: Plan, dev_type: str, a):
    from .. import gemsinfo
    info = gemsinfo.load()
    if not info.available:
        raise UsageError(f"--gems {a.gems} needs Gems: {info.error}")
    if info.backend_device != dev_type:
        why = info.error or f"the active Gems backend '{info.backend}' serves {info.backend_device} tensors"
        raise UsageError(f"Gems cannot run on --device {dev_type}: {why}")
    import gems
    try:
        gems.use_gems(include=p.include, exclude=p.exclude)   # resolves the names; registers nothing
    except (ValueError, AttributeError, RuntimeError) as e:
        raise UsageError(f"--include/--exclude: {e}") from None
    for op, _, _ in p.faults:
        if op not in info.impls:
            raise UsageError(f"--inject-fault: Gems registers no '{op}' on backend '{info.backend}'")


def _load_tokens(path: str, seq_len: int):
    import torch
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"--data {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UsageError(f"--data {path}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if isinstance(obj, dict):
        obj = obj.get("input_ids", obj.get("tokens"))
    if not isinstance(obj, torch.Tensor) or obj.dtype.is_floating_point or obj.dtype == torch.bool:
        raise UsageError(f"--data {path}: expected an integer tensor of token ids (or a dict with 'input_ids')")
    t = obj.reshape(-1).long()
    if t.numel() < seq_len:
        raise UsageError(f"--data {path}: {t.numel()} tokens, fewer than one --seq-len {seq_len} window")
    return t


def check_same_options(argv: list, env: Env):
    """Every rank must have been launched with the same options (a mismatch would hang a collective)."""
    import torch.distributed as dist
    h = hashlib.sha1(json.dumps(argv).encode()).hexdigest()
    got: list = [None] * env.world
    dist.all_gather_object(got, h)
    if len(set(got)) > 1:
        raise UsageError("the ranks were launched with different options: " +
                         ", ".join(f"rank {i}: {x[:8]}" for i, x in enumerate(got)))
