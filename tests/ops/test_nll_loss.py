"""nll_loss_forward / nll_loss_backward (gems/ops/loss/nll_loss.py) against ATen in float64: reductions,
class weights, ignore_index (all ignored: mean is NaN), 1-D and 2-D inputs, non-contiguous inputs and
targets, empty batches, out= variants, gradients through F.cross_entropy / F.nll_loss, ATen's errors
(out-of-range targets: IndexError on CPU, NaN instead of a device assert on the GPU), plans."""
import os

import pytest
import torch
import torch.nn.functional as F

import gems
from harness import DEVICE, ON_GPU, assert_close, check_grad, check_op, dtype_params, make, served, to_ref

fwd = torch.ops.aten.nll_loss_forward
bwd = torch.ops.aten.nll_loss_backward
RED = {"none": 0, "mean": 1, "sum": 2}


def targets(n, C, ignore=(), ignore_index=-100):
    t = torch.randint(0, C, (n,))
    for i in ignore:
        t[i] = ignore_index
    return t.to(DEVICE)


def _fwd_ops(dtype, red):
    # fp16 sums on the CPU are ATen's: its kernel sums in fp16 (test_fp16_sums_like_aten)
    return [] if dtype == torch.float16 and not ON_GPU and red != 0 else ["nll_loss_forward"]


@dtype_params()
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
def test_forward(reduction, weighted, dtype):
    N, C = 9, 7
    x = make((N, C), dtype)
    w = make((C,), dtype, low=0.1, high=2.0) if weighted else None
    for t, ii in [(targets(N, C), -100), (targets(N, C, ignore=(0, 4)), -100), (targets(N, C, ignore=(3,), ignore_index=2), 2)]:
        check_op(fwd, (x, t, w, RED[reduction], ii), dtype=dtype, served_ops=_fwd_ops(dtype, RED[reduction]))


@dtype_params()
def test_forward_layouts_and_edges(dtype):
    N, C = 6, 5
    t = targets(N, C, ignore=(1,))
    for x in (make((C, N), dtype).t(), make((N, 2 * C), dtype)[:, ::2], make((1, C), dtype).expand(N, C)):
        for red in (0, 1, 2):
            check_op(fwd, (x, t, None, red, -100), dtype=dtype, served_ops=_fwd_ops(dtype, red))
    # a strided target and weight
    t2 = targets(2 * N, C)[::2]
    w = make((2 * C,), dtype, low=0.1, high=2.0)[::2]
    check_op(fwd, (make((N, C), dtype), t2, w, 1, -100), dtype=dtype, served_ops=_fwd_ops(dtype, 1))
    # every target ignored: mean is 0/0 = NaN, sum 0, total weight 0
    tall = torch.full((N,), -100, device=DEVICE)
    for red in (0, 1, 2):
        check_op(fwd, (make((N, C), dtype), tall, None, red, -100), dtype=dtype, served_ops=_fwd_ops(dtype, red))
    # an empty batch
    for red in (0, 1, 2):
        check_op(fwd, (make((0, C), dtype), targets(0, C), None, red, -100), dtype=dtype,
                 served_ops=_fwd_ops(dtype, red))
    # a batch larger than one block of the interpreter's loop
    check_op(fwd, (make((37, 3), dtype), targets(37, 3, ignore=(5,)), make((3,), dtype, low=0.5), 1, -100),
             dtype=dtype, served_ops=_fwd_ops(dtype, 1))


