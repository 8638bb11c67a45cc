"""Trace the ATen ops a model calls (TorchDispatchMode) and time them (torch.profiler, real devices only)."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from . import classify as cls_mod
from . import gemsinfo

_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64",
          "int32": "i32", "bool": "bool", "int8": "i8", "uint8": "u8", "int16": "i16", "complex64": "c64"}
MAX_SHAPES = 64   # distinct shape signatures kept per op


def short_dtype(dt) -> str:
    s = str(dt).replace("torch.", "")
    return _SHORT.get(s, s)


def op_name(func) -> str:
    """'mm.default', 'add.Tensor'; other namespaces keep theirs: 'prims::convert_element_type.default'."""
    ns = getattr(func, "namespace", "aten")
    base = getattr(func, "__name__", str(func))
    return base if ns == "aten" else f"{ns}::{base}"


def describe_tensors(args, kwargs=None, limit: int = 4) -> str:
    """'bf16[1,128,4096], bf16[4096]' for the tensor arguments of a call."""
    parts = []
    for t in tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor):
            parts.append(f"{short_dtype(t.dtype)}[{','.join(str(s) for s in t.shape)}]")
            if len(parts) >= limit:
                parts.append("...")
                break
    return ", ".join(parts)


@dataclass
class OpStat:
    name: str
    category: str
    first_call: int              # index of the first call in call order
    calls: int = 0
    dtypes: set = field(default_factory=set)
    first_dtypes: set = field(default_factory=set)
    devices: set = field(default_factory=set)
    example: str = ""
    example_size: int = -1
    shapes: set = field(default_factory=set)


class OpRecorder(TorchDispatchMode):
    """A TorchDispatchMode that counts every ATen overload, its dtypes, devices and example shapes.

    On the meta device, data-dependent scalars (``Tensor.item()``, e.g. transformers' "is the mask all ones"
    checks) have no value; the recorder answers them with a placeholder (True / 1 / 1.0) so the model runs
    on, and records the call.
    """

    def __init__(self, meta_scalars: bool = True, on_call: Optional[Callable] = None):
        super().__init__()
        self.ops: dict[str, OpStat] = {}
        self.n_calls = 0
        self.meta_scalars = meta_scalars
        self.on_call = on_call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name.startswith("profiler::"):
            return func(*args, **kwargs)
        if (self.meta_scalars and name == "_local_scalar_dense.default" and args
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"):
            self._record(name, args, kwargs)
            return _placeholder(args[0])
        out = func(*args, **kwargs)
        self._record(name, args, kwargs)
        if self.on_call is not None:
            self.on_call(name, func, args, kwargs, out)
        return out

    def _record(self, name, args, kwargs):
        st = self.ops.get(name)
        if st is None:
            st = self.ops[name] = OpStat(name=name, category=cls_mod.classify(name), first_call=self.n_calls)
        self.n_calls += 1
        st.calls += 1
        for a in args:   # the dtype Gems' dispatcher checks: the first positional tensor's
            if isinstance(a, torch.Tensor):
                st.first_dtypes.add(short_dtype(a.dtype))
                break
        sig = []
        size = 0
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                st.dtypes.add(short_dtype(t.dtype))
                st.devices.add(t.device.type)
                size += t.numel()
                if len(st.shapes) < MAX_SHAPES:
                    sig.append(tuple(t.shape))
        if sig and len(st.shapes) < MAX_SHAPES:
            st.shapes.add(tuple(sig))
        # the example is the largest call (by input elements): the one that dominates the op's cost
        if size > st.example_size or not st.example:
            st.example_size = size
            st.example = describe_tensors(args, kwargs)


def _placeholder(t):
    import torch
    if t.dtype == torch.bool:
        return True
    if t.is_floating_point() or t.is_complex():
        return 1.0
    return 1


@dataclass
class TraceResult:
    model: str
    source: str
    size: str
    mode: str
    device: str
    dtype: str
    batch: int
    seq_len: int
    new_tokens: Optional[int]
    ops: dict
    gems: gemsinfo.GemsInfo
    gems_enabled: bool = False
    served: Optional[dict] = None        # op -> {served, fallback, reasons} when Gems was enabled
    times: Optional[dict] = None         # op -> time in microseconds (profiled runs)
    time_source: str = ""                # "cpu" or "cuda" clock
    seconds: float = 0.0
    params: int = 0
    notes: list = field(default_factory=list)
    total_calls: int = 0


def trace(model: str, *, mode: str = "inference", device: str = "meta", dtype=None, batch: int = 1,
          seq_len: Optional[int] = None, size: Optional[str] = None, new_tokens: int = 4,
          use_gems: Optional[bool] = None, profile: Optional[bool] = None, optimizer: str = "adamw",
          progress: Optional[Callable[[str], None]] = None, gems_info: Optional[gemsinfo.GemsInfo] = None,
          seed: int = 0, sampling=None) -> TraceResult:
    """Build ``model`` on ``device`` and record every ATen overload it calls in ``mode``
    (``sampling``: a ``runner.Sampling`` makes generate draw tokens instead of taking the argmax)."""
    import torch
    import gems_models
    from . import runner

    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    if device not in ("meta", "cpu", "cuda") and not device.startswith("cuda:"):
        raise gems_models.ModelError(f"unknown device '{device}' (meta, cpu, cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise gems_models.ModelError("--device cuda: no CUDA device on this machine (use meta or cpu)")
    recipe = gems_models.resolve(model)
    if mode not in runner.MODES:
        raise gems_models.ModelError(f"unknown mode '{mode}' ({', '.join(runner.MODES)})")
    size, dtype, dt, seq_len = gems_models.run_defaults(device, size, dtype, seq_len)
    info = gems_info or gemsinfo.load()
    dev_type = torch.device(device).type
    can_serve = info.available and info.backend is not None and info.backend_device == dev_type
    if use_gems is None:
        use_gems = can_serve and dev_type != "meta"
    elif use_gems and not can_serve:
        why = info.error or f"the Gems backend runs on {info.backend_device}, not {dev_type}"
        raise gems_models.ModelError(f"--gems: cannot enable Gems for device {device}: {why}")
    if profile is None:
        profile = dev_type != "meta"
    if dev_type == "meta":
        profile = False

    runner.check_model(recipe, size, mode=mode, seq_len=seq_len, batch=batch, new_tokens=new_tokens)
    # one model; training adds gradients and AdamW's two states
    runner.check_memory(recipe, size, device, dt, 4 if mode == "training" else 1.2, f"a {mode} trace")
    say(f"building {recipe.name} ({size}, {device}, {short_dtype(dt)}) ...")
    bundle = gems_models.build(recipe, size=size, device=device, dtype=dt, batch=batch, seq_len=seq_len,
                          seed=seed)
    runner.check_mode(bundle, mode)
    nparams = sum(p.numel() for p in bundle.model.parameters())
    res = TraceResult(model=recipe.name, source=recipe.source, size=size, mode=mode, device=device,
                      dtype=str(dt).replace("torch.", ""), batch=batch, seq_len=seq_len,
                      new_tokens=new_tokens if mode == "generate" else None, ops={}, gems=info,
                      gems_enabled=bool(use_gems), params=nparams)
    if mode == "generate":
        res.notes.append(f"generate: sampling ({sampling.describe()}; transformers' warpers, softmax, multinomial)"
                         if sampling is not None else "generate: greedy (argmax)")
    if dev_type == "meta":
        res.notes.append("meta device: shapes only, no data and no time; attention takes the math path "
                         "(bmm + softmax), unlike CPU/CUDA fused attention kernels")

    say(f"tracing {mode} ...")
    rec = OpRecorder(meta_scalars=True)
    before = None
    try:
        if use_gems:
            import gems
            before = gemsinfo.stats()
            with gems.use_gems():
                with rec:
                    runner.run(bundle, mode, new_tokens=new_tokens, optimizer=optimizer, sampling=sampling)
            res.served = gemsinfo.stats_delta(before, gemsinfo.stats())
        else:
            with rec:
                runner.run(bundle, mode, new_tokens=new_tokens, optimizer=optimizer, sampling=sampling)
        if dev_type == "cuda":
            torch.cuda.synchronize()
    except gems_models.ModelError:
        raise
    res.ops = rec.ops
    res.total_calls = rec.n_calls

    if profile:
        say("profiling (ATen, time per op) ...")
        if use_gems:
            _unregister_gems()
        res.times, res.time_source = _profile(bundle, mode, new_tokens, optimizer, dev_type, res.ops, sampling)
        res.notes.append(f"time: torch.profiler {res.time_source} time of one ATen run (Gems off), each op "
                         f"with the ATen calls it makes internally")
    res.seconds = time.perf_counter() - t0
    say(f"done in {res.seconds:.1f} s: {len(res.ops)} distinct ops, {res.total_calls} calls")
    return res


def _unregister_gems():
    """Take Gems' kernels out of the dispatcher (unless the user enabled Gems globally) so ATen is timed alone."""
    try:
        import gems
        if not gems.is_enabled():
            gems.disable()
    except Exception:
        pass


