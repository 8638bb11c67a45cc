"""Call plans: everything a call's signature decides, computed once; a repeat call is a lookup,
the allocations and the launches.

Why: an eager model calls each op with a handful of signatures, millions of times. What depends only
on the signature (dtypes, shapes, strides, devices, 16-byte alignment, the values of non-tensor
arguments) -- support checks, type promotion, broadcasting, output strides, layout planning, tiles,
grids, the compiled binary -- need not be redone per call.

How: the second call of a signature (the dispatcher's GEMS_PLAN_AFTER; the first runs unrecorded) runs
the implementation normally while a `Recording` watches it:
every output allocation (`runtime.alloc.empty` / `zeros`), every kernel launch (`LaunchCache.run`)
and, through a TorchDispatchMode, every other ATen op the implementation calls. If it did nothing
but allocate, launch and take views, the recording becomes a *plan*: a small generated Python
function that allocates the same outputs, launches the same binaries directly through Triton's C
launcher with the same grid and constant arguments, and substitutes only what changes per call:
the tensors' data pointers and the values the op marked *dynamic* (a Python scalar operand such as
the `2.0` of `x * 2.0`, `.item()` of a CPU 0-dim tensor). Anything else -- another ATen op (a copy,
`resize_`, `.item()`, `zero_`), an autotuning run, a kernel argument that is neither an input, an
allocation nor a view of one, an ambiguous alias -- marks the signature "no plan" and it keeps the
full path (still correct, just slower). Plans are bounded per overload.

Per call on a hit: the signature tuple, a dict lookup, then the plan: in-place/`out=` overlap guards
(a plan declines with MISS when a written tensor's memory meets another argument's; the full path
then decides exactly as before), `torch.empty_strided` per output, one C launch per kernel.

The generated source of each plan is registered with `linecache` under a readable name
(`<gems plan add.Tensor #3>`), so tracebacks and debuggers show the code that ran. Where the C++
fast path replays the plan (a recipe), the source is compiled only when Python first runs it
(`LazyPlan`): decode meets new signatures every token (the KV cache grows), and a new signature of
`cat` cost 490 us of host with the compile and 264 without (CPU, launches stubbed, session 26).
"""
from __future__ import annotations

import itertools
import math
import linecache
import threading
from typing import Optional

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from .abi import (CONVERSIONS, INF_RANGE, LIST_REF, MAX_PARAMS, MAX_PLANS, NUMBER_RANGES, PHILOX_OFFSET_BASE,
                  PHILOX_SEED_BIT, PTR_TYPE, PTYPES)

_T = torch.Tensor
MISS = object()            # a plan's answer when it declines this call (the full path runs)
NO_PLAN = object()         # cache value: this signature keeps the full path
SEEN = object()            # cache value: called once, unrecorded (the dispatcher's GEMS_PLAN_AFTER=2)

_counter = itertools.count()


# --------------------------------------------------------------------------------------------------
# recording state (thread-local) and the hooks the runtime calls
# --------------------------------------------------------------------------------------------------

class _State(threading.local):
    rec: Optional["Recording"] = None


_STATE = _State()


def active() -> Optional["Recording"]:
    return _STATE.rec


def taint(why: str, transient: bool = False):
    """Called by code that does something a plan cannot repeat (a host read, ...). `transient`: only
    this call is special (it ran an autotuning benchmark): the next call of the signature records."""
    rec = _STATE.rec
    if rec is not None and rec.tainted is None:
        rec.tainted = why
        rec.transient = transient



def dynamic(slots: dict):
    """The next launch takes these kernel arguments from the call: {arg position: (schema argument
    name, conversion)}, e.g. {1: ("other", "float")} for `x * 2.0` (see CONVERSIONS)."""
    rec = _STATE.rec
    if rec is not None:
        rec.pending_dynamic = dict(slots)


# per-call generator state (plan.philox): the two kernel arguments, in order
PHILOX = ("philox_seed", "philox_offset")


def philox_state(device_index: int, increment: int):
    """(seed, offset) for one launch that draws `increment` Philox counters from the default CUDA
    generator of `device_index`, advancing its offset as ATen's kernels do, so `torch.manual_seed`
    makes runs reproducible and successive calls differ. Both int64-typed (see PHILOX_SEED_BIT)."""
    gen = torch.cuda.default_generators[device_index]
    off = gen.get_offset()
    gen.set_offset(off + increment)
    return (gen.initial_seed() & (PHILOX_SEED_BIT - 1)) | PHILOX_SEED_BIT, off + PHILOX_OFFSET_BASE


def philox(position: int, device_index: int, increment: int):
    """`philox_state(device_index, increment)` for the next launch, whose arguments `position` (seed)
    and `position + 1` (offset) they are; a plan recorded from this call draws them the same way on
    every replay (the C++ fast path reads the generator itself), and declines while the stream is
    being captured into a CUDA graph (the state is read on the host)."""
    rec = _STATE.rec
    if rec is not None:
        rec.pending_dynamic = dict(rec.pending_dynamic or {})
        rec.pending_dynamic[position] = (int(increment), PHILOX[0])
        rec.pending_dynamic[position + 1] = (int(increment), PHILOX[1])
    return philox_state(device_index, increment)


