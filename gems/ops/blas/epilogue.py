"""The epilogue every GEMM kernel here ends with (kernels.matmul_kernel, kernels.splitk_reduce_kernel,
tma.matmul_tma_kernel): one definition, inlined by Triton into each."""
import triton
import triton.language as tl


@triton.jit
def scale_add_bias(acc, alpha, beta, x_ptrs, mask, HAS_BIAS: tl.constexpr):
    """alpha * acc + beta * Bias (read at x_ptrs where mask; fp32), for an fp32 accumulator tile."""
    acc = acc * alpha
    if HAS_BIAS:
        acc += beta * tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    return acc
