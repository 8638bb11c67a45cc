"""The C++ fast path (gems/csrc/): it builds, repeat calls are answered there, its
answers equal ATen's (float64) on new data and new per-call numbers, and every state change of
dispatch.py (enable/disable, use_gems scopes, excluded ops, threads, replaced implementations) is
followed exactly. Under the interpreter its launches call back into Python, so CI runs everything
here but cuLaunchKernel; the GPU suite runs that too."""
import os
import threading

import pytest
import torch
import torch.nn.functional as F

import gems
from gems import dispatch, registry
from gems.runtime import fast
from harness import DEVICE, assert_close, make, to_ref

pytestmark = pytest.mark.skipif(os.environ.get("GEMS_FAST", "1") in ("", "0") or
                                os.environ.get("GEMS_PLANS", "1") in ("", "0"),
                                reason="the fast path is switched off in this run (GEMS_FAST=0 / GEMS_PLANS=0)")


def _hits(name):
    op = gems.dispatch.op_runtime(name).fast
    return 0 if op is None else op.hits


@pytest.fixture(scope="module", autouse=True)
def _built():
    """The extension for this torch and these sources: scripts/setup.sh builds it; where it has not (a
    checkout that changed gems/csrc/, a machine set up by hand), the public entry point builds it here,
    and a build that fails fails these tests instead of skipping them."""
    if not fast.is_built():
        fast.build()
        gems.disable()      # a registration made without the module is redone, loading it
    yield


@pytest.fixture(autouse=True)
def _registered():
    with gems.use_gems():
        pass
    yield


def test_the_extension_builds_and_loads():
    with gems.use_gems():
        make((3,)) + 1
    assert fast.status().startswith("loaded"), fast.status()
    assert fast.loaded() is not None
    assert gems.dispatch.op_runtime("add.Tensor").fast is not None


def test_repeat_calls_are_answered_in_cpp_with_per_call_data_and_numbers():
    x = make((1, 1, 64))
    before = _hits("mul.Tensor")
    outs, want = [], []
    with gems.use_gems():
        for s in (2.0, 3.0, -0.5, 7.25):        # one plan: the number is dynamic, read per call
            v = make((1, 1, 1))
            outs.append(x * v * s)
            want.append(to_ref(x) * to_ref(v) * s)
    for o, w in zip(outs, want):
        assert_close(o, w, torch.float32)
    assert _hits("mul.Tensor") - before >= 4


@pytest.mark.parametrize("case", ["broadcast", "transposed", "inplace", "out", "slice", "int_scalar"])
def test_model_layouts_agree_with_aten(case):
    def run():
        if case == "broadcast":
            a, b = make((64,)), make((1, 3, 64))
            return (lambda a, b: a * b), (a, b)
        if case == "transposed":
            return (lambda q, c: q * c), (make((1, 3, 4, 16)).transpose(1, 2), make((1, 1, 1, 16)))
        if case == "inplace":
            return (lambda a, b: a.clone().add_(b, alpha=2)), (make((5, 7)), make((7,)))
        if case == "out":
            def f(a, b):
                o = torch.empty(5, 7, device=a.device, dtype=a.dtype)
                r = torch.sub(a, b, out=o)
                assert r is o
                return o
            return f, (make((5, 7)), make((5, 7)))
        if case == "slice":
            return (lambda q: -q[..., 8:]), (make((1, 4, 1, 16)),)
        return (lambda a: a + 3), (make((2, 9)),)
    for i in range(4):
        fn, args = run()
        with gems.use_gems():
            out = fn(*args)
        assert_close(out, fn(*to_ref(args)), torch.float32, msg=f"{case} call {i}")


def test_multi_output_and_optional_results():
    x, w, b = make((2, 3, 32)), make((32,)), make((32,))
    for _ in range(3):
        with gems.use_gems():
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, [32], w, b, 1e-5)
            g = make((2, 3, 32))
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(g, x, [32], mean, rstd, w, b,
                                                                   [True, False, False])
        ry, rmean, rrstd = torch.ops.aten.native_layer_norm(*to_ref((x, [32], w, b, 1e-5)))
        assert_close(y, ry, torch.float32)
        assert dw is None and db is None
        rdx = torch.ops.aten.native_layer_norm_backward(*to_ref((g, x, [32], rmean, rrstd, w, b)),
                                                         [True, False, False])[0]
        assert_close(dx, rdx, torch.float32)


