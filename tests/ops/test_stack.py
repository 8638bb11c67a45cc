"""stack (gems/ops/stack.py: cat of unsqueezed views) against ATen: bit-identical values, ATen's dtype
(promotion over the inputs) and strides (contiguous where ATen allocates a new inner dim, cat's format
rule for a new last dim), every dim including negative ones, layouts, 0-dim and empty inputs, more
inputs than one cat launch takes, the decode loop's stack of token ids, out=, errors, fallbacks, plans."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, FLOAT_IDS, check_grad, dtype_params, layouts, make, served, raises_like_aten

ALL_DT = DTYPES + [torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731


def _same(got, want, msg=""):
    assert got.dtype == want.dtype, f"{msg}: dtype {got.dtype} vs {want.dtype}"
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel() > 1:
        assert got.stride() == want.stride(), f"{msg}: strides {got.stride()} vs {want.stride()}"
    assert torch.equal(got.cpu(), want.cpu()), f"{msg}: values differ"


def _check(tensors, dim=0, op="stack"):
    want = torch.stack(tensors, dim)
    with served(op), gems.use_gems():
        got = torch.stack(tensors, dim)
    _same(got, want, f"stack dim={dim}")
    return got


@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_dtypes_and_dims(dtype):
    ts = [make((3, 5), dtype, low=0 if dtype == torch.uint8 else -3.0) for _ in range(3)]
    for dim in (0, 1, 2, -1, -2, -3):
        _check(ts, dim)


def test_layouts_and_promotion():
    for dim in (0, 1, 2):
        ls = [t for _, t in layouts((4, 6))]
        _check(ls, dim)
        _check([ls[0], ls[1].to(torch.float16), ls[2].to(torch.int32)], dim)     # promoted like ATen
    # channels_last inputs: ATen stacks a dim before the last as cat's result viewed, keeping cat's
    # memory format (not contiguous); a new last dim as cat of unsqueezed views
    for n in (1, 2):
        c = make((n, 4, 5, 3)).permute(0, 3, 1, 2)
        for dim in range(5):
            _check([c, c.clone()], dim)
    # an out= whose strides cannot be viewed as the joined shape: cat of the unsqueezed views into it,
    # which cat leaves to ATen (not dense in a memory format): counted under stack, ATen's answer
    ts = [make((3, 4)), make((3, 4))]
    gems.reset_stats()
    out = torch.empty(4, 2, 3, device=DEVICE).permute(2, 1, 0)
    with gems.use_gems():
        torch.stack(ts, 1, out=out)
    assert gems.stats()["stack.out"]["fallback"] == 1
    assert torch.equal(out.cpu(), torch.stack(ts, 1).cpu())


def test_edges():
    _check([torch.tensor(1.5, device=DEVICE), torch.tensor(-2.0, device=DEVICE)])     # 0-dim -> 1-D
    _check([torch.tensor(1.5, device=DEVICE)], -1)
    _check([make((0,)), make((0,))], 0)          # 1-D empty inputs are not skipped (they become [1, 0])
    _check([make((2, 0, 3)), make((2, 0, 3))], 1)
    _check([make((7,)) for _ in range(9)], 1)    # more inputs than one cat launch takes
    # the decode loop: a token id per step, [batch] int64, stacked along dim 1
    _check([torch.randint(0, 100, (2,), device=DEVICE) for _ in range(5)], 1)


def test_out_variant():
    ts = [make((3, 4)) for _ in range(2)]
    want = torch.stack(ts, 1)
    for out in (torch.empty(0, device=DEVICE), torch.empty(3, 2, 4, device=DEVICE)):
        with served("stack.out"), gems.use_gems():
            got = torch.stack(ts, 1, out=out)
        assert got is out
        _same(out, want)


def test_errors_like_aten():
    a = make((2, 3))
    cases = [lambda: torch.stack([]),
             lambda: torch.stack([a, make((3, 2))]),
             lambda: torch.stack([a, a], 3),
             lambda: torch.stack([a, a], -4),
             lambda: torch.stack([a, a], out=torch.empty(2, 2, 3, dtype=torch.int32, device=DEVICE))]
    raises_like_aten(cases)


@dtype_params()
def test_grad(dtype):
    # autograd unbinds the gradient with views: stack itself runs forward only
    fn = lambda a, b: torch.stack([a, b.t()], 1)   # noqa: E731
    check_grad(fn, [make((3, 4), dtype), make((4, 3), dtype)], dtype=dtype, served_ops=["stack"])


def test_fallbacks_counted():
    gems.reset_stats()
    with gems.use_gems():
        torch.stack([make((2,)).to(torch.complex64), make((2,)).to(torch.complex64)])
    assert gems.stats()["stack.default"]["fallback"] == 1


def test_repeat_calls_use_a_plan():
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("stack.default", empty_info)
    for _ in range(3):
        _check([make((2, 5)), make((2, 5)), make((2, 5))], 1)
    info = gems.dispatch.plan_stats()["stack.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)
