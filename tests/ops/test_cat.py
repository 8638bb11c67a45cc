"""cat (gems/ops/shape/cat.py) against ATen: a copy, so results must be bit-identical, with ATen's dtype and
strides (memory format); any dim, mixed layouts and dtypes, the legacy skip of 1-D empty inputs, the
model patterns (KV-cache append, rotate_half), more inputs than one launch takes, out=, errors,
gradients, and repeat calls served from a call plan."""
import pytest
import torch

import gems
from gems import registry
from harness import launch_counter, DEVICE, DTYPES, FLOAT_IDS, ON_GPU, check_grad, dtype_params, layouts, make, served

from gems.ops.shape import cat as cat_mod

ALL_DT = DTYPES + [torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731


def _make(shape, dtype):
    return make(shape, dtype, low=0 if dtype == torch.uint8 else -3.0)


def _same(got, want, msg=""):
    assert got.dtype == want.dtype, f"{msg}: dtype {got.dtype} vs {want.dtype}"
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel() > 1:
        assert got.stride() == want.stride(), f"{msg}: strides {got.stride()} vs {want.stride()}"
    assert torch.equal(got.cpu(), want.cpu()), f"{msg}: values differ"


def _check(tensors, dim=0, op="cat", at_least=1):
    want = torch.cat(tensors, dim)
    with served(op, at_least=at_least), gems.use_gems():
        got = torch.cat(tensors, dim)
    _same(got, want, f"cat dim={dim}")
    return got


@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_dtypes_and_dims(dtype):
    a, b, c = _make((3, 4, 5), dtype), _make((3, 2, 5), dtype), _make((3, 1, 5), dtype)
    _check([a, b, c], 1)
    _check([a, b, c], -2)
    _check([a, _make((2, 4, 5), dtype)], 0)
    _check([a, _make((3, 4, 7), dtype)], -1)
    _check([_make((7,), dtype), _make((5,), dtype)], 0)


@dtype_params()
def test_layouts(dtype):
    # every pair of layouts (contiguous, transposed, step-sliced, expanded), along each dim
    ls = layouts((4, 6), dtype)
    for n1, x in ls:
        for n2, y in ls:
            for dim in (0, 1):
                _check([x, y], dim)
    # 4-D permutations: several stride groups on each side of the cat dim
    x = make((2, 3, 4, 5), dtype).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # [2,3,4,5], heads last-but-one
    y = make((2, 3, 1, 5), dtype)
    _check([x, y], 2)
    _check([x, make((2, 3, 4, 2), dtype)[..., ::2].expand(2, 3, 4, 1)], 3)


@dtype_params()
def test_model_patterns(dtype):
    B, H, S, D = 2, 3, 5, 8
    # KV cache append: past [B, H, S, D] (a previous cat's output) + the new token's keys, which come
    # from a transposed projection ([B, 1, H, D] -> [B, H, 1, D])
    past = make((B, H, S, D), dtype)
    new = make((B, 1, H, D), dtype).transpose(1, 2)
    _check([past, new], -2)
    # prefill: the cache starts as an empty 1-D tensor (legacy skip), then the transposed keys
    keys = make((B, S, H, D), dtype).transpose(1, 2)
    _check([torch.tensor([], dtype=dtype, device=DEVICE), keys], -2)
    # rotate_half: cat((-x2, x1), -1) of the two halves of the head dim
    q = make((B, H, S, D), dtype)
    x1, x2 = q[..., : D // 2], q[..., D // 2:]
    _check([-x2, x1], -1)
    _check([x2, x1], -1)
    qt = make((B, S, H, D), dtype).transpose(1, 2)
    _check([-qt[..., D // 2:], qt[..., : D // 2]], -1)


def test_mixed_dtypes_promote_like_aten():
    f32, f16 = make((2, 3)), make((2, 3), torch.float16)
    _check([f32, f16])
    _check([f16, make((2, 3), torch.int64)])
    _check([make((2, 3), torch.bool), make((2, 3), torch.uint8, low=0)])
    _check([make((2, 3), torch.int8), make((2, 3), torch.uint8, low=0)], 1)
    _check([make((2, 3), torch.int32), make((2, 3), torch.float64)], 1)
    # a skipped empty tensor still takes part in the promotion
    _check([torch.tensor([], dtype=torch.float64, device=DEVICE), f32])


def test_legacy_empty_and_zero_size():
    e = torch.tensor([], device=DEVICE)
    x = make((2, 3))
    _check([e, x, e], 1)
    _check([x, e], -1)
    # a [0, 3] input is not skipped: it must match the other dims
    _check([make((0, 3)), x], 0)
    _check([make((2, 0)), x], 1)
    # all skipped: a [0] result, any dim accepted; empty results launch nothing
    want = torch.cat([e, e.half()], 5)
    with gems.use_gems():
        got = torch.cat([e, e.half()], 5)
    _same(got, want)
    with gems.use_gems():
        got = torch.cat([make((0, 3)), make((0, 3))], 1)
    assert got.shape == (0, 6)


def test_many_inputs_several_launches():
    # more inputs than one launch takes: one launch per group of them
    xs = [make((3, i + 1, 4)) for i in range(2 * cat_mod._SLOTS + 1)]
    _check(xs, 1)
    xs = [make((i + 1, 5)).t() for i in range(cat_mod._SLOTS + 2)]
    _check(xs, 1)
    _check([xs[0]] * 3, 1)   # the same tensor several times


def test_memory_formats():
    x = make((2, 3, 4, 5)).to(memory_format=torch.channels_last)
    y = make((2, 6, 4, 5)).to(memory_format=torch.channels_last)
    for dim in (1, 2, 3, 0):
        z = make((2, 3, 4, 5)).to(memory_format=torch.channels_last)
        _check([x, z], dim)
    _check([x, y], 1)
    _check([x, y.contiguous()], 1)      # formats differ: contiguous
    _check([x, torch.tensor([], device=DEVICE)], 1)   # the skipped tensor votes contiguous
    v = make((2, 3, 2, 4, 5)).to(memory_format=torch.channels_last_3d)
    _check([v, v], 1)


def test_out_variant():
    x, y = make((2, 3)), make((2, 4))
    want = torch.cat([x, y], 1)
    with gems.use_gems():
        out = torch.full((2, 7), float("nan"), device=DEVICE)
        with served("cat.out"):
            r = torch.cat([x, y], 1, out=out)
        assert r is out
        _same(out, want)
        wrong = torch.full((3,), float("nan"), device=DEVICE)
        with served("cat.out"), pytest.warns(UserWarning, match="resized"):
            torch.cat([x, y], 1, out=wrong)
        _same(wrong, want)
        fresh = torch.empty(0, device=DEVICE)
        with served("cat.out"):
            torch.cat([x, y], 1, out=fresh)
        _same(fresh, want)
        # a resized out takes the inputs' memory format, like ATen
        a = make((2, 3, 4, 5)).to(memory_format=torch.channels_last)
        o = torch.empty(0, device=DEVICE)
        with served("cat.out"):
            torch.cat([a, a], 1, out=o)
        _same(o, torch.cat([a, a], 1))
        # an out of the right shape keeps its strides (ATen writes through them)
        o = torch.full((2, 6, 4, 5), float("nan"), device=DEVICE)
        with served("cat.out"):
            torch.cat([a, a], 1, out=o)
        assert o.is_contiguous() and torch.equal(o.cpu(), torch.cat([a, a], 1).cpu())
        # out of a wider dtype: ATen casts, Gems leaves it to ATen (counted)
        o64 = torch.empty(2, 7, dtype=torch.float64, device=DEVICE)
        torch.cat([x, y], 1, out=o64)
        assert torch.equal(o64.cpu(), want.double().cpu())


def test_errors_like_aten():
    x = make((2, 3))
    with gems.use_gems():
        with pytest.raises(RuntimeError, match="zero-dimensional"):
            torch.cat([x, torch.tensor(1.0, device=DEVICE)])
        with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
            torch.cat([x, make((3, 3))], 1)
        with pytest.raises(RuntimeError, match="same number of dimensions"):
            torch.cat([x, make((3,))], 1)
        with pytest.raises(IndexError):
            torch.cat([x, x], 2)
        with pytest.raises(IndexError):
            torch.cat([x, x], -3)
        with pytest.raises(TypeError):
            torch.cat([x, x], out=torch.empty(4, 3, dtype=torch.int32, device=DEVICE))
        big = make((4, 3))
        with pytest.raises(RuntimeError, match="single memory location"):
            torch.cat([big[:2], x], out=big)


def test_fallbacks_are_counted():
    gems.reset_stats()
    c = torch.randn(2, 3, dtype=torch.complex64, device=DEVICE)
    with gems.use_gems():
        got = torch.cat([c, c])
    assert torch.equal(got, torch.cat([c, c]))
    st = gems.stats()["cat.default"]
    assert st["fallback"] == 1 and st["served"] == 0


@dtype_params()
def test_grad(dtype):
    # autograd splits the gradient with views: cat itself runs forward only
    fn = lambda a, b, c: torch.cat([a, b.t(), c], 1)  # noqa: E731
    check_grad(fn, [make((3, 2), dtype), make((4, 3), dtype), make((3, 5), dtype)], dtype=dtype, served_ops=["cat"])


def test_repeat_calls_run_a_plan():
    # the signature keys each list element (dtype, shape, strides, alignment), its length and aliasing:
    # repeat calls with new data replay the plan; another list of the same shapes gets its own answer
    B, H, S, D = 1, 2, 4, 8
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("cat.default", empty_info)
    for _ in range(3):
        past, new = make((B, H, S, D)), make((B, 1, H, D)).transpose(1, 2)
        _check([past, new], 2)
    info = gems.dispatch.plan_stats()["cat.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)
    # aliasing is part of the signature: [x, x] and [x, y] must not share a plan's argument mapping
    x = make((2, 3))
    for _ in range(2):
        _check([x, x], 1)
        _check([x, make((2, 3))], 1)
    plans = [p for p in gems.dispatch.op_runtime("cat.default").plans.plans.values() if callable(p)]
    # each plan also carries its recipe for the C++ fast path, which keys and substitutes list elements
    assert plans and all(p.__gems_recipe__ is not None for p in plans)


@pytest.mark.skipif(not ON_GPU, reason="bf16 is left to ATen by the interpreter backend")
def test_bf16_gpu():
    _check([make((3, 4), torch.bfloat16), make((3, 2), torch.bfloat16)], 1)
    _check([make((3, 4), torch.bfloat16), make((3, 2), torch.float32)], 1)


# ---- the uniform path: inputs of one dtype, shape and strides, one launch per cat_mod._MANY --------
S = cat_mod._MANY
CAT_KERNELS = ("cat_kernel", "cat2_kernel", "cat_uniform_kernel")


@pytest.mark.parametrize("n", [1, 3, S - 1, S, S + 1, 2 * S + 3])
def test_uniform_launches(n, monkeypatch):
    # slot k of each launch, the last slot, a second launch of one input, three launches
    xs = [make((2, 3)) for _ in range(n)]
    dim = n % 2
    counts = launch_counter(monkeypatch, CAT_KERNELS)
    _same(cat_mod.cat(xs, dim), torch.cat(xs, dim), f"n={n} dim={dim}")
    assert counts() == {"cat_uniform_kernel": -(-n // S)}, counts()


def test_uniform_launches_other_paths(monkeypatch):
    xs = [make((2, 3)) for _ in range(4)]
    counts = launch_counter(monkeypatch, CAT_KERNELS)
    _same(cat_mod.cat(xs[:2], 1), torch.cat(xs[:2], 1))
    assert counts() == {"cat2_kernel": 1}, counts()          # two: cat2_kernel, fewer arguments
    counts = launch_counter(monkeypatch, CAT_KERNELS)
    ys = xs + [xs[0].t().contiguous().t()]               # same shape, other strides: the general path
    _same(cat_mod.cat(ys, 0), torch.cat(ys, 0))
    assert counts() == {"cat_kernel": 2}, counts()


@pytest.mark.parametrize("dtype,n,dim", [(torch.int64, S + 1, 0), (torch.bool, 2 * S + 3, 1),
                                         (torch.float32, S - 1, -1), (torch.float16, S, 1),
                                         (torch.uint8, S + 1, -1)], ids=DT_IDS)
def test_uniform_many_inputs(dtype, n, dim):
    _check([_make((2, 3, 2), dtype) for _ in range(n)], dim)
    _check([_make((3,), dtype) for _ in range(5)], 0)


def test_uniform_strided_inputs():
    # transposed views, each its own tensor: one strides tuple for all
    _check([make((5, 3)).t() for _ in range(5)], 0)
    _check([make((5, 3)).t() for _ in range(5)], 1)
    # step-sliced rows of one tensor (two inner groups), many at unaligned addresses
    n = S + 2
    base = make((n, 2, 5))
    _check([base[i, :, 1::2] for i in range(n)], 1)
    _check([base[i, :, 1::2] for i in range(5)], 0)
    _check(list(make((3, 5 * 4)).chunk(4, 1)), 1)       # equal chunks: the cat of a split
    _check(list(make((3, 5 * 4)).chunk(4, 1)), 0)
    q = make((2, 5, 3, 4)).transpose(1, 2)               # [B, H, S, D] of a [B, S, H, D] projection
    _check([q[..., :2], q[..., 2:]] * 2, -1)
    _check([q] * 3, 2)
    _check([make((1, 6)).expand(4, 6) for _ in range(3)], 0)   # expanded: stride 0
    # the same shape, different strides: the general path
    _check([make((5, 3)).t() if i % 2 else make((3, 5)) for i in range(7)], 1)
    # mixed dtypes: the general path promotes
    _check([make((2, 3)) for _ in range(5)] + [make((2, 3), torch.float16)], 1)
    _check([make((2, 3), torch.int64) for _ in range(5)] + [make((2, 3), torch.bool)], 0)


def test_uniform_memory_format_and_int64_addressing(monkeypatch):
    cl = [make((2, 3, 4, 5)).to(memory_format=torch.channels_last) for _ in range(5)]
    for dim in range(4):
        _check(cl, dim)
    # int64 offsets (BIG) and the 16-byte alignment hint (ALIGN), at small sizes
    monkeypatch.setattr(cat_mod, "_INT64_FROM", 8)
    monkeypatch.setattr(cat_mod, "_ALIGN_FROM", 1)
    xs = [make((3, 4)) for _ in range(S + 1)]
    _same(cat_mod.cat(xs, 1), torch.cat(xs, 1))
    _same(cat_mod.cat(xs[:3], 0), torch.cat(xs[:3], 0))
    base = make((3, 5))
    xs = [base[i] for i in range(3)]                      # 20-byte steps: ALIGN off
    _same(cat_mod.cat(xs, 0), torch.cat(xs, 0))


def test_uniform_out_and_errors():
    xs = [make((2, 3)) for _ in range(S + 3)]
    want = torch.cat(xs, 1)
    with gems.use_gems():
        for out in (torch.full(tuple(want.shape), float("nan"), device=DEVICE), torch.empty(0, device=DEVICE)):
            with served("cat.out"):
                r = torch.cat(xs, 1, out=out)
            assert r is out
            _same(out, want)
        o = torch.full((2, 15), float("nan"), device=DEVICE)
        with served("cat.out"), pytest.warns(UserWarning, match="resized"):
            torch.cat(xs[:5], 0, out=o)
        _same(o, torch.cat(xs[:5], 0))
        o64 = torch.empty(0, dtype=torch.float64, device=DEVICE)
        torch.cat(xs[:5], 1, out=o64)                      # a wider out: ATen's (counted)
        assert torch.equal(o64.cpu(), torch.cat(xs[:5], 1).double().cpu())
        with pytest.raises(IndexError):
            torch.cat(xs[:5], 2)
        with pytest.raises(TypeError):
            torch.cat(xs[:5], out=torch.empty(0, dtype=torch.int32, device=DEVICE))
        big = make((8, 3))
        with pytest.raises(RuntimeError, match="single memory location"):
            torch.cat([big[:2]] * 4, out=big)
        with pytest.raises(RuntimeError, match="zero-dimensional"):
            torch.cat([torch.tensor(1.0, device=DEVICE)] * 3)
    e = torch.tensor([], device=DEVICE)
    _check([e] * 5 + [make((2, 3))], 1)                    # skipped 1-D empties, then another shape
    with gems.use_gems():
        _same(torch.cat([e] * 5, 3), torch.cat([e] * 5, 3))   # all skipped: [0], any dim


def test_uniform_repeat_calls_run_a_plan():
    # S + 1 inputs: two launches, the second with S - 1 slots repeating its first input
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("cat.default", empty_info)
    for _ in range(3):
        _check([make((3,), torch.int64) for _ in range(S + 1)], 0)
    info = gems.dispatch.plan_stats()["cat.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)
