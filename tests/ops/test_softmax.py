import pytest
import torch

import gems
from harness import DEVICE, ON_GPU, check_grad, check_op, dtype_params, layouts, make, raises_like_aten, served

SHAPES = [(7, 33), (4, 1), (3, 5, 17), (2, 1100)]   # odd sizes; 1100 > the interpreter's tile: online path


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_forward_all_dims(shape, dtype, log):
    fn = torch.log_softmax if log else torch.softmax
    for dim in range(-len(shape), len(shape)):
        check_op(fn, (make(shape, dtype), dim), dtype=dtype, served_ops=["_log_softmax" if log else "_softmax"])


@dtype_params()
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_layouts(dtype, log):
    fn = torch.log_softmax if log else torch.softmax
    for name, x in layouts((6, 19), dtype):
        check_op(fn, (x, -1), dtype=dtype)
        check_op(fn, (x, 0), dtype=dtype)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_edge_cases(log):
    fn = torch.log_softmax if log else torch.softmax
    check_op(fn, (make((), torch.float32), 0), dtype=torch.float32)
    with gems.use_gems():
        e = fn(make((0, 5)), 1)
    assert e.shape == (0, 5)
    # -inf entries (attention masks) and a fully masked row
    x = make((3, 40))
    x[0, :20] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    check_op(fn, (x, 1), dtype=torch.float32)
    x2 = make((2, 1100))
    x2[0, :600] = float("-inf")  # -inf prefix crossing a tile in the online path
    check_op(fn, (x2, 1), dtype=torch.float32)


@dtype_params()
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((5, 37), 1), ((4, 6, 3), 1), ((2, 1100), -1)])
def test_backward(shape, dim, dtype, log):
    fn = torch.log_softmax if log else torch.softmax
    op = "_log_softmax_backward_data" if log else "_softmax_backward_data"
    check_grad(lambda x: fn(x, dim), [make(shape, dtype)], dtype=dtype, served_ops=[op])


def test_out_variant_and_errors():
    x = make((4, 9))
    out = torch.full((4, 9), float("nan"), device=DEVICE)
    with gems.use_gems():
        torch._softmax(x, 1, False, out=out)
        torch.testing.assert_close(out.double(), torch.softmax(x.double(), 1))
        wrong = torch.full((2,), float("nan"), device=DEVICE)
        with pytest.warns(UserWarning, match="resized"):
            torch._softmax(x, 1, False, out=wrong)
        assert wrong.shape == (4, 9)
        with pytest.raises(IndexError):
            torch.softmax(x, 2)
    # half_to_float: ATen rejects it on the CPU, and on CUDA for any input but float16; so must Gems
    aten = torch.ops.aten
    calls = [lambda: aten._softmax(x, 1, True), lambda: aten._log_softmax(x.bfloat16(), 0, True),
             lambda: aten._softmax.out(x, 1, True, out=torch.empty(0, device=DEVICE)),
             lambda: aten._log_softmax(x.half(), 1, True)]
    if DEVICE == "cpu":
        raises_like_aten(calls)
    else:
        raises_like_aten(calls[:3])
        with served("_log_softmax"), gems.use_gems():
            got = aten._log_softmax(x.half(), 1, True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, aten._log_softmax(x.half(), 1, True))


def test_dim_out_of_range_on_empty_tensors_raises_like_aten():
    # an empty tensor has no row to reduce, but ATen still checks the dim (found by the differential fuzz)
    aten = torch.ops.aten
    e, g = make((3, 0)), make((3, 0))
    raises_like_aten([lambda: aten._softmax(e, 3, False), lambda: aten._log_softmax(e, -3, False),
                      lambda: aten._log_softmax.out(e, 2, False, out=torch.empty(0, device=DEVICE)),
                      lambda: aten._safe_softmax(e, 2),
                      lambda: aten._softmax_backward_data(g, e, 2, torch.float32),
                      lambda: aten._log_softmax_backward_data(g, e, -3, torch.float32)])


