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
import time
from typing import Callable, Optional

from .bench_result import BenchResult, attribute, totals
from .runner import OPTIMIZERS, patch_report

WORKLOADS = ("prefill", "decode", "train")
# a profiler annotation around the prompt's forward in a decode run: its ops are not decode steps
PROMPT_MARK = "gems_bench::prompt"


# --------------------------------------------------------------------------------------------- workload
class Workload:
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

    def compile_ahead(self) -> dict:
        """gems.warmup on this workload's step in Gems' mode (patched with --patch): the kernels its first
        Gems run needs compiled in parallel processes; gems.warmup's summary. Decode warms its prompt's
        forward only."""
        train = self.kind == "train"
        inputs = self.b.custom_args or (self.b.train_inputs if train else self.b.inputs)
        with self.mode(True):
            self.sync()   # earlier queued work stays out of warmup's own time
            return self.gems.warmup(self.b.model, inputs, train=train)

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
        from .parity import generate_greedy, main_output
        self.restore()
        with self.mode(on):
            if self.kind == "decode":
                steps: list = []
                out = {"tokens": generate_greedy(self.b, self.new_tokens, steps), "steps": steps}
            elif self.kind == "prefill":
                out = {"logits": main_output(self._step())}
            else:
                out = {"loss": self._step()}
        self.sync()
        return {k: _cpu(v) for k, v in out.items()}

    def reference(self):
        """The compared output computed by ATen in fp32 from the same weights: the reference of parity's
        low-precision rule."""
        from . import runner
        from .parity import main_output
        torch = self.torch
        self.restore()
        with self.mode(False), _as_fp32(self.b), torch.no_grad():
            if self.kind == "train":
                from gems_models import training_loss
                out = training_loss(runner.forward(self.b, train=True))
            else:
                out = main_output(self.b.model(**self.b.inputs))
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
                        with mark_prompt(self.b.model, after=reset):
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
def mark_prompt(model, after: Callable = lambda: None):
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
def validate(model, workload, device, optimizer, new_tokens, include, exclude, command="bench"):
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
          fresh_lengths: bool = False, compile: bool = False, cuda_graphs: bool = False,
          progress: Callable[[str], None] = lambda s: None) -> BenchResult:
    """Run `workload` with ATen and with Gems on one model and compare (see the module docstring).

    patch: the Gems turns also run the model patched by `gems.patch` (fused ops); the ATen turns run it
    unpatched, Gems unregistered. True for gems.patch's defaults, or a dict of its options
    ({"layer_norm": True}: the fused parts are measured one by one).

    fresh_lengths: run k of the warm-up and timed runs (k = 1, 2, ...; both modes the same) meets
    sequence lengths no earlier run met, so every run brings signatures Gems has not planned (and shapes
    cuDNN's attention has no graph for). Decode starts from the prompt's first seq_len - k x new_tokens
    tokens: a server whose prompts vary in length. Prefill and training take the inputs' first
    seq_len - k positions: batches padded to their longest sequence (dynamic padding). Without it every
    timed run repeats the warm-up's lengths (all planned).

    compile: both modes run the model through torch.compile (default mode, `model.compile()`, after
    gems.patch in the Gems turns: docs/torch-compile.md); each mode's first run compiles (the warm-up
    and agreement runs absorb it).

    cuda_graphs: decode through `model.generate` instead (see graphed_decode); no attribution."""
    import torch
    import gems
    import gems_models as M
    recipe, on_cuda = validate(model, workload, device, optimizer, new_tokens, include, exclude)
    if cuda_graphs and (workload != "decode" or recipe.kind != "causal_lm" or compile or fresh_lengths):
        raise M.ModelError("--cuda-graphs: a causal LM's --workload decode, without --compile or --fresh-lengths")
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
    if compile:
        bundle.model.compile()   # in place: every model(...) call below goes through torch.compile
        res.notes.append("compiled: both modes run torch.compile(model) (default mode); the Gems turns' graph "
                         "calls gems.fused's custom operators (with --patch) and Gems serves the ATen ops "
                         "inductor leaves to ATen")
    if patch:
        res.patched = True
        res.patch = patch_report(bundle.model, popts, recipe.name)
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
    if cuda_graphs:
        try:
            graphed_decode(res, bundle, new_tokens, max(warmup, 1), steps, include, exclude, patch, popts, progress)
        finally:
            gems.disable()
        return res
    wl = Workload(bundle, workload, new_tokens, optimizer, include, exclude, patch, popts)
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


