"""The Gluon GEMM (gems/ops/blas/gluon.py) on a Hopper GPU: every config of the search space, small
shapes whose M, N and K leave partial tiles (zero-filled loads, clipped stores), programs that loop over
several tiles, the four operand layouts, a bias row with alpha/beta. Gluon has no interpreter, so on
CPU only the refusals run here (tests/core/test_gpu_compile.py compiles every config for sm_90)."""
import pytest
import torch

from gems.ops.blas import gluon as gemm_gluon
from gems.ops.blas import matmul as blas
from gems.ops.blas import tma as gemm_tma
from harness import DEVICE, ON_GPU, assert_close, check_planned_gemm, make

CONFIGS = [c for c in blas._CONFIGS_16 + [c for g in blas.CANDIDATE_GROUPS.values() for c in g] if c.get("GLUON")]
hopper = pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9,
                            reason="Gluon kernels run on a Hopper GPU only (no interpreter)")


def _operand(rows, cols, transposed, dtype):
    if transposed:
        return make((cols, rows), dtype).t()
    return make((rows, cols), dtype)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lay", ["NN", "NT", "TN", "TT"])
def test_every_config_layouts_bias(dtype, lay):
    # 328 x 1000 x 520: 3 x 4 tiles of 128 x 256 with tails in M, N and K; with more tiles than
    # programs in a 64-SM grid below, each program takes several tiles (the ring's counters and
    # phases carry across tiles)
    M, N, K = 328, 1000, 520
    a, b = _operand(M, K, lay[0] == "T", dtype), _operand(K, N, lay[1] == "T", dtype)
    bias = make((N,), dtype).expand(M, N)
    ref_bias = (0.5 * (a.double() @ b.double()) + 2.0 * bias.double()).cpu()
    ref = (a.double() @ b.double()).cpu()
    for cfg in CONFIGS:
        out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
        blas.launch(a, b, out, bias, 0.5, 2.0, config=cfg)
        assert_close(out, ref_bias, dtype, atol=2e-2, msg=f"{lay} {blas.describe_config(cfg)} bias")
        out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
        blas.launch(a, b, out, None, 1.0, 0.0, config=cfg)
        assert_close(out, ref, dtype, atol=2e-2, msg=f"{lay} {blas.describe_config(cfg)}")


@hopper
def test_many_tiles_per_program_and_short_k(monkeypatch):
    # 4 programs over 40 tiles, and K shorter than the ring's prologue (one 64-wide step with a tail)
    monkeypatch.setattr(gemm_gluon, "sm_count", lambda device: 4)
    for (M, N, K) in [(1000, 1280, 264), (520, 640, 40)]:
        a, b = make((M, K), torch.bfloat16), make((N, K), torch.bfloat16).t()
        for cfg in CONFIGS:
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            blas.launch(a, b, out, None, 1.0, 0.0, config=cfg)
            assert_close(out, (a.double() @ b.double()).cpu(), torch.bfloat16, atol=2e-2,
                         msg=f"{M}x{N}x{K} {blas.describe_config(cfg)}")


def test_what_it_refuses():
    h = torch.float16
    M, N, K = 64, 48, 32
    a, b, c = make((M, K), h), make((K, N), h), make((M, N), h)
    assert gemm_gluon.supports(None, False)
    assert gemm_gluon.supports(make((N,), h).expand(M, N), True)          # a bias row
    assert not gemm_gluon.supports(make((M, N), h), True)                 # a full bias matrix (addmm_)
    assert gemm_gluon.supports(make((M, N), h), False)                    # beta == 0: no bias read
    assert gemm_tma.layout(a, b, c, K, False) is not None                  # the operands themselves are fine
    with pytest.raises(ValueError, match="bias row"):
        blas.launch(a, b, c, make((M, N), h), 1.0, 1.0, config=CONFIGS[0])
    odd = make((M, K + 3), h)[:, :K]                  # leading stride not 16-byte aligned: no descriptor
    with pytest.raises(ValueError, match="TMA GEMM needs"):
        blas.launch(odd, b, c, None, 1.0, 0.0, config=CONFIGS[0])
    assert blas.describe_config(blas._gluon(128, 256, 64, 8, 3)) == "gluon 128x256x64 w8 b3 r160"
    assert blas.describe_config(blas._gluon(128, 256, 64, 8, 3, group=16)) == "gluon 128x256x64 w8 b3 r160 g16"


