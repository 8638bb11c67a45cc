import os
import pytest
import torch
import torch.nn.functional as F

import gems
from gems.ops.blas import matmul as blas
from harness import DEVICE, DTYPES, ON_GPU, assert_close, check_grad, dtype_params, layouts, make, served, while_compiling
from harness import check_op as _check_op


def check_op(fn, args, kwargs=None, *, dtype, **kw):
    # an fp32 dot of K products of size up to 9 carries rounding of a few ulps of the partial sums
    # (~1e-5), not of the possibly cancelled result: the harness' fp32 atol (1e-5) is too tight near
    # zero. A missing or wrong product is off by >= 1e-3 (inputs are never near zero), far above 1e-4.
    if dtype == torch.float32 and "atol" not in kw:
        kw["atol"] = 1e-4
    return _check_op(fn, args, kwargs, dtype=dtype, **kw)

# (M, K, N): odd sizes, K both a multiple of the interpreter's BLOCK_K (32) and not, a matrix-vector
# shape, and one (M = 6 tile rows > GROUP_M) that exercises the grouped program order
SHAPES = [(33, 29, 47), (5, 64, 3), (1, 7, 1), (170, 16, 40)]


@dtype_params()
@pytest.mark.parametrize("mkn", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mm(mkn, dtype):
    M, K, N = mkn
    check_op(torch.mm, (make((M, K), dtype), make((K, N), dtype)), dtype=dtype, served_ops=["mm"])


@dtype_params()
def test_mm_layouts(dtype):
    # every combination of operand layouts is read in place through strides (no copies)
    for na, a in layouts((19, 37), dtype):
        for nb, b in layouts((37, 22), dtype):
            check_op(torch.mm, (a, b), dtype=dtype, served_ops=["mm"])


@dtype_params()
@pytest.mark.parametrize("bias_shape", [(40,), (33, 40), (1, 40), (33, 1), ()], ids=str)
def test_addmm_bias_broadcast(bias_shape, dtype):
    a, b = make((33, 29), dtype), make((29, 40), dtype)
    bias = make(bias_shape, dtype)
    check_op(torch.addmm, (bias, a, b), dtype=dtype, served_ops=["addmm"])
    check_op(torch.addmm, (bias, a, b), {"beta": 0.5, "alpha": -2}, dtype=dtype, served_ops=["addmm"])
    check_op(torch.addmm, (bias, a.t().contiguous().t(), b), {"beta": 2}, dtype=dtype, served_ops=["addmm"])


def test_addmm_beta_zero_ignores_nan_and_alpha_zero():
    a, b = make((9, 13)), make((13, 6))
    bias = torch.full((9, 6), float("nan"), device=DEVICE)
    with served("addmm"), gems.use_gems():
        out = torch.addmm(bias, a, b, beta=0)
    assert not out.isnan().any()
    assert_close(out, (a.double() @ b.double()).cpu(), torch.float32)
    # alpha == 0: the result is beta * bias, whatever A @ B holds; compare with ATen on this device
    bias = make((9, 6))
    a[0, 0] = float("nan")
    with served("addmm"), gems.use_gems():
        out = torch.addmm(bias, a, b, beta=3, alpha=0)
    ref = torch.addmm(bias, a, b, beta=3, alpha=0)
    torch.testing.assert_close(out, ref, equal_nan=True)
    # integer-valued Scalars arrive as Python ints
    check_op(torch.addmm, (make((6,)), make((9, 13)), b), {"beta": 2, "alpha": 3}, dtype=torch.float32,
             served_ops=["addmm"])


@dtype_params()
def test_addmm_alpha_zero_with_inf_and_nan_like_aten(dtype):
    # alpha == 0 with an inf / NaN in A or B: in fp32 ATen's CPU BLAS and cuBLAS' sgemm skip A @ B; its
    # CPU fp16 / bf16 GEMM and cuBLASLt's bias epilogue (1-D bias, beta 1) compute 0 * (A @ B) (NaN on
    # those rows and columns); Gems follows the dtype and path. 16-bit on CUDA: which cuBLAS kernel runs
    # decides, so ATen answers (a counted fallback)
    a, b = make((9, 13), dtype), make((13, 6), dtype)
    a[1, 4], a[5, 0], b[7, 2] = float("inf"), float("nan"), -float("inf")
    to_aten = DEVICE != "cpu" and dtype != torch.float32
    for bias, beta in ((make((9, 6), dtype), 3), (make((6,), dtype), 1), (make((9, 6), dtype), 0)):
        gems.reset_stats()
        with served("addmm", at_least=0 if to_aten else 1), gems.use_gems():
            got = torch.addmm(bias, a, b, beta=beta, alpha=0)
        want = torch.addmm(bias, a, b, beta=beta, alpha=0)
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))
        if to_aten:
            assert "alpha == 0 with 16-bit operands on CUDA" in gems.stats()["addmm.default"]["reasons"]
        elif dtype != torch.float32 or (DEVICE != "cpu" and beta == 1):
            assert want.isnan().any()   # the cases this test is about


