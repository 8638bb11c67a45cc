"""runtime/planned.py: call plans for launch functions that are not ATen overloads (gems.fused)."""
import pytest
import torch
import triton
import triton.language as tl

from harness import DEVICE, make

from gems.runtime import kernel
from gems.runtime.alloc import empty
from gems.runtime.plan import NO_PLAN
from gems.runtime.planned import Planned, planned


@kernel
@triton.jit
def _scale_rows(X, Y, N, sX, alpha, BLOCK: tl.constexpr):
    """y[r, :] = alpha * x[r, :] for one row per program."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    tl.store(Y + r * N + cols, tl.load(X + r * sX + cols, mask=m) * alpha, mask=m)


calls = {"n": 0}


@planned("test_scale(Tensor x, float alpha, bool twice) -> (Tensor, Tensor?)")
def _scale(x, alpha, twice):
    calls["n"] += 1
    if x.dim() != 2:
        raise ValueError("x must be 2-D")
    M, N = x.shape
    y = empty((M, N), x.dtype, x.device)
    _scale_rows[(M,)](x, y, N, x.stride(0), float(alpha), triton.next_power_of_2(N))
    z = None
    if twice:
        z = empty((M, N), x.dtype, x.device)
        _scale_rows[(M,)](y, z, N, N, float(alpha), triton.next_power_of_2(N))
    return y, z


def test_repeat_signature_runs_the_plan_with_new_tensors_and_values_keyed():
    x = make((5, 33), torch.float32)[:, :20]          # row-strided view
    y, z = _scale(x, 2.0, True)
    n = calls["n"]
    x2 = make((5, 33), torch.float32)[:, :20]
    y2, z2 = _scale(x2, 2.0, True)
    assert calls["n"] == n                            # no Python body: the plan ran
    torch.testing.assert_close(y2, x2 * 2, rtol=0, atol=0)
    torch.testing.assert_close(z2, x2 * 4, rtol=0, atol=0)
    assert not torch.equal(y2, y)
    y3, z3 = _scale(x2, 3.0, False)                   # another value of a number: its own signature
    assert calls["n"] == n + 1 and z3 is None
    torch.testing.assert_close(y3, x2 * 3, rtol=0, atol=0)


def test_errors_are_raised_on_every_call_of_the_signature():
    x = make((2, 3, 4), torch.float32)
    for _ in range(2):
        with pytest.raises(ValueError, match="2-D"):
            _scale(x, 1.0, False)


def test_unkeyable_argument_runs_the_function():
    with pytest.raises(AttributeError):
        _scale([[1.0]], 1.0, False)                   # a list at a Tensor position: the body decides


def test_a_body_calling_an_aten_op_keeps_the_full_path():
    @planned("test_copying(Tensor x) -> Tensor")
    def copying(x):
        return x.clone()                              # an ATen op: nothing a plan could repeat
    x = make((4,), torch.float32)
    for _ in range(2):
        assert torch.equal(copying(x), x)
    (p,) = copying.cache.plans.values()
    assert p is NO_PLAN and "aten::clone" in str(copying.cache.reasons)


def test_written_arguments_are_refused():
    with pytest.raises(ValueError, match="written"):
        Planned(lambda x: x, "test_inplace(Tensor(a!) x) -> Tensor(a!)")


def test_fused_ops_report_plans():
    import gems
    from gems.fused import silu_and_mul
    g, u = make((3, 8), torch.float32), make((3, 8), torch.float32)
    silu_and_mul(g, u)
    silu_and_mul(g, u)
    st = gems.plan_stats()
    assert st["fused::gated_forward"]["plans"] >= 1
    assert DEVICE in str(g.device)


def test_fused_backwards_plan_views_of_one_buffer_and_one_grad_for_two_outputs():
    """The layouts models make: gate and up as two halves of one projection output, and add_rms_norm's
    two outputs receiving the same gradient tensor; both used to keep the full path ("not a view of
    exactly one" input)."""
    from gems.fused import add_rms_norm, gated, norms, silu_and_mul
    caches = (gated._gated_forward.cache, gated._gated_backward.cache, norms._rms_forward.cache,
              norms._rms_backward.cache)
    before = [c.declined for c in caches]
    gu = make((3, 5, 32), torch.float32).requires_grad_()
    gate, up = gu.chunk(2, -1)
    x, r = make((3, 5, 16), torch.float32).requires_grad_(), make((3, 5, 16), torch.float32).requires_grad_()
    w = make((16,), torch.float32).requires_grad_()
    g = make((3, 5, 16), torch.float32)
    for _ in range(2):
        silu_and_mul(gate, up).backward(g)
        y, s = add_rms_norm(x, r, w, 1e-5)
        torch.autograd.backward((y, s), (g, g))
    assert [c.declined for c in caches] == before
