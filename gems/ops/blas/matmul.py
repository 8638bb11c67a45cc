"""The GEMM launch behind mm / addmm / bmm (overloads.py): one tiled matmul kernel (kernels.py) with a batch
axis and a fused bias epilogue, its configs (tuned per bucket) and the TMA / Gluon kernels it may pick.

C[b] = alpha * (A[b] @ B[b]) + beta * bias        (bias broadcast to (M, N) by its strides)

Every operand is addressed through its own strides, so transposed inputs (`linear` = t + addmm, and
its backward `grad.t() @ x`) are read in place, never copied; a stride equal to 1 is specialized by
Triton, so the inner dimension of either layout is loaded with 16-byte vectors. Products accumulate
in fp32 for every dtype. fp32 inputs honor `torch.get_float32_matmul_precision()` like ATen:
'highest' (the default) multiplies in full fp32 ("ieee"), anything else allows TF32 tensor cores.

Program order is grouped ("swizzled"): GROUP_M row-tiles are swept for each column-tile, so the A
row-panels and B column-panels a wave of programs reads stay in L2. Launch configs are autotuned per
bucket (M, N, K rounded up to powers of two, dtype, precision, the layouts of A and B, batch, bias) and
cached on disk; the interpreter takes the first (small) config. ATen's own GEMM (cuBLAS) is timed as
one more candidate of each tuned bucket (docs/design.md, decision 12): where it beats every Triton config
(by 10 us, its extra host cost, when it takes under 50 us: _ATEN_HOST_MS), the bucket's calls run ATen (an
ATen plan per signature, replayed from C++), counted in `gems.stats()` as fallbacks "aten faster".
`GEMS_GEMM=triton` keeps Triton for every bucket. Skinny (decode, M <= 32) and small GEMMs are not
tuned and always run Triton.
"""
import os

import torch

from ...registry import Unsupported, all_impls
from ...runtime import backend
from ...runtime.autotune import Autotuner, bench_ms
from ...runtime.utils import cdiv, empty, next_pow2, sm_count, span
from . import gluon as gemm_gluon
from . import tma as gemm_tma
from .kernels import matmul_kernel, splitk_reduce_kernel

I32_MAX = 2**31 - 1


def _cfg(bm, bn, bk, warps, stages, group=8, split=1):
    c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": warps, "num_stages": stages}
    if split > 1:
        c["SPLIT_K"] = split
    return c


def _gluon(bm, bn, bk, warps, buffers, group=8, maxnreg=160, fill_k=False):
    """A config of the Gluon kernel: its pipeline depth is NUM_BUF ring slots (num_stages unused), and
    `maxnreg` caps registers per thread so that its warps plus the load warpgroup fit 64K registers.
    fill_k: split K into as many ranges as fill the SMs in one round (gemm_gluon.k_splits)."""
    return dict(_cfg(bm, bn, bk, warps, 1, group), NUM_BUF=buffers, maxnreg=maxnreg, GLUON=True,
                **({"FILL_K": True} if fill_k else {}))