def philox_for(device, position: int, increment: int):
    """(seed, offset) for a launch whose arguments `position` and `position + 1` take them: on CUDA
    `philox` (the default generator, declared to plans); on the interpreter's CPU tensors a seed drawn
    from the CPU generator and offset 0 (an ATen op: such calls keep the full path)."""
    if device.type == "cuda":
        return philox(position, device.index if device.index is not None else torch.cuda.current_device(),
                      increment)
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item()), 0


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


# ATen ops an implementation may call without making its plan wrong: views (no data touched) and
# allocations (a plan only ever uses recorded ones; an unrecorded tensor cannot be mapped anyway).
_HARMLESS = frozenset("""view as_strided expand t transpose permute squeeze unsqueeze select slice alias
detach _reshape_alias unfold unflatten diagonal split split_with_sizes unbind narrow empty empty_strided empty_like
new_empty new_empty_strided _debug_has_internal_overlap sym_size sym_stride sym_numel
sym_storage_offset is_contiguous sym_is_contiguous _unsafe_view view_as can_cast result_type promote_types
""".split())


# composites that return a view when they can and a copy otherwise: harmless when they returned a view
_VIEW_OR_COPY = frozenset(["reshape", "flatten", "contiguous", "reshape_as", "expand_as"])


class _Watch(TorchDispatchMode):
    """Sees the ATen ops an implementation calls while it is recorded."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        base = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if base in _HARMLESS or self.rec.tainted is not None:
            return out
        if base in _VIEW_OR_COPY and isinstance(out, _T) and isinstance(args[0], _T) and \
                out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr():
            return out   # reshape / contiguous / flatten that returned a view: nothing to repeat
        self.rec.tainted = f"calls aten::{base}"
        return out


class Recording:
    """What one call of an implementation allocated and launched."""

    def __init__(self, values=None):
        self.values = values or {}   # the recorded call's arguments by schema name
        self.allocs = []        # (tensor, zero_fill, poison)
        self.launches = []      # (LaunchCache, entry or None, grid, args, (num_warps, num_stages, maxnreg), dynamic)
        self.tainted = None
        self.transient = False
        self.pending_dynamic = None
        self._watch = None

    def __enter__(self):
        self._prev = _STATE.rec
        _STATE.rec = self
        try:
            self._watch = _Watch(self)
            self._watch.__enter__()
        except Exception:  # noqa: BLE001 - a mode that cannot be entered here: record nothing
            self._watch = None
            self.tainted = "dispatch mode unavailable"
        return self

    def __exit__(self, *exc):
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.__exit__(*exc)
            # the mode and the recording point at each other: left as a cycle, every recording (with the
            # tensors it holds: the call's inputs, outputs and workspaces) waited for the garbage
            # collector, whose collections were half of a recording's host time (CPU, session 28) and
            # kept GPU memory of past calls (decode's KV caches) alive until then
            watch.rec = None
        _STATE.rec = self._prev
        self._prev = None
        return False

    # hooks ------------------------------------------------------------------------------------
    def alloc(self, t, zero, poison):
        self.allocs.append((t, zero, poison))

    def launch(self, lc, entry, grid, args, num_warps, num_stages, maxnreg=None):
        dyn, self.pending_dynamic = self.pending_dynamic, None
        self.launches.append((lc, entry, tuple(grid), tuple(args), (num_warps, num_stages, maxnreg), dyn or {}))


def quiet():
    """Context: ATen ops run here (allocations the recording notes itself, the interpreter's storage
    copies, poison fills, a sanctioned `.item()`) are not the implementation's and must not taint the
    recording. It turns Python dispatch off (the recording's mode is the only one on the stack inside
    an implementation): an allocation under the mode cost 17 us, under this guard 3 (popping the
    modes instead: 11; CPU, session 27)."""
    return torch._C._DisableTorchDispatch() if _STATE.rec is not None else _NULL


class suspended:
    """Context: nothing is recorded inside (an autotuner's timing runs: the call's plan is tainted
    already, and a recording would keep every workspace those runs allocate alive until the call
    ends: hundreds of them)."""

    def __enter__(self):
        self.rec, _STATE.rec = _STATE.rec, None
        return self

    def __exit__(self, *a):
        _STATE.rec = self.rec
        return False


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_NULL = _Null()


# --------------------------------------------------------------------------------------------------
# signatures: one generated function per overload, from its schema
# --------------------------------------------------------------------------------------------------

def _params(schema):
    """(python parameter list, [(name, type string, mutable)], defaults namespace) for a schema; the
    namespace is the caller's own (it adds to it)."""
    params, info, ns, _ = _schema_parts(schema)
    return params, info, dict(ns)


_SCHEMA_PARTS: dict = {}    # id(schema) -> (schema, parts): some schemas do not hash (List[int] defaults)


