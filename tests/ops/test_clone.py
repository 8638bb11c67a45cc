"""clone (gems/ops/shape/copy.py) against ATen: bit-identical values, ATen's strides for every memory format
(preserve keeps dense strides, else the suggested format), every dtype, empty and 0-dim, gradients,
errors, plans."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, FLOAT_IDS, ON_GPU, check_grad, dtype_params, layouts, make, served

ALL_DT = DTYPES + [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731


def _check(x, **kw):
    want = torch.clone(x, **kw)
    with served("clone"), gems.use_gems():
        got = torch.clone(x, **kw)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride(), (got.stride(), want.stride(), kw)
    assert torch.equal(got.cpu(), want.cpu())
    assert got.data_ptr() != x.data_ptr() or x.numel() == 0


@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_dtypes_and_layouts(dtype):
    for name, x in layouts((5, 7), torch.float32):
        x = x.to(dtype) if dtype != torch.uint8 else x.abs().to(dtype)
        for mf in (None, torch.preserve_format, torch.contiguous_format):
            _check(x, **({} if mf is None else {"memory_format": mf}))


@dtype_params()
def test_memory_formats(dtype):
    x = make((2, 3, 4, 5), dtype)
    cl = x.to(memory_format=torch.channels_last)
    for t in (x, cl, x.permute(0, 2, 3, 1), x[:, ::2], x.transpose(0, 1), make((1, 3, 1, 1), dtype).expand(2, 3, 4, 5)):
        for mf in (torch.preserve_format, torch.contiguous_format, torch.channels_last):
            _check(t, memory_format=mf)
    v = make((2, 3, 2, 4, 5), dtype)
    _check(v, memory_format=torch.channels_last_3d)
    _check(v.to(memory_format=torch.channels_last_3d))


def test_edge_shapes():
    _check(make(()))
    _check(make((0, 3)))
    _check(make((3, 1, 4)).transpose(0, 2))
    _check(make((7,))[::3])
    _check(make((4, 1)).expand(4, 6))
    _check(make((2, 3, 4, 5))[:, :, 1:3].permute(3, 0, 1, 2))


def test_errors_and_fallbacks():
    with gems.use_gems():
        with pytest.raises(RuntimeError):
            torch.clone(make((3, 4)), memory_format=torch.channels_last)   # rank 2: ATen raises
    gems.reset_stats()
    x = make((3, 4), torch.float64)
    with gems.use_gems():
        y = x.clone()
    assert torch.equal(x, y)
    assert gems.stats()["clone.default"]["fallback"] == 1


@dtype_params()
def test_grad(dtype):
    check_grad(lambda a: a.clone() * 2, [make((3, 5), dtype)], dtype=dtype, served_ops=["clone"])


def test_repeat_calls_run_a_plan():
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("clone.default", empty_info)
    for _ in range(3):
        _check(make((6, 4)).t())
    info = gems.dispatch.plan_stats()["clone.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)


@pytest.mark.skipif(not ON_GPU, reason="bf16 is left to ATen by the interpreter backend")
def test_bf16_gpu():
    _check(make((3, 4), torch.bfloat16).t())
