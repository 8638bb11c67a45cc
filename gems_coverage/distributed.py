"""Distributed training with Gems on: DDP or FSDP2 through torch.distributed, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 -m gems_coverage.distributed aquila --strategy fsdp2 \\
        --steps 50 --batch 8 --seq-len 2048 --dtype bf16 --gems both -o result.json

Scale-out is PyTorch's (docs: design decision 11): this is a plain training script of the kind users run
(`init_process_group`, DDP or FSDP2 `fully_shard` per decoder layer then the root, AdamW with PyTorch's
defaults, gradient clipping), with Gems switched on by `gems.enable()` around the training steps.

What it does, per rank:

* **Model**: a built-in model (gems_models, random weights, dropout 0) built with the same seed on every
  rank; FSDP2 also broadcasts rank 0's weights before sharding (DDP does that itself). Parameters in
  `--dtype`; with `--mixed-precision` they stay fp32 and compute runs in `--dtype` (FSDP2:
  `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`; DDP: `torch.autocast`).
  `--checkpointing` recomputes each decoder layer in backward (Hugging Face's non-reentrant checkpointing).
* **Data**: synthetic tokens from a generator seeded per step (the same global batch on every rank,
  each rank takes its rows): Zipf-distributed tokens repeated with a random period, so the loss falls
  (uniform random tokens would keep it at ln(vocab) and make loss agreement meaningless). Or
  `--data FILE`: a saved integer tensor of token ids, cut into windows of `--seq-len`.
* **Step**: forward with labels (the tokens themselves: next-token loss for a causal LM, every position
  for a masked LM such as BERT), backward, the total gradient norm after reduction (DDP: of the
  all-reduced gradients; FSDP2: of the sharded gradients, reduced across ranks), clipping to `--clip`,
  `AdamW.step()` (foreach on CUDA, PyTorch's default).
* **`--gems both`**: the same seed and data twice in the same processes, ATen first (Gems never
  registered), then with `gems.enable()`; model and optimizer rebuilt in between. Per step: loss (mean
  over ranks), gradient norm; tokens/s after `--warmup` steps; peak memory per rank.
* **Verdict**: each step's loss by the end-to-end rule of `gems_coverage.parity` (relative error within
  `E2E_TOL` of the compute dtype; for bf16/fp16 with `--fp32-reference`, also passing when Gems' error
  against an fp32 ATen run is at most 2x ATen's own, `parity._lowp_rule`).
* **Ops around the collectives**: step 0 of the Gems run is traced on every rank (the tracer's
  `OpRecorder`), each ATen op tagged with where it was called from (model forward, backward, the
  DDP/FSDP2 wrapper's Python code, the optimizer, gradient clipping) and with what Gems did with it
  (served, fell back and why, not registered); the compute ops Gems did not serve are the gaps.
  Collectives (`c10d::*`) are listed separately: they stay NCCL's (gloo's).
* **Faults**: a Gems kernel that raises on one rank is answered by ATen on that rank (the dispatcher's
  fallback outside `GEMS_STRICT=1`; the fallbacks are reported per rank); nothing else changes, so the
  other ranks neither wait nor diverge (DDP averages gradients, FSDP2 reduce-scatters them: replicas
  stay consistent). With `GEMS_STRICT=1` the failing rank exits, and torchrun stops the others.
  When losses disagree, the Gems run's first `--shadow-steps` steps are run again under parity's
  shadow check on every rank (each Gems-served compute op re-run by ATen on copies of its inputs), which
  names the first diverging op per rank. `--inject-fault OP@RANK[:raise|wrong]` replaces one Gems
  implementation on one rank (a test aid: `raise` throws, `wrong` is a small silent numeric error).

Exit codes: 0 agreement (or a single mode run), 1 losses disagree, 2 bad input or launch (one line),
3 an error while running (one line per failing rank; GEMS_COVERAGE_DEBUG=1 shows the traceback).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# bad input or launch: one line, exit code 2 (the CLI's own error type, parser and number checks)
from .cli import UsageError, _nonneg_int, _Parser, _positive_int as _pos_int

PROG = "gems_coverage.distributed"
STRATEGIES = ("ddp", "fsdp2")
GEMS_MODES = ("on", "off", "both")
# the files a call passes through on its way to an op without being where the op comes from
_PLUMBING = ("/torch/_ops.py", "/torch/utils/_python_dispatch.py", "/torch/overrides.py", "/torch/_tensor.py",
             "/torch/nn/functional.py", "/torch/nn/modules/", "/torch/functional.py", "/torch/utils/checkpoint.py",
             "/torch/utils/_contextlib.py", "/torch/_library/", "/torch/_higher_order_ops/", "/torch/_jit_internal.py",
             "/torch/amp/", "/torch/_compile.py", "/torch/_dynamo/", "/torch/utils/_device.py", "/gems_coverage/",
             "/torch/_prims_common/", "/torch/_decomp/", "/torch/_refs/", "/torch/nn/parameter.py")


# ATen ops that FSDP2's custom ops call inside (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, read
# in torch 2.13): they run below a dispatch mode, so the trace sees only the custom op; Gems would serve them
# at the backend key like any other call if it registered them (gems.stats() then counts them).
FSDP_INNER = {"fsdp::all_gather_copy_in.default": ("_foreach_copy_.default",),
              "fsdp::split_with_sizes_copy.default": ("split_with_sizes_copy.out",),
              "fsdp::chunk_cat.default": ("_chunk_cat.out",)}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"torchrun --nproc-per-node N -m {PROG}",
                description="Train a built-in model with DDP or FSDP2, with and without Gems; compare losses.")
    p.add_argument("model", help="built-in model or alias (aquila, llama2, llama-1.1b, ...), a config.json or "
                                 "model folder (causal or masked LMs: Llama, Aquila, BERT, ...)")
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    p.add_argument("--steps", type=_pos_int, default=50)
    p.add_argument("--warmup", type=_nonneg_int, default=None,
                   help="steps left out of tokens/s (default 3 on cuda, 1 on cpu; at least 1 while tracing)")
    p.add_argument("--batch", type=_pos_int, default=None,
                   help="global batch in sequences, divided evenly over the ranks (default: one per rank)")
    p.add_argument("--seq-len", type=_pos_int, default=None, help="tokens per sequence (default 128 full, 8 tiny)")
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
    p.add_argument("--data", default=None, help="a torch.save'd integer tensor of token ids (default: synthetic)")
    p.add_argument("--seed", type=_nonneg_int, default=0)
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
    p.add_argument("--shadow-steps", type=_pos_int, default=1)
    p.add_argument("--timeout", type=_pos_int, default=600, help="seconds a collective may wait (default 600)")
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


# ------------------------------------------------------------------------------------------- setup
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


def _split(s):
    return None if s is None else [x.strip() for x in s.split(",") if x.strip()]


# model kinds whose forward takes (input_ids, labels=input_ids) and returns a loss: next-token for causal
# LMs, every position predicted (labels = the tokens) for masked LMs such as BERT
TRAINABLE = ("causal_lm", "masked_lm")


def plan(a, env: Env) -> Plan:
    import torch
    import gems_models as M
    from . import runner
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
            raise UsageError("--patch: gems.patch is not available in this Gems (the fused-ops API has not landed)")
    p = Plan(recipe, size, param_dt, dt, seq_len, batch, batch // env.world, warmup, _split(a.include),
             _split(a.exclude), faults_)
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
    from . import gemsinfo
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


# -------------------------------------------------------------------------------------------- data
def describe_data(p: "Plan", path: Optional[str]) -> str:
    if p.tokens is not None:
        windows = p.tokens.numel() // p.seq_len
        return (f"{path}: {p.tokens.numel()} token ids in {windows} windows of {p.seq_len}, {p.batch} per step "
                f"(cycled after {max(1, windows // p.batch)} steps)")
    return ("synthetic: per row a Zipf(1.1) segment of random period 8-64 repeated to --seq-len, from a "
            "generator seeded per step (learnable, so the loss falls)")


class Data:
    """The global batch of step i is the same on every rank; each rank takes its `micro` rows."""

    def __init__(self, vocab: int, batch: int, micro: int, seq_len: int, rank: int, seed: int, tokens=None):
        import torch
        self.vocab, self.batch, self.micro, self.seq_len, self.rank, self.seed = vocab, batch, micro, seq_len, rank, seed
        self.tokens = tokens
        if tokens is None:
            g = torch.Generator().manual_seed(seed * 7919 + 17)
            n = vocab - 3
            probs = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.1
            self.probs = (probs / probs.sum()).float()
            self.perm = torch.randperm(n, generator=g) + 3          # frequent ids spread over the vocabulary
        else:
            if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
                raise UsageError(f"--data: token ids must lie in [0, {vocab}) for this model "
                                 f"(found {int(tokens.min())}..{int(tokens.max())})")
            self.windows = tokens.numel() // seq_len


    def rows(self, step: int):
        import torch
        lo, hi = self.rank * self.micro, (self.rank + 1) * self.micro
        if self.tokens is not None:
            idx = [(step * self.batch + r) % self.windows for r in range(lo, hi)]
            return torch.stack([self.tokens[i * self.seq_len:(i + 1) * self.seq_len] for i in idx])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        out = []
        for r in range(self.batch):      # the whole global batch, so every rank's draws are the same
            period = int(torch.randint(8, 65, (1,), generator=g))
            seg = self.perm[torch.multinomial(self.probs, min(period, self.seq_len), replacement=True, generator=g)]
            if lo <= r < hi:
                out.append(seg.repeat(-(-self.seq_len // seg.numel()))[: self.seq_len])
        return torch.stack(out)


# ------------------------------------------------------------------------------------------- model
def decoder_layers(model):
    """The decoder layers FSDP2 shards one by one (and checkpointing recomputes): the largest ModuleList."""
    import torch
    best = None
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and (best is None or len(m) > len(best)):
            best = m
    return list(best) if best is not None else []


def build_model(a, p: Plan, env: Env, param_dtype=None, mixed: Optional[bool] = None, patch: bool = False):
    """(wrapped model, optimizer, parameters, gems.patch's counts or None) built from the seed on every
    rank, with Gems off; `patch`: gems.patch(model) first (the Gems run under --patch: its losses are
    compared with the unpatched ATen run's, as the fused ops' end-to-end check asks)."""
    import torch
    import torch.distributed as dist
    import gems_models as M
    from .parity import no_dropout
    param_dtype = param_dtype or p.param_dtype
    mixed = a.mixed_precision if mixed is None else mixed
    if env.device.startswith("cuda"):
        torch.cuda.set_device(env.local_rank)
    b = M.build(p.recipe, size=p.size, device=env.device, dtype=param_dtype, batch=1, seq_len=p.seq_len,
                seed=a.seed, dropout=0.0)
    model = b.model
    no_dropout(model)
    model.config.use_cache = False
    model.train()
    patched = None
    if patch:
        import gems
        patched = gems.patch(model).counts()
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model, device_ids=[env.local_rank] if env.backend == "nccl" else None)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        with torch.no_grad():       # the same start on every rank whatever each device's RNG did
            for t in model.state_dict().values():
                dist.broadcast(t, 0)
        mp = MixedPrecisionPolicy(param_dtype=p.compute_dtype, reduce_dtype=torch.float32) if mixed else \
            MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        wrapped = model
    params = [q for q in wrapped.parameters() if q.requires_grad]
    # AdamW as PyTorch defaults it: foreach on CUDA, the per-parameter loop on CPU
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)
    return wrapped, opt, params, patched


# -------------------------------------------------------------------------------------------- trace
def _origin(strategy: str) -> str:
    """Where the op being dispatched was called from: the innermost Python frame that is not plumbing."""
    try:
        f = sys._getframe(3)      # past _origin, the recorder's callback and its __torch_dispatch__
    except ValueError:            # an autograd device thread: no Python frame below the mode
        return "backward"
    while f is not None:
        fn = f.f_code.co_filename.replace("\\", "/")
        if fn.endswith("/gems_coverage/distributed.py") and f.f_code.co_name != "__torch_dispatch__":
            return "step"
        if not any(s in fn for s in _PLUMBING) and f.f_code.co_name != "__torch_dispatch__":
            if "/torch/distributed/" in fn or "/torch/nn/parallel/" in fn:
                return strategy
            if "/torch/optim/" in fn:
                return "optimizer"
            if "/torch/nn/utils/clip_grad" in fn:
                return "grad-clip"
            if "/torch/autograd/" in fn:
                return "backward"
            return "forward"
        f = f.f_back
    return "backward"     # no Python frame: an autograd thread running backward kernels (CUDA)


class StepTracer:
    """The tracer's OpRecorder plus, per op, where it was called from (see `_origin`)."""

    def __init__(self, strategy: str):
        from .tracer import OpRecorder
        self.origins: dict = {}
        self.strategy = strategy

        def on_call(name, func, args, kwargs, out):
            o = _origin(self.strategy)
            d = self.origins.setdefault(name, {})
            d[o] = d.get(o, 0) + 1
        self.rec = OpRecorder(meta_scalars=False, on_call=on_call)

    def summary(self) -> dict:
        return {n: {"calls": s.calls, "category": s.category, "dtypes": sorted(s.dtypes), "example": s.example,
                    "origins": self.origins.get(n, {})} for n, s in self.rec.ops.items()}


def _shadow_mode(names, result, phase):
    """Parity's ShadowMode, skipping calls on tensor subclasses (FSDP2's DTensor parameters in the
    optimizer step: their local ops run below the mode and a DTensor has no numpy view to compare)."""
    import torch
    from torch.utils._pytree import tree_leaves
    from .parity import ShadowMode

    class RankShadow(ShadowMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
                    self.calls += 1
                    return func(*args, **kwargs)
            return super().__torch_dispatch__(func, types, args, kwargs)
    return RankShadow(names, result, phase)


# --------------------------------------------------------------------------------------------- run
@dataclass
class RunResult:
    mode: str
    losses: list = field(default_factory=list)       # mean over ranks, per step
    grad_norms: list = field(default_factory=list)   # total norm after reduction, per step
    step_ms: list = field(default_factory=list)      # slowest rank, per step
    tokens_per_s: Optional[float] = None
    peak_mib: list = field(default_factory=list)     # per rank
    peak_kind: str = ""
    served: list = field(default_factory=list)       # per rank: gems.stats() delta over the run
    trace: list = field(default_factory=list)        # per rank: StepTracer.summary() of step 0
    divergences: list = field(default_factory=list)  # per rank: shadow divergences
    shadow_calls: list = field(default_factory=list)
    patched: Optional[dict] = None                   # gems.patch's counts (fused op -> modules) under --patch


def _sync(env: Env):
    import torch
    if env.backend == "nccl":
        torch.cuda.synchronize()


def _peak_reset(env: Env):
    import torch
    if env.backend == "nccl":
        torch.cuda.reset_peak_memory_stats()


def _peak(env: Env):
    import torch
    if env.backend == "nccl":
        return round(torch.cuda.max_memory_allocated() / 2**20, 1), "CUDA max_memory_allocated during the steps"
    import resource
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "process max RSS (monotonic)"


def _gather(env: Env, obj):
    import torch.distributed as dist
    out: list = [None] * env.world
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def _faults(p: Plan, env: Env):
    """--inject-fault on its rank: Gems' implementation of OP raises, or answers slightly wrong."""
    import torch
    from gems import registry
    with contextlib.ExitStack() as stack:
        for name, rank, kind in p.faults:
            if rank != env.rank:
                continue
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")

            def broken(*args, _op=op, _kind=kind, _name=name, **kwargs):
                if _kind == "raise":
                    raise RuntimeError(f"injected fault in {_name} on rank {env.rank}")
                out = _op(*args, **kwargs)          # inside a Gems implementation nested calls run ATen
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    return out * 1.001 + 1e-3
                return out
            stack.enter_context(registry.override_impl(name, broken))
        yield


def train(a, p: Plan, env: Env, mode: str, say, steps: Optional[int] = None, shadow: bool = False,
          trace: bool = False, param_dtype=None, mixed=None) -> RunResult:
    """One training run from the seed: mode 'aten' (Gems unregistered), 'gems' (gems.enable()) or
    'fp32' (ATen in fp32: the low-precision rule's reference)."""
    import torch
    import torch.distributed as dist
    steps = steps or a.steps
    res = RunResult(mode)
    wrapped, opt, params, res.patched = build_model(a, p, env, param_dtype, mixed,
                                                    patch=a.patch and mode == "gems")
    vocab = wrapped.module.config.vocab_size if a.strategy == "ddp" else wrapped.config.vocab_size
    data = Data(vocab, p.batch, p.micro, p.seq_len, env.rank, a.seed, p.tokens)
    use_autocast = a.strategy == "ddp" and (a.mixed_precision if mixed is None else mixed)
    amp = (torch.autocast(device_type=env.device.split(":")[0], dtype=p.compute_dtype) if use_autocast
           else contextlib.nullcontext())
    on = mode == "gems"
    names = set()
    from .parity import ParityResult
    shadow_res = ParityResult(model=p.recipe.name, size=p.size, device=env.device, dtype=str(p.compute_dtype),
                              backend="", registered_ops=0)
    import gems
    from . import gemsinfo
    if on:
        names = set(gems.use_gems(include=p.include, exclude=p.exclude).cfg)
        before = gemsinfo.stats()
    losses, norms, times = [], [], []
    torch.manual_seed(a.seed + 1)
    _peak_reset(env)
    dist.barrier()
    ctx = contextlib.ExitStack()
    if on:
        gems.enable(include=p.include, exclude=p.exclude)
        ctx.enter_context(_faults(p, env))
    try:
        with ctx:
            for i in range(steps):
                ids = data.rows(i).to(env.device)
                tracer = StepTracer(a.strategy) if (trace and i == 0) else None
                sh = _shadow_mode(names, shadow_res, f"step {i}") if (shadow and on) else None
                _sync(env)
                t0 = time.perf_counter()
                with (tracer.rec if tracer else contextlib.nullcontext()), (sh or contextlib.nullcontext()):
                    with amp:
                        out = wrapped(input_ids=ids, labels=ids)
                    loss = out.loss
                    del out                                 # the logits: not kept into the next step
                    loss.backward()
                    grads = [q.grad for q in params if q.grad is not None]
                    norm = torch.nn.utils.get_total_norm(grads, 2.0)
                    del grads                               # no reference to a gradient past zero_grad
                    if hasattr(norm, "full_tensor"):        # FSDP2: DTensor norm of the shards -> all ranks'
                        norm = norm.full_tensor()
                    if a.clip > 0:
                        torch.nn.utils.clip_grads_with_norm_(params, a.clip, norm)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                _sync(env)
                times.append((time.perf_counter() - t0) * 1e3)
                losses.append(loss.detach().float())
                norms.append(norm.detach().float())
                if tracer is not None:
                    res.trace = tracer.summary()
                if i == 0 or (i + 1) % 10 == 0 or i + 1 == steps:
                    say(f"{mode}: step {i + 1}/{steps} loss {float(loss.detach()):.4f}")
    finally:
        if on:
            gems.disable()
    peak, res.peak_kind = _peak(env)
    # losses: mean over ranks (equal token counts per rank); norms are already global
    lt = torch.stack(losses).to(torch.float64)
    lt_dev = lt.to(env.device) if env.backend == "nccl" else lt
    dist.all_reduce(lt_dev)
    res.losses = [float(x) / env.world for x in lt_dev.cpu()]
    res.grad_norms = [float(x) for x in torch.stack(norms).cpu()]
    served = gemsinfo.stats_delta(before, gemsinfo.stats()) if on else {}
    everyone = _gather(env, {"times": times, "peak": peak, "served": served, "trace": res.trace,
                             "div": [vars(d) for d in shadow_res.divergences], "shadow": shadow_res.shadow_calls})
    res.step_ms = [round(max(e["times"][i] for e in everyone), 3) for i in range(steps)]
    res.peak_mib = [e["peak"] for e in everyone]
    res.served = [e["served"] for e in everyone]
    res.trace = [e["trace"] for e in everyone] if trace else []
    res.divergences = [e["div"] for e in everyone]
    res.shadow_calls = [e["shadow"] for e in everyone]
    timed = res.step_ms[p.warmup:]
    if timed:
        res.tokens_per_s = round(p.batch * p.seq_len / (statistics.median(timed) / 1e3), 2)
    del wrapped, opt, params, loss
    gc.collect()
    if env.backend == "nccl":
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------ verdict
def agreement(aten: RunResult, mine: RunResult, compute_dtype, ref: Optional[RunResult]) -> dict:
    """Per step, parity's end-to-end rule on the loss (see the module docstring)."""
    import torch
    from . import parity as P
    tol = P.E2E_TOL.get(compute_dtype, P.E2E_TOL[torch.float32])
    rows = []
    for i, (a_, g_) in enumerate(zip(aten.losses, mine.losses)):
        a_t = torch.tensor([a_], dtype=torch.float64)
        g_t = torch.tensor([g_], dtype=torch.float64)
        _, rel, mx, _ = P.compare_e2e(g_t, a_t)
        ok = rel <= tol
        detail = f"rel err {rel:.2e} (tol {tol:.0e}, {str(compute_dtype).replace('torch.', '')})"
        if ref is not None:
            h = torch.tensor([ref.losses[i]], dtype=torch.float64)
            ok2, eg, ea = P._lowp_rule(g_t, a_t, h)
            detail += f"; vs fp32: Gems {eg:.2e}, ATen {ea:.2e}"
            ok = ok or ok2
        if not (math.isfinite(a_) and math.isfinite(g_)):
            ok = False
            detail = (f"non-finite loss (ATen {a_}, Gems {g_})" +
                      ("; ATen diverged too: nothing to compare (pure fp16 without loss scaling? use bf16 or "
                       "--mixed-precision)" if not math.isfinite(a_) else ""))
        ga, gg = aten.grad_norms[i], mine.grad_norms[i]
        rows.append({"step": i, "aten_loss": a_, "gems_loss": g_, "rel_err": rel, "tol": tol, "ok": bool(ok),
                     "detail": detail, "aten_grad_norm": ga, "gems_grad_norm": gg,
                     "grad_norm_rel_err": (abs(gg - ga) / abs(ga) if ga else abs(gg - ga))
                     if math.isfinite(ga) and math.isfinite(gg) else float("inf")})
    bad = [r["step"] for r in rows if not r["ok"]]
    return {
        "rule": "gems_coverage.parity end-to-end rule per step: |gems - aten| / |aten| <= E2E_TOL of the compute "
                "dtype" + ("; or Gems' error vs an fp32 ATen run <= 2x ATen's own + 1e-4" if ref else ""),
        "ok": not bad, "first_failing_step": bad[0] if bad else None, "failing_steps": len(bad),
        "max_rel_err": max((r["rel_err"] for r in rows), default=0.0),
        "grad_norm_max_rel_err": max((r["grad_norm_rel_err"] for r in rows), default=0.0),
        "steps": rows,
    }


def op_report(run: RunResult, registered: set, enabled: set, strategy: str) -> dict:
    """The traced step's ops across ranks: collectives, and per compute op what Gems did with it."""
    from . import classify as C
    ops: dict = {}
    for rank, (tr, served) in enumerate(zip(run.trace, run.served)):
        for name, s in (tr or {}).items():
            o = ops.setdefault(name, {"op": name, "category": s["category"], "calls_per_rank": {}, "origins": {},
                                      "dtypes": set(), "example": s["example"]})
            o["calls_per_rank"][rank] = s["calls"]
            o["dtypes"] |= set(s["dtypes"])
            for k, v in s["origins"].items():
                o["origins"][k] = o["origins"].get(k, 0) + v
    collectives, compute, gaps = [], [], []
    for name, o in sorted(ops.items(), key=lambda kv: -sum(kv[1]["calls_per_rank"].values())):
        o["dtypes"] = sorted(o["dtypes"])
        if name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")):
            collectives.append(o)
            continue
        if o["category"] != C.COMPUTE:
            continue
        fell, srv, reasons = 0, 0, {}
        for st in run.served:
            s = st.get(name)
            if s:
                srv += s["served"]
                fell += s["fallback"]
                for r, n in s["reasons"].items():
                    reasons[r] = reasons.get(r, 0) + n
        if name not in registered:
            o["gems"] = "not registered"
        elif name not in enabled:
            o["gems"] = "left to ATen by --include/--exclude"
        elif not srv and not fell:
            o["gems"] = "no call reached Gems"
        elif fell and not srv:
            o["gems"] = "fell back"
        elif fell:
            o["gems"] = "served, some calls fell back"
        else:
            o["gems"] = "served"
        o["fallback_reasons"] = reasons
        compute.append(o)
        if o["gems"] != "served" and not o["gems"].startswith("left to ATen"):
            gaps.append(o)
    for name, inner in FSDP_INNER.items():
        if name not in ops:
            continue
        o = ops[name]
        o["inner_aten_ops"] = {}
        for n in inner:
            srv = sum((st.get(n) or {}).get("served", 0) for st in run.served)
            state = ("not registered" if n not in registered else "left to ATen by --include/--exclude"
                     if n not in enabled else "served" if srv else "no call reached Gems")
            o["inner_aten_ops"][n] = state
            if state in ("not registered", "no call reached Gems"):
                gaps.append({"op": n, "category": C.COMPUTE, "gems": state, "origins": {strategy: 0},
                             "inside": name, "calls_per_rank": o["calls_per_rank"], "fallback_reasons": {},
                             "dtypes": o["dtypes"], "example": o["example"]})
    around = [o for o in compute if strategy in o["origins"]]
    wrapper = [{"op": o["op"], "category": o["category"], "calls": sum(o["calls_per_rank"].values()),
                "gems": o.get("gems", "collective" if o in collectives else "-"),
                **({"inner_aten_ops": o["inner_aten_ops"]} if "inner_aten_ops" in o else {})} for o in ops.values() if strategy in o["origins"] and o["category"] != C.VIEW]
    return {"traced": "step 0 of the Gems run, every rank (TorchDispatchMode: the ops the step dispatches; "
                      "ops inside DTensor and fsdp:: custom ops run below it)",
            "collectives": collectives, "compute": compute, "gaps": gaps,
            "around_collectives": around, "wrapper_ops": wrapper,
            "fallback_reasons_note": "fallback reasons are gems.stats() over the whole Gems run, all ranks",
            "served_compute_ops": sum(1 for o in compute if o["gems"].startswith("served")),
            "compute_ops": len(compute)}


def faults(run: RunResult) -> list:
    out = []
    for rank, st in enumerate(run.served):
        for name, s in st.items():
            errs = {r: n for r, n in s["reasons"].items() if r.startswith("gems error")}
            if errs:
                out.append({"rank": rank, "op": name, "reasons": errs, "fallback_calls": s["fallback"],
                            "served_calls": s["served"]})
    return out


# ----------------------------------------------------------------------------------------- report
def format_table(d: dict) -> str:
    from tabulate import tabulate
    lines = [f"distributed  {d['model']} ({d['size']}) {d['strategy']} on {d['world_size']} x {d['device_kind']} "
             f"({d['backend']}), params {d['param_dtype']}, compute {d['compute_dtype']}"
             f"{', activation checkpointing' if d['checkpointing'] else ''}; global batch {d['batch']} x "
             f"{d['seq_len']} tokens, {d['steps']} steps, AdamW lr {d['lr']}, clip {d['clip']}"]
    lines.append(f"data         {d['data']}")
    runs = d["runs"]
    ag = d.get("agreement")
    if ag:
        rows = [[r["step"], f"{r['aten_loss']:.6f}", f"{r['gems_loss']:.6f}", f"{r['rel_err']:.1e}",
                 "ok" if r["ok"] else "FAIL", f"{r['aten_grad_norm']:.4g}", f"{r['gems_grad_norm']:.4g}"]
                for r in ag["steps"]]
        lines += ["", tabulate(rows, headers=["step", "ATen loss", "Gems loss", "rel err", "loss", "ATen |g|",
                                              "Gems |g|"], tablefmt="simple", disable_numparse=True)]
    else:
        for m, r in runs.items():
            lines.append(f"{m} losses  " + " ".join(f"{x:.4f}" for x in r["losses"]))
    lines.append("")
    summ = []
    for m, r in runs.items():
        summ.append([m, "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}",
                     "-" if not r["step_ms"][d["warmup"]:] else f"{statistics.median(r['step_ms'][d['warmup']:]):.2f}",
                     ", ".join(f"{x:.0f}" for x in r["peak_mib"])])
    lines.append(tabulate(summ, headers=["run", "tokens/s", "ms/step (median)", "peak MiB per rank"],
                          tablefmt="simple", disable_numparse=True))
    if d.get("throughput_ratio") is not None:
        lines.append(f"ratio        {d['throughput_ratio']:.3f} (Gems tokens/s / ATen's; > 1: Gems is faster)")
    ops = d.get("ops")
    if ops:
        lines.append(f"ops          step 0, every rank: Gems served {ops['served_compute_ops']} of {ops['compute_ops']} "
                     f"compute ops; collectives: " + (", ".join(f"{c['op']} ({sum(c['calls_per_rank'].values())})"
                                                             for c in ops["collectives"]) or "none seen"))
        if ops["wrapper_ops"]:
            lines.append(f"around       {d['strategy']}'s own ops (its Python code): " + ", ".join(
                f"{o['op']} x{o['calls']} (" + (", ".join(f"inside: {k} {v}" for k, v in o["inner_aten_ops"].items())
                                                if "inner_aten_ops" in o else o["gems"]) + ")"
                for o in ops["wrapper_ops"] if o["category"] != "creation"))
        if ops["gaps"]:
            lines.append("gaps         " + "; ".join(
                f"{o['op']} ({o['gems']}{': ' + ', '.join(o['fallback_reasons']) if o['fallback_reasons'] else ''};"
                f" from {', '.join(sorted(o['origins']))}{', inside ' + o['inside'] if o.get('inside') else ''})"
                for o in ops["gaps"]))
    for f in d.get("faults") or []:
        lines.append(f"fault        rank {f['rank']}: aten::{f['op']} {', '.join(f'{k} x{v}' for k, v in f['reasons'].items())}"
                     f" -> ATen served those calls on that rank; the others went on")
    div = d.get("first_divergence")
    if div:
        lines.append(f"FIRST DIVERGENT OP  aten::{div['op']}  (rank {div['rank']}, {div['phase']}, call #{div['index']})")
        lines.append(f"  inputs  {div['inputs']}")
        lines.append(f"  output  {div['output']}: max abs err {div['max_abs']:.3e} > allowed {div['allowed']:.3e}")
    elif d.get("shadow_ran"):
        lines.append(f"shadow       {d['shadow_calls']} calls compared op by op on every rank: no divergence")
    for n in d["notes"]:
        lines.append(f"note         {n}")
    if ag:
        lines.append(f"verdict      {d['verdict']}: {len(ag['steps']) - ag['failing_steps']}/"
                     f"{len(ag['steps'])} steps' losses agree (max rel err {ag['max_rel_err']:.1e}); "
                     f"grad norms max rel err {ag['grad_norm_max_rel_err']:.1e}")
    return "\n".join(lines) + "\n"


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
         "gems": a.gems, "include": p.include, "exclude": p.exclude, "patch": a.patch,
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


if __name__ == "__main__":
    sys.exit(main())