def _schema_parts(schema):
    """_params' parts and, per argument, (name, has a default, the default): a function of the
    overload alone, computed once (it was 35 us of each recording, CPU, session 27). Do not mutate."""
    hit = _SCHEMA_PARTS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    params, info, ns = _params_uncached(schema)
    defaults = tuple((a.name, (a.has_default_value() if hasattr(a, "has_default_value")
                               else a.default_value is not None), a.default_value) for a in schema.arguments)
    parts = (params, info, ns, defaults)
    _SCHEMA_PARTS[id(schema)] = (schema, parts)    # (the schema kept: its id stays its own)
    return parts


def _params_uncached(schema):
    parts, info, ns, seen_kw = [], [], {}, False
    for i, a in enumerate(schema.arguments):
        if a.kwarg_only and not seen_kw:
            parts.append("*")
            seen_kw = True
        name = a.name
        has_default = a.has_default_value() if hasattr(a, "has_default_value") else a.default_value is not None
        if has_default or a.kwarg_only:
            ns[f"_D{i}"] = a.default_value if has_default else None
            parts.append(f"{name}=_D{i}")
        else:
            parts.append(name)
        mutable = a.alias_info is not None and a.alias_info.is_write
        info.append((name, str(a.type), mutable))
    return ", ".join(parts), info, ns


_TENSOR_SIG = "({0}.dtype, {0}.shape, {0}.stride(), {0}.data_ptr() & 15, {0}.get_device())"


def _num_sig(v):
    c = v.__class__
    if c is float:
        return (c, v.hex())          # -0.0 and nan key exactly
    return (c, v)


def _dyn_sig(v):
    """Signature part of a per-call number: its class, sign, NaN-ness and range class (number_range),
    and for ints what Triton specializes a binary on (== 1 becomes a constant; divisibility by 16;
    the 32/64-bit range, which the range class holds), so a plan's binary is always the one Triton
    would pick for the value, and every check that reads a number's sign, zero-ness, NaN-ness or
    whether it fits a dtype (ATen's overflow check: gems.codegen.generator.number_misfit) decides
    the same for every call of the signature. csrc/fastpath.cpp's key_number keys the same facts."""
    c = v.__class__
    if c is float:
        if 0.0 < v <= 127.0 or (v == 0.0 and _copysign(1.0, v) > 0):
            return float            # the common case: non-negative, fits every dtype's range
        return _float_sig(v)
    if c is bool:
        return (bool, v)            # passed as 0/1: 1 is specialized
    if isinstance(v, int):
        if 2 <= v <= 127:
            return _SMALL_INT if v & 15 else _SMALL_INT16
        return (int, v == 1, v & 15 == 0, number_range(v), (v > 0) - (v < 0))
    return _float_sig(float(v)) if isinstance(v, float) else c   # float subclasses (numpy), complex


_SMALL_INT = (int, False, False, 0, 1)      # 2 <= v <= 127, v % 16 != 0
_SMALL_INT16 = (int, False, True, 0, 1)     # 16, 32, ..., 112


def number_range(v) -> int:
    """The range class of a number (not NaN); see NUMBER_RANGES."""
    for i, (lo, hi) in enumerate(NUMBER_RANGES):
        if lo <= v <= hi:
            return i
    return INF_RANGE if v in (float("inf"), float("-inf")) else len(NUMBER_RANGES)


def _float_sig(v):
    if v != v:
        return _NAN_NUMBER          # NaN-ness too: an op's check may send NaN numbers to ATen
    r, neg = number_range(v), _copysign(1.0, v) < 0    # -0.0 is "negative": its own signature
    return float if r == 0 and not neg else (float, r, neg)


_NAN_NUMBER = ("nan",)
_copysign = math.copysign


def _tensor_list_sig(ts):
    """Signature part of a tensor list: per element what a tensor argument keys (the length too)."""
    return tuple([(t.dtype, t.shape, t.stride(), t.data_ptr() & 15, t.get_device()) for t in ts])


def _only_list_sig(ts):
    """_tensor_list_sig and the aliasing pattern of a call whose only tensors are this list's (cat):
    unrolled for two elements, the models' case (KV-cache append, rotate_half)."""
    if len(ts) == 2:
        a, b = ts
        return ((a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.get_device()),
                (b.dtype, b.shape, b.stride(), b.data_ptr() & 15, b.get_device()), a is b)
    return _tensor_list_sig(ts), _alias_pattern(ts)


def _alias_sig(tensors, lists):
    """Which of the call's tensors (top-level tensor arguments, then each list's elements) are the same
    object: None when all are distinct, else per tensor the position of its first occurrence."""
    objs = [t for t in tensors if isinstance(t, _T)]
    for ts in lists:
        objs += ts
    return _alias_pattern(objs)


def _alias_pattern(objs):
    ids = list(map(id, objs))
    if len(set(ids)) == len(ids):
        return None
    first = {}
    return tuple([first.setdefault(i, j) for j, i in enumerate(ids)])


