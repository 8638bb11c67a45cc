"""convolution / convolution_backward for 2-D, groups=1, non-transposed convolutions: implicit GEMMs.

Forward, Y[n, o, oh, ow] = bias[o] + sum_{c, kh, kw} X[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw] * W[o, c, kh, kw],
is a GEMM with M = N*OH*OW rows (n, oh, ow), N_gemm = O columns and K = C*KH*KW (c, kh, kw). The A tile is
gathered straight from X: its addresses come from (n, oh, ow) and (c, kh, kw), and taps that fall in the
padding are masked to 0, so no im2col buffer is written (im2col would move N*OH*OW*K elements twice more
than the GEMM itself reads). K is one flat axis (not a loop over (kh, kw) with C inside) so a 3-channel
image (CLIP's patch embedding: C = 3, K = 3*14*14 = 588) fills whole BLOCK_K steps instead of 3 of 16.
Its order is (c, kh, kw) for NCHW inputs (kw is then the contiguous axis) and (kh, kw, c) for channels-last
(c contiguous), picked per call. Bias is added in the epilogue; the result is stored through its strides
in the memory format ATen returns (channels-last when the input or the weight suggests it).
Cost: 2*M*O*K flops; bytes ~ (X once per O-tile column) + W once per M-tile row + Y once.

Backward (convolution_backward), the same three tensors:
* grad_weight[o, (c, kh, kw)] = sum_m grad_out[o, m] * A[m, (c, kh, kw)]: a GEMM [O, M] x [M, K] whose B
  tile is the forward's gathered A tile; fp32 accumulation. M (the batch and all output positions) is
  long and O x K small, so M is split over programs when the O x K tiles would not fill the GPU; each split
  writes an fp32 partial [SPLIT, O, K] that reduction.py's sum kernels add (fixed order, no atomics).
* grad_input[n, c, ih, iw] = sum_{o, kh, kw} grad_out[n, o, (ih + ph - kh*dh)/sh, (iw + pw - kw*dw)/sw] * W[o, c, kh, kw]
  over the taps where the division is exact and in range: a transposed convolution. Rows are grouped
  by stride phase (ih % sh, iw % sw): inside a phase, whether a tap (kh, kw) divides exactly is one scalar
  test, so a whole tile skips the taps that do not map back instead of masking (and multiplying) them;
  the work is the exact 2*N*H*W*C*O*KH*KW/(sh*sw) flops, not sh*sw times that.
* grad_bias = grad_out summed over (N, OH, OW), by reduction.py.

fp32 follows ATen's convolution rule, `torch.backends.cudnn.allow_tf32` (default True, unlike matmul's):
TF32 tensor cores when it is set, full fp32 ("ieee") otherwise; it is part of every call plan's key.
Not served (ATen runs them, counted): 1-D/3-D, groups > 1, transposed, inputs on several devices, C == 0.
"""
import torch
import triton
import triton.language as tl
from torch._prims_common import suggest_memory_format

from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.autotune import Autotuner, bench_ms
from ...runtime.utils import cdiv, empty, next_pow2, span
from ..reduce import reduction
from ..shape import copy
from . import matmul as blas


