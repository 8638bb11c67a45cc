"""Index math of the pointwise generator, in pure Python (unit-tested without a kernel).

Everything here works on (shape, strides) tuples, never on tensor data:

* `broadcast_strides`  a tensor's strides viewed at the broadcast shape (0 where it is broadcast);
* `output_perm`        TensorIterator's memory-order rule for a fresh output (the order in which the
                       inputs' strides say the dims are laid out), and `strides_for_perm`;
* `like_strides`       the strides of ATen's empty_like (preserve_format);
* `result_strides`     the strides ATen gives a fresh output: TensorIterator's fast setup, else the
                       memory order of `output_perm` over the operands' strides as TensorIterator sees them;
* `plan`               the launch geometry: dims ordered by the output's strides (outermost first),
                       size-1 dims dropped, neighbours merged where every operand is contiguous across
                       them, then the two tile dims picked (the output's fastest dim N, and a dim M that
                       some input walks fastest, so a + a.T reads both operands coalesced);
* `internal_overlap`   whether a written-to tensor has elements that share an address;
* `needs_int64`        whether any offset the kernel forms can pass 2**31 - 1 (64-bit index math is
                       a compile-time specialization; the common case keeps 32-bit math).
"""
from __future__ import annotations

INT32_MAX = 2 ** 31 - 1


def internal_overlap(shape, strides) -> bool:
    """Whether two elements share one address (ATen's has_internal_overlap answering YES): a dim of
    size > 1 with stride 0. An empty tensor has no elements to share one; ATen counts it as
    non-overlapping and dense and writes nothing to it."""
    return 0 not in shape and any(st == 0 and n > 1 for n, st in zip(shape, strides))


def broadcast_strides(shape, t_shape, t_strides):
    """Strides of a tensor of shape `t_shape` broadcast (right-aligned) to `shape`."""
    pad = len(shape) - len(t_shape)
    out = [0] * pad
    for s, st in zip(t_shape, t_strides):
        out.append(0 if s == 1 else st)
    return tuple(out)


def contiguous_strides(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(st))


def output_perm(shape, strides_list):
    """Logical-to-physical permutation (outermost first) for a fresh output, TensorIterator's rule.

    Dims are insertion-sorted from fastest to slowest; two dims compare by the first operand whose
    strides for them are both non-zero (smaller stride = faster; equal strides: the longer dim is
    slower); no decision keeps the logical order.
    """
    nd = len(shape)
    if nd <= 1:
        return list(range(nd))

    def should_swap(a, b):
        for st in strides_list:
            sa, sb = st[a], st[b]
            if sa == 0 or sb == 0:
                continue
            if sa == sb:
                if shape[b] >= shape[a]:
                    continue
                return 1
            return -1 if sb > sa else 1
        return 0

    perm = list(reversed(range(nd)))   # fastest first while sorting
    for i in range(1, nd):
        d1 = i
        for d0 in reversed(range(i)):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    return list(reversed(perm))


def non_overlapping_and_dense(shape, strides) -> bool:
    """c10's compute_non_overlapping_and_dense: dims of size >= 2, sorted by stride, are laid out
    densely (size-0 and size-1 dims say nothing)."""
    nd = len(shape)
    if nd == 1:
        return shape[0] < 2 or strides[0] == 1
    perm = sorted(range(nd), key=lambda d: (shape[d] < 2, strides[d] if shape[d] >= 2 else 0))
    expect = 1
    for d in perm:
        if shape[d] < 2:
            return True
        if strides[d] != expect:
            return False
        expect *= shape[d]
    return True


def channels_last_strides(shape):
    """c10's get_channels_last_strides_2d (what empty(memory_format=channels_last) gives a 4-d shape)."""
    n, c, h, w = shape
    sw = c
    sh = sw * w
    return (sh * h, 1, sh, sw)


def iterator_strides(shape, t_shape, t_strides):
    """An operand's strides as TensorIterator's compute_strides sees them at the broadcast `shape`: 0
    where the operand is broadcast (a size-1 dim of a larger dim, or a missing leading dim); a size-1
    dim of a size-1 dim keeps its stride, which then takes part in ordering the dims."""
    pad = len(shape) - len(t_shape)
    out = [0] * pad
    for i, (s, st) in enumerate(zip(t_shape, t_strides)):
        out.append(0 if s == 1 and shape[pad + i] != 1 else st)
    return tuple(out)


def result_strides(shape, operands):
    """The strides ATen's TensorIterator gives a fresh output of broadcast shape `shape`.

    `operands` are the inputs in the order the op adds them to its TensorIterator, each
    (shape, strides, contiguous, channels_last): a 0-dim tensor or a number ATen wraps as one is
    ((), (), True, False). The rule, as TensorIteratorBase::build applies it:

    * fast setup, when every operand has the output's shape (a 0-dim operand beside others breaks
      it): all contiguous -> contiguous strides; all channels_last -> channels_last strides; all
      non-overlapping and dense with equal strides -> those very strides (size-1 dims included);
    * otherwise the dims are ordered by `output_perm` over the operands' `iterator_strides` (a
      broadcast operand and a 0-dim one vote for nothing; ties keep the logical order), and the
      output is laid out densely in that order; when the order is the logical one the output is
      plainly contiguous. The dense strides multiply raw sizes, so dims after a size-0 dim in the
      memory order get stride 0, as ATen's compatible_stride gives them.
    """
    nd = len(shape)
    if nd == 0:
        return ()
    has_scalar = any(len(o[0]) == 0 for o in operands)
    has_tensor = any(len(o[0]) != 0 for o in operands)
    if operands and not (has_scalar and has_tensor) and all(tuple(o[0]) == tuple(shape) for o in operands):
        if all(o[2] for o in operands):
            return contiguous_strides(shape)
        if all(o[3] for o in operands):
            return channels_last_strides(shape)
        first = tuple(operands[-1][1])
        if all(tuple(o[1]) == first and (o[2] or o[3] or non_overlapping_and_dense(o[0], o[1]))
               for o in operands):
            return first
    if nd == 1:
        return contiguous_strides(shape)
    perm = output_perm(shape, [iterator_strides(shape, tuple(o[0]), tuple(o[1])) for o in operands])
    if perm == list(range(nd)):
        return contiguous_strides(shape)
    st = [0] * nd
    acc = 1
    for d in reversed(perm):
        st[d] = acc
        acc *= shape[d]
    return tuple(st)