def test_autograd_passes_absent_optionals_as_undefined_tensors():
    # autograd hands a None bias to native_layer_norm_backward as an undefined tensor, not None.
    # Two norms per backward: on CUDA the backward runs on autograd's device thread, whose first Gems
    # call of each backward takes the Python path (it keys the thread's graph task to the scope), so
    # only a later call of the same backward can be answered in C++
    x, w = make((5, 24), requires_grad=True), make((24,), requires_grad=True)
    g = make((5, 24))

    def f(x, w):
        return F.layer_norm(x, (24,), w, None) + F.layer_norm(x.flip(0), (24,), w, None)
    before = _hits("native_layer_norm_backward.default")
    for _ in range(3):
        with gems.use_gems():
            gx, gw = torch.autograd.grad(f(x, w), (x, w), g)
    assert _hits("native_layer_norm_backward.default") > before
    rx, rw = to_ref(x.detach()).requires_grad_(True), to_ref(w.detach()).requires_grad_(True)
    rgx, rgw = torch.autograd.grad(f(rx, rw), (rx, rw), to_ref(g))
    assert_close(gx, rgx, torch.float32)
    assert_close(gw, rgw, torch.float32)


def test_a_thread_without_a_cuda_context_is_served():
    # a new thread has no current CUDA driver context until it makes a runtime call; the C++ path
    # launches with the driver API, so it must make the device's context current itself
    x = make((33, 7))
    with gems.use_gems():
        torch.exp(x)
    out = {}

    def worker():
        try:
            with gems.use_gems():
                out["y"] = torch.exp(x)     # the first CUDA work of this thread, answered from the recipe
        except Exception as e:  # noqa: BLE001 - re-raised below, in the test's thread
            out["err"] = e
    before = _hits("exp.default")
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "err" not in out, out.get("err")
    assert _hits("exp.default") == before + 1
    assert_close(out["y"], torch.exp(to_ref(x)), torch.float32)


def test_overlapping_inplace_declines_and_raises_like_aten():
    base = make((10,))
    with gems.use_gems():
        for _ in range(2):
            base[:8].add_(make((8,)))     # the plan for [8] += [8]
        with pytest.raises(RuntimeError, match="single memory location"):
            base[:8].add_(base[2:10])     # same signature, partial overlap: the full path decides


def test_aten_errors_propagate_with_their_type():
    with gems.use_gems():
        a, b = make((3, 4)), make((5, 4))
        with pytest.raises(RuntimeError, match="size of tensor"):
            a + b


def test_disable_unregisters_and_aten_serves():
    x = make((4, 4))
    gems.enable()
    try:
        for _ in range(2):
            torch.exp(x)
        before = _hits("exp.default")
        torch.exp(x)
        assert _hits("exp.default") == before + 1
    finally:
        gems.disable()
    torch.exp(x)
    assert _hits("exp.default") == before + 1


def test_excluded_ops_and_other_threads_are_not_served():
    x = make((4, 4))
    with gems.use_gems():
        torch.exp(x)
        torch.exp(x)
    before = _hits("exp.default")
    seen = {}
    with gems.use_gems(exclude=["exp"]):
        torch.exp(x)
        assert _hits("exp.default") == before, "an excluded op was served by the C++ path"
        with gems.use_gems():
            torch.exp(x)                                   # nested scope: served again
            assert _hits("exp.default") == before + 1

            def other():                                   # a thread outside any scope: ATen
                torch.exp(x)
                seen["hits"] = _hits("exp.default")
            t = threading.Thread(target=other)
            t.start()
            t.join()
    assert seen["hits"] == before + 1
    torch.exp(x)                                           # outside every scope (still registered)
    assert _hits("exp.default") == before + 1


def test_backward_threads_follow_the_scope():
    x = make((8, 16), requires_grad=True)
    with gems.use_gems():
        for _ in range(3):
            y = F.silu(x).sum()
            (gx,) = torch.autograd.grad(y, x)
    ref = to_ref(x.detach()).requires_grad_(True)
    (rgx,) = torch.autograd.grad(F.silu(ref).sum(), ref)
    assert_close(gx, rgx, torch.float32)


def test_replacing_an_implementation_drops_cpp_plans():
    x = make((16,))
    with gems.use_gems():
        torch.sigmoid(x)
        torch.sigmoid(x)
        assert gems.dispatch.op_runtime("sigmoid.default").fast.size() >= 1
        calls = []

        def double(self):
            calls.append(1)
            raise gems.Unsupported("test double")
        with registry.override_impl("sigmoid.default", double):
            torch.sigmoid(x)
        assert calls, "a C++ plan of the old implementation ran instead of the override"