def make_signature(schema, dynamic=frozenset(), on_cuda=False):
    """A function of the overload's arguments returning a hashable signature, or None when the schema
    has arguments a plan cannot key (lists of optional tensors, generators). A tensor list (`Tensor[]`)
    keys each element like a tensor argument; its elements join the aliasing pattern."""
    params, info, ns = _params(schema)
    parts, tensors, lists = [], [], []
    for name, ty, _ in info:
        opt = ty.startswith("Optional[")
        base = ty[9:-1] if opt else ty
        if base == "Tensor":
            # a Python number arrives at a Tensor position for wrapped numbers (`x * 2.0`)
            num = f"_dyn({name})" if name in dynamic else f"_num({name})"
            e = f"({_TENSOR_SIG.format(name)} if isinstance({name}, _T) else {num})"
            parts.append(f"(None if {name} is None else {e})" if opt else e)
            tensors.append(name)
        elif base in ("number", "int", "float", "bool", "SymInt"):
            # ints also carry dtypes, layouts and memory formats (by value)
            parts.append(f"_dyn({name})" if name in dynamic else f"(None if {name} is None else _num({name}))")
        elif base in ("List[int]", "List[bool]", "List[SymInt]"):
            parts.append(f"(None if {name} is None else tuple({name}))")
        elif base in ("str", "Device"):
            parts.append(name)
        elif ty == "List[Tensor]":
            # a tensor list (cat's `tensors`): per element what a tensor argument keys
            parts.append(f"_tlist({name})")
            lists.append(name)
            list_part = len(parts) - 1
        else:
            return None   # optional-tensor lists, generators, ...: no plan for this overload
    # aliasing between tensor arguments changes what a kernel may do (x + x vs x + y is harmless,
    # but a plan maps kernel arguments to argument positions, so the pattern is part of the key)
    if lists:
        # list elements count as tensor arguments: one identity pattern over all of them
        if not tensors and len(lists) == 1:
            parts[list_part] = f"_tlist1({lists[0]})"    # elements and their aliasing in one pass
        else:
            parts.append(f"_alias(({''.join(t + ', ' for t in tensors)}), ({', '.join(lists)},))")
    else:
        for a, b in itertools.combinations(tensors, 2):
            parts.append(f"{a} is {b}")
    if on_cuda:
        parts.append("_cur()")
    # int -> float promotions (true division, exp of ints, int tensor + 1.5) follow the default dtype
    parts.append("_ddt()")
    body = f"    return ({', '.join(parts)},)\n"
    plain = [name for name, ty, _ in info if ty == "Tensor"]
    if plain and not lists:
        # the common call, every Tensor argument a tensor: one flat tuple (no inner tuples to build
        # and hash; about 0.9 us less per two-tensor call on the Python path). It is longer than the
        # general form's tuple (4 more elements per tensor), so the two kinds of key never meet.
        flat = [_TENSOR_SIG.format(name)[1:-1] if name in plain else part
                for (name, _, _), part in zip(info, parts)] + parts[len(info):]
        test = " and ".join(f"isinstance({n}, _T)" for n in plain)
        body = f"    if {test}:\n        return ({', '.join(flat)},)\n" + body
    src = f"def sig({params}):\n{body}"
    ns.update(_T=_T, _num=_num_sig, _dyn=_dyn_sig, _cur=getattr(torch._C, "_cuda_getDevice", None),
              _ddt=torch.get_default_dtype, _tlist=_tensor_list_sig, _alias=_alias_sig,
              _tlist1=_only_list_sig)
    name = f"<gems signature {schema.name}.{schema.overload_name or 'default'}>"
    return compile_source(src, name, ns)["sig"]


def compile_source(src, filename, ns):
    """exec generated source under a readable file name that tracebacks can show (linecache)."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - generated from a schema and a recording
    return ns


# --------------------------------------------------------------------------------------------------
# building a plan from a recording
# --------------------------------------------------------------------------------------------------

def record(fn, schema, args, kwargs, direct: bool, values=None, lazy: bool = False):
    """The recording call of a signature: fn(*args, **kwargs) under a Recording, then its plan.
    Returns (result, plan or None, recording): `recording.tainted` says why there is no plan, and
    `recording.transient` whether the next call of the signature should record again. lazy: a plan
    with a C++ recipe is a `LazyPlan` (its Python function compiled on first use)."""
    rec = Recording(values if values is not None else named_args(schema, args, kwargs))
    with rec:
        out = fn(*args, **kwargs)
    try:
        p = build(rec, schema, args, kwargs, out, direct, lazy)
    except Exception as e:  # noqa: BLE001 - a plan is an optimization: never fail the call for it
        p = None
        rec.tainted = f"plan build failed: {type(e).__name__}: {e}"
    return out, p, rec


def named_args(schema, args, kwargs) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    out = {}
    n = len(args)
    for i, (name, has_default, default) in enumerate(_schema_parts(schema)[3]):
        if i < n:
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        else:
            out[name] = default if has_default else None
    return out


def _extent(t):
    """Bytes from t's first element to one past its last (non-negative strides)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)) * t.element_size()


class _Ref:
    """Where a kernel argument or result lives: a known tensor (an input by schema name or an
    allocation `o{j}`), a byte offset into it, and the view's geometry when it is not that tensor."""
    __slots__ = ("name", "off", "view")

    def __init__(self, name, off, view):
        self.name, self.off, self.view = name, off, view