def graphed_decode(res: BenchResult, bundle, new_tokens, warmup, steps, include, exclude, patch, popts, progress):
    """--cuda-graphs: ms per decode token of `model.generate` (gems.decode.timing), ATen's eager steps on
    a static cache against Gems with gems.decode.graphed (greedy tokens compared); Gems' eager steps on
    the static cache and, on CUDA, transformers' own compiled static-cache decode (torch.compile,
    reduce-overhead: its CUDA graphs, ATen) in the notes. The modes run one after the other."""
    import torch

    import gems
    from gems.decode import graph_counts, graphed, replay_ms, ungraphed
    from gems.decode.attention import install as install_decode_attention
    from gems.decode.timing import generate_greedy, ms_per_token
    from .parity import token_check
    m = bundle.model.eval()
    inputs = {k: v for k, v in bundle.inputs.items() if k in ("input_ids", "attention_mask")}
    pad = m.generation_config.pad_token_id
    kw = {"pad_token_id": 0 if pad is None else pad}
    eager = dict(kw, cache_implementation="static", disable_compile=True)
    med = lambda xs: f"{sorted(xs)[len(xs) // 2]:.3f}"   # noqa: E731

    def gems_mode():
        stack = contextlib.ExitStack()
        if patch:
            stack.enter_context(gems.patched(m, **popts))
        stack.enter_context(gems.use_gems(include=include, exclude=exclude))
        return stack
    gems.disable()
    progress("cuda graphs: ATen, eager decode steps on a static cache")
    ref, ref_steps = generate_greedy(m, inputs, new_tokens, **eager)
    res.aten_ms = [round(x, 4) for x in ms_per_token(m, inputs, new_tokens, steps, warmup, **eager)]
    with gems_mode():
        progress("cuda graphs: Gems, eager decode steps on a static cache")
        # Gems' own eager tokens: a graph must replay exactly what its kernels compute eagerly, so a
        # difference from ATen's tokens is told apart from one the graphs make; with the attention the
        # graphed model's decode steps run (gems.decode.attention), as graphed installs it below
        restore = install_decode_attention(m)
        try:
            own, own_steps = generate_greedy(m, inputs, new_tokens, **eager)
            gems_eager = ms_per_token(m, inputs, new_tokens, steps, warmup, **eager)
        finally:
            if restore is not None:
                restore()
        graphed(m, max_batch=inputs["input_ids"].shape[0],
                max_cache_len=max(256, inputs["input_ids"].shape[1] + new_tokens))
        try:
            progress("cuda graphs: Gems, decode steps replayed from CUDA graphs")
            got, _ = generate_greedy(m, inputs, new_tokens, **kw)
            res.gems_ms = [round(x, 4) for x in ms_per_token(m, inputs, new_tokens, steps, warmup, **kw)]
            counts = graph_counts(m)
            replay = replay_ms(m) if inputs["input_ids"].is_cuda else None
        finally:
            ungraphed(m)
    # Gems' eager logits stand for the replay's where the replay's tokens are Gems' eager ones; generate
    # hands logits over in fp32, the tolerances are the model's dtype's
    dtype = next(m.parameters()).dtype

    def reference(step, row):
        progress(f"cuda graphs: a token differs at step {step}: ATen in fp32 on that context, to judge it")
        return fp32_step_logits(bundle, inputs, ref, step, row)
    own_ok = torch.equal(got.cpu(), own.cpu())
    c = token_check(got.cpu(), ref.cpu(), [t.cpu() for t in ref_steps],
                    [t.cpu() for t in own_steps] if own_ok else None, dtype=dtype,
                    reference=reference if dtype in (torch.bfloat16, torch.float16) else None)
    # a replay must give Gems' eager tokens: a flip there is judged at fp32's tie tolerance only
    o = token_check(got.cpu(), own.cpu(), [t.cpu() for t in own_steps])
    res.agreement = [{"check": c.name, "ok": bool(c.ok), "detail": c.detail, "rel_err": None, "tol": None},
                     {"check": "greedy tokens, graphed vs Gems' eager steps", "ok": bool(o.ok), "detail": o.detail,
                      "rel_err": None, "tol": None}]
    res.notes += ["cuda graphs: the modes run one after the other, not alternating; ms per token = (generate of "
                  "--new-tokens - generate of 1 token) / (new tokens - 1), "
                  "generate's own per-step work included; ATen: static cache, eager steps (disable_compile); "
                  f"Gems: gems.decode.graphed ({counts}); no per-op attribution (a graph replay is one launch)",
                  f"Gems, eager steps on the static cache (no graphs; the decode attention of gems.decode): "
                  f"{med(gems_eager)} ms/token"]
    if replay is not None:
        res.notes.append(f"Gems, one decode step's graph replay alone (device time, CUDA events): {replay:.3f} ms; "
                         f"the rest of the {med(res.gems_ms)} ms per token is generate's per-step work outside "
                         f"the graph: its own kernels (logits copy, token choice, stop flag) and host work the GPU "
                         f"waits for")
    hf = None
    if res.meaningful:
        gems.disable()
        progress("cuda graphs: transformers' compiled static-cache decode (ATen)")
        try:
            hf = ms_per_token(m, inputs, new_tokens, steps, warmup, cache_implementation="static", **kw)
            res.notes.append(f"peer, transformers' compiled static-cache decode (torch.compile reduce-overhead, "
                             f"ATen): {med(hf)} ms/token")
        except Exception as e:  # noqa: BLE001 -- a peer that does not compile is reported, not fatal
            res.notes.append(f"peer, transformers' compiled static-cache decode: failed ({type(e).__name__}: {e})")
    if inputs["input_ids"].is_cuda:
        res.notes.append(_roof_note(m, {"Gems": res.gems_ms, "ATen": res.aten_ms, "transformers compiled": hf}))