def test_gemm_overflow_follows_the_sum_not_the_blas():
    # docs/known-differences.md, the GEMM row: alpha * (A @ B) with alpha scaling the fp32 sum, as cuBLAS
    # does; ATen's CPU BLAS scales B by alpha first (-1.5 * 3e38 = -inf there). Gems: the float64 answer
    a, b = make((3, 5)), make((5, 4))
    a[0] = torch.tensor([0.5, 0.25, -1.0, 0.125, 0.0])
    a[1:, 0] = 0.125
    b[0, 2] = 3e38
    bias = make((3, 4))
    with served("addmm"), gems.use_gems():
        got = torch.addmm(bias, a, b, beta=2, alpha=-1.5)
    ref = torch.addmm(bias.double(), a.double(), b.double(), beta=2, alpha=-1.5)
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    assert_close(got, ref.cpu(), torch.float32)
    # an infinity beside an overflowing product: both NaN-or-inf by the order; the rest exact
    a[1] = torch.tensor([float("inf"), 1.0, 0.5, 3e38, 1.0])
    b[3, :] = torch.tensor([-2.0, 2.0, 1.0, -1.0])
    with served("mm"), gems.use_gems():
        got = torch.mm(a, b)
    want = torch.mm(a, b)
    assert not torch.isfinite(got[1]).any() and not torch.isfinite(want[1]).any()
    assert_close(got[[0, 2]], (a.double() @ b.double())[[0, 2]].cpu(), torch.float32)


@dtype_params()
def test_linear_forward_backward(dtype):
    # linear = t + addmm (with bias) / mm (without): W is read transposed in place; backward runs mm twice
    x, w, bias = make((11, 24), dtype), make((17, 24), dtype), make((17,), dtype)
    check_op(F.linear, (x, w, bias), dtype=dtype, served_ops=["addmm"])
    check_op(F.linear, (make((2, 5, 24), dtype), w), dtype=dtype, served_ops=["mm"])
    check_grad(F.linear, [x, w, bias], dtype=dtype, served_ops=["addmm", "mm"])
    check_grad(lambda x, y: torch.mm(x, y), [make((12, 9), dtype), make((9, 14), dtype)], dtype=dtype,
               served_ops=["mm"])


@dtype_params()
def test_bmm(dtype):
    check_op(torch.bmm, (make((3, 33, 29), dtype), make((3, 29, 47), dtype)), dtype=dtype, served_ops=["bmm"])
    # transposed / step-sliced / batch-broadcast (stride 0) operands, read through their strides
    for na, a in layouts((4, 9, 21), dtype):
        for nb, b in layouts((4, 21, 6), dtype):
            check_op(torch.bmm, (a, b), dtype=dtype, served_ops=["bmm"])
    check_op(torch.bmm, (make((2, 21, 4), dtype).permute(2, 0, 1).transpose(0, 1), make((2, 21, 6), dtype)),
             dtype=dtype, served_ops=["bmm"])
    check_grad(torch.bmm, [make((2, 7, 5), dtype), make((2, 5, 8), dtype)], dtype=dtype, served_ops=["bmm"])
    # matmul on batched operands lands on bmm
    check_op(torch.matmul, (make((2, 3, 5, 6), dtype), make((2, 3, 6, 4), dtype)), dtype=dtype, served_ops=["bmm"])