def _profile(bundle, mode, new_tokens, optimizer, dev_type, ops, sampling=None):
    import torch
    from torch.profiler import ProfilerActivity, profile
    from . import runner
    acts = [ProfilerActivity.CPU]
    if dev_type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=acts) as prof:
            runner.run(bundle, mode, new_tokens=new_tokens, optimizer=optimizer, sampling=sampling)
            if dev_type == "cuda":
                torch.cuda.synchronize()
        events = prof.events()
    use_dev = dev_type == "cuda"
    traced = {cls_mod.packet_of(n) for n in ops if "::" not in n}
    # Attribute each event's inclusive time to the outermost traced op it runs under: the dispatch mode sees
    # only outermost calls (ATen's internal calls, e.g. copy_ inside _to_copy or cuDNN's helpers, run below
    # it), so their time belongs to the op the trace lists. Untraced wrappers (linear, dropout, ...) are
    # composite: their children are the traced ops.
    per_packet: dict[str, float] = {}
    for evt in events:
        name = evt.name
        if not name.startswith("aten::") or name[6:] not in traced:
            continue
        p, nested = evt.cpu_parent, False
        while p is not None:
            if p.name.startswith("aten::") and p.name[6:] in traced:
                nested = True
                break
            p = p.cpu_parent
        if nested:
            continue
        if use_dev:
            us = float(evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total)
        else:
            us = float(evt.cpu_time_total)
        per_packet[name[6:]] = per_packet.get(name[6:], 0.0) + us
    # A profiler event names the packet ('aten::add'); split its time over the traced overloads by calls.
    by_packet: dict[str, list] = {}
    for name, st in ops.items():
        if "::" not in name:
            by_packet.setdefault(cls_mod.packet_of(name), []).append(st)
    times = {}
    for pk, sts in by_packet.items():
        total = per_packet.get(pk, 0.0)
        n = sum(s.calls for s in sts) or 1
        for s in sts:
            times[s.name] = total * s.calls / n
    return times, ("cuda" if use_dev else "cpu")