# Search spaces per backend (kept here rather than in backends.py: the autotuner owns them).
# 16-bit inputs on Hopper: 128x256x64 / 8 warps is the classic wgmma-friendly tile (2 warpgroups, each
# 64x256); 3-4 stages of (128 + 256) x 64 x 2 B = 48 KiB fit in 228 KiB of shared memory. Smaller tiles
# win for skinny or small problems (more programs than SMs), and a K split where even those leave SMs
# idle (M = 256-577 with N <= 2048: BERT/CLIP-sized layers, weight gradients). The list is every config
# that was fastest for at least one of the models' 85 GEMM shapes in a sweep of 30 (H200).
_CONFIGS_16 = [
    _cfg(128, 256, 64, 8, 3),
    _cfg(128, 256, 64, 8, 4),
    _cfg(128, 256, 64, 8, 3, group=16),
    _cfg(256, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 5),
    _cfg(64, 128, 128, 4, 3),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4, split=2),
    _cfg(64, 128, 64, 4, 4, split=4),
    # the persistent TMA kernel (tma.py; Hopper, 16-bit, aligned layouts, large problems only):
    # the configs that beat the pointer kernel on the most model shapes in a sweep of 11. 128x256
    # takes 3 stages, unflattened: 4 stages (192 KiB) plus the 64 KiB epilogue tile, or the flattened
    # loop with a bias, exceed shared memory
    dict(_cfg(128, 256, 64, 8, 3), TMA=True, FLAT=False),
    dict(_cfg(128, 128, 64, 8, 5), TMA=True, FLAT=True),
    # the warp-specialized Gluon kernel (gluon.py: the same operands and gate as TMA, a bias row at
    # most): the configs that won a model shape of >= 2**33 multiply-adds in a sweep of 5 (H200);
    # NUM_BUF ring slots of (BM + BN) x 64 x 2 bytes plus the BM x BN output tile fit 227 KiB
    _gluon(128, 256, 64, 8, 3),
    _gluon(128, 256, 64, 8, 3, group=16),
    _gluon(128, 128, 64, 4, 5, maxnreg=224),
    # one warpgroup on 64 x 128 tiles: the mid-size winner (2**31-2**33 multiply-adds: weight gradients,
    # BERT/CLIP layers, 7 of the 85 shapes) of 5 candidates tried once Gluon calls were planned; 128x128
    # with 8 warps, 128x64, 64x256 and 128x128x128 won none (H200)
    _gluon(64, 128, 64, 4, 6, maxnreg=224),
]
# Gluon tiles 192 columns wide (gemm_gluon.matmul_gluon_wide_kernel: 128 + 64, two accumulators; 4 ring
# slots of (128 + 192) x 64 x 2 bytes plus the 128 x 192 output tile: 208 KiB). For the 768-wide outputs
# of BERT/CLIP (4096 x 768: 128 tiles, one round on 132 SMs, against 192 of 128 x 128) and 576-row shapes.
# In the tuned benchmark's 64 shapes of >= 2^30 multiply-adds (H200) the tuner chose them for 4,
# 3 of them 9-11% faster (576 x 4096 x 4096 1.36 -> 1.20x cuBLAS, 4096 x 768 x 768 1.19 -> 1.07, 4096 x
# 768 x 3072 1.20 -> 1.10); GEMM time per step fell 0-3% for every training and prefill source, decode moved
# within 1% (geomean 1.092 -> 1.079).
_GLUON_WIDE = [_gluon(128, 192, 64, 8, 4)]
# Tiles sized so that the mid-size shapes make about one round of programs on 132 SMs, as cuBLAS's kernels
# there do (H200, profiler names: 192x96 tiles for 576 x 4096 x 4096 (129 tiles, Gems 1.42x
# with 128x256's 80), 128x160 for 768 x 3072 x 4096 (120; Gems 1.18x), 128x152 for 577 x 4096 x 1024,
# 64x64 for 256 x 2048 x 4096 (128; Gems 1.70x), 96x128 for 512 x 3072 x 768): 128 x 160 (128 + 32) makes
# 130 tiles of 576 x 4096 and 120 of 768 x 3072; 128 x 96 (64 + 32) 128 of 512 x 3072; 64 x 64 with a
# deep ring 128 of 256 x 2048. Offered by default because on the same 64 shapes (H200, tuned from
# an empty cache, one run each) the geomean went 1.070 -> 1.054x cuBLAS and the GEMM time per step of every
# Llama-family training and prefill source fell 2-4% (llama2 train 1.063 -> 1.023), decode within 0.5%;
# the tuner chose a wave tile for 576 x 4096 x 4096 (1.44 -> 1.24), 577 x 1024 x 4096 (1.52 -> 1.19) and
# 768 x 3072 x 4096 (1.41 -> 1.18) among others (docs/perf.md)
_GLUON_WAVE = [_gluon(128, 160, 64, 8, 4), _gluon(128, 96, 64, 8, 6), _gluon(64, 64, 64, 4, 8, maxnreg=224)]
# Small tiles with deep rings for the mid-size GEMMs whose K is 4-16x their M or N (8-40 us; 1.2-1.6x cuBLAS
# without these tiles, the worst rows of the model table). cuBLAS runs them with 64x64 / 64x80 / 96x64 tiles and
# 8-13 stages in about one round of programs: 64 x 64 with 12 ring slots (192 KiB), 64 x 80 (64 + 16) with
# 10 (180 KiB), and 64 x 128 with two consumer warpgroups (8 warps, each a 64 x 64 half, as cuBLAS's
# cooperative kernels split a tile).
# Offered by default because on the GPU they match float64 for every layout
# (tests/ops/test_gemm_gluon.py), and on the 64 shapes of >= 2^30 multiply-adds (H200, each side tuned from
# an empty cache in one run) the geomean went 1.042 -> 1.015x cuBLAS; the tuner chose 64 x 64 x 12 slots
# for 256 x 2048 x 4096 (1.63 -> 1.07) and 512 x 768 x 3072 (1.60 -> 1.14), and BERT prefill's GEMM time
# per step fell 1.15 -> 0.99x (docs/perf.md)
_GLUON_DEEP = [_gluon(64, 64, 64, 4, 12, maxnreg=224), _gluon(64, 80, 64, 4, 10, maxnreg=224),
               _gluon(64, 128, 64, 8, 6)]
