"""Call plans (gems/runtime/plan/): repeat calls of a signature run a recorded plan, and the plan
gives the same answers as the full path -- on new data, new scalar values, aliasing, overlap, and
the layouts models use (size-1 dims, broadcasts, transposed views)."""
import json
import linecache
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gems
from gems import registry
from gems.runtime import plan as plan_mod
from gems.runtime.plan import build as plan_build
from gems.runtime.plan import recipe as plan_recipe
from gems.runtime.plan import signature as plan_signature
from harness import DEVICE, assert_close, make, to_ref


def _plans(name):
    return gems.dispatch.op_runtime(name).plans


def _twice(fn, make_args, name, dtype=torch.float32, n=3):
    """Call fn with fresh random arguments n times with Gems on; each result vs float64 ATen."""
    for i in range(n):
        args = make_args(i)
        with gems.use_gems():
            out = fn(*args)
        ref = fn(*to_ref(args))
        assert_close(out, ref, dtype, msg=f"{name} call {i}")
    info = _plans(name).info()
    assert info["plans"] >= 1, info
    return info


MODEL_PATTERNS = [
    ("mul.Tensor", lambda x, v: x * v, lambda i: (make((1, 1, 64)), make((1, 1, 1)))),
    ("mul.Tensor", lambda w, x: w * x, lambda i: (make((64,)), make((1, 1, 64)))),
    ("mul.Tensor", lambda q, c: q * c,
     lambda i: (make((1, 1, 4, 16)).transpose(1, 2), make((1, 1, 1, 16)))),
    ("neg.default", lambda q: -q[..., 8:], lambda i: (make((1, 4, 1, 16)),)),
    ("add.Tensor", lambda v: v + 1e-6, lambda i: (make((1, 1, 1)),)),
    ("rsqrt.default", torch.rsqrt, lambda i: (make((1, 1, 1), low=0.5),)),
    ("pow.Tensor_Scalar", lambda x: x.pow(2), lambda i: (make((1, 1, 64)),)),
    ("silu.default", F.silu, lambda i: (make((1, 1, 96)),)),
    ("_softmax.default", lambda s: torch.softmax(s, -1), lambda i: (make((1, 4, 1, 17)),)),
    ("mean.dim", lambda x: x.mean(-1, keepdim=True), lambda i: (make((1, 1, 64)),)),
    ("mm.default", torch.mm, lambda i: (make((3, 16)), make((8, 16)).t())),
    ("addmm.default", lambda x, w, b: F.linear(x, w, b), lambda i: (make((2, 16)), make((8, 16)), make((8,)))),
    ("_to_copy.default", lambda x: x.to(torch.float16), lambda i: (make((1, 1, 64)),)),
    ("native_layer_norm.default", lambda x, w, b: F.layer_norm(x, (32,), w, b),
     lambda i: (make((1, 3, 32)), make((32,)), make((32,)))),
]


@pytest.mark.parametrize("name,fn,make_args", MODEL_PATTERNS, ids=[f"{i}-{p[0]}" for i, p in enumerate(MODEL_PATTERNS)])
def test_model_call_patterns_run_plans(name, fn, make_args):
    before = gems.stats().get(name, {}).get("served", 0)     # Python kernel and C++ fast path
    _twice(fn, make_args, name, torch.float16 if "to_copy" in name else torch.float32)
    assert gems.stats()[name]["served"] - before >= 3


def test_scalar_values_are_per_call_not_baked():
    x = make((5, 7))
    with gems.use_gems():
        outs = [x * s for s in (2.0, 3.0, -0.5)] + [x + k for k in (1, 2)] + [torch.add(x, x, alpha=a) for a in (2, 3)]
    want = [x * s for s in (2.0, 3.0, -0.5)] + [x + k for k in (1, 2)] + [torch.add(x, x, alpha=a) for a in (2, 3)]
    for o, w in zip(outs, want):
        assert_close(o, to_ref(w), torch.float32)


def test_aliasing_is_part_of_the_signature():
    with gems.use_gems():
        x = make((4, 6))
        xx = x + x
        a, b = make((4, 6)), make((4, 6))
        ab = a + b                 # same shapes and dtypes as x + x: must not reuse x + x's mapping
    assert_close(xx, to_ref(x) * 2, torch.float32)
    assert_close(ab, to_ref(a) + to_ref(b), torch.float32)


