"""The launch behind the _foreach_* ops (what torch.optim's foreach implementations call, registered in
overloads.py) and behind _fused_adamw_ (fused_adam.py): one launch per call, any number of tensors.

ATen's CUDA kernels (multi_tensor_apply) pass the tensors' addresses in the kernel's argument space:
a launch takes 30 to 110 tensors (by the number of lists) and 320 chunks of 64K elements, so a
model's parameter list takes many launches. Triton kernels take no arrays as arguments; here the host
writes the addresses into one int64 *table* instead, copied to the device with the call, and one
launch covers every tensor:

    Tab = [S_0 .. S_{N-1} | row_0 | .. | row_{N-1}]      row_i = [n_i, a_i(list 0) .. a_i(list k), out_i, s_i]

S_i is the number of chunks (CHUNK elements each) of the tensors before i, n_i tensor i's element
count, a_i the data addresses of tensor i in each list, out_i that of its result (functional
variants only), s_i its scalar (ScalarList variants: the number's float64 bits; a List variant whose
second list holds 0-dim tensors: that tensor's address). Program p finds its tensor as the last i
with S_i <= p (a binary search: log2 N scalar loads, the price of not cutting the launch), and its
chunk c = p - S_i. Addresses become pointers as Base + (a_i - a_Base) / elsize, with Base a tensor
argument of the list's dtype: the offset is exact (every address is a multiple of the element
size), and when every address is 16-byte aligned a hint says so, so the loads can stay 128-bit
vectors as for a plain tensor argument. A chunk is CHUNK // BLOCK unrolled blocks, so the search is
paid once per CHUNK elements; a whole chunk is read and written without a mask (a mask against a
size read from the table splits the vectors into 2-byte accesses), only a tensor's last chunk is
masked.

Formulas (x, y, z the elements of the lists in order, s the scalar: a Scalar argument, the list's
entry for this tensor, or a 0-dim tensor's value; all in fp32, ATen's opmath; one rounding on store):
    add: x + alpha * y | x + s    sub: x - alpha * y | x - s    mul: x * y | x * s
    div: x / y | x / s (IEEE)     maximum / minimum: NaN if either is NaN
    lerp: x + w (y - x) from the nearer end, w = z or s      pow: x ** y | x ** s | s ** x
    addcmul: x + s * y * z        addcdiv: x + s * y / z       sqrt, neg, reciprocal, zero_
(addcmul and addcdiv are the non-foreach ops' bodies, in ATen's order of the products and quotient on
each device: its CPU loop calls those ops per tensor, its CUDA foreach kernels share their formula)
Bytes moved: each list read once, the result written once; plus the table (8 bytes per tensor and
column).

Host cost per call, O(N): per tensor and list its address, shape, dtype, device and contiguity are
read. With the fast path loaded (gems.enable() loads it) a call runs whole in C++ (csrc/fastpath.cpp
foreach_serve, about 0.05 us a tensor and list against about 1 us in Python): the checks, the numbers,
the results, the overlap check of in-place operands (an element written by one program and read or
written by another would race; ATen's CPU loop applies the op tensor by tensor, so such calls go to
ATen), the table and its upload (kept by content: an optimizer passes the same tensors every step),
one launch of the binary that the Python path compiled and handed over (_publish) for the call's
binary facts. A call C++ does not serve, or the first one with new facts, runs the Python kernel
below: the same checks and table in C++ passes (`foreach_lists`, `foreach_empty`, `foreach_table`),
the table's device copy kept by content (_TABLES); without the module (GEMS_FAST=0) all in Python,
launches kept by the lists' addresses and shapes (_LAUNCHES). A ScalarList holding one nonzero
value for every tensor (Adam's step sizes) becomes a kernel argument, so that its table does not
change with the step. Measured on BERT-base's AdamW on an H100: with address-keyed launch plans in
Python alone a step took 12.4 ms of host time against ATen's 6.0; with the C++ path the foreach rows
of benchmarks.host run at 0.63-0.91x ATen (docs/perf.md).

Served: contiguous tensors, one dtype (fp32/fp16, bf16 on the GPU) and one device across all lists.
Anything else (mixed dtypes, which ATen promotes; non-contiguous tensors; different shapes, which
ATen's loop broadcasts; overlapping in-place operands; numbers out of the dtype's range) goes to
ATen, counted. No call plans (results are lists or None, which a plan does not map): the
registrations skip the signature too, which would read every element of every list per call.
"""
from __future__ import annotations

