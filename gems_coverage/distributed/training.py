"""One training run from the seed, per rank: the model wrapped in DDP or FSDP2, AdamW, the steps, and what
they measured (losses, gradient norms, times, peak memory, what Gems served) gathered from every rank."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

from .data import Data
from .options import Env, Plan
from .step_trace import StepTracer, shadow_mode


def decoder_layers(model):
    """The decoder layers FSDP2 shards one by one (and checkpointing recomputes): the largest ModuleList."""
    import torch
    best = None
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and (best is None or len(m) > len(best)):
            best = m
    return list(best) if best is not None else []


def build_model(a, p: Plan, env: Env, param_dtype=None, mixed: Optional[bool] = None, patch: bool = False,
                compile: bool = False):
    """(wrapped model, optimizer, parameters, gems.patch's counts or None) built from the seed on every
    rank, with Gems off; `patch`: gems.patch(model) first (the Gems run under --patch: its losses are
    compared with the unpatched ATen run's, as the fused ops' end-to-end check asks); `compile`: then
    torch.compile, in place (`model.compile()`: the wrappers below call the compiled forward)."""
    import torch
    import torch.distributed as dist
    import gems_models as M
    from ..parity import no_dropout
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
    if compile:
        model.compile()
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
                                                    patch=a.patch and mode == "gems",
                                                    compile=a.compile and mode == "gems")
    vocab = wrapped.module.config.vocab_size if a.strategy == "ddp" else wrapped.config.vocab_size
    data = Data(vocab, p.batch, p.micro, p.seq_len, env.rank, a.seed, p.tokens)
    use_autocast = a.strategy == "ddp" and (a.mixed_precision if mixed is None else mixed)
    amp = (torch.autocast(device_type=env.device.split(":")[0], dtype=p.compute_dtype) if use_autocast
           else contextlib.nullcontext())
    on = mode == "gems"
    names = set()
    from ..parity import ParityResult
    shadow_res = ParityResult(model=p.recipe.name, size=p.size, device=env.device, dtype=str(p.compute_dtype),
                              backend="", registered_ops=0)
    import gems
    from .. import gemsinfo
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
                sh = shadow_mode(names, shadow_res, f"step {i}") if (shadow and on) else None
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
