"""The shared op-test harness: ATen in float64 as the reference, one tolerance table, input variants.

    from harness import DEVICE, DTYPES, make, layouts, check_op
    check_op(torch.softmax, (make((7, 33), dtype), 1), dtype=dtype, served="_softmax")

`check_op` runs `fn` with Gems on, the same call through ATen in float64 on CPU (the reference) and
through ATen at the test dtype (its own low-precision error), and requires Gems' error against the
reference to be within the dtype's tolerance or within 2x ATen's own error (the flash-attention rule
for low precision), whichever is looser. It also asserts Gems actually served the op (stats), so a
silent fallback can never pass as coverage.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import gems

DEVICE = os.environ.get("GEMS_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
# bf16 arithmetic is broken in the Triton interpreter (facts.md): bf16 is tested in the GPU run only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
FLOAT_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# (rtol, atol) against the float64 reference
TOL = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def dtype_params(dtypes=None):
    return pytest.mark.parametrize("dtype", dtypes or DTYPES, ids=lambda d: FLOAT_IDS.get(d, str(d)))


def make(shape, dtype=torch.float32, device=DEVICE, low=-3.0, high=3.0, nonzero=True, requires_grad=False):
    """Random values in [low, high], never exactly zero (zeros hide unwritten outputs)."""
    if dtype.is_floating_point:
        t = torch.empty(shape, dtype=torch.float64).uniform_(low, high)
        if nonzero:
            t = torch.where(t.abs() < 1e-3, torch.full_like(t, 0.5), t)
        t = t.to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(shape) > 0.5
    else:
        t = torch.randint(int(low) if low < 0 else 1, int(high) + 1, shape, dtype=dtype)
        if nonzero:
            t = torch.where(t == 0, torch.ones_like(t), t)
    return t.to(device).requires_grad_(requires_grad)


def layouts(shape, dtype=torch.float32, **kw):
    """(name, tensor) pairs with the same logical shape: contiguous and several non-contiguous views."""
    out = [("contiguous", make(shape, dtype, **kw))]
    if len(shape) >= 2:
        t = make(shape[:-2] + (shape[-1], shape[-2]), dtype, **kw)
        out.append(("transposed", t.transpose(-1, -2)))
    if len(shape) >= 1 and shape[-1] > 0:
        big = make(shape[:-1] + (shape[-1] * 2,), dtype, **kw)
        out.append(("step-sliced", big[..., ::2]))
    if len(shape) >= 2:
        row = make((1,) + tuple(shape[1:]), dtype, **kw)
        out.append(("expanded", row.expand(shape)))
    return out


def to_ref(x):
    """Move a call argument to the float64 CPU reference world."""
    if isinstance(x, torch.Tensor):
        y = x.detach().cpu()
        return y.double() if y.is_floating_point() else y
    if isinstance(x, (list, tuple)):
        return type(x)(to_ref(v) for v in x)
    return x


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return []


def assert_close(out, ref, dtype, aten=None, rtol=None, atol=None, msg=""):
    """out (any device/dtype) vs ref (float64); aten = ATen's own result at `dtype`, for the 2x rule."""
    outs, refs = _flat(out), _flat(ref)
    atens = _flat(aten) if aten is not None else [None] * len(outs)
    assert len(outs) == len(refs), f"{msg}: {len(outs)} outputs vs {len(refs)} in the reference"
    r0, a0 = TOL.get(dtype, TOL[torch.float32])
    rtol = r0 if rtol is None else rtol
    atol = a0 if atol is None else atol
    for i, (o, r, a) in enumerate(zip(outs, refs, atens)):
        assert tuple(o.shape) == tuple(r.shape), f"{msg}[{i}]: shape {tuple(o.shape)} vs {tuple(r.shape)}"
        o, r = o.detach().cpu(), r.detach().cpu()
        if not r.is_floating_point():
            assert o.dtype == r.dtype, f"{msg}[{i}]: dtype {o.dtype} vs {r.dtype}"
            assert torch.equal(o, r), f"{msg}[{i}]: integer results differ"
            continue
        o64 = o.double()
        nan_o, nan_r = torch.isnan(o64), torch.isnan(r)
        assert torch.equal(nan_o, nan_r), f"{msg}[{i}]: NaN pattern differs ({int(nan_o.sum())} vs {int(nan_r.sum())})"
        o64, r = o64.masked_fill(nan_o, 0), r.masked_fill(nan_r, 0)
        err = (o64 - r).abs()
        inf = torch.isinf(r)
        assert torch.equal(o64[inf], r[inf]), f"{msg}[{i}]: infinities differ"
        err = err.masked_fill(inf, 0)
        bound = atol + rtol * r.abs()
        if a is not None and r.numel():
            a64 = a.detach().cpu().double().masked_fill(nan_r, 0)
            # flash-attention rule: within 2x ATen's own worst error at this dtype
            bound = torch.clamp(bound, min=2 * (a64 - r).abs().masked_fill(inf, 0).max().item() + atol)
        bad = err > bound
        if bad.any():
            j = int(bad.flatten().nonzero()[0])
            raise AssertionError(f"{msg}[{i}]: {int(bad.sum())}/{err.numel()} elements off; worst err "
                                 f"{err.max().item():.3e}; first at flat index {j}: got {o64.flatten()[j].item()}, "
                                 f"expected {r.flatten()[j].item()}")