def test_out_variants():
    a, b, bias = make((7, 10)), make((10, 5)), make((5,))
    ref = (a.double() @ b.double()).cpu()
    with gems.use_gems():
        out = torch.full((7, 5), float("nan"), device=DEVICE)
        with served("mm.out"):
            r = torch.mm(a, b, out=out)
        assert r is out
        assert_close(out, ref, torch.float32)
        wrong = torch.full((3,), float("nan"), device=DEVICE)
        with served("mm.out"), pytest.warns(UserWarning, match="resized"):
            torch.mm(a, b, out=wrong)
        assert_close(wrong, ref, torch.float32)
        out = torch.full((7, 5), float("nan"), device=DEVICE)
        with served("addmm.out"):
            torch.addmm(bias, a, b, beta=2, alpha=0.5, out=out)
        assert_close(out, (2 * bias.double() + 0.5 * (a.double() @ b.double())).cpu(), torch.float32)
        ba, bb = make((3, 4, 6)), make((3, 6, 2))
        out = torch.full((3, 4, 2), float("nan"), device=DEVICE)
        with served("bmm.out"):
            torch.bmm(ba, bb, out=out)
        assert_close(out, torch.bmm(ba.double(), bb.double()).cpu(), torch.float32)


def test_addmm_inplace():
    a, b = make((8, 12)), make((12, 6))
    for name, c in layouts((8, 6))[:3]:  # contiguous, transposed, step-sliced (expanded is rejected below)
        c0 = c.detach().clone()
        with served("addmm_"), gems.use_gems():
            r = c.addmm_(a, b, beta=0.5, alpha=2)
        assert r.data_ptr() == c.data_ptr()
        assert_close(c, (0.5 * c0.double() + 2 * (a.double() @ b.double())).cpu(), torch.float32, msg=name)
    with gems.use_gems():
        with pytest.raises(RuntimeError):
            make((1, 6)).expand(8, 6).addmm_(a, b)     # overlapping output
        with pytest.raises(RuntimeError):
            make((6,)).addmm_(a, b)                     # in-place result cannot broadcast


def test_empty_and_k_zero():
    with gems.use_gems():
        assert torch.mm(make((0, 5)), make((5, 3))).shape == (0, 3)
        assert torch.mm(make((4, 5)), make((5, 0))).shape == (4, 0)
        assert torch.bmm(make((0, 2, 3)), make((0, 3, 4))).shape == (0, 2, 4)
        with served("mm"):
            z = torch.mm(make((4, 0)), make((0, 3)))
        assert torch.equal(z.cpu(), torch.zeros(4, 3))
        bias = make((3,))
        with served("addmm"):
            z = torch.addmm(bias, make((4, 0)), make((0, 3)), beta=2)
        assert_close(z, (2 * bias.double()).expand(4, 3).cpu(), torch.float32)
        with served("bmm"):
            z = torch.bmm(make((2, 3, 0)), make((2, 0, 5)))
        assert torch.equal(z.cpu(), torch.zeros(2, 3, 5))


def test_errors():
    x = make((3, 4))
    with gems.use_gems():
        with pytest.raises(RuntimeError):
            torch.mm(x, make((5, 6)))
        with pytest.raises(RuntimeError):
            torch.mm(x, make((4, 6), torch.float16))
        with pytest.raises(RuntimeError):
            torch.mm(x, make((4,)))
        with pytest.raises(RuntimeError):
            torch.addmm(make((5,)), x, make((4, 6)))    # bias does not broadcast to (3, 6)
        with pytest.raises(RuntimeError):
            torch.bmm(make((2, 3, 4)), make((3, 4, 5)))  # batch mismatch
        with pytest.raises(RuntimeError):
            torch.bmm(make((2, 3, 4)), make((2, 5, 5)))
        with pytest.raises(RuntimeError):
            torch.bmm(x, x.t())


def test_fallbacks_are_counted_and_right():
    gems.reset_stats()
    a, b = make((5, 6), torch.float64), make((6, 4), torch.float64)
    with gems.use_gems():
        out = torch.mm(a, b)
    torch.testing.assert_close(out, a @ b)
    st = gems.stats()["mm.default"]
    assert st["fallback"] == 1 and st["served"] == 0 and "dtype torch.float64" in st["reasons"]
    # an addmm bias of another dtype is left to ATen (which decides whether it is legal)
    bias32, a16, b16 = make((4,)), make((5, 6), torch.float16), make((6, 4), torch.float16)
    with gems.use_gems():
        try:
            r = torch.addmm(bias32, a16, b16)
        except RuntimeError:
            r = None
    assert gems.stats()["addmm.default"]["fallback"] == 1
    if r is not None:
        assert r.dtype == torch.addmm(bias32, a16, b16).dtype


