"""The model benchmark: a workload with ATen and with Gems, end to end, and where the difference goes.

    gems-coverage bench llama2 --device cuda --workload decode

Both modes run the same model object on the same inputs, in one process, in turns (ATen, Gems, ATen, ...)
so drift hits both. The ATen turns run with Gems *unregistered* (`gems.disable()`): once registered, every
call of a registered overload passes through Gems' Python kernel even with Gems off, a cost users
without Gems never pay; call plans survive the unregistration, so the Gems turns stay warm.

Per mode: one untimed run whose outputs are compared (parity's rules: logits and the first step's loss
by the end-to-end tolerance of the model's dtype and, for bf16/fp16, against an fp32 run of the same
weights; greedy tokens position by position, a flip accepted only on a near tie), `--warmup` untimed
runs, `--steps` timed runs (synchronized on CUDA: end-to-end throughput, host work included), then one
run under `torch.profiler` for the attribution: each outermost ATen op's calls, host time per call (its
CPU time, Python kernel and children included) and device time per call (the kernels launched under
it), and what it adds to or saves from the step.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from .runner import OPTIMIZERS  # noqa: F401 - the training step's optimizers (runner.make_optimizer)

WORKLOADS = ("prefill", "decode", "train")
# a profiler annotation around the prompt's forward in a decode run: its ops are not decode steps
PROMPT_MARK = "gems_bench::prompt"


# ------------------------------------------------------------------------------------------ results
@dataclass
class OpRow:
    """One outermost ATen op of the profiled run, per unit (step, or decode token)."""

    op: str                                 # profiler name without "aten::" (e.g. "mm", "linear")
    aten_calls: float = 0.0                 # calls per unit
    gems_calls: float = 0.0
    aten_host_us_per_call: Optional[float] = None
    gems_host_us_per_call: Optional[float] = None
    aten_device_us_per_call: Optional[float] = None   # None on CPU (no device timeline)
    gems_device_us_per_call: Optional[float] = None
    delta_host_ms: float = 0.0              # per unit: gems calls x time - aten calls x time
    delta_device_ms: Optional[float] = None
    served: float = 0.0                     # per unit, Gems overloads that ran under this op
    fallback: float = 0.0
    gems_overloads: dict = field(default_factory=dict)   # overload -> {"served", "fallback"} per unit

    def rank(self) -> float:
        return abs(self.delta_host_ms) + abs(self.delta_device_ms or 0.0)


@dataclass
class BenchResult:
    model: str
    workload: str
    device: str
    gpu: str
    size: str
    dtype: str
    batch: int
    seq_len: int
    new_tokens: int
    steps: int
    warmup: int
    optimizer: Optional[str]
    unit: str                                   # "step" or "token"
    tokens_per_unit: int
    aten_ms: list = field(default_factory=list)
    gems_ms: list = field(default_factory=list)
    aten_peak_mib: Optional[float] = None
    gems_peak_mib: Optional[float] = None
    agreement: list = field(default_factory=list)     # [{check, ok, detail, rel_err, tol}]
    ops: list = field(default_factory=list)           # OpRow, ranked
    profiled_units: Optional[int] = None              # units in the profiled run (None: no attribution)
    totals: Optional[dict] = None                     # per unit: host/device sums, profiled wall time
    no_plan: dict = field(default_factory=dict)       # overload -> why signatures kept the full path
    # overload -> {reason: calls}: what ATen served with Gems on, and why ("aten faster": a tuned bucket
    # where cuBLAS won); counted over the profiled Gems run with attribution, else over every Gems turn
    fallbacks: dict = field(default_factory=dict)
    # overload -> served calls that ran Python (no call plan replayed from C++: ops without plans, such as
    # the _foreach_* ops, or signatures seen for the first time), same scope as fallbacks; None when
    # the C++ fast path is not loaded (then every call runs Python)
    python_path: Optional[dict] = None
    meaningful: bool = True
    notes: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    # decode --fresh-lengths: every warm-up and timed run decodes KV lengths no earlier run met
    fresh_lengths: bool = False
    patched: bool = False                             # --patch: the Gems turns run gems.patch(model) too
    patch: Optional[dict] = None                      # gems.patch's report (what was replaced)

    @property
    def agree(self) -> bool:
        return all(c["ok"] for c in self.agreement)

    @property
    def aten_median(self) -> Optional[float]:
        return statistics.median(self.aten_ms) if self.aten_ms else None

    @property
    def gems_median(self) -> Optional[float]:
        return statistics.median(self.gems_ms) if self.gems_ms else None

    @property
    def device_timed(self) -> bool:
        return self.device.startswith("cuda")

    def to_dict(self) -> dict:
        d = asdict(self)
        a, g = self.aten_median, self.gems_median
        d["aten_ms_median"] = _r(a, 4)
        d["gems_ms_median"] = _r(g, 4)
        d["aten_tokens_per_s"] = _r(self.tokens_per_unit / a * 1e3, 2) if a else None
        d["gems_tokens_per_s"] = _r(self.tokens_per_unit / g * 1e3, 2) if g else None
        d["throughput_ratio"] = _r(a / g, 4) if a and g else None
        d["agree"] = self.agree
        d["baseline"] = "ATen with Gems unregistered"
        return d


def _r(x, n):
    return None if x is None else round(float(x), n)


# --------------------------------------------------------------------------------------------- workload
class _Workload:
    """One built model and its workload; each method runs in the mode it is given (False: ATen, True: Gems)."""

    def __init__(self, bundle, kind: str, new_tokens: int, optimizer: str, include, exclude, patch: bool = False,
                 patch_options=None, keep_start: bool = True):
        import torch
        import gems
        self.torch, self.gems, self.b, self.kind, self.new_tokens = torch, gems, bundle, kind, new_tokens
        self.include, self.exclude = include, exclude
        self.patch, self.patch_options = patch, dict(patch_options or {})   # gems.patch's options
        dev = torch.device(bundle.device)
        self.on_cuda = dev.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(dev)) if self.on_cuda else (lambda: None)
        self.opt = self.start = None
        if kind == "train":
            bundle.model.train()
            params = [p for p in bundle.model.parameters() if p.requires_grad]
            self.opt = _make_optimizer(params, optimizer)
            # the agreement runs start both modes from these weights; dropped afterwards (peak memory)
            if keep_start:
                self.start = {k: v.detach().clone() for k, v in bundle.model.state_dict().items()}
        else:
            bundle.model.eval()

    def mode(self, on: bool):
        """The context of one run: Gems' scope (and with --patch the model patched by gems.patch for the
        run), or ATen with Gems unregistered and the model unpatched (see the module docstring)."""
        if on:
            scope = self.gems.use_gems(include=self.include, exclude=self.exclude)
            if not self.patch:
                return scope
            stack = contextlib.ExitStack()
            stack.enter_context(self.gems.patched(self.b.model, **self.patch_options))
            stack.enter_context(scope)
            return stack
        self.gems.disable()
        return contextlib.nullcontext()

    def restore(self):
        """Training: the starting weights and a fresh optimizer state."""
        if self.start is None:
            return
        with self.torch.no_grad():
            for k, v in self.b.model.state_dict().items():
                v.copy_(self.start[k])
        self.opt.state.clear()

    def _step(self):
        from . import runner
        if self.kind == "prefill":
            with self.torch.no_grad():
                return runner.forward(self.b)
        from gems_models import training_loss
        self.opt.zero_grad(set_to_none=True)
        loss = training_loss(runner.forward(self.b, train=True))
        loss.backward()
        self.opt.step()
        return loss.detach()

    def first(self, on: bool) -> dict:
        """The run the modes are compared on (training: from the starting weights), outputs on the CPU."""
        from .parity import _generate, _main_output
        self.restore()
        with self.mode(on):
            if self.kind == "decode":
                steps: list = []
                out = {"tokens": _generate(self.b, self.new_tokens, steps), "steps": steps}
            elif self.kind == "prefill":
                out = {"logits": _main_output(self._step())}
            else:
                out = {"loss": self._step()}
        self.sync()
        return {k: _cpu(v) for k, v in out.items()}

    def reference(self):
        """The compared output computed by ATen in fp32 from the same weights: the reference of parity's
        low-precision rule."""
        from . import runner
        from .parity import _main_output
        torch = self.torch
        self.restore()
        with self.mode(False), _as_fp32(self.b), torch.no_grad():
            if self.kind == "train":
                from gems_models import training_loss
                out = training_loss(runner.forward(self.b, train=True))
            else:
                out = _main_output(self.b.model(**self.b.inputs))
                if self.kind == "decode":
                    out = out[:, -1, :]     # the logits that pick the first token
            out = out.detach().cpu()
        if self.on_cuda:
            torch.cuda.empty_cache()    # the fp32 copy's memory goes back before anything is measured
        return out

    @contextlib.contextmanager
    def truncated(self, length):
        """Prefill / training inputs cut to their first `length` positions for the block (every [B, S]
        tensor of the inputs: ids, masks, token types, labels; Llava's image tokens come first and stay);
        None: as built."""
        b = self.b
        if length is None:
            yield
            return
        full = b.inputs["input_ids"].shape[1]

        # contiguous, as a collator's padded batch is (BERT's loss views its labels; a slice would not view)
        def cut(d):
            return {k: v[:, :length].contiguous()
                    if isinstance(v, self.torch.Tensor) and v.dim() == 2 and v.shape[1] == full else v
                    for k, v in d.items()}
        saved = b.inputs, b.train_inputs
        b.inputs, b.train_inputs = cut(b.inputs), cut(b.train_inputs)
        try:
            yield
        finally:
            b.inputs, b.train_inputs = saved

    def timed(self, on: bool, prompt_len=None):
        """One timed run: (ms per unit, peak MiB or None); prompt_len: decode from the prompt's first
        prompt_len positions (runner.run_generate), prefill / train on the inputs' first prompt_len."""
        torch = self.torch
        from . import runner
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
        with self.mode(on):     # entering it (registering Gems, or not) is outside the timed region
            if self.kind == "decode":
                times: list = []
                runner.run_generate(self.b, self.new_tokens, times=times, sync=self.sync, prompt_len=prompt_len)
                ms = times[0]   # per decode step: the prompt's prefill is not timed
            else:
                with self.truncated(prompt_len):
                    self.sync()
                    t0 = time.perf_counter()
                    self._step()
                    self.sync()
                    ms = (time.perf_counter() - t0) * 1e3
        peak = torch.cuda.max_memory_allocated() / 2**20 if self.on_cuda else None
        return ms, peak

    def profile(self, on: bool) -> dict:
        """One run under torch.profiler: per outermost ATen op (calls, host us, device us), the run's wall
        time and, with Gems, gems.stats() of the same run; decode: the decode steps only."""
        import warnings
        from torch.profiler import ProfilerActivity, profile
        from . import runner
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        reset = self.gems.reset_stats if on else (lambda: None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.mode(on):
                reset()
                with profile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    if self.kind == "decode":
                        # stats restart after the prompt, like the attribution, which leaves it out
                        with _mark_prompt(self.b.model, after=reset):
                            runner.run_generate(self.b, self.new_tokens)
                    else:
                        self._step()
                    self.sync()
                    wall = (time.perf_counter() - t0) * 1e3
                stats = self.gems.stats() if on else {}
            events = prof.events()
        ops, inner = outermost_ops(events, self.on_cuda, fused_event_names() if on and self.patch else None)
        return {"ops": ops, "inner": inner, "wall_ms": wall,
                "stats": {k: {"served": v["served"], "fallback": v["fallback"]} for k, v in stats.items()}}


def _cpu(x):
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, list):
        return [_cpu(v) for v in x]
    return x


def _make_optimizer(params, name):
    # runner.make_optimizer's (adamw: foreach=True, what CUDA users run; adamw-loop; adamw-fused; sgd)
    from . import runner
    return runner.make_optimizer(params, name, lr=1e-3 if name == "sgd" else 1e-4)


@contextlib.contextmanager
def _as_fp32(bundle):
    """The model and its floating inputs in fp32 for the block, then exactly as before (bf16 and fp16
    values are exact in fp32, so the round trip changes nothing). Tensor by tensor, in place: the peak
    is one fp32 copy of the model, not a bf16 copy plus an fp32 one."""
    import itertools
    import torch
    m = bundle.model
    tensors = [t for t in itertools.chain(m.parameters(), m.buffers()) if t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    saved = [dict(bundle.inputs), dict(bundle.train_inputs)]
    with torch.no_grad():
        for t in tensors:
            t.data = t.data.float()
    for d in (bundle.inputs, bundle.train_inputs):
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                d[k] = v.float()
    try:
        yield
    finally:
        with torch.no_grad():
            for t, dt in zip(tensors, dtypes):
                t.data = t.data.to(dt)
        for d, s in zip((bundle.inputs, bundle.train_inputs), saved):
            d.clear()
            d.update(s)


@contextlib.contextmanager
def _mark_prompt(model, after: Callable = lambda: None):
    """Annotate the first forward (the prompt's prefill) for the profiler; call `after` when it returns."""
    from torch.profiler import record_function
    orig = model.forward
    first = [True]

    def forward(*a, **k):
        if not first[0]:
            return orig(*a, **k)
        first[0] = False
        with record_function(PROMPT_MARK):
            out = orig(*a, **k)
        after()
        return out
    had, prev = "forward" in model.__dict__, model.__dict__.get("forward")   # gems.patch's forward, if any
    model.forward = forward
    try:
        yield
    finally:
        del model.forward
        if had:
            model.forward = prev


def fused_event_names() -> dict:
    """{profiler event name: row name} of gems.fused's autograd Functions (forward: the class name;
    backward: the class name + "Backward"): with --patch their kernels are launched outside any ATen op."""
    import importlib
    import torch
    from gems import fused
    names = {}
    for mod in sorted(set(fused._WHERE.values())):
        try:
            m = importlib.import_module(f"gems.fused.{mod}")
        except ImportError:
            continue
        for v in vars(m).values():
            if isinstance(v, type) and issubclass(v, torch.autograd.Function) and v.__module__ == m.__name__:
                names[v.__name__] = f"fused::{v.__name__}"
                names[v.__name__ + "Backward"] = f"fused::{v.__name__}Backward"
    return names


def outermost_ops(events, with_device: bool, fused: Optional[dict] = None):
    """From profiler events: ({op: [calls, host us, device us]} over the outermost ATen ops of each
    thread, {outermost op: {ATen op under it, itself included: calls}}). Events inside the
    PROMPT_MARK annotation are left out. Host time is the outermost event's CPU time (its children
    included); device time is the profiler's attribution of the kernels launched under it. `fused`
    ({event name: row name}, see fused_event_names) counts those events as ops too."""
    fused = fused or {}

    def op_of(name):
        return name[6:] if name.startswith("aten::") else fused.get(name)

    ops: dict = {}
    inner: dict = {}
    for e in events:
        if op_of(e.name) is None:
            continue
        outer, p = e, e.cpu_parent
        while p is not None and p.name != PROMPT_MARK:
            if op_of(p.name) is not None:
                outer = p
            p = p.cpu_parent
        if p is not None:       # inside the prompt
            continue
        name = op_of(outer.name)
        below = inner.setdefault(name, {})
        below[op_of(e.name)] = below.get(op_of(e.name), 0) + 1
        if outer is e:
            r = ops.setdefault(name, [0, 0.0, 0.0])
            r[0] += 1
            r[1] += float(e.cpu_time_total)
            if with_device:
                r[2] += float(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    return ops, inner


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------------ the bench
def _validate(model, workload, device, optimizer, new_tokens, include, exclude, command="bench"):
    """Everything that is bad input, checked before anything is built (-> exit 2); `command` names the
    caller in the messages (bench, tune)."""
    import torch
    import gems_models as M
    from . import gemsinfo
    if workload not in WORKLOADS:
        raise M.ModelError(f"unknown workload '{workload}' ({', '.join(WORKLOADS)})")
    if optimizer not in OPTIMIZERS:
        raise M.ModelError(f"unknown optimizer '{optimizer}' ({', '.join(OPTIMIZERS)})")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise M.ModelError(f"unknown device '{device}' (cuda or cpu)") from None
    if dev.type not in ("cuda", "cpu"):
        raise M.ModelError(f"{command} runs real kernels: --device cuda (full size) or cpu (tiny, Triton "
                           f"interpreter)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise M.ModelError("--device cuda: no CUDA device on this machine")
    info = gemsinfo.load()
    if not info.available:
        raise M.ModelError(f"{command} needs Gems: {info.error}")
    if info.backend_device != dev.type:
        why = info.error or f"the active Gems backend '{info.backend}' serves {info.backend_device} tensors"
        raise M.ModelError(f"Gems cannot run on device {device}: {why}")
    recipe = M.resolve(model)
    if workload == "decode":
        if recipe.kind not in ("causal_lm", "llava"):
            raise M.ModelError(f"{recipe.name}: workload 'decode' needs a causal LM (this is {recipe.kind})")
        if new_tokens < 2:
            raise M.ModelError("decode: --new-tokens must be at least 2 (the first token comes from the prompt)")
    import gems
    if gems.is_enabled():
        # the ATen turns unregister Gems, which would also switch off the caller's gems.enable()
        raise M.ModelError(f"{command} needs Gems off outside its own runs (gems.enable() is active)")
    try:
        gems.use_gems(include=include, exclude=exclude)   # resolves the names; registers nothing
    except (ValueError, AttributeError, RuntimeError) as e:
        raise M.ModelError(f"--include/--exclude: {e}") from None
    return recipe, dev.type == "cuda"


def bench(model: str, *, workload: str = "prefill", device: str = "cpu", size: Optional[str] = None,
          dtype: Optional[str] = None, batch: int = 1, seq_len: Optional[int] = None, new_tokens: int = 16,
          steps: Optional[int] = None, warmup: Optional[int] = None, optimizer: str = "adamw",
          include=None, exclude=None, attribution: bool = True, patch: bool = False,
          fresh_lengths: bool = False, progress: Callable[[str], None] = lambda s: None) -> BenchResult:
    """Run `workload` with ATen and with Gems on one model and compare (see the module docstring).

    patch: the Gems turns also run the model patched by `gems.patch` (fused ops); the ATen turns run it
    unpatched, Gems unregistered. True for gems.patch's defaults, or a dict of its options
    ({"layer_norm": True}: the fused parts are measured one by one).

    fresh_lengths: run k of the warm-up and timed runs (k = 1, 2, ...; both modes the same) meets
    sequence lengths no earlier run met, so every run brings signatures Gems has not planned (and shapes
    cuDNN's attention has no graph for). Decode starts from the prompt's first seq_len - k x new_tokens
    tokens: a server whose prompts vary in length. Prefill and training take the inputs' first
    seq_len - k positions: batches padded to their longest sequence (dynamic padding). Without it every
    timed run repeats the warm-up's lengths (all planned)."""
    import torch
    import gems
    import gems_models as M
    recipe, on_cuda = _validate(model, workload, device, optimizer, new_tokens, include, exclude)
    from .runner import patch_options, patched
    popts, patch = patch_options(patch), patched(patch)
    size, dtype_name, dt, seq_len = M.run_defaults("cuda" if on_cuda else "cpu", size, dtype, seq_len)
    steps = steps if steps is not None else (5 if on_cuda else 1)
    warmup = warmup if warmup is not None else (2 if on_cuda else 1)
    decode = workload == "decode"
    shorter = new_tokens if decode else 1     # --fresh-lengths: each run's sequence this much shorter
    if fresh_lengths and seq_len - (warmup + steps) * shorter < (1 if decode else 2):
        raise M.ModelError(f"--fresh-lengths: --seq-len must exceed (warm-up + timed runs) x "
                           f"{'--new-tokens' if decode else '1'} = {(warmup + steps) * shorter} "
                           f"(each run's sequence is {'--new-tokens' if decode else 'one token'} shorter)")
    res = BenchResult(recipe.name, workload, device, torch.cuda.get_device_name(device) if on_cuda else "cpu",
                      size, dtype_name, batch, seq_len, new_tokens if decode else 0, steps, warmup,
                      optimizer if workload == "train" else None, unit="token" if decode else "step",
                      tokens_per_unit=batch * (1 if decode else seq_len), meaningful=on_cuda,
                      versions={"torch": torch.__version__, "triton": _version("triton"),
                                "transformers": _version("transformers"), "gems": gems.__version__})
    if not on_cuda:
        res.notes.append("timings meaningless (CPU interpreter): this run checks that the workload runs, "
                         "agrees and is attributed")
    if workload == "train":
        res.notes.append("training runs with dropout 0 (the two modes' first-step losses are compared)")
    progress(f"building {recipe.name} ({size}, {dtype_name}) on {device}")
    if on_cuda and torch.device(device).index is not None:
        # Gems falls back for tensors off the current device ("cuda" alone already is the current one)
        torch.cuda.set_device(torch.device(device))
    bundle = M.build(recipe, size=size, device=device, dtype=dtype_name, batch=batch, seq_len=seq_len, seed=0,
                     dropout=0.0 if workload == "train" else None)
    if patch:
        res.patched = True
        res.patch = _patch_report(bundle.model, popts)
        res.notes.append("Gems turns: gems.patch(model) + Gems' ATen ops; ATen turns: the unpatched model; "
                         "attribution rows fused::<Function> are gems.fused's kernels (forward and Backward)")
    if fresh_lengths:
        res.fresh_lengths = True
        res.notes.append(f"fresh lengths: run k of the warm-up and timed runs decodes from the prompt's first "
                         f"seq_len - k x {new_tokens} tokens (both modes alike), so every token's KV length is "
                         f"new to Gems' plan caches; the agreement and profiled runs use the whole prompt"
                         if decode else
                         "fresh lengths: run k of the warm-up and timed runs takes the inputs' first seq_len - k "
                         "positions (both modes alike; dynamic padding), so every run's shapes are new to Gems' "
                         "plan caches; tokens per step counts the whole seq_len; the agreement and profiled runs "
                         "use the whole inputs")
    if fresh_lengths and bundle.custom_args:
        raise M.ModelError(f"--fresh-lengths: {recipe.name} takes positional inputs, which have no sequence "
                           f"length to vary")
    # (Llava's image tokens included)
    full_len = bundle.inputs["input_ids"].shape[1] if decode or fresh_lengths else 0
    wl = _Workload(bundle, workload, new_tokens, optimizer, include, exclude, patch, popts)
    try:
        res.agreement = _agreement(wl, dt, progress)
        wl.start = None   # the training start weights are not needed any more
        for i in range(warmup + steps):
            plen = full_len - (i + 1) * shorter if fresh_lengths else None
            if i < warmup:
                progress(f"warm-up {i + 1}/{warmup}")
                wl.timed(False, plen)
                wl.timed(True, plen)
                continue
            progress(f"timed {i + 1 - warmup}/{steps}")
            for on, times, key in ((False, res.aten_ms, "aten_peak_mib"), (True, res.gems_ms, "gems_peak_mib")):
                ms, peak = wl.timed(on, plen)
                times.append(round(ms, 4))
                if peak is not None:
                    setattr(res, key, round(max(getattr(res, key) or 0.0, peak), 1))
        if attribution:
            progress("attribution: one profiled run per mode")
            units = new_tokens - 1 if decode else 1
            a, g = wl.profile(False), wl.profile(True)
            res.ops = attribute(a, g, units, on_cuda)
            res.profiled_units = units
            res.totals = totals(a, g, units, on_cuda)
            if decode:
                res.notes.append(f"attribution per decode step: the profiled run's {units} one-token steps "
                                 f"(the prompt's forward left out), divided by {units}")
        res.no_plan = {k: v["reasons"] for k, v in gems.plan_stats().items() if v["no_plan"]}
        st = gems.stats()
        res.fallbacks = {k: dict(sorted(v["reasons"].items(), key=lambda r: -r[1]))
                         for k, v in sorted(st.items(), key=lambda kv: -kv[1]["fallback"]) if v["fallback"]}
        from gems.runtime import fast as _fast
        if _fast.status().startswith("loaded"):
            res.python_path = {k: v["python"] for k, v in sorted(st.items(), key=lambda kv: -kv[1]["python"])
                               if v["python"]}
    finally:
        gems.disable()   # leave the process as it was: nothing registered
    return res


def _patch_report(model, options) -> dict:
    """What gems.patch replaces in this model (patched and unpatched at once; bad input -> ModelError)."""
    import gems
    import gems_models as M
    try:
        report = gems.patch(model, **options)
    except (ValueError, TypeError, RuntimeError) as e:
        raise M.ModelError(f"--patch: {e}") from None
    gems.unpatch(model)
    return report.to_dict()


def _agreement(wl: _Workload, dtype, progress) -> list:
    """The checks of parity's end-to-end rule on this workload's outputs (see gems_coverage.parity)."""
    import torch
    from .parity import _check, _token_check
    hi = None
    if dtype in (torch.bfloat16, torch.float16):
        progress("agreement: the fp32 reference (ATen, same weights in fp32)")
        hi = wl.reference()
    progress("agreement: one ATen and one Gems run")
    ref, got = wl.first(False), wl.first(True)
    kind = wl.kind
    if kind == "prefill":
        checks = [_check(kind, "logits", got["logits"], ref["logits"], hi)]
    elif kind == "train":
        checks = [_check(kind, "loss (first step, same start)", got["loss"], ref["loss"], hi)]
    else:
        checks = [_check(kind, "prompt logits (last position)", got["steps"][0], ref["steps"][0], hi),
                  _token_check(got["tokens"], ref["tokens"], ref["steps"])]
    out = []
    for c in checks:
        detail = c.detail
        if not c.ok and hi is None:
            detail += "; `gems-coverage parity MODEL --device ...` names the first divergent op"
        out.append({"check": c.name, "ok": bool(c.ok), "detail": detail, "rel_err": c.rel_err, "tol": c.tol})
    return out


# ----------------------------------------------------------------------------------------- attribution
def attribute(aten: dict, mine: dict, units: int, with_device: bool) -> list:
    """OpRows from the two profiled runs, per unit, ranked by |delta host| + |delta device|."""
    rows: dict[str, OpRow] = {}
    for mode, prof in (("aten", aten), ("gems", mine)):
        for op, (calls, host, dev) in prof["ops"].items():
            r = rows.setdefault(op, OpRow(op))
            setattr(r, f"{mode}_calls", round(calls / units, 3))
            setattr(r, f"{mode}_host_us_per_call", round(host / calls, 2))
            if with_device:
                setattr(r, f"{mode}_device_us_per_call", round(dev / calls, 2))
    for op, r in rows.items():
        a, g = aten["ops"].get(op, (0, 0.0, 0.0)), mine["ops"].get(op, (0, 0.0, 0.0))
        r.delta_host_ms = round((g[1] - a[1]) / units / 1e3, 4)
        if with_device:
            r.delta_device_ms = round((g[2] - a[2]) / units / 1e3, 4)
    _place_stats(rows, mine["stats"], mine["inner"], units)
    return sorted(rows.values(), key=lambda r: -r.rank())


def totals(aten: dict, mine: dict, units: int, with_device: bool) -> dict:
    """Per unit and mode: the sums of host and device time over the outermost ATen ops, and the profiled
    run's wall time (profiler on: the difference to the host sum is Python outside ATen ops)."""
    out = {}
    for mode, prof in (("aten", aten), ("gems", mine)):
        vals = list(prof["ops"].values())
        out[f"{mode}_host_ms"] = round(sum(v[1] for v in vals) / units / 1e3, 4)
        out[f"{mode}_device_ms"] = round(sum(v[2] for v in vals) / units / 1e3, 4) if with_device else None
        out[f"{mode}_wall_ms"] = round(prof["wall_ms"] / units, 4)
    return out


def _place_stats(rows: dict, stats: dict, inner: dict, units: int):
    """Put each Gems overload's served/fallback counts on the outermost ops it ran under.

    Gems serves at the backend key, often below a composite op (`mm` under `linear`): the counts go
    to the rows whose profiled subtree held that ATen op, split by how many of its calls each held."""
    from .classify import packet_of
    for overload, s in stats.items():
        pk = packet_of(overload)
        holders = {outer: below[pk] for outer, below in inner.items() if below.get(pk)}
        total = sum(holders.values())
        if not total:   # not seen by the profiler: keep the counts visible under the op's own name
            holders, total = {pk: 1}, 1
        for outer, n in holders.items():
            r = rows.setdefault(outer, OpRow(outer))
            share = n / total / units
            served, fell = round(s["served"] * share, 3), round(s["fallback"] * share, 3)
            r.served = round(r.served + served, 3)
            r.fallback = round(r.fallback + fell, 3)
            r.gems_overloads[overload] = {"served": served, "fallback": fell}


# ------------------------------------------------------------------------------------------- output
def format_result(res: BenchResult, fmt: str = "table", top: int = 25) -> str:
    import json
    d = res.to_dict()
    if fmt == "json":
        return json.dumps(d, indent=1) + "\n"
    from tabulate import tabulate
    md = fmt == "markdown"
    tf = "github" if md else "simple"
    u = res.unit
    what = (f"{res.model} ({res.size}, {res.dtype}) on {res.gpu}: {res.workload}, batch {res.batch}, "
            f"seq {res.seq_len}" + (f" + {res.new_tokens} new tokens" if res.workload == "decode" else "")
            + (" (fresh lengths every run)" if res.fresh_lengths else "")
            + (f", {res.optimizer}" if res.optimizer else "")
            + f"; median of {res.steps} timed run(s) after {res.warmup} warm-up, ATen (Gems unregistered) "
              f"and Gems alternating")
    lines = [("### " if md else "bench    ") + what, ""]
    for n in res.notes:
        lines.append(("- " if md else "note     ") + n)
    if res.patched and res.patch:
        lines.append(("- " if md else "patched  ") + ("patched: " if md else "") + ", ".join(
            f"{k} x{v}" for k, v in res.patch["replaced"].items()) + "".join(f"; {n}" for n in res.patch["notes"]))
    summary = []
    for mode, label in (("aten", "ATen"), ("gems", "Gems")):
        peak = d[f"{mode}_peak_mib"]
        summary.append([label, _fmt(d[f"{mode}_ms_median"], ".3f"), _fmt(d[f"{mode}_tokens_per_s"], ".1f"),
                        "n/a (CPU)" if peak is None else f"{peak:.0f}"])
    lines += ["", tabulate(summary, headers=["mode", f"ms/{u}", "tokens/s", "peak MiB"], tablefmt=tf,
                           disable_numparse=True), ""]
    lines.append(("**ratio** " if md else "ratio    ") + f"{_fmt(d['throughput_ratio'], '.3f')} "
                 f"(Gems throughput / ATen's; > 1: Gems is faster)")
    for c in res.agreement:
        lines.append(("- agree " if md else "agree    ") + f"{'yes' if c['ok'] else 'NO'}: {c['check']}: {c['detail']}")
    if res.fallbacks:
        scope = "the profiled run" if res.profiled_units is not None else "every Gems turn"
        lines.append(("- " if md else "") + f"fell back to ATen (calls in {scope}): " + "; ".join(
            f"{k} {sum(v.values())} ({', '.join(f'{r}: {c}' for r, c in v.items())})"
            for k, v in list(res.fallbacks.items())[:12]))
    if res.python_path:
        scope = "the profiled run" if res.profiled_units is not None else "every Gems turn"
        lines.append(("- " if md else "") + f"served on the Python path, not replayed from C++ (calls in {scope}): "
                     + "; ".join(f"{k} {n}" for k, n in list(res.python_path.items())[:12]))
    if res.no_plan:
        lines.append(("- " if md else "") + "full path (no call plan): "
                     + "; ".join(f"{k}: {', '.join(v)}" for k, v in res.no_plan.items()))
    if res.profiled_units is not None:
        lines += ["", _totals_line(res.totals, u, res.profiled_units), ""]
        lines.append(_attribution_table(res.ops[:top], u, res.device_timed, tf))
        if len(res.ops) > top:
            lines.append(f"({len(res.ops) - top} more rows in --format json)")
    return "\n".join(lines) + "\n"


def _totals_line(t: dict, u: str, units: int) -> str:
    dev = ("device n/a (CPU)" if t["aten_device_ms"] is None else
           f"device {t['aten_device_ms']:.2f} -> {t['gems_device_ms']:.2f} ms")
    return (f"attribution per {u} (one profiled run per mode, {units} {u}(s), outermost ATen ops, ATen -> "
            f"Gems): host {t['aten_host_ms']:.2f} -> {t['gems_host_ms']:.2f} ms, {dev}; profiled wall "
            f"{t['aten_wall_ms']:.2f} -> {t['gems_wall_ms']:.2f} ms")


def _attribution_table(rows: list, u: str, device: bool, tf: str) -> str:
    from tabulate import tabulate
    table = []
    for r in rows:
        table.append([r.op, _fmt(r.aten_calls, "g"), _fmt(r.gems_calls, "g"),
                      _fmt(r.aten_host_us_per_call, ".1f"), _fmt(r.gems_host_us_per_call, ".1f"),
                      _fmt(r.aten_device_us_per_call, ".1f"), _fmt(r.gems_device_us_per_call, ".1f"),
                      f"{r.delta_host_ms:+.3f}", "-" if r.delta_device_ms is None else f"{r.delta_device_ms:+.3f}",
                      f"{r.served:g}/{r.fallback:g}" if (r.served or r.fallback) else "-"])
    headers = ["op", f"calls/{u} A", f"calls/{u} G", "host us/call A", "host us/call G", "dev us/call A",
               "dev us/call G", f"Δhost ms/{u}", f"Δdev ms/{u}", "served/fell back"]
    if not device:
        headers[5:7] = ["dev us/call A (n/a)", "dev us/call G (n/a)"]
    return tabulate(table, headers=headers, tablefmt=tf, disable_numparse=True)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)