import itertools
import operator
from array import array
from functools import reduce

import torch
import triton
import triton.language as tl

from ...codegen.generator import number_misfit
from ...codegen.tlmath import GPU
from ...registry import FLOATS, Unsupported
from ...runtime import alloc, backend, kernel, plan, reentry
from ...runtime import fast as fastpath
from ...runtime.abi import FOREACH_MAX_TABLES
from ...runtime.utils import empty
from ..pointwise.arith import add_f, div_f, mul_f, neg_f, sub_f
from ..pointwise.binary import c_pow_f, maximum_f, minimum_f, pow_f
from ..pointwise.ternary import addcdiv_f, addcmul_f, lerp_f
from ..pointwise.unary import reciprocal_f, sqrt_f

# how a program gets its scalar s: a kernel argument, its tensor's table entry (float64 bits),
# a 0-dim tensor's value, entry i of a 1-D tensor (addcmul/addcdiv .Tensor), or the value of its
# tensor's own 0-dim tensor, whose address is in the table (a .List variant whose second list holds
# 0-dim tensors: capturable Adam divides by per-parameter bias corrections kept on the device)
S_ARG, S_TABLE, S_TENSOR, S_TENSORS = 0, 1, 2, 4


@triton.jit
def address(row, k, B0, ES: tl.constexpr, VEC: tl.constexpr):
    """Element offset from Base of the tensor whose address is row[k] (a multiple of VEC elements)."""
    d = (tl.load(row + k) - B0) // ES
    if VEC > 1:
        d = tl.multiple_of(d, VEC)
    return d


@triton.jit
def locate(Tab, N, TOP, LOGN, W: tl.constexpr, CHUNK: tl.constexpr):
    """(i, row i's address, n_i, the first element of this program's chunk) for program p: tensor i
    is the last i < N with S_i <= p, found by binary lifting over steps TOP, TOP / 2, .., 1 (TOP the
    largest power of two below N; LOGN steps)."""
    pid = tl.program_id(0)
    i = pid * 0
    step = TOP + pid * 0
    for _ in range(LOGN):
        c = i + step
        v = tl.load(Tab + tl.minimum(c, N - 1))
        i = tl.where(c < N, tl.where(v <= pid, c, i), i)
        step = step // 2
    row = Tab + N + i.to(tl.int64) * W
    n = tl.load(row)
    lo = (pid - tl.load(Tab + i)).to(tl.int64) * CHUNK
    return i, row, n, lo