def _rebase(d):
    """A function of a tensor: descriptor `d` (Triton's or Gluon's host TMA descriptor) over that
    tensor, every other field as recorded. The recorded base is left out: a plan lives in its cache
    (up to MAX_PLANS signatures per overload) and would keep the recording call's tensor alive, e.g.
    a prefill's activations and KV cache for every prompt length a server met."""
    cls, fields = d.__class__, dict(d.__dict__)
    fields.pop("base", None)
    new = object.__new__

    def rebased(base):
        out = new(cls)
        out.__dict__.update(fields)
        out.base = base
        return out
    return rebased


def build(rec: Recording, schema, args, kwargs, result, direct: bool, lazy: bool = False):
    """The plan function for this recording, or None (with `rec.tainted` saying why, when known).

    The plan carries `__gems_recipe__`: the same plan as data for the C++ fast path (see
    `_recipe`), or None where the plan uses something the C++ side does not replay. lazy and a
    recipe: a `LazyPlan`, whose Python function is compiled when it first runs."""
    if rec.tainted is not None:
        return None
    params, info, ns = _params(schema)
    values = rec.values or named_args(schema, args, kwargs)
    inputs = [(n, values[n]) for n, ty, _ in info if isinstance(values[n], _T)]
    # elements of tensor lists are inputs too, named by their position (`tensors[1]`): the signature
    # keys the list's length and aliasing, so the position names the same tensor on every call
    inputs += [(f"{n}[{i}]", t) for n, ty, _ in info if ty == "List[Tensor]" and values[n] is not None
               for i, t in enumerate(values[n])]
    allocs = [(f"o{j}", t) for j, (t, _, _) in enumerate(rec.allocs)]
    known = inputs + allocs
    lines = []
    consts = {}

    def const(v):
        k = f"_k{len(consts)}"
        consts[k] = v
        return k

    def ref(t):
        """The _Ref of tensor `t`, or None (tainting the recording)."""
        for n, v in known:
            if v is t:
                return _Ref(n, 0, None)
        # a view: find the one known tensor whose memory holds it
        p = t.data_ptr()
        hits = [(n, v) for n, v in known if v.numel() and v.data_ptr() <= p < v.data_ptr() + max(_extent(v), 1)]
        if len({id(v) for _, v in hits}) == 1:
            hits = hits[:1]     # one tensor passed as two arguments (the signature keys that aliasing)
        if len(hits) != 1:
            rec.tainted = "kernel argument is not an input, an allocation or a view of exactly one"
            return None
        n, v = hits[0]
        off = p - v.data_ptr()
        view = None
        if v.dtype == t.dtype and off % t.element_size() == 0:
            view = (tuple(t.shape), tuple(t.stride()), off // t.element_size())
        return _Ref(n, off, view if view is not None else False)

    def tensor_expr(r, as_pointer):
        if as_pointer:
            return f"({r.name}.data_ptr() + {r.off})" if r.off else f"{r.name}.data_ptr()"
        if r.view is None:
            return r.name
        if r.view is False:
            rec.tainted = "a view with another dtype"
            return None
        shape, stride, eoff = r.view
        return f"{r.name}.as_strided({shape!r}, {stride!r}, {r.name}.storage_offset() + {eoff})"

    # guards: a written tensor whose memory meets another argument's goes to the full path
    mutable = [n for n, ty, m in info if m and isinstance(values[n], _T)]
    guards = []
    for m in mutable:
        for n, v in inputs:
            if n == m:
                continue
            em, ev = _extent(values[m]), _extent(v)
            if em and ev:
                guards.append((m, n, em, ev))
                lines.append(f"    if {m}.data_ptr() < {n}.data_ptr() + {ev} and {n}.data_ptr() < {m}.data_ptr() + {em}:")
                lines.append("        return _MISS")
    for j, (t, zero, poison) in enumerate(rec.allocs):
        dt, dv = const(t.dtype), const(t.device)
        lines.append(f"    o{j} = _empty_strided({tuple(t.shape)!r}, {tuple(t.stride())!r}, dtype={dt}, device={dv})")
        if zero:
            lines.append(f"    o{j}.zero_()")
        elif poison:
            lines.append(f"    _poison(o{j})")
    if direct:
        lines.insert(0, "    if _hooks():\n        return _MISS")
    launches = []    # per launch: (entry, grid, [(kind, value)]) for the recipe
    random = False
    for i, (lc, entry, grid, kargs, opts, dyn) in enumerate(rec.launches):
        exprs, parts = [], []
        for pos, a in enumerate(kargs):
            if pos in dyn and dyn[pos][1] in PHILOX:
                increment, which = dyn[pos]
                if which == PHILOX[0]:
                    lines.append(f"    _ps{i}, _po{i} = _philox({_dev_index(kargs)}, {increment})")
                exprs.append(f"_ps{i}" if which == PHILOX[0] else f"_po{i}")
                parts.append(("philox", (PHILOX.index(which), increment)))
                random = True
            elif pos in dyn:
                name, conv = dyn[pos]
                exprs.append(f"{name}.item()" if conv == ".item()" else (f"{conv}({name})" if conv else name))
                parts.append(("dyn", (name, conv)))
            elif isinstance(a, _T):
                r = ref(a)
                e = None if r is None else tensor_expr(r, direct)
                if e is None:
                    return None
                exprs.append(e)
                parts.append(("tensor", r))
            elif a is None or a.__class__ in (bool, int) and -2**62 < a < 2**62:
                exprs.append(repr(a))
                parts.append(("const", a))
            elif isinstance(getattr(a, "base", None), _T) and hasattr(a, "block_shape"):
                # a TMA descriptor (Triton's or Gluon's): its shape, strides and block are functions of
                # the signature, its base is this call's tensor. The plan rebuilds it per call; the
                # C++ recipe encodes it once and puts in each call's address
                r = ref(a.base)
                e = None if r is None else tensor_expr(r, False)
                if e is None:
                    return None
                exprs.append(f"{const(_rebase(a))}({e})")
                parts.append(("desc", (r, a)))
            else:
                exprs.append(const(a))
                parts.append(("const", a))
        g = tuple(grid) + (1,) * (3 - len(grid))
        nw, ns_, maxnreg = opts
        launches.append((lc, entry, g, parts, opts, _dev_index(kargs) if direct else None))
        if direct and entry is not None and entry[1] is not None:
            kernel, launch, function, coop, pdl, meta = entry
            lines.append(f"    {const(launch)}({g[0]}, {g[1]}, {g[2]}, _stream({const(_dev_index(kargs))}), "
                         f"{const(function)}, {const(coop)}, {const(pdl)}, None, None, {const(meta)}, None, None, "
                         f"None, {', '.join(exprs)})")
        elif direct:
            rec.tainted = "kernel without a direct launcher"
            return None
        else:
            cap = "" if maxnreg is None else f", maxnreg={maxnreg}"
            lines.append(f"    {const(lc.fn)}[{g!r}]({', '.join(exprs)}, num_warps={nw}, num_stages={ns_}{cap})")

    if random:
        if not direct:
            rec.tainted = "per-call Philox state outside CUDA"
            return None
        lines.insert(0, "    if _capturing():\n        return _MISS")
    results = list(result) if isinstance(result, tuple) else [result]
    refs, parts = [], []
    for r in results:
        if r is None and isinstance(result, tuple):   # e.g. a backward's gradient not asked for
            refs.append(None)
            parts.append("None")
            continue
        if r.__class__ is int and isinstance(result, tuple) and -2**62 < r < 2**62 and \
                _symint_returns(schema)[len(refs)]:
            # a SymInt result (attention's max_q / max_k) is a size: a function of the shapes the
            # signature keys, so the recorded value is every call's
            refs.append(r)
            parts.append(repr(r))
            continue
        if not isinstance(r, _T):
            rec.tainted = "result not mappable"
            return None
        rr = ref(r)
        e = None if rr is None else tensor_expr(rr, False)
        if e is None:
            rec.tainted = rec.tainted or "result not mappable"
            return None
        refs.append(rr)
        parts.append(e)
    ret = "(" + "".join(p + ", " for p in parts) + ")" if isinstance(result, tuple) else parts[0]
    lines.append(f"    return {ret}")
    src = f"def plan({params}):\n" + "\n".join(lines) + "\n"
    ns.update(consts)
    from . import alloc
    ns.update(_MISS=MISS, _empty_strided=torch.empty_strided, _poison=alloc.poison, _hooks=hooks_active,
              _philox=philox_state, _capturing=_capturing,
              _stream=getattr(torch._C, "_cuda_getCurrentRawStream", None))
    name = f"<gems plan {schema.name.split('::')[-1]}.{schema.overload_name or 'default'} #{next(_counter)}>"
    try:
        recipe = _recipe(schema, rec, guards, launches, refs, direct)
    except _NoRecipe:
        recipe = None
    if lazy and recipe is not None:
        return LazyPlan(src, name, ns, recipe)
    return _compile_plan(src, name, ns, recipe)


def _compile_plan(src, name, ns, recipe):
    fn = compile_source(src, name, ns)["plan"]
    fn.__gems_source__ = src
    fn.__gems_recipe__ = recipe
    return fn


class LazyPlan:
    """A plan whose Python function is compiled when it first runs. Why: where the C++ fast path
    replays a signature from its recipe, the Python function is rarely called, and compiling it was a
    third of a new signature's host cost (163 of 490 us for a `cat`, CPU, session 26). Decode meets a
    new signature every token (the KV cache's length), for several ops. The compiled function
    replaces it in its plan cache (`PlanCache.put` tells it where) when it is first
    compiled, so later Python-side hits call the function itself."""

    __slots__ = ("__gems_source__", "__gems_recipe__", "_name", "_ns", "_fn", "slot")

    def __init__(self, src, name, ns, recipe):
        self.__gems_source__, self.__gems_recipe__ = src, recipe
        self._name, self._ns, self._fn = name, ns, None
        self.slot = None     # (plans dict, key) of the cache holding it

    def compiled(self):
        fn = self._fn
        if fn is None:
            fn = self._fn = _compile_plan(self.__gems_source__, self._name, self._ns, self.__gems_recipe__)
            if self.slot is not None:
                plans, key = self.slot
                if plans.get(key) is self:
                    plans[key] = fn
        return fn

    def __call__(self, *args, **kwargs):
        return self.compiled()(*args, **kwargs)

    @property
    def __code__(self):
        return self.compiled().__code__

    @property
    def __globals__(self):
        """The namespace the function is (or will be) compiled in, as a function's `__globals__`: what
        the plan calls (a descriptor rebuild, say) can be inspected without compiling it."""
        return self._ns


def _symint_returns(schema):
    """Per return of the schema: whether it is declared SymInt (a size). Python's schema objects show
    SymInt as `int`; the schema's text keeps the declaration."""
    text = str(schema).rpartition(") -> ")[2].strip()
    if text.startswith("("):
        text = text[1:-1]
    return [part.strip().startswith("SymInt ") or part.strip() == "SymInt" for part in text.split(",")]


class _NoRecipe(Exception):
    """The plan uses something the C++ fast path does not replay (it keeps the Python plan)."""


def param_type(ty) -> Optional[int]:
    """The fast path's code (abi.PTYPES) of a Triton signature type: PTR_TYPE for a pointer, PTYPES'
    code for a number, None for what it cannot pass (a constexpr, a tuple, ...)."""
    if not isinstance(ty, str):
        return None
    return PTR_TYPE if ty.startswith("*") else PTYPES.get(ty)


def _pack(value, ty: str) -> int:
    """A constant kernel argument as the bits Triton's launcher would pass (little endian)."""
    import struct
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    if ty in ("fp16", "bf16"):
        t = torch.tensor(float(value), dtype=torch.float16 if ty == "fp16" else torch.bfloat16)
        return int(t.view(torch.int16).item()) & 0xFFFF
    return int(value) & 0xFFFFFFFFFFFFFFFF


def _recipe(schema, rec, guards, launches, refs, direct):
    """The plan as data for the C++ fast path (the layout fastpath.cpp's parse_recipe reads):
    (guards, allocations, launches, results), every tensor named by (0, schema argument index) or
    (1, allocation index), or (3, argument index << 20 | element index) for a tensor-list element
    (`tensors[2]`); a guard's other tensor is an argument index, or LIST_REF + that code. A result
    may also be (2, 0, None): undefined, or (4, value, None): a constant int."""
    index = {a.name: i for i, a in enumerate(schema.arguments)}

    def src(name):
        if name in index:
            return 0, index[name]
        if name.endswith("]"):
            arg, _, elem = name[:-1].partition("[")
            if int(elem) >= 1 << 20:
                raise _NoRecipe
            return 3, index[arg] << 20 | int(elem)
        return 1, int(name[1:])

    def other(name):
        kind, i = src(name)
        return i if kind == 0 else LIST_REF + i

    g = tuple((index[m], other(n), em, ev) for m, n, em, ev in guards)
    allocs = []
    for t, zero, poison in rec.allocs:
        allocs.append((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), 1 if zero else 2 if poison else 0))
    ls = []
    for lc, entry, grid, parts, (nw, ns_, maxnreg), dev_index in launches:
        params = []
        if direct:
            kernel = entry[0]
            _, _, function, coop, pdl, _meta = entry
            md = kernel.metadata
            if coop or pdl or getattr(md, "num_ctas", 1) != 1:
                raise _NoRecipe
            types = list(kernel.src.signature.values())
            if len(types) != len(parts):
                raise _NoRecipe
            metas = iter(getattr(md, "tensordesc_meta", None) or ())
            for ty, (kind, v) in zip(types, parts):
                if ty == "constexpr":
                    continue
                if not isinstance(ty, str):
                    raise _NoRecipe
                if ty.startswith("tensordesc") != (kind == "desc"):
                    raise _NoRecipe
                if kind == "desc":
                    r, d = v
                    tmap, shape, strides = _tensor_map(d, next(metas, None))
                    params.append((4, *src(r.name), r.off, tmap))
                    params += [(1, PTYPES["i32"], _pack(x, "i32")) for x in shape]
                    params += [(1, PTYPES["i64"], _pack(x, "i64")) for x in strides]
                elif kind == "tensor":
                    if not ty.startswith("*"):
                        raise _NoRecipe
                    params.append((0, *src(v.name), v.off, None))
                elif ty not in PTYPES:
                    raise _NoRecipe
                elif kind == "dyn":
                    name, conv = v
                    params.append((2, index[name], CONVERSIONS[conv], PTYPES[ty]))
                elif kind == "philox":
                    if ty != "i64":
                        raise _NoRecipe
                    which, increment = v
                    params.append((3, which, increment, dev_index))
                else:
                    if v is None:
                        raise _NoRecipe
                    params.append((1, PTYPES[ty], _pack(v, ty)))
            if len(params) > MAX_PARAMS:
                raise _NoRecipe     # the C++ replay's parameter array; the Python plan still serves
            ls.append((0, int(function), grid, 32 * md.num_warps, int(md.shared), dev_index, tuple(params)))
        else:
            for kind, v in parts:
                if kind == "desc":
                    raise _NoRecipe     # the interpreter's descriptors stay with the Python plan
                if kind == "tensor":
                    if v.view is False:
                        raise _NoRecipe
                    params.append((0, *src(v.name), 0, v.view))
                elif kind == "dyn":
                    name, conv = v
                    params.append((2, index[name], CONVERSIONS[conv], 0))
                else:
                    params.append((1, None, v))
            ls.append((1, _interpreter_launch(lc.fn, grid, nw, ns_, maxnreg), None, None, None, None, tuple(params)))
    res = []
    for r in refs:
        if r is None:
            res.append((2, 0, None))
            continue
        if r.__class__ is int:
            res.append((4, r, None))     # a constant int result
            continue
        if r.view is False:
            raise _NoRecipe
        res.append((*src(r.name), r.view))
    return (g, tuple(allocs), tuple(ls), tuple(res))