@contextlib.contextmanager
def served(*names, at_least=1):
    """Assert Gems served each overload at least `at_least` times inside the block."""
    names = [gems.registry.canonical(n) for n in names]
    before = {n: gems.dispatch.op_runtime(n).served for n in names}
    yield
    for n in names:
        got = gems.dispatch.op_runtime(n).served - before[n]
        assert got >= at_least, f"Gems served aten::{n} {got} times (expected >= {at_least}); stats: {gems.stats().get(n)}"


def check_op(fn, args, kwargs=None, *, dtype, served_ops=(), rtol=None, atol=None, aten_rule=True):
    """Run fn(*args) with Gems on and compare to ATen in float64; returns Gems' result."""
    kwargs = kwargs or {}
    with served(*served_ops), gems.use_gems():
        out = fn(*args, **kwargs)
    ref = fn(*to_ref(args), **to_ref(kwargs))
    aten = fn(*args, **kwargs) if aten_rule and dtype != torch.float32 else None
    assert_close(out, ref, dtype, aten, rtol, atol, msg=getattr(fn, "__name__", "op"))
    return out


def check_grad(fn, inputs, *, dtype, served_ops=(), rtol=None, atol=None, grad_out=None):
    """Compare gradients of sum(fn(*inputs) * grad_out) w.r.t. every floating input, Gems vs float64."""
    def grads(xs, on):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in xs]
        ctx = gems.use_gems() if on else contextlib.nullcontext()
        with ctx:
            y = fn(*xs)
            g = grad_out.to(device=y.device, dtype=y.dtype)
            leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            return torch.autograd.grad(y, leaves, g)
    if grad_out is None:
        with torch.no_grad():
            shape = tuple(fn(*[i.detach() if isinstance(i, torch.Tensor) else i for i in inputs]).shape)
        grad_out = make(shape, dtype)
    with served(*served_ops):
        got = grads(inputs, True)
    ref = grads([to_ref(x) for x in inputs], False)
    aten = grads(inputs, False) if dtype != torch.float32 else None
    assert_close(got, ref, dtype, aten, rtol, atol, msg="grad")
    return got


def raises_like_aten(cases):
    """Each case (a no-argument callable) must raise with Gems off (else the test's premise is wrong) and
    raise the same exception type with Gems on."""
    import pytest

    def settled(k, who):
        # on the GPU a kernel's device-side assert surfaces at the next synchronization: name the case
        if ON_GPU:
            try:
                torch.cuda.synchronize()
            except Exception as e:   # noqa: BLE001
                raise AssertionError(f"case {k} ({who}): the device failed: {e}") from e

    for k, f in enumerate(cases):
        try:
            f()
        except Exception as e:   # noqa: BLE001
            want = type(e)
        else:
            raise AssertionError(f"case {k}: ATen accepted a case the test expects it to reject")
        settled(k, "ATen")
        with gems.use_gems():
            with pytest.raises(want):
                f()
        settled(k, "Gems")


class _Launches(list):
    """Kernel names; a failed comparison also prints where each launch came from (the Gems op and
    the test line), so an unexpected launch says who made it."""

    def __init__(self):
        super().__init__()
        self.origins = []

    def __repr__(self):
        return f"{list.__repr__(self)} (launched by: {'; '.join(self.origins)})"