@hopper
@pytest.mark.parametrize("programs", [None, 4], ids=["one round", "4 programs"])
@pytest.mark.parametrize("lay", ["NT", "TN"])
def test_k_split_partials_and_reduce(monkeypatch, lay, programs):
    # the K-split configs (fp32 partials of K ranges into a padded workspace, then blas's reduce with alpha
    # and the bias row): K with a tail, tails in M, and an output that is a column slice of odd width, so
    # the workspace's rows are padded past N (16-byte TMA rows); with 4 programs each one walks several
    # (tile, K range) items, the ring's counters and phases carrying across them
    if programs:
        monkeypatch.setattr(gemm_gluon, "sm_count", lambda device: programs)
    M, N, K = 312, 998, 1000                       # M % 8 == 0: A stored transposed (TN) has 16-byte rows
    a = _operand(M, K, lay[0] == "T", torch.bfloat16)
    # B row-major (TN) is a column slice too: a TMA descriptor needs 16-byte rows, which N = 998 lacks
    b = _operand(K, N, True, torch.bfloat16) if lay[1] == "T" else make((K, 1008), torch.bfloat16)[:, :N]
    bias = make((N,), torch.bfloat16).expand(M, N)
    ref = (0.5 * (a.double() @ b.double()) + 2.0 * bias.double()).cpu()
    for cfg in blas._GLUON_KSPLIT:
        splits, per, rows = gemm_gluon.k_splits(M, N, K, cfg, blas.sm_count(a.device))
        assert splits > 1 and rows % cfg["BLOCK_M"] == 0 and gemm_gluon.ws_cols(N) == 1000
        out = torch.full((M, 1008), float("nan"), dtype=torch.bfloat16, device=DEVICE)[:, :N]
        blas.launch(a, b, out, bias, 0.5, 2.0, config=cfg)
        assert_close(out, ref, torch.bfloat16, atol=2e-2, msg=f"{lay} {blas.describe_config(cfg)} split {splits}")


@hopper
@pytest.mark.parametrize("cfg", blas._GLUON_KSPLIT, ids=blas.describe_config)
def test_k_split_calls_replay_a_plan(monkeypatch, cfg):
    # the split's plan: a workspace allocated per call, the partials' launch with three descriptors (A, B
    # and the workspace's, rebuilt over each call's workspace) and the reduce, replayed by the C++ fast path
    shape = (300 + 8 * blas._GLUON_KSPLIT.index(cfg), 1024, 1000)
    assert gemm_gluon.k_splits(*shape, cfg, blas.sm_count(torch.device(DEVICE)))[0] > 1
    check_planned_gemm(monkeypatch, cfg, gemm_gluon, shape, torch.bfloat16, atol=2e-2, entry="launch_splitk",
                       descriptors=3)


def test_k_splits_fill_one_round_without_empty_ranges():
    # pure arithmetic (runs on CPU too): the split count fills the SMs in one round, every range has at
    # least two K steps and none is empty, and calls whose tiles fill half the SMs do not split
    big = blas._GLUON_KSPLIT[0]                                  # 128 x 128 x 64
    assert gemm_gluon.k_splits(577, 1024, 4096, big, 132) == (3, 22, 640)      # 40 tiles: 120 programs
    assert gemm_gluon.k_splits(256, 2048, 4096, big, 132) == (4, 16, 256)      # 32 tiles: 128
    assert gemm_gluon.k_splits(4096, 4096, 4096, big, 132) == (1, 64, 4096)    # 1024 tiles: no split
    assert gemm_gluon.k_splits(577, 1024, 100, big, 132) == (1, 2, 577)        # two K steps: no split
    assert gemm_gluon.ws_cols(998) == 1000 and gemm_gluon.ws_cols(1024) == 1024
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        M, N, K = (int(x) for x in torch.randint(1, 3000, (3,), generator=gen))
        for cfg in blas._GLUON_KSPLIT:
            splits, per, rows = gemm_gluon.k_splits(M, N, K, cfg, 132)
            steps = -(-K // cfg["BLOCK_K"])
            tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
            if splits == 1:
                assert per == steps and rows == M
                continue
            assert 2 <= splits <= gemm_gluon.MAX_SPLITS and tiles * splits <= 132 and per >= 2
            assert (splits - 1) * per < steps <= splits * per, (M, N, K)         # the last range is not empty
            assert rows >= M and rows % cfg["BLOCK_M"] == 0
    assert blas.describe_config(big) == "gluon 128x128x64 w8 b4 r160 ksplit"


def test_configs_fit_the_register_file():
    # the load warp is scheduled as a warpgroup: (num_warps + 4) x 32 threads at `maxnreg` registers each
    # must fit the SM's 64K, or the launch fails (out of resources: threads) on the GPU only
    for cfg in CONFIGS:
        assert (cfg["num_warps"] + 4) * 32 * cfg["maxnreg"] <= 65536, cfg
        assert cfg["maxnreg"] % 8 == 0 and cfg["maxnreg"] >= 128, cfg


def test_descriptors_match_the_validated_ones():
    # per-call descriptors skip the dataclass's checks (gemm_tma.layout made them once): same fields
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    for dtype, gdtype in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        t = make((64, 136), dtype)[:, :128]
        d = gemm_gluon._desc(t, [64, 128], 136, [64, 32])
        ref = TensorDescriptor(t, [64, 128], [136, 1], [64, 32], gl.NVMMASharedLayout.get_default_for([64, 32], gdtype))
        for f in ("shape", "strides", "block_shape", "layout", "padding"):
            assert getattr(d, f) == getattr(ref, f), f
        assert d.base is ref.base and type(d) is TensorDescriptor


@hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=blas.describe_config)
def test_repeat_calls_replay_a_plan(monkeypatch, cfg):
    # a launch with a register cap and three descriptors (five: the wide tiles), replayed by the C++ fast
    # path; the shape is one no other test plans, per config (the forced config must not serve other calls)
    shape = (264 + 8 * CONFIGS.index(cfg), 392, 136)
    check_planned_gemm(monkeypatch, cfg, gemm_gluon, shape, torch.bfloat16, atol=2e-2)