def test_fp16_sums_like_aten():
    # 33 weights of 65000: their sum is past fp16's range. ATen's CPU kernel sums in fp16 (inf; the mean
    # inf / inf is NaN), its CUDA kernel in fp32 (finite): Gems gives each device's answer
    N = 33
    x = torch.full((N, 2), -0.5, dtype=torch.float16, device=DEVICE)
    t = torch.zeros(N, dtype=torch.int64, device=DEVICE)
    w = torch.tensor([65000.0, 1.0], dtype=torch.float16, device=DEVICE)
    for red in (1, 2):
        want = fwd(x, t, w, red, -100)
        with served(*_fwd_ops(torch.float16, red)), gems.use_gems():
            got = fwd(x, t, w, red, -100)
        for g, a in zip(got, want):
            assert torch.equal(g.isnan(), a.isnan()) and torch.equal(g.nan_to_num(), a.nan_to_num()), (red, got, want)
    assert ON_GPU or want[1].isinf()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_forward_unbatched(reduction):
    # a [C] input with a 0-dim target; mean of an ignored target differs by device in ATen (CPU: NaN,
    # CUDA: 0), so the reference is ATen on the test device in float64
    C = 6
    x = make((C,))
    for t, w in [(torch.tensor(2), None), (torch.tensor(-100), None), (torch.tensor(3), make((C,), low=0.5)),
                 (torch.tensor(1), torch.tensor([1.0, 0.0, 1, 1, 1, 1]))]:
        t = t.to(DEVICE)
        w = None if w is None else w.to(DEVICE)
        with served("nll_loss_forward"), gems.use_gems():
            got = fwd(x, t, w, RED[reduction], -100)
        want = fwd(x.double(), t, None if w is None else w.double(), RED[reduction], -100)
        assert_close(got, [want[0].cpu(), want[1].cpu()], torch.float32)


def test_forward_out_variant():
    N, C = 5, 4
    x, t = make((N, C)), targets(N, C, ignore=(2,))
    want = fwd(x.double(), t, None, 0, -100)
    with gems.use_gems():
        out, tw = torch.full((N,), float("nan"), device=DEVICE), torch.full((), float("nan"), device=DEVICE)
        with served("nll_loss_forward.output"):
            r = fwd.output(x, t, None, 0, -100, output=out, total_weight=tw)
        assert r[0] is out and r[1] is tw
        assert_close([out, tw], [want[0].cpu(), want[1].cpu()], torch.float32)
        out, tw = torch.full((3,), float("nan"), device=DEVICE), torch.full((), float("nan"), device=DEVICE)
        with served("nll_loss_forward.output"), pytest.warns(UserWarning, match="resized"):
            fwd.output(x, t, None, 1, -100, output=out, total_weight=tw)
        want = fwd(x.double(), t, None, 1, -100)
        assert_close([out, tw], [want[0].cpu(), want[1].cpu()], torch.float32)


@dtype_params()
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
def test_backward_direct(reduction, weighted, dtype):
    N, C = 7, 6
    x = make((N, C), dtype)
    t = targets(N, C, ignore=(2,))
    w = make((C,), dtype, low=0.1, high=2.0) if weighted else None
    tw = fwd(x, t, w, RED[reduction], -100)[1]
    g = make((2 * N,), dtype)[::2] if reduction == "none" else make((), dtype)
    check_op(bwd, (g, x, t, w, RED[reduction], -100, tw), dtype=dtype, served_ops=["nll_loss_backward"])
    # unbatched
    x1, t1 = make((C,), dtype), torch.tensor(3, device=DEVICE)
    tw1 = fwd(x1, t1, w, RED[reduction], -100)[1]
    check_op(bwd, (make((), dtype), x1, t1, w, RED[reduction], -100, tw1), dtype=dtype,
             served_ops=["nll_loss_backward"])
    # wide rows: several column tiles
    x2 = make((3, 150), dtype)
    t2 = targets(3, 150)
    check_op(bwd, (make((), dtype), x2, t2, None, 1, -100, fwd(x2, t2, None, 1, -100)[1]), dtype=dtype,
             served_ops=["nll_loss_backward"])


def test_backward_out_and_empty():
    N, C = 4, 3
    x, t = make((N, C)), targets(N, C)
    tw = fwd(x, t, None, 1, -100)[1]
    g = make(())
    want = bwd(g.double(), x.double(), t, None, 1, -100, tw.double())
    with gems.use_gems():
        gi = torch.full((N, C), float("nan"), device=DEVICE)
        with served("nll_loss_backward.grad_input"):
            r = bwd.grad_input(g, x, t, None, 1, -100, tw, grad_input=gi)
        assert r is gi
        assert_close(gi, want.cpu(), torch.float32)
        e = bwd(make(()), make((0, C)), targets(0, C), None, 1, -100, make(()))
    assert e.shape == (0, C)