def _launch_origin(name) -> str:
    import traceback
    frames = traceback.extract_stack(limit=40)[:-2]
    op = next((f.name for f in reversed(frames) if f.filename.startswith("<gems") or "/gems/ops/" in f.filename),
              "?")
    test = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                 if "/tests/" in f.filename and not f.filename.endswith("harness.py")), "?")
    return f"{name} by {op} from {test}"


class StandInKernel:
    """A compiled kernel's stand-in for LaunchCache (no launcher: its `run` is called and does nothing)."""
    function = packed_metadata = None

    def run(self, *a):
        pass


class StandInJit:
    """A compiled-backend JITFunction stand-in (one constexpr parameter, the launch's value): a value is
    compiled once it is in `held` or in the in-memory cache `device_caches` (where a background compile
    puts it); otherwise its launch asks Triton's jit_cache_hook, and a hook answering True skips the
    compile (the launch returns None, as Triton's does). `inline`: the values compiled at their launch
    (or warmup); `launched`: the values launched through Triton (a warmup compiles and launches nothing)."""
    __name__ = "fake_kernel"
    params = [type("P", (), {"num": 0, "is_constexpr": True})()]

    def __init__(self, held=()):
        self.held = set(held)
        self.device_caches = {"dev": ({},)}
        self.inline = []
        self.launched = []

    def _kernel(self, value):
        if value in self.held or value in self.device_caches["dev"][0]:
            return StandInKernel()
        hook = __import__("triton").knobs.runtime.jit_cache_hook
        if hook is not None and hook(key=value, repr="", fn=self, compile={}) is True:
            return None
        self.held.add(value)
        self.inline.append(value)
        return StandInKernel()

    def __getitem__(self, grid):
        def run(value, **opts):
            kernel = self._kernel(value)
            if kernel is not None:
                self.launched.append(value)
            return kernel
        return run

    def warmup(self, value, grid=None, **opts):
        return self._kernel(value)


def launch_without_a_device(monkeypatch):
    """runtime.launch asks no GPU for its device and stream (tests launching stand-in kernels)."""
    from gems.runtime import launch
    monkeypatch.setattr(launch, "_get_device", lambda: 0)
    monkeypatch.setattr(launch, "_get_stream", lambda dev: 0)


def count_launches(monkeypatch) -> list:
    """The names of the Gems kernels launched from now on (through LaunchCache), in order."""
    from gems.runtime import plan
    from gems.runtime.launch import LaunchCache
    launches, run = _Launches(), LaunchCache.run

    def counting(self, *a, **k):
        # while a call plan is recorded on the GPU, run() re-enters itself once for the real launch:
        # count that inner call only (the interpreter's recorded launch does not re-enter)
        if plan.active() is None or self.interpreted:
            launches.append(self.name)
            launches.origins.append(_launch_origin(self.name))
        return run(self, *a, **k)
    monkeypatch.setattr(LaunchCache, "run", counting)
    return launches


def launch_counter(monkeypatch, kernels):
    """A function giving {kernel name: launches} of the named kernels since this call (count_launches;
    an implementation called directly: call plans replay launches without LaunchCache)."""
    from collections import Counter
    names = count_launches(monkeypatch)
    return lambda: dict(Counter(n for n in names if n in kernels))