@pytest.mark.parametrize("log", [False, True])
def test_backward_dtype_combinations_answer_or_raise_like_aten(log):
    # the result dtype (or the error) of a grad/input_dtype mismatch differs between ATen's CPU and
    # CUDA kernels: whatever ATen does on this device, Gems must do
    op = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    x = make((3, 5))
    y = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    g = make((3, 5))
    for gdt in (torch.float32, torch.float16):
        for idt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            args = (g.to(gdt), y.to(gdt), -1, idt)
            try:
                want = op(*args)
            except RuntimeError:
                with pytest.raises(RuntimeError):
                    with gems.use_gems():
                        op(*args)
                continue
            with gems.use_gems():
                got = op(*args)
            assert got.dtype == want.dtype, (gdt, idt, got.dtype, want.dtype)
            torch.testing.assert_close(got.double(), want.double(), rtol=2e-3, atol=2e-3)


def _safe(x, dim, dtype=None):
    return torch.ops.aten._safe_softmax(x, dim, dtype)


def _with_dead_rows(shape, dim, dtype):
    """Random values with -inf entries, and about a third of the rows along `dim` entirely -inf."""
    x = make(shape, dtype)
    x = x.masked_fill(torch.rand(shape, device=x.device) < 0.2, float("-inf"))
    rows = list(shape)
    rows[dim] = 1
    dead = torch.rand(rows, device=x.device) < 0.35
    dead.view(-1)[0] = True     # at least one dead row, whatever the draw
    return x.masked_fill(dead, float("-inf"))


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES)
def test_safe_softmax_all_dims(shape, dtype):
    for dim in range(len(shape)):
        x = _with_dead_rows(shape, dim, dtype)
        out = check_op(_safe, (x, dim - len(shape)), dtype=dtype, served_ops=["_safe_softmax"])
        assert not out.isnan().any() and (out == 0).all(dim=dim).any()   # dead rows are zeros, not NaN


def test_safe_softmax_tile_crossing_and_edges():
    x = make((3, 1100))   # longer than one tile: the online path (and a GPU block)
    x[0] = float("-inf")
    x[1, :700] = float("-inf")
    x[2, 5] = float("nan")     # NaN stays NaN: only an all -inf row becomes zeros
    x[2, 6:] = float("-inf")
    out = check_op(_safe, (x, 1), dtype=torch.float32, served_ops=["_safe_softmax"])
    assert (out[0] == 0).all() and out[2].isnan().all()
    check_op(_safe, (torch.tensor(float("-inf"), device=DEVICE), 0), dtype=torch.float32, served_ops=["_safe_softmax"])
    check_op(_safe, (make(()), -1), dtype=torch.float32)
    with gems.use_gems():
        assert _safe(make((0, 5)), 1).shape == (0, 5)
    for name, x in layouts((6, 19)):
        x = x.clone().masked_fill(torch.rand(6, 19, device=x.device) < 0.3, float("-inf"))
        check_op(_safe, (x.expand(6, 19) if name == "expanded" else x, -1), dtype=torch.float32)
        check_op(_safe, (x, 0), dtype=torch.float32)


def test_safe_softmax_dtype_argument():
    x = _with_dead_rows((5, 40), 1, torch.float16)
    out = check_op(_safe, (x, 1, torch.float32), dtype=torch.float16, served_ops=["_safe_softmax"])
    assert out.dtype == torch.float32   # a half input read as fp32: exact, served
    impl = gems.registry.get("_safe_softmax")
    before = gems.dispatch.op_runtime(impl.name).fell_back
    with gems.use_gems():
        # narrowing: ATen rounds the input first; the kernel would not, so ATen runs it (counted)
        got = _safe(x.float(), 1, torch.float16)
        with pytest.raises(IndexError):
            _safe(x, 2)
        with pytest.raises(NotImplementedError):   # ATen has no integer softmax
            _safe(x.float(), 1, torch.int64)
    assert gems.dispatch.op_runtime(impl.name).fell_back >= before + 2
    torch.testing.assert_close(got, _safe(x.float(), 1, torch.float16))


@dtype_params()
@pytest.mark.parametrize("shape,dim", [((5, 37), 1), ((4, 6, 3), 1), ((2, 1100), -1)])
def test_safe_softmax_backward(shape, dim, dtype):
    x = _with_dead_rows(shape, dim, dtype)
    g = check_grad(lambda t: _safe(t, dim), [x], dtype=dtype, served_ops=["_safe_softmax", "_softmax_backward_data"])
    assert not g[0].isnan().any()