def fp32_step_logits(bundle, inputs: dict, tokens, step: int, row: int):
    """ATen's logits in fp32 (on the CPU) for the context that picks token `step` of batch row `row`: the
    prompt and `tokens[row, :step]`, the tokens decoded before it (greedy runs agree up to their first
    difference, so this is the context both decoded there). One forward without a cache, the model in
    fp32 for it (_as_fp32) and exactly as before afterwards."""
    import torch
    ids = torch.cat([inputs["input_ids"][row:row + 1], tokens[row:row + 1, :step].to(inputs["input_ids"].device)], 1)
    kw = {"input_ids": ids}
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"][row:row + 1]
        kw["attention_mask"] = torch.cat([mask, mask.new_ones((1, step))], dim=1)
    with _as_fp32(bundle), torch.no_grad():
        out = bundle.model(**kw).logits[0, -1].float().cpu()
    if ids.is_cuda:
        torch.cuda.empty_cache()    # the fp32 copy's memory goes back
    return out


def _roof_note(model, runs: dict) -> str:
    """Each set-up's ms per token as a share of the copy bandwidth: a decode step reads every weight once."""
    from gems.decode.timing import copy_roof_gbps, weight_bytes
    gb, roof = weight_bytes(model) / 1e9, copy_roof_gbps()
    shares = [f"{name} {gb / (sorted(ms)[len(ms) // 2] * 1e-3):.0f} GB/s "
              f"({gb / (sorted(ms)[len(ms) // 2] * 1e-3) / roof:.0%})" for name, ms in runs.items() if ms]
    return (f"read roof: a step reads {gb:.2f} GB of weights; this GPU copies {roof:.0f} GB/s (a 512 MiB "
            f"device copy); weights read per second: " + ", ".join(shares))


def _agreement(wl: Workload, dtype, progress) -> list:
    """The checks of parity's end-to-end rule on this workload's outputs (see gems_coverage.parity)."""
    import torch
    from .parity import e2e_check, token_check
    hi = None
    if dtype in (torch.bfloat16, torch.float16):
        progress("agreement: the fp32 reference (ATen, same weights in fp32)")
        hi = wl.reference()
    progress("agreement: one ATen and one Gems run")
    ref, got = wl.first(False), wl.first(True)
    kind = wl.kind
    if kind == "prefill":
        checks = [e2e_check(kind, "logits", got["logits"], ref["logits"], hi)]
    elif kind == "train":
        checks = [e2e_check(kind, "loss (first step, same start)", got["loss"], ref["loss"], hi)]
    else:
        reference = None
        text_only = set(wl.b.inputs) <= {"input_ids", "attention_mask"}    # (Llava's image needs its pixels)
        if hi is not None and text_only:
            def reference(step, row):
                progress(f"agreement: a token differs at step {step}: ATen in fp32 on that context, to judge it")
                with wl.mode(False):
                    return fp32_step_logits(wl.b, wl.b.inputs, ref["tokens"], step, row)
        checks = [e2e_check(kind, "prompt logits (last position)", got["steps"][0], ref["steps"][0], hi),
                  token_check(got["tokens"], ref["tokens"], ref["steps"], got["steps"], reference=reference)]
    out = []
    for c in checks:
        detail = c.detail
        if not c.ok and hi is None:
            detail += "; `gems-coverage parity MODEL --device ...` names the first divergent op"
        out.append({"check": c.name, "ok": bool(c.ok), "detail": detail, "rel_err": c.rel_err, "tol": c.tol})
    return out
