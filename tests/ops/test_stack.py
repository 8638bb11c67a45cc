"""stack (gems/ops/shape/stack.py: cat of unsqueezed views) against ATen: bit-identical values, ATen's dtype
(promotion over the inputs) and strides (contiguous where ATen allocates a new inner dim, cat's format
rule for a new last dim), every dim including negative ones, layouts, 0-dim and empty inputs, more
inputs than one cat launch takes, the decode loop's stack of token ids, out=, errors, fallbacks, plans."""
import pytest
import torch

import gems
from harness import launch_counter, DEVICE, DTYPES, FLOAT_IDS, check_grad, dtype_params, layouts, make, served, raises_like_aten

from gems.ops.shape import cat as cat_mod
from gems.ops.shape import stack as stack_mod

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


# ---- inputs of one dtype, shape and strides: cat's uniform path, one launch per cat_mod._MANY -------
S = cat_mod._MANY
CAT_KERNELS = ("cat_kernel", "cat2_kernel", "cat_uniform_kernel")


@pytest.mark.parametrize("n", [1, 3, S - 1, S, S + 1, 2 * S + 3])
def test_uniform_launches(n, monkeypatch):
    # the decode loop's token ids, [batch] int64, along a new last dim; and along dim 0
    toks = [torch.randint(0, 100, (4,), device=DEVICE) for _ in range(n)]
    for dim in (1, 0) if n < S else (1,):
        counts = launch_counter(monkeypatch, CAT_KERNELS)
        _same(stack_mod.stack(toks, dim), torch.stack(toks, dim), f"n={n} dim={dim}")
        assert counts() == {"cat_uniform_kernel": -(-n // S)}, counts()
    counts = launch_counter(monkeypatch, CAT_KERNELS)
    _same(stack_mod.stack(toks[:1] * 2, 1), torch.stack(toks[:1] * 2, 1))
    assert counts() == {"cat2_kernel": 1}, counts()


@pytest.mark.parametrize("dtype,n", [(torch.int64, S + 1), (torch.bool, S - 1), (torch.float16, 5),
                                     (torch.float32, S)], ids=DT_IDS)
def test_uniform_many_inputs(dtype, n):
    ts = [make((2, 3), dtype, low=-3.0) for _ in range(n)]
    _check(ts, -1)
    _check(ts[:3], 0)
    _check(ts[:3], -2)
    _check([torch.tensor(i, dtype=dtype, device=DEVICE) for i in range(n)], 0)     # 0-dim -> [n]


def test_uniform_strided_inputs():
    # transposed inputs, each its own tensor; step-sliced rows of one tensor at unaligned addresses;
    # expanded rows; channels_last inputs (the new last dim keeps cat's format rule)
    n = S + 2
    base = make((n, 3, 4))
    _check([base[i, :, 1::2] for i in range(n)], 2)
    for dim in (0, 1, 2):
        _check([make((4, 3)).t() for _ in range(5)], dim)
        _check([base[i, :, 1::2] for i in range(5)], dim)
        _check([make((1, 4)).expand(3, 4) for _ in range(3)], dim)
    cl = [make((2, 4, 5, 3)).permute(0, 3, 1, 2) for _ in range(3)]
    for dim in range(5):
        _check(cl, dim)
    # the same shape, other strides; other dtypes: the general path
    for dim in (0, 2):
        _check([make((4, 3)).t() if i % 2 else make((3, 4)) for i in range(5)], dim)
        _check([make((3, 4)) for _ in range(4)] + [make((3, 4), torch.float16)], dim)
        _check([make((3, 4), torch.int64) for _ in range(4)] + [make((3, 4), torch.bool)], dim)


def test_uniform_out_variant():
    ts = [make((3, 4)) for _ in range(S + 1)]
    for dim, n in ((0, 5), (1, 5), (2, 5), (2, S + 1)):
        want = torch.stack(ts[:n], dim)
        for out in (torch.empty(0, device=DEVICE), torch.full(tuple(want.shape), float("nan"), device=DEVICE)):
            with served("stack.out"), gems.use_gems():
                got = torch.stack(ts[:n], dim, out=out)
            assert got is out
            _same(out, want)
    # an out= whose strides do not join (dim 1): ATen's, counted; a wider dtype: ATen's
    gems.reset_stats()
    ts = ts[:5]
    out = torch.empty(4, 5, 3, device=DEVICE).permute(2, 1, 0)
    o64 = torch.empty(0, dtype=torch.float64, device=DEVICE)
    with gems.use_gems():
        torch.stack(ts, 1, out=out)
        torch.stack(ts, 1, out=o64)
    assert gems.stats()["stack.out"]["fallback"] == 2
    assert torch.equal(out.cpu(), torch.stack(ts, 1).cpu())
    assert torch.equal(o64.cpu(), torch.stack(ts, 1).double().cpu())


def test_uniform_errors_like_aten():
    a = make((2, 3))
    raises_like_aten([lambda: torch.stack([a] * 5, 3),
                      lambda: torch.stack([a] * 5, -4),
                      lambda: torch.stack([a] * 5, out=torch.empty(5, 2, 3, dtype=torch.int32, device=DEVICE)),
                      lambda: torch.stack([a] * 4 + [make((3, 2))])])


def test_uniform_repeat_calls_use_a_plan():
    # the decode loop: S + 1 token ids, two launches (the second's unused slots repeat its first input)
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("stack.default", empty_info)
    for _ in range(3):
        _check([torch.randint(0, 100, (3,), device=DEVICE) for _ in range(S + 1)], 1)
    info = gems.dispatch.plan_stats()["stack.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)