@triton.jit
def _grouped_tile(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M tile-rows per column sweep (L2 reuse, as in blas)."""
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _split_k(rk, C, KH, KW, C_INNER: tl.constexpr):
    """Flat reduction index -> (c, kh, kw): order (kh, kw, c) for channels-last, (c, kh, kw) otherwise."""
    if C_INNER:
        c = rk % C
        r = rk // C
        kh = r // KW
        kw = r % KW
    else:
        kw = rk % KW
        r = rk // KW
        kh = r % KH
        c = r // KH
    return c, kh, kw


@triton.jit
def _gather_x(X, n, oh, ow, c, kh, kw, mask, H, W, sxn, sxc, sxh, sxw, st_h, st_w, pad_h, pad_w, dil_h, dil_w):
    """X[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw] for row vectors (n, oh, ow) x column vectors
    (c, kh, kw); taps in the padding read 0."""
    ih = oh[:, None] * st_h - pad_h + kh[None, :] * dil_h
    iw = ow[:, None] * st_w - pad_w + kw[None, :] * dil_w
    ok = mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    ptrs = X + n[:, None] * sxn + c[None, :] * sxc + ih * sxh + iw * sxw
    return tl.load(ptrs, mask=ok, other=0.0)


@kernel
@triton.jit
def conv2d_fwd_kernel(X, Wt, Bias, Y, C, H, W, O, OH, OW, KH, KW, M, K,
                      sxn, sxc, sxh, sxw, swo, swc, swh, sww, syn, syo, syh, syw,
                      st_h, st_w, pad_h, pad_w, dil_h, dil_w,
                      HAS_BIAS: tl.constexpr, C_INNER: tl.constexpr, PRECISION: tl.constexpr, I64: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Y[n, o, oh, ow] = Bias[o] + sum_{k=(c,kh,kw)} X[n, c, oh*sh-ph+kh*dh, ow*sw-pw+kw*dw] * W[o, c, kh, kw]
    (implicit GEMM, rows m = (n, oh, ow), fp32 accumulation)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(O, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    if I64:  # X or Y spans >= 2**31 elements: every derived offset in 64 bits
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
        rk0 = rk0.to(tl.int64)
    mask_m = rm < M
    mask_n = rn < O
    ow = rm % OW
    oh = (rm // OW) % OH
    n = rm // (OW * OH)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        mask_k = rk < K
        c, kh, kw = _split_k(rk, C, KH, KW, C_INNER)
        a = _gather_x(X, n, oh, ow, c, kh, kw, mask_m[:, None] & mask_k[None, :], H, W, sxn, sxc, sxh, sxw,
                      st_h, st_w, pad_h, pad_w, dil_h, dil_w)
        b = tl.load(Wt + rn[None, :] * swo + c[:, None] * swc + kh[:, None] * swh + kw[:, None] * sww,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + (n * syn + oh * syh + ow * syw)[:, None] + rn[None, :] * syo
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@kernel
@triton.jit
def conv2d_grad_weight_kernel(G, X, GW, C, H, W, O, OH, OW, KH, KW, M, K, m_per_split,
                              sgn, sgo, sgh, sgw, sxn, sxc, sxh, sxw, swo, swc, swh, sww,
                              st_h, st_w, pad_h, pad_w, dil_h, dil_w,
                              PARTIAL: tl.constexpr, C_INNER: tl.constexpr, PRECISION: tl.constexpr, I64: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """GW[o, k=(c,kh,kw)] = sum_{m=(n,oh,ow) in this split} G[n, o, oh, ow] * X[n, c, oh*sh-ph+kh*dh, ow*sw-pw+kw*dw].

    Tile rows are o (BLOCK_M), columns k (BLOCK_N), the loop runs over m (BLOCK_K). PARTIAL: write fp32
    into the workspace GW[split, o, k] (contiguous, k in _split_k's order) instead of the weight's strides."""
    pid_o, pid_k = _grouped_tile(tl.program_id(0), tl.cdiv(O, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    ro = pid_o * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)
    rm0 = tl.arange(0, BLOCK_K)
    if I64:
        ro = ro.to(tl.int64)
        rk = rk.to(tl.int64)
        rm0 = rm0.to(tl.int64)
    mask_o = ro < O
    mask_k = rk < K
    c, kh, kw = _split_k(rk, C, KH, KW, C_INNER)
    m_lo = split * m_per_split
    m_hi = tl.minimum(m_lo + m_per_split, M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_K):
        rm = m0 + rm0
        mask_m = rm < m_hi
        ow = rm % OW
        oh = (rm // OW) % OH
        n = rm // (OW * OH)
        g = tl.load(G + ro[:, None] * sgo + (n * sgn + oh * sgh + ow * sgw)[None, :],
                    mask=mask_o[:, None] & mask_m[None, :], other=0.0)
        x = _gather_x(X, n, oh, ow, c, kh, kw, mask_m[:, None] & mask_k[None, :], H, W, sxn, sxc, sxh, sxw,
                      st_h, st_w, pad_h, pad_w, dil_h, dil_w)
        acc = tl.dot(g, x, acc, input_precision=PRECISION)
    mask = mask_o[:, None] & mask_k[None, :]
    if PARTIAL:
        ws = GW + split.to(tl.int64) * O * K + ro[:, None] * K + rk[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        ptrs = GW + ro[:, None] * swo + (c * swc + kh * swh + kw * sww)[None, :]
        tl.store(ptrs, acc.to(GW.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def conv2d_grad_input_kernel(G, Wt, GI, C, H, W, O, OH, OW, KH, KW, Hq, Wq, Mq,
                             sgn, sgo, sgh, sgw, swo, swc, swh, sww, sin, sic, sih, siw,
                             st_h, st_w, pad_h, pad_w, dil_h, dil_w,
                             PRECISION: tl.constexpr, I64: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """GI[n, c, ih, iw] = sum_{o, kh, kw} G[n, o, (ih+ph-kh*dh)/sh, (iw+pw-kw*dw)/sw] * W[o, c, kh, kw]
    over the exact, in-range quotients (a transposed convolution).

    Axis 1 is the stride phase (ih % sh, iw % sw); rows m = (n, i, j) of a phase are ih = phase_h + i*sh,
    iw = phase_w + j*sw. Within a phase, ih + ph - kh*dh = (phase_h + ph - kh*dh) + i*sh divides exactly by
    sh for every row or for none, so each tap is one scalar test. Every element is written (0 where no
    tap reaches it): no zero-fill pass."""
    pid_m, pid_c = _grouped_tile(tl.program_id(0), tl.cdiv(Mq, BLOCK_M), tl.cdiv(C, BLOCK_N), GROUP_M)
    phase = tl.program_id(1)
    phase_h = phase // st_w
    phase_w = phase % st_w
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rc = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    ro0 = tl.arange(0, BLOCK_K)
    if I64:
        rm = rm.to(tl.int64)
        rc = rc.to(tl.int64)
        ro0 = ro0.to(tl.int64)
    j = rm % Wq
    i = (rm // Wq) % Hq
    n = rm // (Wq * Hq)
    ih = phase_h + i * st_h
    iw = phase_w + j * st_w
    mask_m = (rm < Mq) & (ih < H) & (iw < W)
    mask_c = rc < C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kh in range(0, KH):
        th = phase_h + pad_h - kh * dil_h
        if th % st_h == 0:
            oh = i + th // st_h
            ok_h = mask_m & (oh >= 0) & (oh < OH)
            for kw in range(0, KW):
                tw = phase_w + pad_w - kw * dil_w
                if tw % st_w == 0:
                    ow = j + tw // st_w
                    ok = ok_h & (ow >= 0) & (ow < OW)
                    g_row = n * sgn + oh * sgh + ow * sgw
                    for o0 in range(0, O, BLOCK_K):
                        ro = o0 + ro0
                        mask_o = ro < O
                        g = tl.load(G + g_row[:, None] + ro[None, :] * sgo, mask=ok[:, None] & mask_o[None, :],
                                    other=0.0)
                        w = tl.load(Wt + ro[:, None] * swo + rc[None, :] * swc + kh * swh + kw * sww,
                                    mask=mask_o[:, None] & mask_c[None, :], other=0.0)
                        acc = tl.dot(g, w, acc, input_precision=PRECISION)
    ptrs = GI + (n * sin + ih * sih + iw * siw)[:, None] + rc[None, :] * sic
    tl.store(ptrs, acc.to(GI.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


def _tf32_key():
    return torch.backends.cudnn.allow_tf32


def _precision(dtype):
    # ATen's convolutions read cudnn.allow_tf32 (matmul's setting does not apply to them); 16-bit
    # inputs multiply exactly on tensor cores either way
    if dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
        return "ieee"
    return "tf32"


_TUNERS = {}


def _pick(name, bucket, itemsize, run, macs):
    """Launch config for one of the three GEMMs: the interpreter's small tile; blas's fixed mid-size
    tile below `blas.TUNE_MIN_MACS` multiply-adds (launch-bound: compiling and timing nine configs
    would cost seconds to save microseconds); else blas's search space (16-bit and fp32 lists)
    autotuned per bucket. `run(cfg)` launches into scratch for timing.
    On the GPU the shapes worth tuning first are Llava's patch embedding (M = 576 rows per image,
    N = 1024, K = 588: BLOCK_K 32/64 both leave a K tail) and its grad_weight (M long, O x K small)."""
    if backend().name == "interpreter":
        return blas.INTERP_CONFIG
    small = blas.small_config(macs, itemsize)
    if small is not None:
        return small
    key = name + ("16" if itemsize <= 2 else "32")
    t = _TUNERS.get(key)
    if t is None:
        t = _TUNERS[key] = Autotuner("conv-" + key, blas.tile_configs(itemsize))
    return t.pick(bucket, lambda cfg: bench_ms(lambda: run(cfg)))


def _pair(v, name):
    v = list(v)
    if len(v) == 1:
        v = v * 2
    if len(v) != 2:
        raise RuntimeError(f"expected {name} to be a single integer value or a list of 2 values to match the "
                           f"convolution dimensions, but got {name}={v}")
    return v


def _params(x, weight, stride, padding, dilation, transposed, output_padding, groups):
    """Checks shared by forward and backward; returns (C, H, W, O, KH, KW, OH, OW, strides, pads, dils,
    channels_last). Combinations the kernels do not cover raise Unsupported; invalid ones RuntimeError."""
    if x.dim() != 4 or weight.dim() != 4:
        raise Unsupported("not a 2-D convolution")
    if transposed:
        raise Unsupported("transposed convolution")
    if groups != 1:
        raise Unsupported("groups > 1")
    if weight.device != x.device:
        raise Unsupported("weight on another device")
    if weight.dtype != x.dtype:
        raise Unsupported("weight dtype differs from the input")  # ATen raises its own message
    st, pad, dil = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    if any(s <= 0 for s in st):
        raise RuntimeError("non-positive stride is not supported")
    if any(p < 0 for p in pad):
        raise RuntimeError("negative padding is not supported")
    if any(d <= 0 for d in dil):
        raise RuntimeError("dilation should be greater than zero")
    N, C, H, W = x.shape
    O, Cw, KH, KW = weight.shape
    if Cw != C:
        raise RuntimeError(f"Given groups=1, weight of size {list(weight.shape)}, expected input{list(x.shape)} to "
                           f"have {Cw} channels, but got {C} channels instead")
    if C == 0:
        raise Unsupported("zero input channels")
    eh, ew = dil[0] * (KH - 1) + 1, dil[1] * (KW - 1) + 1
    if H + 2 * pad[0] < eh or W + 2 * pad[1] < ew:
        raise RuntimeError(f"Calculated padded input size per channel: ({H + 2 * pad[0]} x {W + 2 * pad[1]}). "
                           f"Kernel size: ({eh} x {ew}). Kernel size can't be greater than actual input size")
    OH = (H + 2 * pad[0] - eh) // st[0] + 1
    OW = (W + 2 * pad[1] - ew) // st[1] + 1
    # ATen's format for every result (forward and all three gradients): channels-last when the input or
    # the weight suggests it (both backends, cuDNN and CPU)
    cl = torch.channels_last
    channels_last = suggest_memory_format(x) == cl or suggest_memory_format(weight) == cl
    return C, H, W, O, KH, KW, OH, OW, st, pad, dil, channels_last


def _strides(shape, channels_last):
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)


# offsets switch to int64 beyond this many elements (a module variable so tests can lower it)
_INT64_FROM = blas.I32_MAX


def _i64(*ts):
    return max(span(t) for t in ts) > _INT64_FROM


def _conv_fwd(x, weight, bias, p):
    C, H, W, O, KH, KW, OH, OW, st, pad, dil, cl = p
    N = x.shape[0]
    y = empty((N, O, OH, OW), x.dtype, x.device, like_strides=_strides((N, O, OH, OW), cl))
    M, K = N * OH * OW, C * KH * KW
    if M == 0 or O == 0:
        return y
    i64 = _i64(x, y, weight)
    args = (x, weight, bias if bias is not None else y, y, C, H, W, O, OH, OW, KH, KW, M, K,
            *x.stride(), *weight.stride(), *y.stride(), st[0], st[1], pad[0], pad[1], dil[0], dil[1],
            bias is not None, cl, _precision(x.dtype), i64)

    def run(cfg, out=y):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        a = args[:3] + (out,) + args[4:]
        conv2d_fwd_kernel[(cdiv(M, bm) * cdiv(O, bn),)](*a, bm, bn, cfg["BLOCK_K"], cfg["GROUP_M"],
                                                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    bucket = (next_pow2(M), next_pow2(O), next_pow2(K), str(x.dtype), args[-2], cl, bias is not None)
    run(_pick("fwd", bucket, x.element_size(), lambda cfg: run(cfg, torch.empty_like(y)), M * O * K))
    return y


@register("convolution", category="blas", dtypes=FLOATS, plan_key=_tf32_key)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """2-D convolution (groups=1) as an implicit GEMM: taps gathered in-kernel, bias in the epilogue."""
    p = _params(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise RuntimeError(f"Given weight of size {list(weight.shape)}, expected bias to be 1-dimensional with "
                               f"{weight.shape[0]} elements, but got bias of size {list(bias.shape)} instead")
        if bias.dtype != input.dtype or bias.device != input.device:
            raise Unsupported("bias dtype/device differs from the input")
    return _conv_fwd(input, weight, bias, p)


def _is_patchify(p):
    """Non-overlapping patches: stride = kernel, no padding, no dilation (ViT/CLIP patch embeddings)."""
    C, H, W, O, KH, KW, OH, OW, st, pad, dil, cl = p
    return st[0] == KH and st[1] == KW and pad == [0, 0] and dil == [1, 1]


def _patch_grad_weight(g, x, gw, p):
    """grad_weight of a patch embedding: GW[o, k] = sum_n sum_l G[n, o, l] * P[n, l, k] over the images n
    and their L = OH*OW patches l, where P (the patches of x, im2col) is a permutation of x's cropped
    elements: one copy of x and no more. G[n] is a view of grad_out (NCHW or channels-last: [O, L] with
    strides (L, 1) or (1, O)). The GEMM's output O x K is small (CLIP: 1024 x 588, 40 tiles) and its
    reduction long, so it runs as a batched GEMM (blas's kernel, Triton configs) over the images, or
    over chunks of one image's patches, into fp32 partials [B, O, K] that reduction.py sums in a fixed
    order. The implicit GEMM below gathers the same patches with divisions per element instead.
    Bytes: x read and written once more (the copy), G and P read once, the partials written and read."""
    C, H, W, O, KH, KW, OH, OW, st, pad, dil, cl = p
    N, L = x.shape[0], OH * OW
    K = C * KH * KW
    xs = x[:, :, :OH * KH, :OW * KW].unflatten(3, (OW, KW)).unflatten(2, (OH, KH))   # [N, C, OH, KH, OW, KW]
    # the patch's element order is the weight's memory order: (c, kh, kw), or (kh, kw, c) channels-last
    order = (0, 2, 4, 3, 5, 1) if cl else (0, 2, 4, 1, 3, 5)
    patches = copy.clone(xs.permute(order), memory_format=torch.contiguous_format).view(N, L, K)
    try:
        g3 = g.view(N, O, L)
    except RuntimeError:        # OH and OW do not merge in grad_out's strides
        g3 = copy.clone(g, memory_format=torch.contiguous_format).view(N, O, L)
    a, b = g3, patches
    if N < _PATCH_BATCH:
        # few images: chunks of the patches of each image as the batch instead (one image: S chunks)
        s = next((s for s in (8, 4, 2) if L % s == 0 and L // s >= 64), 1) if N == 1 else 1
        a = g3[0].unflatten(1, (s, L // s)).permute(1, 0, 2) if s > 1 else g3
        b = patches[0].view(s, L // s, K) if s > 1 else patches
    ws = empty((a.shape[0], O, K), torch.float32, x.device)
    blas.launch(a, b, ws, None, 1.0, 0.0, triton_only=True, precision=_precision(x.dtype))
    flat = (gw.permute(0, 2, 3, 1) if cl else gw).view(O, K)
    reduction.reduce_dims(ws, [0], False, gw.dtype, reduction.OP_SUM, out=flat)


# images from which a patch embedding's grad_weight batches over the images (fewer: over patch chunks)
_PATCH_BATCH = 4


def _grad_weight(g, x, gw, p):
    C, H, W, O, KH, KW, OH, OW, st, pad, dil, cl = p
    if _is_patchify(p) and x.shape[0] * OH * OW:
        return _patch_grad_weight(g, x, gw, p)
    N = x.shape[0]
    M, K = N * OH * OW, C * KH * KW
    prec, i64 = _precision(x.dtype), _i64(x, g, gw)
    geo = (C, H, W, O, OH, OW, KH, KW, M, K)
    strides = (*g.stride(), *x.stride(), *gw.stride(), st[0], st[1], pad[0], pad[1], dil[0], dil[1])

    def launch(cfg, split, m_per, out, partial):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        conv2d_grad_weight_kernel[(cdiv(O, bm) * cdiv(K, bn), split)](
            g, x, out, *geo, m_per, *strides, partial, cl, prec, i64, bm, bn, cfg["BLOCK_K"], cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def plan(cfg):
        # split M when the O x K tiles alone leave the GPU idle; each split runs >= min_iters M steps
        tiles = cdiv(O, cfg["BLOCK_M"]) * cdiv(K, cfg["BLOCK_N"])
        rcfg = reduction.config()
        want = max(1, reduction.target_programs_on(x.device) // tiles)
        split = max(1, min(want, cdiv(M, cfg["BLOCK_K"] * rcfg["min_iters"]), rcfg["max_split"]))
        m_per = cdiv(cdiv(M, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        return cdiv(M, m_per) if M else 1, m_per

    def run(cfg, out):
        split, m_per = plan(cfg)
        if split == 1:
            launch(cfg, 1, max(m_per, 1), out, False)
            return
        ws = empty((split, O, K), torch.float32, x.device)
        launch(cfg, split, m_per, ws, True)
        # the workspace's k order is the weight's memory order, so the sum lands in `out` as an [O, K] view
        flat = (out.permute(0, 2, 3, 1) if cl else out).view(O, K)
        reduction.reduce_dims(ws, [0], False, out.dtype, reduction.OP_SUM, out=flat)

    bucket = (next_pow2(M), next_pow2(O), next_pow2(K), str(x.dtype), prec, cl)
    run(_pick("wgrad", bucket, x.element_size(), lambda cfg: run(cfg, torch.empty_like(gw)), M * O * K), gw)


def _grad_input(g, weight, gi, p):
    C, H, W, O, KH, KW, OH, OW, st, pad, dil, cl = p
    N = gi.shape[0]
    Hq, Wq = cdiv(H, st[0]), cdiv(W, st[1])
    Mq = N * Hq * Wq
    if Mq == 0:
        return
    args = (g, weight, gi, C, H, W, O, OH, OW, KH, KW, Hq, Wq, Mq, *g.stride(), *weight.stride(), *gi.stride(),
            st[0], st[1], pad[0], pad[1], dil[0], dil[1], _precision(g.dtype), _i64(g, gi, weight))

    def run(cfg, out=gi):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        conv2d_grad_input_kernel[(cdiv(Mq, bm) * cdiv(C, bn), st[0] * st[1])](
            *args[:2], out, *args[3:], bm, bn, cfg["BLOCK_K"], cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    bucket = (next_pow2(Mq), next_pow2(C), next_pow2(O * KH * KW), str(g.dtype), args[-2], cl)
    run(_pick("dgrad", bucket, g.element_size(), lambda cfg: run(cfg, torch.empty_like(gi)),
              Mq * C * O * KH * KW))


@register("convolution_backward", category="blas", dtypes=FLOATS, backward=True, plan_key=_tf32_key)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    """grad_input (phase-split transposed implicit GEMM), grad_weight (implicit GEMM, M split), grad_bias (sum)."""
    p = _params(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    C, H, W, O, KH, KW, OH, OW, st, pad, dil, cl = p
    N = input.shape[0]
    if tuple(grad_output.shape) != (N, O, OH, OW):
        raise Unsupported("grad_output shape differs from the convolution's output")
    if grad_output.dtype != input.dtype or grad_output.device != input.device:
        raise Unsupported("grad_output dtype/device differs from the input")
    do_gi, do_gw, do_gb = (bool(v) for v in output_mask)
    gi = gw = gb = None
    if do_gi:
        gi = empty(input.shape, input.dtype, input.device, like_strides=_strides(input.shape, cl))
        _grad_input(grad_output, weight, gi, p)
    if do_gw:
        gw = empty(weight.shape, weight.dtype, weight.device, like_strides=_strides(weight.shape, cl))
        if O:
            _grad_weight(grad_output, input, gw, p)
    if do_gb:
        gb = reduction.reduce_dims(grad_output, [0, 2, 3], False, grad_output.dtype, reduction.OP_SUM)
    return gi, gw, gb