def test_inplace_overlap_declines_the_plan_and_raises_like_aten():
    base = make((10,))
    with gems.use_gems():
        y = make((8,))
        base[:8].add_(y)           # records the plan for [8] += [8]
        ok = make((8,))
        okb = ok.clone()
        ok.add_(make((8,)) * 0 + 1)
        assert_close(ok, to_ref(okb) + 1, torch.float32)
        with pytest.raises(RuntimeError, match="single memory location"):
            base[:8].add_(base[2:10])   # partial overlap: the full path raises ATen's error


def test_out_and_inplace_plans_write_the_given_tensor():
    with gems.use_gems():
        for _ in range(3):
            a, b = make((3, 5)), make((3, 5))
            o = torch.empty(3, 5, device=DEVICE)
            r = torch.add(a, b, out=o)
            assert r is o
            assert_close(o, to_ref(a) + to_ref(b), torch.float32)
            c = a.clone()
            r2 = c.mul_(b)
            assert r2 is c
            assert_close(c, to_ref(a) * to_ref(b), torch.float32)


def test_unplannable_calls_stay_on_the_full_path_and_say_why():
    # a reduction over a layout its kernel cannot read in one pass copies first (an ATen op): no plan
    x = make((6, 5, 4)).permute(1, 2, 0)[:, ::2]
    with gems.use_gems():
        for _ in range(2):
            got = torch.sum(x, dim=(0, 2))
    assert_close(got, to_ref(x).sum(dim=(0, 2)), torch.float32)
    info = _plans("sum.dim_IntList").info()
    assert info["no_plan"] >= 1 or info["plans"] >= 1


def test_replacing_an_implementation_drops_its_plans():
    x = make((16,))
    with gems.use_gems():
        torch.exp(x)
        torch.exp(x)
        assert _plans("exp.default").info()["plans"] >= 1
        calls = []

        def double(self):
            calls.append(1)
            raise gems.Unsupported("test double")
        with registry.override_impl("exp.default", double):
            torch.exp(x)
        assert calls, "a plan of the old implementation ran instead of the override"


def test_plan_source_is_readable_in_tracebacks():
    x = make((9,))
    with gems.use_gems():
        torch.sigmoid(x)
        torch.sigmoid(x)
    plans = [p for p in _plans("sigmoid.default").plans.values() if p is not plan_mod.NO_PLAN]
    code = plans[0].__code__
    assert code.co_filename.startswith("<gems plan sigmoid.default")
    assert linecache.getline(code.co_filename, 1).startswith("def plan(")


def test_a_plan_the_fast_path_replays_is_compiled_only_when_python_runs_it():
    # with the C++ fast path, a new signature's plan is kept as source and recipe (LazyPlan): repeat
    # calls replay the recipe in C++; the first call that reaches the Python plan compiles it and the
    # compiled function replaces the LazyPlan in the cache
    impl = registry.get("sigmoid.default")
    x = make((7, 5))
    with gems.use_gems():
        torch.sigmoid(x)
    key = next(k for k in reversed(gems.dispatch.op_runtime(impl.name).plans.plans) if gems.dispatch.op_runtime(impl.name).plans.plans[k] is not plan_mod.NO_PLAN)
    p = gems.dispatch.op_runtime(impl.name).plans.plans[key]
    if gems.dispatch.op_runtime(impl.name).fast is None:
        assert callable(p) and not isinstance(p, plan_mod.LazyPlan)    # Python plans only: compiled at once
        return
    assert isinstance(p, plan_mod.LazyPlan) and p._fn is None
    assert p.__gems_recipe__ is not None and p.__gems_source__.startswith("def plan(")
    # its namespace can be inspected like a function's (check_descriptor_plan does) without compiling it
    assert isinstance(p.__globals__, dict) and p.__globals__ and p._fn is None
    with gems.use_gems():
        for _ in range(3):
            assert_close(torch.sigmoid(x), torch.sigmoid(to_ref(x)), torch.float32)
    assert gems.dispatch.op_runtime(impl.name).plans.plans[key] is p and p._fn is None, "the C++ replay compiled or replaced the plan"
    # a call the C++ side misses (its plans dropped) reaches the Python plan: compiled once, swapped in
    gems.dispatch.op_runtime(impl.name).fast.clear()
    with gems.use_gems():
        assert_close(torch.sigmoid(x), torch.sigmoid(to_ref(x)), torch.float32)
    fn = gems.dispatch.op_runtime(impl.name).plans.plans[key]
    assert fn is p._fn and not isinstance(fn, plan_mod.LazyPlan) and p.compiled() is fn
    assert fn.__gems_recipe__ is p.__gems_recipe__ and fn.__gems_source__ == p.__gems_source__
    assert fn.__code__.co_filename.startswith("<gems plan sigmoid.default")