def test_fp32_precision_setting():
    a, b = make((20, 40)), make((40, 12))
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")   # TF32 allowed: ~1e-3 relative
        check_op(torch.mm, (a, b), dtype=torch.float32, served_ops=["mm"], rtol=2e-3, atol=2e-2)
        torch.set_float32_matmul_precision("highest")
        check_op(torch.mm, (a, b), dtype=torch.float32, served_ops=["mm"])
    finally:
        torch.set_float32_matmul_precision(old)
    assert blas._precision(torch.float32) == ("ieee" if old == "highest" else "tf32")


def test_int64_offsets_path(monkeypatch):
    # the >= 2**31-element path cannot be allocated in CI; force it to check the 64-bit offset code
    monkeypatch.setattr(blas, "I32_MAX", 8)
    check_op(torch.addmm, (make((9,)), make((13, 7)).t(), make((13, 9))), dtype=torch.float32,
             served_ops=["addmm"])
    check_op(torch.bmm, (make((2, 5, 7)), make((2, 7, 3))), dtype=torch.float32, served_ops=["bmm"])


@dtype_params()
def test_split_k(dtype):
    # K split over programs (fp32 partials in a workspace, then the epilogue launch): every split size,
    # K not a multiple of the tile (the tail lands in the last split only), bias/alpha/beta in the
    # epilogue, transposed and batched operands, an fp32 result of 16-bit inputs, and a result that
    # is its own bias (addmm_): the epilogue reads each bias element before writing it
    k = 32 * 5 + 7
    atol = 1e-4 if dtype == torch.float32 else None   # fp32: rounding of K-term partial sums (check_op)
    a, b, bias = make((37, k), dtype), make((45, k), dtype).t(), make((45,), dtype)
    ref = (0.5 * bias.double() + 2.0 * (a.double() @ b.double())).cpu()
    for split in (2, 3, 4, 8):
        cfg = dict(blas.INTERP_CONFIG, SPLIT_K=split)
        assert blas.split_k(split, k, cfg["BLOCK_K"], 37 * 45)[0] > 1
        out = torch.full((37, 45), float("nan"), dtype=dtype, device=DEVICE)
        blas.launch(a, b, out, bias.expand(37, 45), 2.0, 0.5, config=cfg)
        assert_close(out, ref, dtype, atol=atol, msg=f"split {split}")
    cfg = dict(blas.INTERP_CONFIG, SPLIT_K=3)
    ba, bb = make((3, 9, k), dtype), make((3, k, 11), dtype).transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty((3, 9, 11), dtype=dtype, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    blas.launch(ba, bb, out, None, 1.0, 0.0, config=cfg)
    assert_close(out, torch.bmm(ba.double(), bb.double()).cpu(), dtype, atol=atol, msg="bmm split")
    c = make((37, 45), dtype)
    ref = (c.double() + a.double() @ b.double()).cpu()
    blas.launch(a, b, c, c, 1.0, 1.0, config=cfg)
    assert_close(c, ref, dtype, atol=atol, msg="in place")
    if dtype != torch.float32:
        out = torch.empty((37, 45), dtype=torch.float32, device=DEVICE)
        blas.launch(a, b, out, None, 1.0, 0.0, config=cfg)
        assert_close(out, (a.double() @ b.double()).cpu(), torch.float32, rtol=1e-5, atol=1e-4)
    # no split: K under two tiles per split, or a workspace past 32-bit offsets
    assert blas.split_k(4, 40, 32, 100) == (1, 40)
    assert blas.split_k(4, 4096, 32, 2**30) == (1, 4096)
    assert blas.split_k(4, 4096, 256, 100) == (4, 1024)
    assert blas.split_k(3, 1000, 64, 100) == (3, 384)


@pytest.mark.skipif(not ON_GPU, reason="ATen implements the out_dtype overloads on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_out_dtype_fp32(dtype):
    a, b = make((33, 29), dtype), make((29, 47), dtype)
    with served("mm.dtype"), gems.use_gems():
        out = torch.ops.aten.mm.dtype(a, b, torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, (a.double() @ b.double()).cpu(), torch.float32, rtol=1e-5, atol=1e-4)
    ba, bb = make((2, 9, 8), dtype), make((2, 8, 5), dtype)
    with served("bmm.dtype"), gems.use_gems():
        out = torch.ops.aten.bmm.dtype(ba, bb, torch.float32)
    assert_close(out, torch.bmm(ba.double(), bb.double()).cpu(), torch.float32, rtol=1e-5, atol=1e-4)
    bias = make((47,), torch.float32)
    with served("addmm.dtype"), gems.use_gems():
        out = torch.ops.aten.addmm.dtype(bias, a, b, torch.float32)
    assert_close(out, (bias.double() + a.double() @ b.double()).cpu(), torch.float32, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="ATen implements the out_dtype overloads on CUDA only")
def test_out_dtype_out_of_another_shape_like_aten():
    # ATen's .dtype_out overloads write into out= as given, without resizing it (an empty bmm leaves
    # a (0,) out as it is; mm raises for a 1-D out): such calls go to ATen, whatever it does with them
    a, b, ba, bb = make((0, 16)), make((16, 0)), make((16, 0, 2)), make((16, 2, 33))
    calls = {"mm": lambda o: torch.ops.aten.mm.dtype_out(a.half(), b.half(), torch.float16, out=o),
             "bmm": lambda o: torch.ops.aten.bmm.dtype_out(ba.half(), bb.half(), torch.float16, out=o),
             "addmm": lambda o: torch.ops.aten.addmm.dtype_out(make((3,), torch.float16), make((2, 4), torch.float16),
                                                                make((4, 3), torch.float16), torch.float16, out=o)}
    for name, call in calls.items():
        outcome = []
        for on in (False, True):
            o = torch.empty(0, dtype=torch.float16, device=DEVICE)
            try:
                if on:
                    with gems.use_gems():
                        call(o)
                else:
                    call(o)
                outcome.append(tuple(o.shape))
            except RuntimeError as e:
                outcome.append(str(e).splitlines()[0])
        assert outcome[0] == outcome[1], (name, outcome)


_CONFIG_PARTS = 3   # each dtype's configs in parts, which the suite's workers run side by side (compiles dominate)


@pytest.mark.skipif(not ON_GPU, reason="the tuned search space runs on the GPU only")
@pytest.mark.parametrize("part", range(_CONFIG_PARTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_every_tuned_config(dtype, part):
    # the autotuner may pick any config of the search space: each must be right, not only one winner;
    # odd M/N/K exercise the masks, the transposed B the strided path of linear layers
    a, b, bias = make((300, 200), dtype), make((777, 200), dtype).t(), make((777,), dtype)
    aten = torch.addmm(bias, a, b)
    configs = blas._CONFIGS_16 if dtype != torch.float32 else blas._CONFIGS_32
    skinny = [blas._skinny(m, n, 200, a.element_size(), sms) for m in (16, 32) for n in (777, 9000, 40)
              for sms in (132, 8)]
    every = configs + list(blas._SMALL.values()) + skinny
    assert len(every) >= _CONFIG_PARTS
    for cfg in every[part::_CONFIG_PARTS]:
        # a column slice of a wider buffer: a row-major result with a 16-byte aligned leading stride,
        # which the TMA configs need (777 x 2 bytes is not)
        out = torch.full((300, 784), float("nan"), dtype=dtype, device=DEVICE)[:, :777]
        blas.launch(a, b, out, bias.expand(300, 777), 1.0, 1.0, config=cfg)
        _check_gemm(out, a, b, bias, aten, msg=str(cfg))
    if part:
        return
    # decode shapes (M = 1..32, the skinny tiles of 16 and 32 rows), K not a multiple of the tile, transposed
    # weight
    for m in (1, 5, 16, 17, 32):
        x, w = make((m, 1000), dtype), make((9000, 1000), dtype)
        with served("mm"), gems.use_gems():
            out = torch.nn.functional.linear(x, w)
        _check_gemm(out, x, w.t(), None, torch.nn.functional.linear(x, w), msg=f"linear M={m}")
    # and the tuned path end to end (above the tuning threshold), Triton's kernel even where the tuning
    # would find cuBLAS faster (the 'auto' policy's ATen candidate is tested in test_aten_plan.py)
    x, w = make((512, 520), dtype), make((520, 640), dtype)
    before = blas.gemm_policy()
    try:
        blas.set_gemm_policy("triton")
        with served("mm"), gems.use_gems():
            out = torch.mm(x, w)
    finally:
        blas.set_gemm_policy(before)
    _check_gemm(out, x, w, None, torch.mm(x, w), msg="mm 512x520x640")


def _check_gemm(out, a, b, bias, aten, msg):
    """bias + a @ b against float64. fp32: within the deterministic bound of a K-term fp32 sum,
    (K + 1) 2^-24 (|bias| + |a| @ |b|): any summation order (tile shape, split) lands inside it, TF32
    rounding (2^-11 per product) does not. 16-bit: the harness's tolerance and 2x-ATen rule."""
    a64, b64 = a.double().cpu(), b.double().cpu()
    ref = a64 @ b64 + (bias.double().cpu() if bias is not None else 0)
    if out.dtype != torch.float32:
        assert_close(out, ref, out.dtype, aten, msg=msg)
        return
    mag = a64.abs() @ b64.abs() + (bias.double().cpu().abs() if bias is not None else 0)
    gamma = (a.shape[-1] + 1) * 2.0 ** -24 * mag
    err = (out.double().cpu() - ref).abs()
    assert not out.isnan().any() and (err <= gamma).all(), f"{msg}: worst {(err / gamma).max():.2f}x the bound"


def test_config_names_and_last_choice():
    assert blas.describe_config(blas._cfg(64, 128, 64, 4, 4, split=2)) == "ptr 64x128x64 w4 s4 split2"
    assert blas.describe_config(dict(blas._cfg(128, 256, 64, 8, 3), TMA=True, FLAT=False)) == "tma 128x256x64 w8 s3"
    assert blas.describe_config({"aten": True}) == "cuBLAS" and blas.describe_config(None) == ""
    x, w = make((9, 7)), make((7, 5))
    out = torch.empty(9, 5, device=DEVICE)
    blas.launch(x, w, out, None, 1.0, 0.0)     # the path a first call takes: a config is chosen
    assert blas.last_config() is not None and not blas.last_config().get("aten")


def test_tile_configs_for_other_gemms():
    # convolution's implicit GEMMs tune over the distinct tiles of the search space: the TMA and K-split
    # entries would time duplicates of plain tiles there, the Gluon ones tiles of another pipeline
    keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
    for itemsize, space in ((2, blas._CONFIGS_16), (4, blas._CONFIGS_32)):
        tiles = blas.tile_configs(itemsize)
        assert all(set(c) == keys for c in tiles)
        assert len({tuple(sorted(c.items())) for c in tiles}) == len(tiles)
        plain = [c for c in space if not c.get("GLUON")]     # (another kernel, whose tiles mean ring slots)
        assert {tuple(sorted((k, c[k]) for k in keys)) for c in plain} == {tuple(sorted(c.items())) for c in tiles}


@dtype_params()
def test_skinny_tiles(dtype):
    # the decode tiles (blas._skinny: 16 rows up to M = 16, 32 up to 32; narrow N, wide N (swapped operands
    # at M > 16), a K split where N leaves SMs idle) are chosen without tuning; each must compute what the
    # tuned tiles do (transposed B, a bias, alpha and beta, K off the tile). The GPU reaches them through the dispatcher too
    # (test_every_tuned_config); the interpreter only when asked for, as here
    k = 300
    for m, n, sms in ((5, 70, 132), (27, 70, 132), (27, 9000, 132), (32, 70, 8)):
        a, b, bias = make((m, k), dtype), make((n, k), dtype).t(), make((n,), dtype)
        ref = (0.5 * bias.double() + 2.0 * (a.double() @ b.double())).cpu()
        cfg = blas._skinny(m, n, k, a.element_size(), sms)
        # wide N at M > 16 swaps the operands: the tile's 64 rows are the weight's
        swapped = m > 16 and n >= 8192
        assert cfg.get("SWAP", False) == swapped
        assert cfg["BLOCK_M"] == (64 if swapped else 16 if m <= 16 else 32)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        blas.launch(a, b, out, bias.expand(m, n), 2.0, 0.5, config=cfg)
        aten = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)   # 16-bit: within twice ATen's own error
        assert_close(out, ref, dtype, aten, atol=1e-4 if dtype == torch.float32 else None, msg=str(cfg))
    # swapped operands with a K split: the workspace and its reduce in the swapped orientation
    a, b, bias = make((19, k), dtype), make((90, k), dtype).t(), make((90,), dtype)
    cfg = dict(blas._cfg(64, 32, 64, 4, 2, split=3), SWAP=True)
    out = torch.full((19, 90), float("nan"), dtype=dtype, device=DEVICE)
    blas.launch(a, b, out, bias.expand(19, 90), 2.0, 0.5, config=cfg)
    ref = (0.5 * bias.double() + 2.0 * (a.double() @ b.double())).cpu()
    aten = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    assert_close(out, ref, dtype, aten, atol=1e-4 if dtype == torch.float32 else None, msg=str(cfg))


def test_gemm_candidates_come_from_the_environment():
    import subprocess
    import sys
    code = "from gems.ops.blas import matmul; print(','.join(matmul.CANDIDATES))"
    env = dict(os.environ, GEMS_GEMM_CANDIDATES="wide,ksplit")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "wide,ksplit", p.stderr[-500:]
    p = subprocess.run([sys.executable, "-c", code], env=dict(env, GEMS_GEMM_CANDIDATES="tall"), capture_output=True,
                       text=True)
    assert p.returncode != 0 and "unknown group(s) ['tall']" in p.stderr


def test_an_out_or_in_place_gemm_whose_kernel_is_compiling_is_answered_by_aten():
    # with background compilation a GEMM overload's launch is its call's one write (a K split's partials
    # go to a workspace first): while a GEMM kernel compiles ATen answers out= and in-place calls too (the
    # fused linear cross-entropy's mm into its chunk buffers), with results equal to ATen's own; a GEMM
    # launched directly inside another writing op promises nothing and compiles
    r = while_compiling(["matmul_kernel", "splitk_reduce_kernel", "matmul_tma_kernel", "matmul_gluon_kernel",
                         "matmul_gluon_wide_kernel", "matmul_gluon_splitk_kernel"], """
        from gems.ops.blas import matmul
        torch.manual_seed(0)
        a, b, bias = torch.randn(33, 40, device=dev), torch.randn(40, 24, device=dev), torch.randn(24, device=dev)
        ba, bb = torch.randn(3, 33, 40, device=dev), torch.randn(3, 40, 24, device=dev)
        c0 = torch.randn(33, 24, device=dev)
        def calls():
            o, ob, oa, c = torch.empty(33, 24, device=dev), torch.empty(3, 33, 24, device=dev), \\
                torch.empty(33, 24, device=dev), c0.clone()
            torch.mm(a, b, out=o)
            torch.bmm(ba, bb, out=ob)
            torch.addmm(bias, a, b, beta=0.5, out=oa)
            c.addmm_(a, b, alpha=2)
            return o, ob, oa, c
        want = calls()
        with gems.use_gems():
            got = calls()
        n = len(asked)
        prev = background.set_deferring(background.WRITES)
        try:
            d = torch.empty(33, 24, device=dev)
            matmul.launch(a, b, d, None, 1.0, 0.0)
        finally:
            background.set_deferring(prev)
        report(ok=all(torch.equal(g, w) for g, w in zip(got, want)), n=n,
               direct_ok=bool(torch.allclose(d, a @ b, rtol=1e-4, atol=1e-4)))
    """)
    assert r["ok"], r
    served_launches, direct = r["asked"][:r["n"]], r["asked"][r["n"]:]
    assert served_launches and all(first and deferring for _, first, deferring in served_launches), r
    compiling = {k for k, v in r["aten"].items() if "kernel not compiled yet" in v}
    assert {"mm.out", "bmm.out", "addmm.out", "addmm_.default"} <= compiling, r["aten"]
    assert direct and all(not first and not deferring for _, first, deferring in direct) and r["direct_ok"], r