# Large tiles split over K for the same shapes (gemm_gluon.matmul_gluon_splitk_kernel; 128 x 128 makes 40
# tiles of 577 x 1024, split 3 ways: 120 programs): each operand is read from L2 as often as by an
# unsplit 128 x 128 tile, half as often as by 64 x 64 tiles. They only take calls that split
# (the tuner skips them elsewhere); the fp32 output tile takes the shared memory of one or two ring
# slots (128 x 128: 4 slots of 32 KiB and 64 KiB of output). Not offered: correct on the GPU
# (tests/ops/test_gemm_gluon.py), but slower on the device where it splits (H200, device time
# alone: 577 x 1024 x 4096 split 3 ways 1.42x cuBLAS against 1.28x unsplit; 512 x 768 x 3072 1.37-1.43x
# against 1.15x), and never chosen in an A/B on the 64 large model shapes. The fp32 partials' round trip
# costs more than the L2 reads it saves. Kept as a candidate group (benchmarks.gemm --candidates ...,ksplit)
# for GPUs and shapes where that balance differs
_GLUON_KSPLIT = [_gluon(128, 128, 64, 8, 4, fill_k=True), _gluon(64, 128, 64, 4, 6, maxnreg=224, fill_k=True)]
# the candidate groups beyond _CONFIGS_16 (16-bit inputs), each under its own tuning cache name, and the
# ones the tuner offers (benchmarks.gemm --candidates, $GEMS_GEMM_CANDIDATES: an A/B of them)
CANDIDATE_GROUPS = {"wide": _GLUON_WIDE, "wave": _GLUON_WAVE, "deep": _GLUON_DEEP, "ksplit": _GLUON_KSPLIT}
_GROUP_SUFFIX = {"wide": "w", "wave": "q", "deep": "d", "ksplit": "k"}
DEFAULT_CANDIDATES = ("wide", "wave", "deep")


def check_candidates(groups) -> tuple:
    """`groups` as CANDIDATES takes them (a tuple), or ValueError naming the unknown ones."""
    groups = tuple(groups)
    unknown = [g for g in groups if g not in CANDIDATE_GROUPS]
    if unknown:
        raise ValueError(f"unknown group(s) {unknown} of GEMM candidates; known: {', '.join(CANDIDATE_GROUPS)}")
    return groups


# read once, at import: the groups name the tuning cache, so a process keeps one set
CANDIDATES = (check_candidates(g for g in os.environ["GEMS_GEMM_CANDIDATES"].split(",") if g)
              if os.environ.get("GEMS_GEMM_CANDIDATES") else DEFAULT_CANDIDATES)
# fp32: twice the bytes per element, so BLOCK_K 32 keeps the same shared-memory footprint
_CONFIGS_32 = [
    _cfg(128, 256, 32, 8, 3),
    _cfg(128, 128, 32, 8, 4),
    _cfg(256, 128, 32, 8, 3),
    _cfg(128, 128, 32, 4, 4),
    _cfg(64, 128, 32, 4, 4),
    _cfg(128, 64, 32, 4, 4),
    _cfg(64, 64, 32, 4, 4),
]