def test_stats_count_cpp_hits():
    x = make((6,))
    gems.reset_stats()
    with gems.use_gems():
        for _ in range(5):
            torch.tanh(x)
    assert gems.stats()["tanh.default"]["served"] == 5
    assert gems.plan_stats()["tanh.default"]["fast_plans"] >= 1


def test_tensor_lists_are_keyed_and_replayed_in_cpp():
    # cat's `tensors`: the C++ key holds each element (and the aliasing among all tensors), a recipe
    # names elements by (argument, position); new data per call, [x, x] apart from [x, y]
    before = _hits("cat.default")
    with gems.use_gems():
        for _ in range(3):
            past, new = make((1, 2, 5, 8)), make((1, 1, 2, 8)).transpose(1, 2)
            assert_close(torch.cat([past, new], 2), torch.cat([to_ref(past), to_ref(new)], 2), torch.float32)
        x = make((2, 3))
        for _ in range(3):
            y = make((2, 3))
            assert_close(torch.cat([x, x], 1), torch.cat([to_ref(x), to_ref(x)], 1), torch.float32)
            assert_close(torch.cat([x, y], 1), torch.cat([to_ref(x), to_ref(y)], 1), torch.float32)
    assert _hits("cat.default") - before >= 6


def test_tensor_list_out_overlap_declines_and_raises_like_aten():
    # the plan is recorded on calls without overlap; a call of the same signature whose list element
    # lies inside out= must be declined by the recipe's guard and raise ATen's error
    y = make((8, 4))
    before = _hits("cat.out")
    with gems.use_gems():
        for _ in range(3):
            o = torch.empty(16, 4, device=DEVICE)
            a = make((8, 4))
            torch.cat([a, y], 0, out=o)
            assert_close(o, torch.cat([to_ref(a), to_ref(y)], 0), torch.float32)
    assert _hits("cat.out") - before >= 2
    for _ in range(2):
        o = torch.empty(16, 4, device=DEVICE)
        o[:8].copy_(y)
        with pytest.raises(RuntimeError, match="unsupported operation"):
            with gems.use_gems():
                torch.cat([o[:8], y], 0, out=o)


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """fast.load() as in a new process, over an empty build directory, with the compiler replaced by a
    recorder (whatever happens, the module this process loaded stays loaded)."""
    for name, value in (("_tried", False), ("_module", None), ("_noted", False), ("_status", "not loaded")):
        monkeypatch.setattr(fast, name, value)
    monkeypatch.setenv("GEMS_FAST_BUILD_DIR", str(tmp_path))
    for var in ("GEMS_QUIET", "GEMS_FAST_BUILD"):
        monkeypatch.delenv(var, raising=False)
    builds = []

    def compile_fails(out):
        builds.append(out)
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(fast, "_build", compile_fails)
    return builds


def test_loading_never_compiles_and_says_once_how_to_build(fresh_loader, capsys):
    assert fast.load() is None and fast.load() is None
    assert fresh_loader == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-m gems.runtime.fast build" in err, err
    assert fast.status().startswith("not built"), fast.status()


def test_a_module_built_for_other_sources_is_named_stale(fresh_loader, capsys, tmp_path):
    (tmp_path / "fastpath" / "0123456789abcdef").mkdir(parents=True)
    (tmp_path / "fastpath" / "0123456789abcdef" / "gems_fastpath.so").write_bytes(b"")
    assert fast.load() is None and fresh_loader == []
    assert "another torch version or older sources" in capsys.readouterr().err


def test_gems_quiet_silences_the_note(fresh_loader, capsys, monkeypatch):
    monkeypatch.setenv("GEMS_QUIET", "1")
    assert fast.load() is None
    assert capsys.readouterr().err == ""


def test_gems_fast_build_auto_builds_on_first_use(fresh_loader, monkeypatch):
    monkeypatch.setenv("GEMS_FAST_BUILD", "auto")
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert fast.load() is None
    assert len(fresh_loader) == 1 and fast.status().startswith("unavailable")


def test_the_build_command_says_where_and_how_long(fresh_loader, monkeypatch, capsys):
    monkeypatch.setattr(fast, "_build", lambda out: (fresh_loader.append(out), out.write_bytes(b"")))
    assert fast.main(["status"]) == 1
    assert fast.main(["build"]) == 0
    out = capsys.readouterr().out
    assert "built the C++ fast path in " in out and str(fast.build_path()) in out, out
    assert fast.main(["build"]) == 0 and len(fresh_loader) == 1      # built: nothing to do
    assert fast.main(["build", "--force"]) == 0 and len(fresh_loader) == 2
    assert fast.main(["status"]) == 0
