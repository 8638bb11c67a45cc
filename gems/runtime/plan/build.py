"""Building a plan from a recording: the generated Python function (and its C++ recipe) that repeats
a recorded call's allocations and launches for a new call of the same signature."""
from __future__ import annotations

import itertools

import torch

from .. import alloc
from .cache import MISS, LazyPlan, compile_plan
from .launchers import dev_index, hooks_active
from .recipe import NoRecipe, make_recipe
from .recording import Recording
from .rng import PHILOX, capturing, philox_state
from .signature import named_args, schema_params, symint_returns

_T = torch.Tensor
_counter = itertools.count()


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


def descriptor_rebuilder(d):
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
    params, info, ns = schema_params(schema)
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
                    lines.append(f"    _ps{i}, _po{i} = _philox({dev_index(kargs)}, {increment})")
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
                exprs.append(f"{const(descriptor_rebuilder(a))}({e})")
                parts.append(("desc", (r, a)))
            else:
                exprs.append(const(a))
                parts.append(("const", a))
        g = tuple(grid) + (1,) * (3 - len(grid))
        nw, ns_, maxnreg = opts
        launches.append((lc, entry, g, parts, opts, dev_index(kargs) if direct else None))
        if direct and entry is not None and entry[1] is not None:
            kernel, launch, function, coop, pdl, meta = entry
            lines.append(f"    {const(launch)}({g[0]}, {g[1]}, {g[2]}, _stream({const(dev_index(kargs))}), "
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
        lines.insert(0, "    if capturing():\n        return _MISS")
    results = list(result) if isinstance(result, tuple) else [result]
    refs, parts = [], []
    for r in results:
        if r is None and isinstance(result, tuple):   # e.g. a backward's gradient not asked for
            refs.append(None)
            parts.append("None")
            continue
        if r.__class__ is int and isinstance(result, tuple) and -2**62 < r < 2**62 and \
                symint_returns(schema)[len(refs)]:
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
    ns.update(_MISS=MISS, _empty_strided=torch.empty_strided, _poison=alloc.poison, _hooks=hooks_active,
              _philox=philox_state, capturing=capturing,
              _stream=getattr(torch._C, "_cuda_getCurrentRawStream", None))
    name = f"<gems plan {schema.name.split('::')[-1]}.{schema.overload_name or 'default'} #{next(_counter)}>"
    try:
        recipe = make_recipe(schema, rec, guards, launches, refs, direct)
    except NoRecipe:
        recipe = None
    if lazy and recipe is not None:
        return LazyPlan(src, name, ns, recipe)
    return compile_plan(src, name, ns, recipe)
