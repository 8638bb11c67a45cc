"""The registry: the single source of truth mapping ATen overloads to Gems implementations.

Every implementation is declared once, next to its code, with `@register(...)`. `enable`, `use_gems`,
the docs' op table and the coverage tool all read this table; nothing else lists ops.

    @register("add.Tensor", "add.out", category="pointwise", dtypes=FLOATS)
    def add(self, other, *, alpha=1, out=None): ...

An implementation may raise `Unsupported("why")` for an input it does not handle (an argument
combination, say) before touching any output: the dispatcher then runs ATen's own kernel and counts
the fallback under that reason in `gems.stats()`.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from .runtime.backends import BACKENDS

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
ALL = FLOATS + INTS + (torch.bool, torch.float64)

CATEGORIES = ("pointwise", "reduction", "norm", "blas", "index", "copy", "other")


class Unsupported(Exception):
    """Raised by an implementation, before it writes anything, for inputs it leaves to ATen.

    `signature=True` says the decision follows from the call's signature alone (shapes, strides,
    dtypes, argument values: e.g. a GEMM bucket where ATen's kernel was measured faster): the
    dispatcher then records it as the signature's plan, so repeat calls go straight to ATen (from C++
    on the fast path) without running the implementation again.
    """

    def __init__(self, reason: str = "", *, signature: bool = False):
        super().__init__(reason)
        self.signature = signature


class AtenError(Exception):
    """Raised by an implementation that found the error ATen raises for this call (`error`, e.g. a
    RuntimeError with ATen's message) where ATen itself must not run the call to raise it: ATen's CUDA
    kernel would report it with a device-side assert, which ends the process's CUDA context. The
    dispatcher raises `error` as is (any other exception from an implementation makes ATen run the
    call, see gems/dispatch/fallback.py)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@dataclass
class OpImpl:
    """One ATen overload served by Gems.

    `dtypes` are the dtypes accepted for the tensor arguments named in `dtype_args` (default: the first
    tensor argument). `check(*args, **kwargs)` may return a reason string to send a call to ATen.
    """

    name: str                      # "add.Tensor", "mm.default"
    fn: Callable
    category: str
    dtypes: tuple
    backward: bool = False
    check: Optional[Callable] = None
    backends: tuple = ("cuda", "interpreter")
    doc: str = ""
    # call plans (runtime/plan/): False for an op whose kernels take per-call values a plan cannot
    # see (random seeds); `dynamic` names the arguments whose numbers are per-call kernel arguments
    plan: bool = True
    dynamic: frozenset = frozenset()
    plan_key: Optional[Callable] = None   # global state the implementation reads (matmul precision)
    # "" or a group ("attention"): a name `include=`/`exclude=` accept for all its overloads
    group: str = ""
    # Tensor arguments ATen takes on the host whatever the device (the packed scalars of
    # _foreach_addcmul.Tensor): a CPU tensor there does not send a GPU call to ATen
    host_args: frozenset = frozenset()
    # a _foreach_* overload the C++ fast path serves whole (ops/foreach/overloads.py: where its lists and
    # its number are among the arguments, and the numbers each dtype takes); None for every other op
    foreach: Optional[dict] = None

    def set_fn(self, fn: Callable):
        """Replace the implementation; whatever was learnt from the old one at run time (its call
        plans, the signatures it failed on) is dropped by the listeners of `on_replace`."""
        self.fn = fn
        for listener in _REPLACE_LISTENERS:
            listener(self.name)

    @property
    def base(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def overload(self) -> str:
        return self.name.split(".", 1)[1]


_IMPLS: dict[str, OpImpl] = {}
_LOCK = threading.Lock()
_REPLACE_LISTENERS: list = []


def on_replace(listener: Callable[[str], None]):
    """Call `listener(name)` whenever an overload's implementation is replaced (`OpImpl.set_fn`): the
    dispatcher drops what it recorded from the old implementation."""
    _REPLACE_LISTENERS.append(listener)


def canonical(name: str) -> str:
    """'mm' -> 'mm.default' only when the op has no other overload; names with a dot are kept."""
    return name if "." in name else name + ".default"


def register(*names: str, category: str, dtypes: Iterable = FLOATS, backward: bool = False,
             check: Optional[Callable] = None, backends: Iterable[str] = ("cuda", "interpreter"),
             plan: bool = True, dynamic: Iterable[str] = (), plan_key: Optional[Callable] = None,
             group: str = "", host_args: Iterable[str] = (), foreach: Optional[dict] = None):
    """Declare that the decorated function implements the ATen overloads `names`.

    Names are ATen overload names as `torch.ops.aten.<base>.<overload>` spells them; a name without
    a dot means the `.default` overload. The function receives exactly ATen's arguments.

    Repeat calls run a cached plan (runtime/plan/) when the recorded call of a signature only
    allocated through `runtime.alloc`, launched `LaunchCache` kernels and took views; `plan=False`
    opts out (kernels seeded per call), `dynamic` names arguments whose Python numbers are passed to
    the kernel per call (the op reports where with `runtime.plan.dynamic`); `plan_key()` returns
    process state the implementation reads besides its arguments (it becomes part of the signature).
    `group="name"` makes the overloads one name for `include=`/`exclude=` (`exclude=("attention",)`).
    `host_args` names Tensor arguments ATen itself reads on the CPU: a CPU tensor there is served, not
    sent to ATen.
    `foreach` (ops/foreach/ only) tells the C++ fast path how to serve a _foreach_* call whole.
    """
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")

    def deco(fn):
        for raw in names:
            name = canonical(raw)
            aten_overload(name)  # fails early on a typo
            with _LOCK:
                if name in _IMPLS:
                    raise ValueError(f"{name} is registered twice ({_IMPLS[name].fn.__module__} and {fn.__module__})")
                _IMPLS[name] = OpImpl(name, fn, category, tuple(dtypes), backward, check, tuple(backends),
                                      (fn.__doc__ or "").strip().split("\n")[0], plan, frozenset(dynamic), plan_key,
                                      group=group, host_args=frozenset(host_args),
                                      foreach=foreach)
        return fn

    return deco


def restrict_backends(name: str, backends: Iterable[str]):
    """Serve an already declared overload only on `backends` (a torch limitation on the others)."""
    with _LOCK:
        _IMPLS[canonical(name)].backends = tuple(backends)


def aten_overload(name: str):
    """torch.ops.aten's OpOverload of canonical name `name` ("add.Tensor"); ValueError if there is none."""
    base, overload = name.split(".", 1)
    try:
        return getattr(getattr(torch.ops.aten, base), overload)
    except AttributeError:
        raise ValueError(f"aten::{name} is not an ATen overload in torch {torch.__version__}") from None


def _load_ops():
    # Importing the op modules fills the table; done lazily so `import gems` stays light.
    from . import ops  # noqa: F401


def all_impls(backend: Optional[str] = None) -> list[OpImpl]:
    """Every registered implementation (for one backend name, when given), sorted by name."""
    _load_ops()
    return [i for _, i in sorted(_IMPLS.items()) if backend is None or backend in i.backends]


def dtypes_on(impl: OpImpl, backend: Optional[str] = None) -> tuple:
    """The dtypes `impl` serves on `backend` (a name): its declared dtypes minus those the backend leaves
    to ATen (bfloat16 on the interpreter, see runtime/backends.py). All declared ones without a backend."""
    if backend is None:
        return impl.dtypes
    be = BACKENDS.get(backend)
    skip = set(be.unserved_dtypes) if be is not None else set()
    return tuple(d for d in impl.dtypes if str(d).replace("torch.", "") not in skip)


def get(name: str) -> OpImpl:
    _load_ops()
    try:
        return _IMPLS[canonical(name)]
    except KeyError:
        raise KeyError(f"Gems does not implement aten::{canonical(name)}") from None


def resolve(names: Optional[Iterable[str]], backend: Optional[str] = None, unknown: str = "ignore") -> set[str]:
    """Expand user-facing names ('add.Tensor' or a base name 'add') to registered overload names.

    A name that is not an ATen op at all is an error, so a typo never silently selects nothing. A name
    that is an ATen op Gems does not implement (on `backend`) selects nothing; `unknown` says what
    else happens: "ignore", "raise" (ValueError naming what Gems does implement nearby: `include=`
    uses it, a selection that selects nothing is a mistake) or "warn" (`exclude=`: excluding
    `softmax` leaves `_softmax`, which it decomposes into, served).
    """
    if names is None:
        return set()
    if isinstance(names, str):
        names = [names]
    impls = all_impls(backend)
    named = groups()
    out = set()
    for n in names:
        if n in named:   # a group ("attention") names its overloads
            out.update(i.name for i in impls if i.group == n)
            continue
        if "." in n:
            aten_overload(n)
            found = {i.name for i in impls if i.name == n}
        else:
            if not hasattr(torch.ops.aten, n):
                raise ValueError(f"aten::{n} is not an ATen op in torch {torch.__version__}")
            found = {i.name for i in impls if i.base == n}
        if not found and unknown != "ignore":
            msg = _not_implemented(n, impls, backend)
            if unknown == "raise":
                raise ValueError(msg)
            if n not in _WARNED_NAMES:
                _WARNED_NAMES.add(n)
                import warnings
                warnings.warn(msg + "; excluding it changes nothing", UserWarning, stacklevel=4)
        out.update(found)
    return out


_WARNED_NAMES: set = set()


def groups() -> set[str]:
    """Names of the groups (`register(..., group=...)`)."""
    _load_ops()
    return {i.group for i in _IMPLS.values() if i.group}


def _not_implemented(n: str, impls, backend) -> str:
    base = n.split(".", 1)[0]
    msg = f"Gems does not implement aten::{n}"
    elsewhere = [i for i in _IMPLS.values() if i.name == n or i.base == n]
    if backend is not None and elsewhere:
        return msg + f" on the {backend} backend (only on {', '.join(sorted({b for i in elsewhere for b in i.backends}))})"
    key = base.strip("_")
    near = sorted({i.base for i in impls if key and key in i.base}, key=lambda b: (b.strip("_") != key, len(b), b))
    if near:
        msg += (f"; related ops it implements: {', '.join(near[:5])} (ATen turns some ops into others before "
                f"the backend kernels Gems replaces: name the one that runs, as `gems-coverage trace` lists it)")
    return msg


@contextlib.contextmanager
def override_impl(name: str, fn: Callable):
    """Temporarily replace Gems' implementation of one overload (a test double for tools and tests).

    The dispatcher looks the function up through the OpImpl on every call, so the swap takes effect
    even while Gems is enabled.
    """
    impl = get(name)
    old = impl.fn
    impl.set_fn(fn)
    try:
        yield impl
    finally:
        impl.set_fn(old)