@triton.jit
def _chunk(Base, d0, d1, d2, dout, lo, n, sv, alpha, OP: tl.constexpr, NIN: tl.constexpr,
           BLOCK: tl.constexpr, CHUNK: tl.constexpr, MASK: tl.constexpr):
    """One chunk of foreach_kernel: CHUNK elements from lo (MASK: those below n only)."""
    for k in tl.static_range(CHUNK // BLOCK):
        offs = lo + k * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n if MASK else None   # whole chunks unmasked (see foreach_kernel)
        if OP == "zero":
            r = tl.zeros([BLOCK], tl.float32)
        else:
            x = tl.load(Base + d0 + offs, mask=mask).to(tl.float32)
            if NIN >= 2:
                b = tl.load(Base + d1 + offs, mask=mask).to(tl.float32)
            else:
                b = sv
            if NIN >= 3:
                c3 = tl.load(Base + d2 + offs, mask=mask).to(tl.float32)
            if OP == "add":
                r = add_f(x, b, alpha)
            elif OP == "sub":
                r = sub_f(x, b, alpha)
            elif OP == "mul":
                r = mul_f(x, b)
            elif OP == "div":
                r = div_f(x, b, "none")
            elif OP == "maximum":
                r = maximum_f(x, b)
            elif OP == "minimum":
                r = minimum_f(x, b)
            elif OP == "pow":
                if GPU or Base.dtype.element_ty == tl.float16:
                    # C pow for every exponent, without pointwise pow's sqrt and product forms
                    # ((-inf) ** 0.5 is inf, not NaN): ATen's CUDA foreach kernels (the lists served
                    # here take its fast route, powf in opmath) and its CPU Half kernel compute that
                    r = c_pow_f(x, b)
                else:
                    r = pow_f(x, b)
            elif OP == "rpow":
                r = pow_f(tl.zeros([BLOCK], tl.float32) + sv, x)
            elif OP == "lerp":
                if NIN == 3:
                    r = lerp_f(x, b, c3)
                else:
                    r = lerp_f(x, b, sv)
            elif OP == "addcmul":
                r = addcmul_f(x, b, c3, sv)
            elif OP == "addcdiv":
                r = addcdiv_f(x, b, c3, sv)
            elif OP == "sqrt":
                r = sqrt_f(x)
            elif OP == "neg":
                r = neg_f(x)
            else:
                tl.static_assert(OP == "reciprocal")
                r = reciprocal_f(x)
        tl.store(Base + dout + offs, r.to(Base.dtype.element_ty), mask=mask)


# the ints are not specialized (no "== 1" constant, no divisibility hint): one binary, with one
# parameter list, serves every number of tensors, which the C++ fast path relies on (fastpath.cpp
# foreach_serve launches the binary the Python path compiled for the same binary facts)
@kernel
@triton.jit(do_not_specialize=["N", "TOP", "LOGN", "B0", "S0"])
def foreach_kernel(Base, Tab, N, TOP, LOGN, B0, s, alpha, S, S0,
                   OP: tl.constexpr, NIN: tl.constexpr, FUNC: tl.constexpr, SMODE: tl.constexpr,
                   W: tl.constexpr, ES: tl.constexpr, SES: tl.constexpr, VEC: tl.constexpr,
                   BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """out_i[j] = f(x_i[j], y_i[j], z_i[j], s) for chunk p - S_i of tensor i (module doc): NIN input
    lists, the result in place into list 0 or (FUNC) into out_i. S: the 0-dim scalar tensor (SMODE 2)
    or the first of the per-tensor 0-dim tensors (SMODE 4, at S + (address - S0) / SES)."""
    i, row, n, lo = locate(Tab, N, TOP, LOGN, W, CHUNK)
    d0 = address(row, 1, B0, ES, VEC)
    if NIN >= 2:
        d1 = address(row, 2, B0, ES, VEC)
    if NIN >= 3:
        d2 = address(row, 3, B0, ES, VEC)
    if FUNC:
        dout = address(row, 1 + NIN, B0, ES, VEC)
    else:
        dout = d0
    # the numbers as fp32 values (the interpreter passes them as Python floats, which the shared
    # bodies' fma_f cannot take; on the GPU they are fp32 arguments already)
    alpha = tl.cast(alpha, tl.float32)
    if SMODE == 0:
        sv = tl.cast(s, tl.float32)
    elif SMODE == 1:
        sv = tl.load(row + W - 1).to(tl.float64, bitcast=True).to(tl.float32)
    else:
        if SMODE == 2:
            sv = tl.load(S).to(tl.float32)
        else:
            sv = tl.load(S + (tl.load(row + W - 1) - S0) // SES).to(tl.float32)
        # a 0-dim tensor operand is cast to the list's dtype first by ATen's TensorIterator (its loop
        # over the tensors, taken when the dtypes differ); the CPU's mul and div kernels read their
        # second operand unrounded instead
        if GPU:
            sv = sv.to(Base.dtype.element_ty).to(tl.float32)
        elif OP != "mul":
            if OP != "div":
                sv = sv.to(Base.dtype.element_ty).to(tl.float32)
    if NIN < 2:
        d1 = d0
    if NIN < 3:
        d2 = d0
    # a whole chunk goes unmasked: n is read from the table, so a mask `offs < n` is not known to be
    # constant over a 16-byte vector and would split every load and store into 2-byte accesses (an
    # H200 moved 1.4-2.8 TB/s masked, 3.9-4.4 unmasked); only a tensor's last chunk is masked
    if lo + CHUNK <= n:
        _chunk(Base, d0, d1, d2, dout, lo, n, sv, alpha, OP, NIN, BLOCK, CHUNK, False)
    else:
        _chunk(Base, d0, d1, d2, dout, lo, n, sv, alpha, OP, NIN, BLOCK, CHUNK, True)


# BLOCK: elements per unrolled step; CHUNK: elements per program (the interpreter pays per program and
# per op, not per element: few wide programs). cuda: from a sweep on an H200 over TinyLlama-1.1B's 201
# bf16 parameters (out-of-tree): one 2048-element block per program, 4 warps, moved 3.9
# TB/s in place over one list and 4.4 over three (ATen's multi_tensor_apply: 2.9 and 3.6); chunks of
# 4096-65536 in one program, looping over blocks, were slower. The tests shrink the interpreter's so
# that their small tensors span several chunks.
CONFIGS = {"cuda": dict(BLOCK=2048, CHUNK=2048, num_warps=4),
            "interpreter": dict(BLOCK=1024, CHUNK=4096, num_warps=1)}

_T = torch.Tensor
data_ptr, _numel, _contig, _dev = _T.data_ptr, _T.numel, _T.is_contiguous, _T.get_device
_dtype, _shape = operator.attrgetter("dtype"), operator.attrgetter("shape")

# device copies of tables by (device, stream, content): optimizers pass the same tensors every step
_TABLES: dict = {}


def _device_table(tab, device: torch.device):
    """The table (an array('q'), or its bytes from the C++ pass) as an int64 tensor on `device`: on
    the CPU a copy of it; on a GPU one pinned host copy and one asynchronous copy, or a cached earlier
    copy of the same content (an optimizer passes the same tensors from step to step)."""
    raw = tab if tab.__class__ is bytes else tab.tobytes()
    if device.type == "cpu":
        return torch.frombuffer(bytearray(raw), dtype=torch.int64)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), raw)
    t = _TABLES.get(key)
    if t is None:
        # non_blocking from pinned memory: no wait for the stream (a pageable copy may wait); the host
        # allocator keeps the pinned block until the copy has run. The cache is per stream so that a
        # table evicted here is freed in the order of the stream that used it.
        t = torch.frombuffer(bytearray(raw), dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        if len(_TABLES) >= FOREACH_MAX_TABLES:   # the C++ side keeps as many (abi)
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = t
    return t


def scalar_value(v, dtype, what="scalar"):
    """A Scalar argument as the kernel's float, or Unsupported where ATen may convert it otherwise."""
    if isinstance(v, complex):
        raise Unsupported(f"complex {what}")
    why = number_misfit(v, dtype)
    if why is not None:
        raise Unsupported(f"{what}: {why}")
    return float(v)


LIMITS = {torch.float16: 65504.0, torch.bfloat16: 3.3895313892515355e38, torch.float32: 3.4028234663852886e38}


def _number_list(vals, dtype) -> array:
    """A Scalar[] argument as float64 values (the table carries their bits: -0.0 keeps its sign)."""
    lim = LIMITS[dtype]
    try:
        fits = -lim <= min(vals) and max(vals) <= lim   # the common case, without a call per number
    except TypeError:
        raise Unsupported("complex scalar in the list") from None
    if not fits:
        for v in vals:
            why = None if v == 0 else number_misfit(v, dtype)
            if why is not None:
                raise Unsupported(f"scalars: {why}")
    return array("d", vals)


def lists_overlap(written, nbytes, reads) -> bool:
    """Whether a written tensor's memory meets another written tensor's, or a read tensor's other
    than the same memory at the same position (read and written by the same lane: safe). `reads`:
    (addresses, byte sizes, whether position i is read for tensor i only) per read list."""
    w0 = list(map(data_ptr, written))
    iv = {(p, p + b) for p, b in zip(w0, nbytes) if b}
    if len(iv) != sum(1 for b in nbytes if b):
        return True                                   # the same tensor twice in the written list
    xs = set()
    for ptrs, sizes, own in reads:
        if own:
            xs.update((p, p + b) for p, b, q, wb in zip(ptrs, sizes, w0, nbytes) if b and (p != q or b != wb))
        else:
            xs.update((p, p + b) for p, b in zip(ptrs, sizes) if b)
    if xs & iv:
        return True
    # sorted by start, every interval must end before the next begins (reads overlapping other
    # reads, e.g. a list passed twice, are counted too: harmless, they just go to ATen)
    allv = sorted(iv | xs)
    return any(a[1] > b[0] for a, b in zip(allv, allv[1:]))


_SCALAR_DTYPES = FLOATS + (torch.float64,)


# the Python path's launches (no fast path) by everything that decides their table: the kind of
# variant, the lists' addresses and shapes, the scalars' table entries, the device and stream. Where an
# optimizer passes the same tensors again, a call skips the overlap check and the table (O(N) Python
# each) and reuses the table's device copy.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 64
_OVERLAP, _NOTHING = "overlap", "nothing"


def launch(op, lists, inplace, *, s=0.0, alpha=1.0, smode=S_ARG, svals=None, stensor=None):
    """Run `op` over `lists` (list 0 written in place, or shaping the functional outputs).

    svals: per-tensor numbers (ScalarList); stensor: a 0-dim tensor (S_TENSOR) or a list of N 0-dim
    tensors (S_TENSORS)."""
    first = lists[0]
    n = len(first)
    if n == 0:
        raise RuntimeError("Tensor list must have at least one tensor.")
    for lst in lists[1:] + ([stensor] if smode == S_TENSORS else []):
        if len(lst) != n:
            raise RuntimeError(f"Tensor lists must have the same number of tensors, got {n} and {len(lst)}")
    if svals is not None and len(svals) != n:
        raise RuntimeError("Tensor list must have same number of elements as scalar list.")
    t0 = first[0]
    dtype, dev = t0.dtype, t0.get_device()
    fast = _fast_lists()
    if fast is not None:
        # the C++ pass (csrc/fastpath.cpp foreach_lists): uniform_lists' checks
        _first_checks(t0)
        why = fast.foreach_lists(lists)
        if why is not None:
            raise Unsupported(why)
        shapes = None
    else:
        shapes = uniform_lists(lists)
    device = t0.device
    if svals is not None:
        svals = _number_list(svals, dtype)
        v0 = svals[0]
        if v0 != 0 and svals.count(v0) == n:
            # one value for every tensor (Adam's step sizes): a kernel argument, and the table stays
            # the same from step to step (a zero keeps the table: an argument would lose -0.0's sign)
            s, smode, svals = v0, S_ARG, None
    S, S0, ses, skey = None, 0, 1, None
    if smode == S_TENSORS:
        S = stensor[0]
        sdt, S0, ses = S.dtype, S.data_ptr(), S.element_size()
        if sdt not in _SCALAR_DTYPES or set(map(_dtype, stensor)) != {sdt}:
            raise Unsupported("0-dim tensors of a non-float or of several dtypes")
        if set(map(_dev, stensor)) != {dev}:
            raise Unsupported("tensors on different devices")
        skey = tuple(map(data_ptr, stensor))
    elif stensor is not None:
        if stensor.device != device:
            if smode == S_TENSOR and stensor.device.type == "cpu":
                s, smode = float(stensor.item()), S_ARG      # a CPU scalar next to GPU lists
            else:
                raise Unsupported("scalar tensor on another device")
        else:
            S = stensor
            skey = (stensor.data_ptr(), stensor.numel() * stensor.element_size())
    outs = None
    if not inplace:
        if fast is not None:
            outs = fast.foreach_empty(first)     # C++: one at::empty per tensor
            if alloc.POISON:
                for o in outs:
                    alloc.poison(o)
        else:
            outs = [empty(sh, dtype, device) for sh in shapes]
    cfg = CONFIGS[backend().name]
    if fast is not None:
        hit = _cpp_launch_plan(fast, lists, outs, inplace, svals, smode, skey, ses, cfg["CHUNK"])
    else:
        hit = _cached_launch_plan(lists, outs, inplace, svals, smode, S, skey, ses, shapes, dev)
    if hit is _OVERLAP:
        raise Unsupported("overlapping in-place operands")
    if hit is _NOTHING:
        return outs
    tab, total, top, base_i, aligned, cols = hit
    base = first[base_i]
    es = t0.element_size()
    args = (base, tab, n, top, top.bit_length(), base.data_ptr(), s, alpha, S, S0)
    consts = (op, len(lists), outs is not None, smode, cols, es, ses, 16 // es if aligned else 1, cfg["BLOCK"],
              cfg["CHUNK"])
    # the call's one write (first=True): a binary still compiling lets ATen answer an in-place call too
    foreach_kernel.run((total,), (*args, *consts), cfg["num_warps"], first=True)
    if fast is not None and fast.foreach_pending():
        _publish(fast, args, consts, cfg)
    return outs


def _fits32(v: int) -> bool:
    return -0x80000000 <= v <= 0x7FFFFFFF


def _publish(fast, args, consts, cfg):
    """Give the C++ fast path this call's launch (it asked: fastpath.cpp foreach_serve found no binary for
    the call's binary facts). It keeps it only if the facts below are the ones it computed."""
    base, tab, n, top, logn, b0, s, alpha, S, S0 = args
    smode, cols, vec, chunk = consts[3], consts[4], consts[7], consts[9]
    if tab.data_ptr() & 15:
        return
    facts = (base.dtype, base.get_device(), smode, cols, vec, int(b0 & 15 == 0), None if S is None else S.dtype,
             0 if S is None else int(S.data_ptr() & 15 == 0), *(int(_fits32(v)) for v in (n, top, logn, b0, S0)))
    nw = cfg["num_warps"]
    if foreach_kernel.interpreted:
        fn = foreach_kernel.fn

        def interpreted_launch(programs, *a):
            with reentry.guard():
                fn[(programs,)](*a, *consts, num_warps=nw)
        fast.foreach_publish(facts, (1, interpreted_launch, chunk))
        return
    entry = foreach_kernel.entry(args + consts, nw)
    if entry is None or entry[1] is None or entry[3] or entry[4]:
        return   # no direct launcher (scratch memory, cooperative or PDL launches): Python keeps it
    kernel = entry[0]
    md = kernel.metadata
    if getattr(md, "num_ctas", 1) != 1:
        return
    params = []
    for role, ty in enumerate(list(kernel.src.signature.values())[:len(args)]):
        if ty == "constexpr":
            continue
        code = plan.param_type(ty)
        if code is None:
            return
        params.append((role, code))
    fast.foreach_publish(facts, (0, int(entry[2]), 32 * md.num_warps, int(md.shared), chunk, tuple(params)))


def _cpp_launch_plan(fast, lists, outs, inplace, svals, smode, skey, ses, chunk):
    """The launch's table and its parameters from the C++ pass (csrc/fastpath.cpp foreach_table: the
    overlap check and the table, per call; only the table's device copy is kept, by content)."""
    extra = []
    own = shared = None
    if svals is not None:
        extra.append(svals.tobytes())
    elif smode == S_TENSORS:
        extra.append(array("q", skey).tobytes())
        own = (extra[-1], ses)
    elif skey is not None:
        shared = skey
    cols = lists if outs is None else lists + [outs]
    status, tab, total, top, base_i, aligned = fast.foreach_table(cols, inplace, len(lists), extra, own, shared,
                                                                  chunk)
    if status is not None:
        return _OVERLAP if status == "overlap" else _NOTHING
    return _device_table(tab, lists[0][0].device), total, top, base_i, aligned, 1 + len(cols) + len(extra)


def _cached_launch_plan(lists, outs, inplace, svals, smode, S, skey, ses, shapes, dev):
    """Without the fast path: the launch plan built in Python, kept by what decides it (_LAUNCHES)."""
    ptr_cols = [tuple(map(data_ptr, lst)) for lst in lists]
    if outs is not None:
        ptr_cols.append(tuple(map(data_ptr, outs)))
    stream = torch._C._cuda_getCurrentRawStream(dev) if lists[0][0].is_cuda else None
    # (not the op: the ops an optimizer runs over the same lists share one launch plan)
    key = (inplace, smode, lists[0][0].dtype, tuple(ptr_cols), tuple(shapes), skey,
           None if svals is None else svals.tobytes(), dev, stream)
    hit = _LAUNCHES.get(key)
    if hit is None:
        hit = _launch_plan(lists[0], lists, inplace, ptr_cols, svals, smode, S, skey, ses)
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.pop(next(iter(_LAUNCHES)))
        _LAUNCHES[key] = hit
    return hit


def _launch_plan(first, lists, inplace, ptr_cols, svals, smode, S, skey, ses):
    """What a call's launch needs that depends on its key alone (see _LAUNCHES): _OVERLAP for in-place
    operands that meet, _NOTHING with no element to visit, else (table, programs, TOP, index of the
    Base tensor, whether every address is 16-byte aligned, table columns)."""
    n = len(first)
    numel = list(map(_numel, first))
    es = first[0].element_size()
    nbytes = [k * es for k in numel]
    reads = [(list(p), nbytes, True) for p in ptr_cols[1:len(lists)]]
    if smode == S_TENSORS:
        reads.append((list(skey), [ses] * n, True))
    elif S is not None and skey[1]:
        # read by every program: it must not be written by any
        reads.append(([skey[0]], [skey[1]], False))
    if inplace and lists_overlap(first, nbytes, reads):
        return _OVERLAP
    extra = []
    if svals is not None:
        extra.append(array("q", svals.tobytes()))
    elif smode == S_TENSORS:
        extra.append(skey)
    cfg = CONFIGS[backend().name]
    t = table(first, numel, ptr_cols, extra, cfg["CHUNK"])
    if t is None:
        return _NOTHING
    tab, total, top, base, aligned = t
    return tab, total, top, next(j for j, k in enumerate(numel) if k), aligned, 1 + len(ptr_cols) + len(extra)


def _fast_lists():
    """The C++ fast path's module (its foreach_lists, foreach_empty and foreach_table) when it is loaded
    (gems.enable() loads it), else None."""
    return fastpath.loaded()


def _first_checks(t0):
    dtype = t0.dtype
    if dtype not in FLOATS:
        raise Unsupported(f"dtype {dtype}")
    if backend().device_type == "cuda":
        if t0.get_device() != torch.cuda.current_device():
            raise Unsupported("tensors on a non-current device")
        if torch.cuda.is_current_stream_capturing():
            # the table's host-to-device copy would be captured with a host buffer reused later
            raise Unsupported("CUDA graph capture")


def uniform_lists(lists):
    """The shapes of list 0 after checking that every list is served as one launch: one float dtype
    and the current device throughout, contiguous tensors, list 0's shapes; else Unsupported."""
    first = lists[0]
    t0 = first[0]
    _first_checks(t0)
    dtype, dev = t0.dtype, t0.get_device()
    shapes = list(map(_shape, first))
    one_dtype, one_dev = {dtype}, {dev}
    for lst in lists:
        if set(map(_dtype, lst)) != one_dtype:
            raise Unsupported("tensors of different dtypes")
        if set(map(_dev, lst)) != one_dev:
            raise Unsupported("tensors on different devices")
        if not all(map(_contig, lst)):
            raise Unsupported("non-contiguous tensor")
        if lst is not first and list(map(_shape, lst)) != shapes:
            raise Unsupported("tensors of different shapes")   # ATen's loop broadcasts or raises
    return shapes


def table(first, numel, ptr_cols, extra, chunk):
    """The launch's table (module doc) on list 0's device, rows [n_i, ptr_cols.., extra..], as
    (table, programs, TOP, Base, whether every address in ptr_cols is 16-byte aligned); None when
    there is no element to visit."""
    counts = [-(-k // chunk) for k in numel]
    starts = array("q", itertools.accumulate(counts, initial=0))
    total = starts.pop()
    if total == 0:
        return None
    starts.extend(itertools.chain.from_iterable(zip(numel, *ptr_cols, *extra)))
    tab = _device_table(starts, first[0].device)
    # Base: a tensor with memory (an empty tensor's address may be 0, which a launcher refuses)
    base = first[next(j for j, k in enumerate(numel) if k)]
    aligned = reduce(operator.or_, itertools.chain.from_iterable(ptr_cols)) & 15 == 0
    n = len(numel)
    top = 1 << (n - 1).bit_length() - 1 if n > 1 else 0
    return tab, total, top, base, aligned