# the dispatcher's re-entry guard (a context class), set by gems.dispatch, which imports this module
reentry_guard = None


def _interpreter_launch(fn, grid, num_warps, num_stages, maxnreg=None):
    """A launch the C++ fast path calls back under the interpreter. The interpreter copies storages
    with ATen ops Gems may serve: the re-entry guard is up while it runs (as for a Python plan)."""
    cap = {} if maxnreg is None else {"maxnreg": maxnreg}

    def launch(*args):
        with reentry_guard():
            fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **cap)
    return launch


# Triton's TMA data type codes differ between the compiler's metadata and the driver's enum
# (driver.py TMA_DTYPE_DEVICE_TO_HOST): 8, 9, 10 map to 10, 8, 9
_TMA_DTYPE_TO_DRIVER = {8: 10, 9: 8, 10: 9}


def _tensor_map(d, meta):
    """The C++ recipe's form of host descriptor `d` for a kernel compiled with TMA metadata `meta`
    (one entry of `tensordesc_meta`): ((address, driver data type, dims, byte strides, box, swizzle,
    out-of-bounds fill), shape, strides), the parameters Triton's launcher passes for it
    (driver.make_tensordesc_arg: the encoded map, then the shape as i32 and the strides as i64), with
    the encoding's arrays innermost first as driver.c's fillTMADescriptor gives them to
    cuTensorMapEncodeTiled. A kernel lowered without TMA metadata (descriptors decomposed into
    pointers) gets no recipe."""
    if meta is None or d.strides[-1] != 1:
        raise _NoRecipe
    shape = list(d.shape)
    if meta["fp4_padded"]:
        shape[-1] *= 2
    size = meta["elem_size"]
    block = list(meta["block_size"])
    if len(block) != len(shape) or not 1 <= len(shape) <= 5:
        raise _NoRecipe
    fill = 1 if d.padding == "nan" else 0
    dtype = _TMA_DTYPE_TO_DRIVER.get(meta["elem_type"], meta["elem_type"])
    tmap = (d.base.data_ptr(), dtype, tuple(reversed(shape)), tuple(size * s for s in reversed(d.strides[:-1])),
            tuple(reversed(block)), meta["swizzle"], fill)
    return tmap, shape, list(d.strides)