def tile_configs(itemsize):
    """The search space's distinct plain tiles (no TMA or Gluon config, no K split): for other implicit
    GEMMs (convolution) that have one tiled kernel and read only the tile, warps and stages."""
    out = []
    for c in _CONFIGS_16 if itemsize <= 2 else _CONFIGS_32:
        if c.get("GLUON"):
            continue
        c = {k: v for k, v in c.items() if k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")}
        if c not in out:
            out.append(c)
    return out


# the interpreter runs each program in Python: small tiles keep the per-program numpy work small and the
# test shapes (tens of elements) need only a handful of programs
INTERP_CONFIG = _cfg(32, 32, 32, 4, 1, group=4)
# problems below this many multiply-adds take a fixed mid-size tile without tuning: their time is
# launch-bound, and a tuning run (compiling and timing every config) would cost more than it saves
_SMALL = {16: _cfg(64, 64, 64, 4, 3), 32: _cfg(64, 64, 32, 4, 3)}


# decode GEMMs up to this many rows take a fixed tile (_skinny), untuned
SKINNY_MAX_M = 32


def _skinny(M, N, K, itemsize, sms):
    """Decode GEMMs (M <= SKINNY_MAX_M, one batch): the weight stream is the whole cost, so a 16-row tile
    (32 rows for M = 17..32, batch-32 decode), deep K
    steps with 4 stages in flight, and N tiles narrow enough that every SM gets a program (4096 / 32 =
    128 on 132 SMs) but, for wide N (vocab projections), 128 wide. H200 sweep (bf16, M = 1 /
    4 / 16, time / cuBLAS's): N = 4096: 0.96 / 0.97 / 0.91 (16x32x256); N = 11008: 1.00 / 1.00 / 0.98
    and N = 32000: 0.98 / 0.98 / 0.98 (16x128x128, was 1.05 with 16x64x128). Where N gives at most a
    quarter as many tiles as SMs (GQA k/v projections, N <= 1024) K is split so that about one program
    runs per SM: M = 1, N x K = 512 x 4096 1.38 -> 1.02 (split 8), 256 x 5632 1.87 -> 1.13, 1024 x 4096
    1.32 -> 1.09 (split 5); at N = 2048 (64 tiles) a split of 3 lost (1.03 -> 1.17).
    Narrow N takes 6 stages (H200, kernel time with a cold L2 over 162 configs): 1 x 4096 x 4096
    14.8 -> 14.3 us, 1 x 4096 x 11008 32.8 -> 30.9, M = 4 15.2 -> 14.2, M = 16 15.8 -> 14.4 (cuBLAS 15.3-33.2); wide N is already the best config seen (1 x 32000 x 4096 69.9,
    cuBLAS 71.1). That is 57% of the 4.19 TB/s copy roof at 4096 x 4096 and 70-90% at the larger weights.
    M = 17..32 takes the same tiles 32 rows tall: a program still streams the same weight tile, and its
    activation tile (32 x BLOCK_K) is a quarter of the stage or less. The tuned tiles (64 rows and up)
    left half of each tile idle and, at N = 4096, made 32 programs for 132 SMs: Llama-2-7B batch-32
    decode read its weights at 46% of the copy roof (7.17 ms per step, H200); with these tiles 6.68 ms (the
    same tiles timed by the tuner, one of them split over K, made it 6.42 ms on another H200, whose
    transformers peer ran 8% faster too: within the machines' spread).
    Except wide N at M = 17..32: 32 x 128 tiles made 96 programs for the 132 SMs at N = 12288 (q/k/v
    packed) and 172 (1.3 waves) at 22016 (gate/up packed). There the operands swap (SWAP: C^T = W X^T)
    and the tile is 64 weight rows by 32 activation rows, Hopper's 64-row MMA filled by the weight:
    H200, bf16, M = 32, cold L2, us (cuBLAS): 12288 x 4096 37.7 -> 37.7 (38.4), 22016 x 4096 62.6 ->
    56.5 (56.6), 32000 x 4096 75.6 -> 75.5 (78.2). At N = 4096 the swapped tiles lost (17.8 -> 20.8,
    4096 x 11008 34.7 -> 38.0), as they did at M = 8."""
    wide = N >= 8192
    if wide and M > 16:
        return dict(_cfg(64, 32, 128 // (1 if itemsize <= 2 else 2), 4, 6), SWAP=True)
    bn = 128 if wide else 32
    bk = (128 if wide else 256) // (1 if itemsize <= 2 else 2)
    tiles = cdiv(N, bn)
    split = min(cdiv(sms, tiles), 8) if 4 * tiles <= sms else 1
    return _cfg(16 if M <= 16 else 32, bn, bk, 4, 4 if wide else 6, split=split)


TUNE_MIN_MACS = 2**27
# The TMA and Gluon kernels (persistent, one program per SM) are candidates from 2**30 multiply-adds
# (e.g. 512 x 1024 x 2048, ~3 us of device time on an H200): the Gluon kernel won shapes from 2**31 up
# (weight gradients of 2048-4096 x 256-2048) in the tuned benchmark, and below 2**30 the tuner would
# only time more configs. Their calls are planned like any launch (runtime/plan.py rebuilds the host
# descriptors per call, the C++ recipe encodes them once and puts in each call's addresses: 8-12 us of
# host per call, against cuBLAS's 19-22). Without plans they ran the Python path, 80-150 us
# of host per call, and the gate was 2**36.
_TMA_MIN_MACS = 2**30
# the split-K epilogue's tile: 32 rows x 128 contiguous fp32 columns (512-byte row segments)
_RED_M, _RED_N = 32, 128


def split_k(split, K, block_k, outputs):
    """(splits, K per split) for a config asking for `split`: K per split a multiple of BLOCK_K, every
    split non-empty; no split when K holds fewer than two BLOCK_K steps per split or the workspace
    (splits x outputs fp32) would need 64-bit offsets."""
    if split <= 1 or K < 2 * block_k or split * outputs > I32_MAX:
        return 1, K
    k_per = cdiv(cdiv(K, split), block_k) * block_k
    return cdiv(K, k_per), k_per


def small_config(macs, itemsize):
    """The fixed tile for a GEMM-shaped problem below TUNE_MIN_MACS multiply-adds on the GPU, else None
    (tune). Shared by mm/bmm and convolution's implicit GEMMs."""
    if backend().name == "interpreter" or macs >= TUNE_MIN_MACS:
        return None
    return _SMALL[16 if itemsize <= 2 else 32]

# ATen's own kernel (cuBLAS) as one more candidate of a tuned bucket (docs/design.md, decision 12): where it
# beats every Triton config, the bucket records {"aten": True} and its calls run ATen, counted as
# fallbacks with reason "aten faster". GEMS_GEMM=triton keeps Triton for every bucket (its own cache).
_ATEN = {"aten": True}
ATEN_FASTER = "aten faster"
# ATen's candidate is timed on the device, but a cuBLAS call also costs more host time than a Triton
# launch replayed from the C++ fast path, and a training step's mid-size GEMMs are host-bound: in
# BERT-base's backward (M = 4096, N, K = 768 / 3072, bf16; H100) cuBLAS took 27 us on the
# device and 31-83 us of host per call, Triton 33 us and 16 us; the step ran 1.13x ATen with Triton
# there and 0.90-0.96x with cuBLAS. So where ATen's device time is below _HOST_BOUND_MS (comparable
# to a call's host time) it must win by _ATEN_HOST_MS to be chosen; larger GEMMs, whose device time
# dwarfs any call's host cost (prefill, big training steps), go to cuBLAS wherever it is faster.
_ATEN_HOST_MS = 0.010
_HOST_BOUND_MS = 0.050


def _aten_time(device_ms, host_ms=_ATEN_HOST_MS):
    """ATen's candidate time in the tuner (or a K split's, with its `host_ms`): device time, plus the
    host handicap for small GEMMs."""
    return device_ms + (host_ms if device_ms < _HOST_BOUND_MS else 0.0)


# The Gluon K split's handicap in the tuner: one more launch and a workspace, both replayed from C++ by the
# call's plan. An estimate (half of cuBLAS's measured excess), not measured on its own; the pointer
# kernel's splits keep _ATEN_HOST_MS, under which the default search space was measured
_SPLIT_HOST_MS = 0.005


_POLICY = None


def _parse_policy(v) -> str:
    v = str(v).strip().lower() or "auto"
    if v not in ("auto", "triton"):
        raise ValueError(f"GEMS_GEMM={v!r}: expected 'auto' (ATen where measured faster) or 'triton'")
    return v


def gemm_policy() -> str:
    """'auto' (ATen where it was measured faster for a bucket) or 'triton': $GEMS_GEMM, read once
    (the decisions live in call plans); `set_gemm_policy` changes it at run time."""
    global _POLICY
    if _POLICY is None:
        _POLICY = _parse_policy(os.environ.get("GEMS_GEMM", "auto"))
    return _POLICY


def set_gemm_policy(policy: str):
    """Switch the GEMM policy ('auto' or 'triton') at run time: the GEMM overloads' plans, ATen
    decisions included, are dropped so every signature decides again under the new policy."""
    global _POLICY
    _POLICY = _parse_policy(policy)
    for impl in all_impls():
        if impl.category == "blas":
            impl.set_fn(impl.fn)


_TUNERS = {}


def _tuner(itemsize, triton_only=False):
    triton_only = triton_only or gemm_policy() == "triton"
    # separate tuning caches: a bucket tuned without the ATen candidate must not answer for 'auto'
    # ("-auto2": decisions since ATen's candidate carries _ATEN_HOST_MS; older caches decided without it)
    # ("v2": the search space with K splits; older caches chose from the previous one)
    # ("v3": with the Gluon kernel's configs)
    # ("v4": TMA and Gluon calls planned, offered from 2**33 multiply-adds without a host handicap)
    # (a letter per candidate group offered: "w" the Gluon wide tiles, "q" the one-round tiles, "d" the deep rings)
    key = (itemsize <= 2, triton_only, tuple(CANDIDATES))     # a call's full path: one lookup
    t = _TUNERS.get(key)
    if t is None:
        groups = sorted(check_candidates(CANDIDATES)) if itemsize <= 2 else []
        configs = ([INTERP_CONFIG] if backend().name == "interpreter"
                   else tuner_configs(itemsize, triton_only, groups))
        t = _TUNERS[key] = Autotuner(tuner_name(itemsize, triton_only, groups), configs)
    return t


def tuner_name(itemsize, triton_only, groups) -> str:
    """The name of the GEMM tuner (its cache and shipped files) for these operands and candidate groups."""
    return (("mm16v4" if itemsize <= 2 else "mm32v4") + "".join(_GROUP_SUFFIX[g] for g in groups)
            + ("" if triton_only else "-auto2"))


def tuner_configs(itemsize, triton_only, groups) -> list:
    """The configs that GEMM tuner times on a GPU: the tiles, the candidate groups' and cuBLAS (unless
    triton_only)."""
    extra = [c for g in groups for c in CANDIDATE_GROUPS[g]]
    return (_CONFIGS_16 + extra if itemsize <= 2 else _CONFIGS_32) + ([] if triton_only else [_ATEN])


def _aten_gemm(a, b, bias, alpha, beta, out):
    """ATen's GEMM for the same operands into `out` (timed against the Triton configs). Called inside
    Gems' kernel, so the nested call runs ATen's kernel (the dispatcher's re-entry guard)."""
    if a.dim() == 3:
        if bias is None:
            return torch.bmm(a, b, out=out) if alpha == 1 else torch.baddbmm(out, a, b, beta=0, alpha=alpha, out=out)
        return torch.baddbmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    return torch.addmm(out if bias is None else bias, a, b, beta=0 if bias is None else beta, alpha=alpha, out=out)


def _precision(dtype):
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    # 16-bit inputs multiply exactly on tensor cores; fp32 under 'highest' must not be rounded to tf32
    return "ieee" if dtype == torch.float32 else "tf32"


def _layout(s_row, s_col):
    return "r" if s_col == 1 else ("c" if s_row == 1 else "s")


def _s3(t):
    """(batch, row, col) strides of a 2-D or 3-D operand; a matrix repeats over the batch (stride 0)."""
    st = t.stride()
    return st if len(st) == 3 else (0,) + st


_LAST = [None]


def _picked(cfg):
    _LAST[0] = cfg
    return cfg


def last_config():
    """The launch config (or {"aten": True}) the last GEMM that ran blas's Python path chose: a
    diagnostic for benchmarks (a planned call replays its plan and does not update it)."""
    return _LAST[0]


def describe_config(cfg) -> str:
    """A short name of a GEMM config: 'tma 128x256x64 w8 s3', 'ptr 64x128x64 w4 s4 split2', 'cuBLAS'."""
    if not cfg:
        return ""
    if cfg.get("aten"):
        return "cuBLAS"
    if cfg.get("GLUON"):
        return (f"gluon {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} b{cfg['NUM_BUF']}"
                f" r{cfg['maxnreg']}" + (f" g{cfg['GROUP_M']}" if cfg["GROUP_M"] != 8 else "")
                + (" ksplit" if cfg.get("FILL_K") else ""))
    kind = "tma" if cfg.get("TMA") else "ptr"
    split = f" split{cfg['SPLIT_K']}" if cfg.get("SPLIT_K", 1) > 1 else ""
    return (f"{kind} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
            f"{split}")


def _alpha0_reads_product(a):
    """Whether ATen computes 0 * (A @ B) for alpha == 0 (NaN where the product has an inf or a NaN) rather
    than skipping A @ B: for fp16 / bf16 on the CPU (its own GEMM; on CUDA addmm leaves alpha == 0 in 16 bits
to ATen, whose answer depends on the cuBLAS kernel); in fp32
    the CPU BLAS and cuBLAS' sgemm skip it (cuBLASLt's bias epilogue does not: overloads.addmm passes
    alpha0_reads_product for it)."""
    return a.dtype in (torch.float16, torch.bfloat16)


def launch(a, b, c, bias, alpha, beta, config=None, triton_only=False, precision=None, alpha0_reads_product=None,
           first=False):
    """c[i] = alpha * a[i] @ b[i] + beta * bias[i]; 2-D (mm) or 3-D (bmm) operands, bias None or c's shape.

    Only strides go to the kernel: no views are made per call. `config` forces one launch config
    (tests check every config of the search space with it). `triton_only`: tune over the Triton
    configs alone (a GEMM inside another op, which has no ATen GEMM to hand the call to). `first`: the
    caller's promise that nothing its call writes has been written (the GEMM overloads, whose one write
    this is): c is written by the last kernel only (a K split's partials go to a workspace), so any of
    them still compiling may let ATen answer an in-place or out= call (runtime/background.py). Tuning
    runs its configs into scratch and promises nothing."""
    nb = a.shape[0] if a.dim() == 3 else 1
    M, K = a.shape[-2], a.shape[-1]
    N = b.shape[-1]
    if nb == 0 or M == 0 or N == 0:
        return c
    if alpha == 0 and not (_alpha0_reads_product(a) if alpha0_reads_product is None else alpha0_reads_product):
        K = 0  # the BLAS convention (ATen's CPU BLAS, cuBLAS' GEMM): alpha == 0 ignores A @ B, NaNs included
    has_bias = bias is not None and beta != 0
    if not has_bias:
        bias = c  # never read; any valid pointer keeps the argument list fixed
    i64 = max(span(a), span(b), span(c), span(bias)) > I32_MAX
    prec = precision or _precision(a.dtype)
    sa, sb, sc = _s3(a), _s3(b), _s3(c)
    sx = _s3(bias) if has_bias else (0, 0, 0)
    ab = (float(alpha), float(beta))
    s_ab = (*sa, *sb)

    def reduce_splits(ws, out, split, s_ws, s_wm, first, m=M, n=N, s_out=None, s_bias=sx):
        # the K splits' fp32 partials added in fixed order (deterministic) with alpha, the bias and the cast
        splitk_reduce_kernel[(cdiv(m, _RED_M) * cdiv(n, _RED_N), nb)](
            ws, out, bias, m, n, *ab, s_ws, s_wm, *(s_out or _s3(out)), *s_bias, has_bias, i64, split,
            _RED_M, _RED_N, num_warps=4, first=first)

    def run(cfg, out, first=False):
        if cfg.get("TMA") or cfg.get("GLUON"):
            lay = gemm_tma.layout(a, b, out, K, i64)
            if lay is None:
                raise ValueError("the TMA GEMM needs one 16-bit matrix product with 16-byte aligned, "
                                 "unit-stride operands and a row-major result")
            if cfg.get("TMA"):
                gemm_tma.launch(a, b, out, bias, alpha, beta, has_bias, lay, cfg, first)
                return
            if not gemm_gluon.supports(bias, has_bias):
                raise ValueError("the Gluon GEMM adds at most a bias row (stride 0 along M)")
            split, k_per, rows = (gemm_gluon.k_splits(M, N, K, cfg, sm_count(a.device)) if cfg.get("FILL_K")
                                  else (1, 0, M))
            if split == 1:
                gemm_gluon.launch(a, b, out, bias, alpha, beta, has_bias, lay, cfg, first)
                return
            # fp32 partials of `split` K ranges into a workspace whose rows are padded to 16 bytes (TMA)
            # and whose ranges to whole tiles, then the same reduce as the pointer kernel's splits
            cols = gemm_gluon.ws_cols(N)
            ws = empty((split, rows, cols), torch.float32, out.device)
            gemm_gluon.launch_splitk(a, b, ws, rows, lay, cfg, split, k_per, first)
            reduce_splits(ws, out, split, rows * cols, cols, first)
            return
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        if cfg.get("SWAP"):
            # C^T = B^T A^T by strides alone (no views): the kernel's M is N, its N the few rows of A
            x, y, m, n = b, a, N, M
            st_xy = (sb[0], sb[2], sb[1], sa[0], sa[2], sa[1])
            st_c, st_x = (sc[0], sc[2], sc[1]), (sx[0], sx[2], sx[1])
        else:
            x, y, m, n, st_xy, st_c, st_x = a, b, M, N, s_ab, sc, sx
        tiles = nb * cdiv(m, bm) * cdiv(n, bn)
        split, k_per = split_k(cfg.get("SPLIT_K", 1), K, bk, nb * M * N)
        if split == 1:
            matmul_kernel[(tiles, 1)](x, y, out, bias, m, n, K, K, *ab, *st_xy, 0, *st_c, *st_x, has_bias, prec,
                                      K % bk == 0, i64, 1, bm, bn, bk, cfg["GROUP_M"], num_warps=cfg["num_warps"],
                                      num_stages=cfg["num_stages"], first=first)
            return
        # K split over `split` programs per tile: raw fp32 partials into a workspace [split, nb, m, n],
        # then one small launch adds them
        ws = empty((split, nb, m, n), torch.float32, out.device)
        matmul_kernel[(tiles, split)](x, y, ws, bias, m, n, K, k_per, *ab, *st_xy, nb * M * N, M * N, n, 1, *st_x,
                                      has_bias, prec, K % bk == 0, i64, split, bm, bn, bk, cfg["GROUP_M"],
                                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], first=first)
        reduce_splits(ws, out, split, nb * M * N, n, first, m, n, st_c, st_x)

    if config is not None:
        run(config, c, first)
        return c
    tuner = _tuner(a.element_size(), triton_only)
    if backend().name != "interpreter" and M <= SKINNY_MAX_M and nb == 1:
        run(_picked(_skinny(M, N, K, a.element_size(), sm_count(a.device))), c, first)
        return c
    small = small_config(nb * M * N * K, a.element_size())
    if small is not None:
        run(_picked(small), c, first)
        return c
    # whether the TMA kernel can take the call is part of the bucket: its configs are candidates only
    # there (and a bucket that chose one serves only calls it can run)
    tma = nb * M * N * K >= _TMA_MIN_MACS and gemm_tma.tma_layout(a, b, c, K, i64) is not None
    # (and whether the Gluon configs can take its bias: a bucket that chose one serves only such calls)
    bucket = (next_pow2(M), next_pow2(N), next_pow2(max(K, 1)), str(a.dtype).split(".")[-1], prec,
              _layout(sa[1], sa[2]), _layout(sb[1], sb[2]), nb > 1, has_bias) + (
        (("tma",) if gemm_gluon.supports(bias, has_bias) else ("tma", "bias2d")) if tma else ())

    def bench(cfg):
        # time into scratch: `c` may alias the bias (addmm_), which repeated runs would accumulate into.
        # With c's strides (the launches above take them from c): empty_like would make a column slice's
        # scratch contiguous and smaller than what those strides address
        scratch = torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device=c.device)
        if cfg is _ATEN or cfg.get("aten"):
            if c.dtype != a.dtype:   # fp32 results of 16-bit inputs (out_dtype): no like-for-like ATen call
                raise RuntimeError("no ATen candidate")
            return _aten_time(bench_ms(lambda: _aten_gemm(a, b, bias if has_bias else None, alpha, beta, scratch)))
        if (cfg.get("TMA") or cfg.get("GLUON")) and not tma:
            raise RuntimeError("not a TMA call")
        if cfg.get("FILL_K"):
            split, host = gemm_gluon.k_splits(M, N, K, cfg, sm_count(a.device))[0], _SPLIT_HOST_MS
            if split == 1:      # unsplit, it is another config's tile: not timed twice
                raise RuntimeError("no K split for this call")
        else:
            split, host = split_k(cfg.get("SPLIT_K", 1), K, cfg["BLOCK_K"], nb * M * N)[0], _ATEN_HOST_MS
        ms = bench_ms(lambda: run(cfg, scratch))
        # a K split adds a launch (and a workspace): like ATen's candidate it must win by that host
        # cost where the GEMM is short enough for host time to matter
        return _aten_time(ms, host) if split > 1 else ms

    cfg = _picked(tuner.pick(bucket, bench))
    if cfg.get("aten"):
        # before anything is written; the decision holds for every call of this signature
        raise Unsupported(ATEN_FASTER, signature=True)
    run(cfg, c, first)
    return c
