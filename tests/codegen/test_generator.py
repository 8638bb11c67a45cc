"""The pointwise generator itself: index math (pure Python), kernel caching, direct calls."""
import pytest
import torch
import triton
import triton.language as tl

import gems
from gems.codegen import layout, pointwise
from gems.ops.pointwise import activation
from harness import DEVICE, assert_close, make, while_compiling


def test_collapse_merges_contiguous_dims_and_drops_ones():
    # contiguous (2, 3, 4): one dim
    assert layout.collapse((2, 3, 4), [(12, 4, 1)], [0, 1, 2]) == ([24], [[24 // 24]])
    # a row broadcast over a matrix: the row's zero stride blocks the merge
    sizes, sts = layout.collapse((5, 7), [(7, 1), (0, 1)], [0, 1])
    assert sizes == [5, 7] and sts == [[7, 1], [0, 1]]
    # size-1 dims vanish whatever their stride
    sizes, sts = layout.collapse((3, 1, 4), [(4, 99, 1)], [0, 1, 2])
    assert sizes == [12] and sts == [[1]]
    # a uniformly step-sliced tensor is still one dim (stride 2)
    sizes, sts = layout.collapse((2, 3, 4), [(12, 4, 1), (24, 8, 2)], [0, 1, 2])
    assert sizes == [24] and sts == [[1], [2]]
    # x[:, :3] of a (2, 4, 4) tensor: the inner pair merges, the outer dim cannot
    sizes, sts = layout.collapse((2, 3, 4), [(12, 4, 1), (16, 4, 1)], [0, 1, 2])
    assert sizes == [2, 12] and sts == [[12, 1], [16, 1]]


def test_plan_orders_by_output_strides_and_picks_transposed_tile_dim():
    # out = a.t() + a.t() (both transposed like the fresh output): collapses to one dense dim
    sizes, sts, tr = layout.plan((8, 6), (1, 8), [(1, 8), (1, 8)])
    assert sizes == [1, 48] and all(s[-1] == 1 for s in sts) and not tr
    # a + a.T: out row-major, second input column-major -> M is the input's fast dim (a square tile)
    sizes, sts, tr = layout.plan((8, 6), (6, 1), [(6, 1), (1, 8)])
    assert tr and sizes == [8, 6] and sts[2] == [1, 8]
    # batch dims stay in front; the tile dims are the last two
    sizes, sts, tr = layout.plan((4, 8, 6), (48, 6, 1), [(48, 6, 1), (48, 1, 8)])
    assert sizes == [4, 8, 6] and tr


def test_output_perm_matches_aten_strides():
    base = torch.empty(4, 5, 6)
    cases = [
        [base.permute(2, 0, 1)],
        [base.permute(1, 2, 0), base.permute(1, 2, 0)],
        [base.permute(2, 0, 1), base.permute(2, 0, 1).contiguous()],
        [base[:, :1, :].permute(2, 1, 0).expand(6, 5, 4), base.permute(2, 1, 0)],
        [base.transpose(0, 1), torch.empty(6)],
        [torch.empty(5, 1, 6).transpose(0, 2), torch.empty(6, 4, 5)],
    ]
    for ts in cases:
        shape = tuple(torch.broadcast_shapes(*[t.shape for t in ts]))
        sts = [layout.broadcast_strides(shape, tuple(t.shape), tuple(t.stride())) for t in ts]
        got = layout.strides_for_perm(shape, layout.output_perm(shape, sts))
        want = sum(ts[1:], ts[0]).stride() if len(ts) > 1 else (ts[0] + 1).stride()
        assert got == tuple(want), (shape, sts, got, want)
        descs = [(tuple(t.shape), tuple(t.stride()), t.is_contiguous(), False) for t in ts]
        if len(ts) == 1:
            descs.append(((), (), True, False))     # + 1: ATen wraps the number as a 0-dim tensor
        assert layout.result_strides(shape, descs) == tuple(want), (shape, descs, want)


def test_result_strides_follow_tensor_iterator():
    # size-1 dims: the fast setup keeps an input's strides exactly; a 0-dim operand turns it off, and
    # then a size-1 dim's stride still votes for the memory order
    x = torch.empty(5, 1, 4, 3).permute(2, 0, 3, 1)
    cl = torch.empty(2, 3, 1, 1).to(memory_format=torch.channels_last)
    zero = torch.empty(4, 0, 3).permute(2, 1, 0)
    for t in (x, cl, zero):
        d = (tuple(t.shape), tuple(t.stride()), t.is_contiguous(),
             t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
        wrapped = ((), (), True, False)
        assert layout.result_strides(tuple(t.shape), [d]) == torch.exp(t).stride()
        assert layout.result_strides(tuple(t.shape), [d, wrapped]) == (t + 1).stride()
        assert layout.result_strides(tuple(t.shape), [d, d]) == (t + t).stride()


def test_int64_offsets_only_when_needed():
    blk = 1024
    assert not layout.needs_int64(2 ** 20, blk, [((1024, 1024), (1024, 1))])
    assert layout.needs_int64(2 ** 31, blk, [])                       # numel itself
    assert layout.needs_int64(2 ** 31 - blk // 2, blk, [])            # the last tile's lanes pass 2**31
    # few elements, huge strides (a strided view of a >2**31 storage)
    assert layout.needs_int64(4, blk, [((2, 2), (2 ** 31, 1))])
    assert not layout.needs_int64(4, blk, [((2, 2), (2 ** 30, 1))])
    # 2**31 + elements in a broadcast view of a small tensor: offsets stay small, numel decides
    assert layout.needs_int64(2 ** 31 + 5, blk, [((2 ** 31 + 5,), (0,))])
    assert not layout.needs_int64(2 ** 30, blk, [((2 ** 30,), (0,))])


def test_tile_shapes():
    assert layout.tile([64, 4096], False, 4096, 64) == (1, 4096)
    assert layout.tile([4096, 3], False, 4096, 64) == (1024, 4)
    assert layout.tile([8192, 8192], True, 4096, 64) == (64, 64)
    assert layout.tile([3, 2], True, 4096, 64) == (4, 2)


def _n_kernels(op):
    return len(op._kernels)


def test_kernel_cache_is_per_layout_class_not_shape():
    g1, x1 = make((4, 5)), make((4, 5))
    g2, x2 = make((7, 9)), make((7, 9))
    op = activation.silu_backward
    bwd = torch.ops.aten.silu_backward
    # counts start from empty caches: other tests in this process may have compiled these layout classes
    # and recorded plans for these signatures (a plan replay compiles nothing)
    with op._lock:
        op._kernels.clear()
    impl = gems.registry.get("silu_backward")
    impl.set_fn(impl.fn)
    with gems.use_gems():
        bwd(g1, x1)
        n = _n_kernels(op)
        bwd(g2, x2)
        bwd(make((3, 2, 11)), make((3, 2, 11)))
        assert _n_kernels(op) == n                          # contiguous: one flat kernel for all shapes
        bwd(g1, x1.t().contiguous().t()[:, :5])
        m = _n_kernels(op)
        assert m == n + 1
        bwd(g2, make((9, 7)).t())                           # another shape, same class (rank 2 nd)
        bwd(make((3, 6, 2)), make((3, 2, 6)).transpose(1, 2))   # rank 3
        assert _n_kernels(op) == m + 1
        # and repeat calls of a signature run its call plan
        assert gems.dispatch.op_runtime("silu_backward").plans.info()["plans"] >= 1


@triton.jit
def _sum_diff(a, b):
    return a + b, a - b


_two = pointwise(body=_sum_diff, outputs=2)   # no ATen names: called directly


def test_two_outputs_direct_call_and_strided():
    a, b = make((5, 7)), make((7, 5)).t()
    s, d = _two(a, b)
    assert_close([s, d], [a.double() + b.double(), a.double() - b.double()], torch.float32)
    o1, o2 = torch.empty(5, 7, device=DEVICE), torch.empty(5, 7, device=DEVICE)
    r = _two(a, b, out=[o1, o2])
    assert r[0] is o1 and r[1] is o2
    assert_close([o1, o2], [a.double() + b.double(), a.double() - b.double()], torch.float32)


def test_generated_source_lands_in_cache_dir():
    from gems.runtime.autotune import cache_dir
    with gems.use_gems():
        torch.mul(make((3, 4)), 3.0)
    files = list((cache_dir() / "codegen").glob("pw_*.py"))
    assert files and all("def kernel(" in f.read_text() for f in files)


def test_call_plan_source_has_no_analysis():
    from gems.runtime.plan import NO_PLAN
    g, x = make((4, 8)), make((1, 8))
    with gems.use_gems():
        for _ in range(2):
            torch.ops.aten.silu_backward(g, x)
    plans = [p for p in gems.dispatch.op_runtime("silu_backward").plans.plans.values() if p is not NO_PLAN]
    src = plans[-1].__gems_source__
    # allocate, launch, return: promotion, broadcasting and layout planning happened when it was built
    assert "broadcast" not in src and "promot" not in src and src.count("\n") <= 8, src



def test_an_in_place_or_out_call_whose_kernel_is_compiling_is_answered_by_aten():
    # with background compilation a generated op's overload is one launch, its call's first write:
    # while the binary compiles ATen answers in-place and out= calls too (autograd's zeroed gradient
    # buffers, the optimizer's fills), with results equal to ATen's own
    r = while_compiling(["kernel"], """
        from gems.ops.pointwise import arith
        torch.manual_seed(0)
        x, y = torch.randn(6, 5, device=dev), torch.randn(5, device=dev)
        src, idx = torch.randn(2, 5, device=dev), torch.tensor([[0, 3, 1, 2, 5], [4, 4, 0, 1, 2]], device=dev)
        def calls(a):
            z, f, s, o, so = a.clone(), a.clone(), a.clone(), torch.empty_like(a), torch.empty_like(a)
            z.zero_()
            f.fill_(2.5)
            s.add_(y, alpha=2)
            torch.mul(a, y, out=o)
            torch.scatter(a, 0, idx, src, out=so)      # copy_fn (out starts as self), then the scatter
            return z, f, s, o, so
        want = calls(x)
        with gems.use_gems():
            got = calls(x)
        n = len(asked)
        # a direct call from inside a writing call (another op's implementation) promises no first write
        prev = background.set_deferring(background.WRITES)
        try:
            direct = arith.mul(x, y)
        finally:
            background.set_deferring(prev)
        report(ok=all(torch.equal(g, w) for g, w in zip(got, want)), n=n, direct_ok=torch.equal(direct, x * y))
    """)
    assert r["ok"], r
    served, direct = r["asked"][:r["n"]], r["asked"][r["n"]:]
    assert served and all(first and deferring for _, first, deferring in served), r
    compiling = {k for k, v in r["aten"].items() if "kernel not compiled yet" in v}
    assert {"zero_.default", "fill_.Scalar", "add_.Tensor", "mul.out", "scatter.src_out"} <= compiling, r["aten"]
    # the op called directly inside a writing call compiled and ran: no promise, no deferral
    assert direct == [["kernel", False, False]] and r["direct_ok"], r