@dtype_params()
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_grad_through_cross_entropy(reduction, dtype):
    N, C = 8, 11
    t = targets(N, C, ignore=(1, 6))
    w = make((C,), dtype, low=0.1, high=2.0)
    ops = _fwd_ops(dtype, RED[reduction]) + ["nll_loss_backward"]
    # the reference runs on CPU float64 copies of the inputs: targets follow the input's device
    check_grad(lambda x: F.cross_entropy(x, t.to(x.device), reduction=reduction), [make((N, C), dtype)],
               dtype=dtype, served_ops=ops)
    t3 = targets(N, C, ignore=(0,), ignore_index=3)
    check_grad(lambda x: F.cross_entropy(x, t3.to(x.device), weight=w.to(device=x.device, dtype=x.dtype),
                                               reduction=reduction,
                                               ignore_index=3),
               [make((N, C), dtype)], dtype=dtype, served_ops=ops)
    check_grad(lambda x: F.nll_loss(torch.log_softmax(x, -1), t.to(x.device), reduction=reduction),
               [make((N, C), dtype)], dtype=dtype, served_ops=ops)


def test_errors_like_aten():
    x = make((4, 5))
    with gems.use_gems():
        if not ON_GPU:   # CUDA stops with a device-side assert; the CPU kernel raises
            with pytest.raises(IndexError, match="out of bounds"):
                fwd(x, torch.tensor([0, 5, 1, 2], device=DEVICE), None, 1, -100)
            with pytest.raises(IndexError, match="out of bounds"):
                fwd(x, torch.tensor([0, -1, 1, 2], device=DEVICE), None, 0, -100)
            with pytest.raises(IndexError, match="out of bounds"):
                bwd(make(()), x, torch.tensor([0, 7, 1, 2], device=DEVICE), None, 1, -100, make(()))
        with pytest.raises((ValueError, RuntimeError)):
            fwd(x, targets(3, 5), None, 1, -100)                    # batch sizes differ
        with pytest.raises(RuntimeError):
            fwd(x, targets(4, 5).reshape(2, 2), None, 1, -100)      # multi-target
        with pytest.raises(RuntimeError):
            fwd(x, targets(4, 5), make((4,)), 1, -100)              # weight for 4 of 5 classes
        with pytest.raises(RuntimeError):
            fwd(x, targets(4, 5).int(), None, 1, -100)              # int32 targets
        with pytest.raises(RuntimeError):
            bwd(make((3,)), x, targets(4, 5), None, 0, -100, make(()))   # grad of the wrong size


@pytest.mark.skipif(not ON_GPU or os.environ.get("TRITON_DEBUG", "0") not in ("", "0"),
                    reason="GPU only, and only with device asserts compiled out (they would stop the process)")
def test_out_of_range_target_is_nan_on_gpu():
    x = make((4, 5))
    t = torch.tensor([0, 5, 1, 2], device=DEVICE)
    with gems.use_gems():
        assert torch.isnan(fwd(x, t, None, 1, -100)[0]).item()
        assert torch.isnan(fwd(x, t, None, 0, -100)[0][1]).item()
        gi = bwd(make(()), x, t, None, 2, -100, make(()))
    assert torch.isnan(gi[1]).all().item() and not torch.isnan(gi[0]).any().item()


def test_fallbacks_are_counted():
    gems.reset_stats()
    x = make((4, 5), torch.float64)
    t = targets(4, 5)
    with gems.use_gems():
        fwd(x, t, None, 1, -100)
        fwd(make((4, 5)), t.to(torch.uint8), None, 1, -100)
    st = gems.stats()["nll_loss_forward.default"]
    assert st["fallback"] == 2 and st["served"] == 0


def test_repeat_calls_run_a_plan_on_gpu():
    # on the GPU the call is kernels only: repeat calls replay a plan. On the interpreter the wrapper
    # checks targets on the host (ATen ops, like ATen's CPU kernel's IndexError), so it keeps the full path
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("nll_loss_forward.default", empty_info)
    N, C = 13, 3    # a signature no other test makes
    for _ in range(3):
        x, t = make((N, C)), targets(N, C, ignore=(2,))
        with served("nll_loss_forward"), gems.use_gems():
            got = fwd(x, t, None, 1, -100)
        assert_close(got, fwd(*to_ref((x, t)), None, 1, -100), torch.float32)
    info = gems.dispatch.plan_stats()["nll_loss_forward.default"]
    if ON_GPU:
        assert info["plans"] == before["plans"] + 1, (before, info)
    else:
        assert info["no_plan"] == before["no_plan"] + 1, (before, info)