def like_strides(shape, strides, contiguous, channels_last):
    """The strides of ATen's empty_like(t) (preserve_format) for t of `shape` / `strides`: t's own when
    c10 flags t non-overlapping and dense, else dense in t's memory order (infer_dense_strides)."""
    if contiguous or channels_last or non_overlapping_and_dense(shape, strides):
        return tuple(strides)
    return strides_for_perm(shape, output_perm(shape, [tuple(strides)]))


def strides_for_perm(shape, perm):
    """Dense strides laying `shape` out in the physical order `perm` (outermost first)."""
    st = [0] * len(shape)
    acc = 1
    for d in reversed(perm):
        st[d] = acc
        acc *= max(shape[d], 1)
    return tuple(st)


def max_offset(shape, strides):
    return sum((s - 1) * abs(st) for s, st in zip(shape, strides) if s > 0)


def needs_int64(numel, block, shapes_strides):
    """True when 32-bit index math could overflow: the last tile's lanes (numel rounded up to the
    tile) or any operand's largest element offset pass INT32_MAX."""
    if numel + block > INT32_MAX:
        return True
    return any(max_offset(sh, st) > INT32_MAX for sh, st in shapes_strides)


def collapse(shape, strides_list, order):
    """Dims in `order` (outermost first), size-1 dims dropped, mergeable neighbours merged.

    Returns (sizes, [strides per operand]) with the fastest dim last; a merge of outer dim i into
    inner dim j needs stride_i == stride_j * size_j for every operand.
    """
    sizes = []
    sts = [[] for _ in strides_list]
    for d in order:
        if shape[d] == 1:
            continue
        sizes.append(shape[d])
        for k, st in enumerate(strides_list):
            sts[k].append(st[d])
    # merge from the inside out: dim i (outer) into i+1 (inner)
    i = len(sizes) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * sizes[i + 1] for s in sts):
            sizes[i + 1] *= sizes[i]
            del sizes[i]
            for s in sts:
                del s[i]
        i -= 1
    if not sizes:
        sizes = [1]
        sts = [[0] for _ in strides_list]
    return sizes, sts


def plan(shape, out_strides, in_strides, out_perm=None):
    """Collapsed launch geometry for the strided kernel.

    `out_strides` and `in_strides` are at the broadcast `shape`. Returns (sizes, strides, m_dim):
    `sizes` ordered outermost-first with the output's fastest dim last, `strides[0]` the output's and
    `strides[1:]` the inputs', all with the same number of dims (at least 2; a leading size-1 dim is
    added to rank-1 plans), and the tile's second dim at position -2. `m_transposed` tells whether an
    input is fastest along that dim (square tiles then serve both access patterns).
    """
    nd = len(shape)
    if out_perm is None:
        # order by the output's strides, ties (size-1 dims) keep the logical order
        out_perm = sorted(range(nd), key=lambda d: -out_strides[d])
    all_st = [tuple(out_strides)] + [tuple(s) for s in in_strides]
    sizes, sts = collapse(shape, all_st, out_perm)
    if len(sizes) == 1:
        sizes = [1] + sizes
        sts = [[0] + s for s in sts]
    r = len(sizes)
    # M: a dim some input walks with stride 1 (or its smallest non-zero stride) while its N stride is
    # not 1: that input would otherwise read one element per row of the tile
    m = r - 2
    transposed = False
    for s in sts[1:]:
        if s[-1] == 1 or s[-1] == 0:
            continue
        cands = [(abs(s[d]), d) for d in range(r - 1) if s[d] != 0 and sizes[d] > 1]
        if cands:
            best_st, best_d = min(cands)
            if best_st < abs(s[-1]):
                m = best_d
                transposed = True
                break
    if m != r - 2:
        order = [d for d in range(r - 1) if d != m] + [m, r - 1]
        sizes = [sizes[d] for d in order]
        sts = [[s[d] for d in order] for s in sts]
    return sizes, sts, transposed


def tile(sizes, transposed, block, square):
    """(BLOCK_M, BLOCK_N) for the last two dims of a plan: `block` elements per program."""
    from triton import next_power_of_2 as p2
    sm, sn = sizes[-2], sizes[-1]
    if transposed:
        bn = min(square, p2(sn))
        bm = min(max(block // bn, 1), p2(sm))
        return bm, bn
    bn = min(p2(sn), block)
    bm = min(max(block // bn, 1), p2(sm))
    return bm, bn