def test_sdpa_math_path_serves_safe_softmax():
    # what SDPA's math backend runs (the models on the meta device, BERT's padding masks): a query
    # whose keys are all masked out attends to nothing and gets zeros
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = make((2, 3, 5, 8)), make((2, 3, 7, 8)), make((2, 3, 7, 8))
    mask = torch.rand(2, 1, 5, 7, device=DEVICE) > 0.3
    mask[:, :, 1] = False
    with sdpa_kernel(SDPBackend.MATH):
        out = check_op(torch.nn.functional.scaled_dot_product_attention, (q, k, v, mask), dtype=torch.float32,
                       served_ops=["_safe_softmax"])
    assert (out[:, :, 1] == 0).all()


def test_row_blocks_past_32_bit_offsets_go_to_aten():
    # a row block of N x K >= 2**31 elements (softmax over dim 0 of [70000, 32000]) would wrap the
    # kernels' 32-bit offsets: such calls go to ATen (the tensors are too large to allocate here)
    from gems.ops.norm import softmax as S
    from gems.registry import Unsupported
    S._offsets_fit(2**16, 2**15 - 1)
    with pytest.raises(Unsupported):
        S._offsets_fit(70000, 32000)


def test_backward_of_outputs_past_fp32_range():
    """docs/known-differences.md, the softmax-backward row: an output that is no softmax's (3e38) with
    products grad * y past fp32's range. Gems' fp32 sum(grad * y) meets +inf and -inf: NaN on every dim,
    as ATen's CPU over the last dim and its CUDA kernel; ATen's CPU over another dim answers inf."""
    g = torch.tensor([-75.93, -107.98, -54.58, 29.18, 38.90], device=DEVICE)
    y = torch.full((5,), 3e38, device=DEVICE)
    B = torch.ops.aten._softmax_backward_data.default
    for gg, yy, dim in ((g[None], y[None], 1), (g[:, None], y[:, None], 0)):
        with served("_softmax_backward_data"), gems.use_gems(include=["_softmax_backward_data"]):
            got = B(gg, yy, dim, torch.float32)
        assert got.isnan().all()
        if dim == 1 or ON_GPU:
            assert torch.equal(got.isnan(), B(gg, yy, dim, torch.float32).isnan())
    # fp16 outputs near fp16's limit: the fp32 products and sum do not overflow; inf as float64 and
    # ATen's CPU (ATen's CUDA kernel answers NaN here: its products overflow fp16; same table row)
    gh, yh = g.half()[None], torch.full((1, 5), 60000.0, device=DEVICE).half()
    with served("_softmax_backward_data"), gems.use_gems(include=["_softmax_backward_data"]):
        got = B(gh, yh, 1, torch.float16)
    assert torch.equal(got, B(gh.double(), yh.double(), 1, torch.float64).half())
    if not ON_GPU:
        assert torch.equal(got, B(gh, yh, 1, torch.float16))


def test_log_softmax_backward_product_past_fp32_range():
    # dX = grad - exp(y) * sum(grad) as one fused multiply-add, as ATen's kernels: exp(y) * sum(grad)
    # passes fp32's range (3.56e38) where dX (-5.56e37) does not; y = -inf with grad -0.0 keeps -0.0
    B = torch.ops.aten._log_softmax_backward_data.default
    for n in (5, 1100):   # 1100: the looping path on the interpreter
        g = torch.zeros(n, device=DEVICE)
        g[1], g[2:4] = 3e38, -0.0
        y = torch.full((n,), 0.17016173899173737, device=DEVICE)
        y[3] = -float("inf")
        for gg, yy, dim in ((g[None], y[None], 1), (g[:, None], y[:, None], 0)):
            with served("_log_softmax_backward_data"), gems.use_gems(include=["_log_softmax_backward_data"]):
                got = B(gg, yy, dim, torch.float32)
            want = B(gg, yy, dim, torch.float32)
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
            assert torch.isfinite(got.flatten()[1]) and got.flatten()[3] == 0 and got.flatten()[3].signbit()
