"""The persistent TMA GEMM (gems/ops/blas/tma.py), launched directly with small tiles: on CPU through the
interpreter (fp16), on a Hopper GPU for real. Tiles are 32 x 32 x 32 so that M, N and K below leave
partial tiles (zero-filled loads, clipped stores) and programs loop over several tiles."""
import pytest
import torch

from gems.ops.blas import matmul as blas
from gems.ops.blas import tma as gemm_tma
from harness import DEVICE, ON_GPU, assert_close, check_planned_gemm, make

CFG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2, TMA=True, FLAT=True)
DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
M, N, K = 72, 56, 88        # leading strides of 16-bit rows stay 16-byte aligned; every dim has a tail


def _operand(rows, cols, transposed, dtype, pad=0):
    """A rows x cols matrix, row-major or the transpose of a row-major one, optionally a column slice
    of a wider buffer (leading stride larger than the row)."""
    if transposed:
        return make((cols, rows + pad), dtype)[:, :rows].t()
    return make((rows, cols + pad), dtype)[:, :cols]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lay", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("flat", [True, False])
def test_layouts_bias_alpha_beta(dtype, lay, flat):
    a = _operand(M, K, lay[0] == "T", dtype, pad=8)
    b = _operand(K, N, lay[1] == "T", dtype)
    bias = make((N,), dtype).expand(M, N)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    layouts = gemm_tma.layout(a, b, out, K, False)
    assert layouts is not None
    gemm_tma.launch(a, b, out, bias, 0.5, 2.0, True, layouts, dict(CFG, FLAT=flat))
    ref = 0.5 * (a.double() @ b.double()) + 2.0 * bias.double()
    assert_close(out, ref.cpu(), dtype, atol=1e-2, msg=lay)
    # no bias, through blas.launch's config path (its layout check included)
    out2 = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    blas.launch(a, b, out2, None, 1.0, 0.0, config=dict(CFG, FLAT=flat))
    assert_close(out2, (a.double() @ b.double()).cpu(), dtype, atol=1e-2, msg=lay + " no bias")


def test_in_place_bias_is_read_before_written():
    a, b = make((M, K), torch.float16), make((K, N), torch.float16)
    c = make((M, N), torch.float16)
    ref = (c.double() + a.double() @ b.double()).cpu()
    blas.launch(a, b, c, c, 1.0, 1.0, config=CFG)
    assert_close(c, ref, torch.float16, atol=1e-2)


def test_layouts_it_refuses():
    h = torch.float16
    a, b, c = make((M, K), h), make((K, N), h), make((M, N), h)
    assert gemm_tma.layout(a, b, c, K, False) is not None
    assert gemm_tma.layout(a.float(), b.float(), c.float(), K, False) is None          # fp32
    assert gemm_tma.layout(a, b, c, 0, False) is None                                  # alpha == 0 / K == 0
    assert gemm_tma.layout(a, b, c, K, True) is None                                   # 64-bit offsets
    odd = make((M, K + 3), h)[:, :K]                      # leading stride 91 x 2 bytes: not 16-byte aligned
    assert gemm_tma.layout(odd, b, c, K, False) is None
    assert gemm_tma.layout(make((M, 2 * K), h)[:, ::2], b, c, K, False) is None        # no unit stride
    assert gemm_tma.layout(a, b, make((N, M), h).t(), K, False) is None                # column-major result
    assert gemm_tma.layout(a, b, c.to(torch.float32), K, False) is None                # fp32 result
    shifted = make((M * K + 8,), h)[1:1 + M * K].view(M, K)                            # base off by 2 bytes
    assert gemm_tma.layout(shifted, b, c, K, False) is None
    with pytest.raises(ValueError, match="TMA GEMM needs"):
        blas.launch(odd, b, c, None, 1.0, 0.0, config=CFG)
    # a call the tuner sees: TMA configs are candidates only on a Hopper GPU
    if not ON_GPU:
        assert gemm_tma.tma_layout(a, b, c, K, False) is None


def test_repeat_calls_replay_a_plan(monkeypatch):
    # 80 x 56 x 88: a signature no other test plans (the forced config must not serve other tests)
    check_planned_gemm(monkeypatch, CFG, gemm_tma, (80, 56, 88), torch.float16, atol=1e-2)