_RECORD_AT_SECOND_CALL = """
import json, os, torch, gems
from gems import registry
from gems.runtime import plan
dev = "cuda" if os.environ.get("GEMS_TEST_DEVICE") == "cuda" else "cpu"
impl = registry.get("sigmoid.default")
def state():
    ps = gems.dispatch.op_runtime(impl.name).plans.plans.values() if gems.dispatch.op_runtime(impl.name).plans is not None else ()
    return {"seen": sum(p is plan.SEEN for p in ps), "built": gems.dispatch.op_runtime(impl.name).plans.built if gems.dispatch.op_runtime(impl.name).plans else 0,
            "served": gems.dispatch.op_runtime(impl.name).served}
x = torch.randn(5, 7, device=dev)
ref = torch.sigmoid(x.double()).float()
out = []
for _ in range(3):
    with gems.use_gems():
        y = torch.sigmoid(x)
    assert torch.allclose(y, ref, atol=1e-6)
    out.append(state())
with gems.use_gems():
    # decode's growing lengths: signatures called once each are never recorded
    for n in range(3, 9):
        torch.sigmoid(torch.randn(n, device=dev))
out.append(state())
print(json.dumps(out))
"""


@pytest.mark.parametrize("after", ["2", "1"])
def test_a_signature_records_its_plan_at_its_second_call_by_default(after):
    # GEMS_PLAN_AFTER (read at import: a fresh process): 2, the default, runs a signature's first call
    # unrecorded and records at the second (a decode step's new lengths, used once, never record);
    # 1 records at the first call (the test suite's setting)
    env = {k: v for k, v in os.environ.items() if k not in ("GEMS_PLAN_AFTER", "GEMS_PLAN_CHECK")}
    if after == "2":
        env.pop("GEMS_PLAN_AFTER", None)   # the default
    else:
        env["GEMS_PLAN_AFTER"] = after
    r = subprocess.run([sys.executable, "-c", _RECORD_AT_SECOND_CALL], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert [c["served"] for c in s[:3]] == [1, 2, 3]
    if after == "2":
        assert [(c["seen"], c["built"]) for c in s] == [(1, 0), (0, 1), (0, 1), (6, 1)]
    else:
        assert [(c["seen"], c["built"]) for c in s] == [(0, 1), (0, 1), (0, 1), (0, 7)]


def test_a_recording_leaves_no_reference_cycle():
    # the recording's dispatch mode and the recording pointed at each other: every recording, with the
    # tensors it holds (the call's inputs, outputs, workspaces), waited for the garbage collector
    import gc
    with gems.use_gems():     # a first call's one-time lazy imports leave cycles of their own
        for _ in range(2):
            torch.cat([make((2, 2, 4)), make((2, 1, 4))], dim=1)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with gems.use_gems():
            for n in range(3, 9):     # new signatures (a growing KV cache): recorded at their first or second call
                for _ in range(2):
                    torch.cat([make((2, n, 4)), make((2, 1, 4))], dim=1)
        gc.collect()
        kept = [type(o).__name__ for o in gc.garbage if isinstance(o, (plan_mod.Recording, torch.Tensor))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert _plans("cat.default").info()["plans"] >= 6
    assert not kept, kept


def test_plan_after_rejects_other_values():
    env = dict(os.environ, GEMS_PLAN_AFTER="3")
    r = subprocess.run([sys.executable, "-c", "import gems.dispatch"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "GEMS_PLAN_AFTER must be 1 or 2" in r.stderr


def test_signature_keys_negative_zero_and_nan_exactly():
    sig = plan_mod.make_signature(torch.ops.aten.native_layer_norm.default._schema)
    x, w = make((2, 4)), make((4,))
    assert sig(x, [4], w, w, 0.0) != sig(x, [4], w, w, -0.0)
    assert sig(x, [4], w, w, float("nan")) == sig(x, [4], w, w, float("nan"))


def test_per_call_numbers_key_class_sign_and_range_not_value():
    # dynamic numbers are kernel arguments: one plan per class of values, where the class holds what
    # a check may read (sign, zero, NaN, the narrowest dtype range holding it; see _dyn_sig)
    sig = plan_mod.make_signature(torch.ops.aten.add.Tensor._schema, frozenset(["other", "alpha"]))
    x = make((2, 4))
    same = [(2, 3), (5, 7), (-3, -7), (300, 301), (2.0, 0.5), (-0.5, -2.0), (1e6, 2e6), (1e40, 1e300),
            (0.0, 0.5), (float("inf"), float("inf"))]
    for a, b in same:
        assert sig(x, a) == sig(x, b), (a, b)
    differ = [(0.0, -0.0), (-0.0, -1.0), (0, 16), (3, -3), (1, 2), (127, 128), (255, 256), (-255, -256), (32767, 32768), (65504, 65505),
              (2 ** 31 - 1, 2 ** 31), (2, 2.0), (1, True), (0.5, -0.5), (65504.0, 65505.0), (1e38, 3.39e38),
              (3.4e38, 3.5e38), (float("inf"), float("-inf")), (float("inf"), 1e300), (float("nan"), 1.0),
              (127.0, 128.0), (-128.0, -129.0), (2.5, 300.5), (2.0 ** 63 - 1024, 2.0 ** 63)]
    for a, b in differ:
        assert sig(x, a) != sig(x, b), (a, b)
    assert sig(x, 2, alpha=0.5) != sig(x, 2, alpha=-0.5)


def test_a_negative_plan_never_serves_negative_zero():
    # -0.0 reaches a kernel as 0 (its sign lost), so it goes to ATen; a plan recorded for x / -1.5 (and
    # the C++ fast path replaying it) must not answer x / -0.0 with +inf
    x = make((), torch.float16)
    x.fill_(1.5)
    with gems.use_gems():
        for _ in range(4):
            torch.ops.aten.div.Scalar(x, -1.5)
        got = torch.ops.aten.div.Scalar(x, -0.0)
    assert got.item() == float("-inf")


def test_default_dtype_is_part_of_the_signature():
    # int -> float promotions follow torch's default dtype: a plan recorded under float32 must not
    # answer a call made under float64. Repeat calls reach the C++ key when the fast path is built
    # (test_fast checks that it answers repeats) and the Python signature otherwise; both carry it.
    i = torch.arange(1, 7, dtype=torch.int32, device=DEVICE).reshape(2, 3)
    sig = plan_mod.make_signature(torch.ops.aten.add.Tensor._schema, frozenset(["other", "alpha"]))
    old = torch.get_default_dtype()
    try:
        keys = set()
        for _ in range(2):
            for dt in (torch.float32, torch.float64, torch.float32):
                torch.set_default_dtype(dt)
                keys.add(sig(i, 1.5))
                with gems.use_gems():
                    outs = [torch.add(i, 1.5), torch.exp(i), torch.div(i, 4)]
                for out, ref in zip(outs, [torch.add(i, 1.5), torch.exp(i), torch.div(i, 4)]):
                    assert out.dtype == ref.dtype == dt, (out.dtype, ref.dtype, dt)
                    torch.testing.assert_close(out, ref)
        assert len(keys) == 2
    finally:
        torch.set_default_dtype(old)


def test_tensor_list_signature_keys_each_element_and_aliasing():
    # a Tensor[] argument (cat's `tensors`): per element dtype, shape, strides, alignment and device,
    # the list's length, and which elements are the same tensor
    sig = plan_mod.make_signature(torch.ops.aten.cat.default._schema)
    assert sig is not None
    x, y = make((2, 3)), make((2, 3))
    assert sig([x, y], 1) == sig([make((2, 3)), make((2, 3))], 1)
    assert sig([x, y], 1) != sig([x, y], 0)
    assert sig([x, y], 1) != sig([x, y, y.clone()], 1)
    assert sig([x, y], 1) != sig([x, make((3, 2)).t()], 1)
    assert sig([x, y], 1) != sig([x, y.half()], 1)
    assert sig([x, x], 1) != sig([x, y], 1)
    assert sig([x, y, x], 1) != sig([x, y, y], 1)
    sig_out = plan_mod.make_signature(torch.ops.aten.cat.out._schema)
    o = make((2, 6))
    assert sig_out([x, y], 1, out=o) != sig_out([x, o], 1, out=o)


def test_tensor_list_plans_replay_with_new_tensors():
    # elements are substituted per call (their data pointers), never baked into the plan
    name = "cat.default"
    info = _twice(lambda a, b: torch.cat([a, b.t()], 1), lambda i: (make((3, 4)), make((5, 3))), name)
    assert info["plans"] >= 1
    plans = [p for p in _plans(name).plans.values() if p is not plan_mod.NO_PLAN]
    assert any("tensors[1]" in p.__gems_source__ for p in plans)


def test_tensor_list_out_overlap_declines_the_plan():
    x = make((2, 3))
    with gems.use_gems():
        for _ in range(2):
            o = torch.empty(4, 3, device=DEVICE)
            torch.cat([x, make((2, 3))], out=o)       # records a plan for cat.out
        big = make((4, 3))
        with pytest.raises(RuntimeError, match="single memory location"):
            torch.cat([big[:2], x], out=big)          # same signature, out overlaps an input


def test_autotuning_runs_are_not_recorded(monkeypatch, tmp_path):
    # the tuner times every config inside the call being recorded; what those runs allocate (a split-K
    # GEMM's workspace, hundreds of times per config) must not be kept by the recording: on an H200 a
    # 1.1B training step ran out of 140 GB that way
    from gems.runtime import alloc, autotune, backends
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backends, "backend", lambda: type("B", (), {"can_benchmark": True, "arch": "test"})())
    seen = []

    def bench(cfg):
        seen.append(plan_mod.active())
        alloc.empty((8,), torch.float32, "cpu")
        return cfg["t"]

    tuner = autotune.Autotuner("test", [{"t": 2.0}, {"t": 1.0}])
    with plan_mod.Recording() as rec:
        assert tuner.pick("bucket", bench) == {"t": 1.0}
        assert plan_mod.active() is rec          # restored after the timing runs
        alloc.empty((8,), torch.float32, "cpu")
    assert seen == [None, None]
    assert len(rec.allocs) == 1 and rec.transient   # only the call's own allocation; the plan is not kept


def test_symint_results_are_constants_of_the_signature():
    # SDPA's cuDNN/flash forwards return max_q / max_k (SymInt: sizes, so functions of the keyed shapes).
    # Their plans return the recorded ints; the C++ recipe carries them as constants (result kind 4).
    # The CUDA overload's implementation runs here on CPU tensors too (through the interpreter).
    from gems.ops.attention import overloads as attention
    schema = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
    assert plan_signature.symint_returns(schema) == [False] * 4 + [True, True] + [False] * 3

    def args(i):
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DEVICE) for _ in range(3))
        return q, k, v, None, True, 0.0, True

    a0 = args(0)
    out, p, rec = plan_build.record(attention.sdpa_cudnn, schema, a0, {}, direct=False)
    assert p is not None, rec.tainted
    assert out[4:6] == (24, 24)
    assert p.__gems_recipe__[3][4:6] == ((4, 24, None), (4, 24, None))
    a1 = args(1)
    got = p(*a1)
    assert got[4] == 24 and got[5] == 24 and got[2] is None
    ref = F.scaled_dot_product_attention(*(t.double().cpu() for t in a1[:3]), is_causal=True)
    assert_close(got[0], ref, torch.float32)


def test_int_results_not_declared_symint_keep_the_full_path():
    # an int result the schema does not declare a size (it could depend on the data): no plan
    schema = torch.ops.aten._local_scalar_dense.default._schema
    assert plan_signature.symint_returns(schema) == [False]


@pytest.mark.parametrize("case", ["fp16 2-D", "nan padding", "fp8 dtype code", "fp4 padded", "3-D"])
def test_tma_recipe_passes_what_tritons_launcher_passes(monkeypatch, case):
    # The C++ recipe encodes a host TMA descriptor itself (cuTensorMapEncodeTiled) and passes the shape
    # and strides after it: the arguments must be the ones Triton's launcher derives from the same
    # descriptor and kernel metadata (driver.make_tensordesc_arg, which calls fill_tma_descriptor;
    # driver.c then reverses the arrays to innermost-first and turns element strides into bytes)
    import triton
    from triton.backends.nvidia import driver as nv
    from triton.tools.tensor_descriptor import TensorDescriptor
    seen = []

    class Utils:
        def fill_tma_descriptor(self, *args):
            seen.append(args)
            return "map"

    class Driver:
        utils = Utils()
    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    shape, block, elem_type, fp4, padding = [72, 88], [32, 64], 6, False, "zero"
    if case == "nan padding":
        padding = "nan"
    elif case == "fp8 dtype code":
        elem_type = 9      # the compiler's and the driver's codes differ for 8, 9 and 10
    elif case == "fp4 padded":
        fp4 = True
    elif case == "3-D":
        shape, block = [3, 72, 88], [1, 32, 64]
    buf = torch.empty(4096 * 4, dtype=torch.float16)
    strides = [96 * 80, 96, 1][-len(shape):]
    d = TensorDescriptor(buf, shape, strides, block, padding)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": elem_type, "block_size": block, "fp4_padded": fp4}
    want = nv.make_tensordesc_arg(d, meta)
    (ptr, swizzle, size, dtype, box, dims, st, fill), = seen
    rank = len(dims)
    tmap, got_shape, got_strides = plan_recipe.tensor_map(d, meta)
    assert tmap == (ptr, dtype, tuple(reversed(dims)), tuple(size * st[i] for i in reversed(range(rank - 1))),
                    tuple(reversed(box)), swizzle, fill)
    assert ["map", *got_shape, *got_strides] == want
    assert tmap[1] == (8 if case == "fp8 dtype code" else 6) and tmap[6] == (padding == "nan")
    assert got_shape[-1] == (176 if fp4 else 88)


def test_tma_recipe_refuses_a_kernel_lowered_without_tma_metadata():
    from triton.tools.tensor_descriptor import TensorDescriptor
    d = TensorDescriptor(torch.empty(64, dtype=torch.float16), [8, 8], [8, 1], [8, 8])
    with pytest.raises(plan_recipe.NoRecipe):
        plan_recipe.tensor_map(d, None)


@pytest.mark.parametrize("which", ["triton", "gluon"])
def test_a_rebuilt_descriptor_does_not_keep_the_recorded_tensor(which):
    # a plan rebuilds each TMA descriptor per call over the call's tensor (plan/build.py); holding the
    # recording's descriptor would keep the recorded tensor alive as long as the plan is cached
    import gc
    import weakref
    if which == "triton":
        from triton.tools.tensor_descriptor import TensorDescriptor
        d = TensorDescriptor(torch.empty(64, dtype=torch.float16), [8, 8], [8, 1], [8, 8])
    else:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        layout = gl.NVMMASharedLayout.get_default_for([8, 8], gl.float16)
        d = TensorDescriptor(torch.empty(64, dtype=torch.float16), [8, 8], [8, 1], [8, 8], layout)
    recorded = weakref.ref(d.base)
    rebuild = plan_build.descriptor_rebuilder(d)
    fields = {k: v for k, v in d.__dict__.items() if k != "base"}
    del d
    gc.collect()
    assert recorded() is None
    t = torch.empty(64, dtype=torch.float16)
    e = rebuild(t)
    assert e.base is t and {k: v for k, v in e.__dict__.items() if k != "base"} == fields