def _dev_index(kargs):
    for a in kargs:
        if isinstance(a, _T) and a.is_cuda:
            return a.get_device()
    return torch.cuda.current_device()


_knobs_runtime = triton.knobs.runtime


def hooks_active() -> bool:
    """Whether a Triton launch hook listens (a profiler such as proton): plans then decline, and the
    launch goes through Triton's own path, which gives the hook what it expects."""
    rt = _knobs_runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    # triton 3.6 keeps hooks as (usually empty) HookChain objects; older versions use None
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class AtenPlan:
    """A signature whose plan is ATen's kernel: the implementation decided so for the whole signature
    (`Unsupported(reason, signature=True)`, e.g. a GEMM bucket where cuBLAS was measured faster), so
    a repeat call skips the implementation and its checks and goes straight to ATen (counted as a
    fallback with that reason)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class PlanCache:
    """Plans of one overload, keyed by call signature; bounded."""

    __slots__ = ("plans", "built", "declined", "reasons")

    def __init__(self):
        self.plans: dict = {}
        self.built = self.declined = 0
        self.reasons: dict = {}

    def _room(self, key):
        """Evict the oldest signature when a new key would exceed MAX_PLANS (replacing one never does)."""
        if len(self.plans) >= MAX_PLANS and key not in self.plans:
            self.plans.pop(next(iter(self.plans)))

    def put_seen(self, key):
        """The signature ran once without a recording: its next call records."""
        self._room(key)
        self.plans[key] = SEEN

    def put(self, key, plan, why=None):
        self._room(key)
        if plan is None:
            self.plans[key] = NO_PLAN
            self.declined += 1
            if why:
                self.reasons[why] = self.reasons.get(why, 0) + 1
        else:
            if plan.__class__ is LazyPlan:
                plan.slot = (self.plans, key)
            self.plans[key] = plan
            self.built += 1

    def info(self) -> dict:
        aten = sum(p.__class__ is AtenPlan for p in self.plans.values())
        planned = sum(p is not NO_PLAN and p is not SEEN for p in self.plans.values())
        return {"plans": planned - aten, "aten": aten,
                "no_plan": self.declined,
                "built": self.built, "reasons": dict(self.reasons)}