def optimizer_steps(make_opt, dtype, steps, on, shapes, seed):
    """Params and the optimizer's floating state after `steps` steps of `make_opt(params)` on parameters
    of `shapes`, the same gradients in every run (one seed); with Gems on or off. float64 runs on the CPU:
    the reference."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.empty(s, dtype=torch.float64).uniform_(-1, 1, generator=g) for s in shapes]
    grads = [[torch.empty(s, dtype=torch.float64).uniform_(-1, 1, generator=g) for s in shapes]
             for _ in range(steps)]
    dev = "cpu" if dtype == torch.float64 else DEVICE
    params = [torch.nn.Parameter(p.to(dev, dtype)) for p in base]
    opt = make_opt(params)
    for k in range(steps):
        for p, gr in zip(params, grads[k]):
            p.grad = gr.to(dev, dtype)
        with gems.use_gems() if on else contextlib.nullcontext():
            opt.step()
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim()]
    return [p.detach() for p in params] + state


def check_planned_gemm(monkeypatch, cfg, launcher, shape, dtype, atol, entry="launch", descriptors=None):
    """Three mm calls of one signature with fresh data and GEMM config `cfg` forced (the tuner and
    the fixed small tiles bypassed): each agrees with float64 ATen, only the first runs Gems' Python
    path (`launcher`, the module whose function `entry` it calls, is entered once: the others replay
    the call plan), and the plan rebuilds the descriptors per call. On the GPU the C++ fast path
    replays it: its recipe encodes each descriptor once and puts in each call's address (`descriptors`
    of them, when given). Returns the plan."""
    from gems import registry
    from gems.ops.blas import matmul as blas

    class Fixed:
        def pick(self, bucket, bench):
            return cfg
    monkeypatch.setattr(blas, "_tuner", lambda *a, **k: Fixed())
    monkeypatch.setattr(blas, "small_config", lambda *a, **k: None)
    entered, launch = [], getattr(launcher, entry)
    monkeypatch.setattr(launcher, entry, lambda *a, **k: entered.append(1) or launch(*a, **k))
    impl = registry.get("mm.default")
    hits = gems.dispatch.op_runtime(impl.name).fast.hits if gems.dispatch.op_runtime(impl.name).fast is not None else 0
    M, N, K = shape
    for i in range(3):
        a, b = make((M, K), dtype), make((N, K), dtype).t()     # x @ W.t(), as a linear layer
        with gems.use_gems():
            out = torch.mm(a, b)
        assert_close(out, (a.double() @ b.double()).cpu(), dtype, atol=atol, msg=f"call {i}")
    assert len(entered) == 1, f"the Python path ran {len(entered)} times: {gems.dispatch.op_runtime(impl.name).plans.reasons}"
    return check_descriptor_plan(impl, hits, descriptors)


def check_descriptor_plan(impl, hits_before, descriptors=None):
    """The op's call plan that rebuilds host TMA descriptors per call (asserted to exist); on the GPU its
    C++ recipe holds descriptor parameters (`descriptors` of them, when given) and the C++ fast path
    replayed it at least twice since `gems.dispatch.op_runtime(impl.name).fast.hits` was `hits_before`. Returns the plan."""
    plans = [p for p in gems.dispatch.op_runtime(impl.name).plans.plans.values()
             if any(getattr(v, "__name__", "") == "rebased" for v in getattr(p, "__globals__", {}).values())]
    assert plans, "no plan rebuilds a descriptor"
    if ON_GPU:
        recipe = plans[-1].__gems_recipe__
        assert recipe is not None, "the plan has no C++ recipe"
        n = sum(p[0] == 4 for launch_ in recipe[2] for p in launch_[6])      # P_TMA parameters
        assert n >= 1 if descriptors is None else n == descriptors, recipe
        assert gems.dispatch.op_runtime(impl.name).fast is not None and gems.dispatch.op_runtime(impl.name).fast.hits - hits_before >= 2
    return plans[-1]


_COMPILING_PRELUDE = '''
import json, sys, torch, gems
from gems.runtime import background, collect
from gems.runtime.launch import LaunchCache
_run, asked = LaunchCache.run, []
def _compiling(self, grid, args, num_warps=4, num_stages=3, maxnreg=None, first=False):
    # these kernels' binaries are still compiling: what the miss path does (ATen answers where the call
    # may defer at this launch, else the kernel compiles and runs)
    if self.name in COMPILING:
        asked.append([self.name, first, background.deferring(first)])
        if background.deferring(first):
            raise collect.not_compiled()("kernel not compiled yet")
    return _run(self, grid, args, num_warps, num_stages, maxnreg, first)
LaunchCache.run = _compiling
dev = sys.argv[1]
def report(**kw):
    st = gems.stats()
    print(json.dumps(dict(kw, asked=asked, aten={k: v["reasons"] for k, v in st.items() if v["reasons"]})))
'''


def while_compiling(kernels, body: str, env: dict | None = None) -> dict:
    """Run `body` in a fresh process with background compilation, where every launch of the kernels named
    in `kernels` misses as if its binary were still compiling (ATen answers the call where it may defer
    at that launch; elsewhere the kernel compiles and runs). `body` sees `dev`, `asked` (each such launch
    as [kernel, first, deferrable]) and calls `report(**values)` last; its dict comes back, with `asked`
    and `aten` (gems.stats()' reasons per op). `env`: more environment variables for the process."""
    import json
    import subprocess
    import sys
    import textwrap
    script = f"COMPILING = {set(kernels)!r}\n" + _COMPILING_PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, **(env or {}), GEMS_COMPILE="background")
    p = subprocess.run([sys.executable, "-c", script, DEVICE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
