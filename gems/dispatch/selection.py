"""Selection: which overloads Gems serves, process-wide (`enable` / `disable`) or in a thread's scope
(`use_gems`), and the C++ fast path's mirror of it (config ids for op sets)."""
from __future__ import annotations

from typing import Iterable, Optional

from .. import registry
from ..runtime import backends, tritonkey
from .registration import ensure_registered, unregister_if_idle
from .state import STATE, DispatchState, active_config_of, cfg_id, stash_scope

# distinct selections whose op sets are cached (a service may build a selection per request: the
# cache must not grow with them); an evicted selection is resolved again when it is next used
MAX_SELECTIONS = 256


def _sync_any_scope(state: DispatchState):
    if state.fast is not None:
        state.fast.set_any_scope(bool(state.scopes))


def config(state: DispatchState, include, exclude) -> frozenset:
    """The op set of a selection: the registered overloads (or the `include`d ones) minus `exclude`."""
    key = (_names_key(include), _names_key(exclude))
    cache = state.cfg_cache
    cfg = cache.get(key)
    if cfg is None:
        backends.check_environment()
        backend = backends.backend()
        if backend.device_type == "cuda":
            tritonkey.start()   # Triton's own key hashes on a thread while the ops import (runtime/tritonkey.py)
        be = backend.name
        if include is not None:
            ops = registry.resolve(include, be, "raise")
        else:
            ops = {i.name for i in registry.all_impls(be)}
        cfg = frozenset(ops - registry.resolve(exclude, be, "warn"))
        with state.lock:
            if len(cache) >= MAX_SELECTIONS:
                cache.pop(next(iter(cache), None), None)
            cache[key] = cfg
    return cfg


def _names_key(names):
    if names is None:
        return None
    return (names,) if isinstance(names, str) else tuple(names)


def enable(include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None):
    """Serve every registered ATen overload (or the `include`d ones, minus `exclude`) with Gems.

    A group's name selects all its overloads in `include=` and `exclude=`:
    `enable(exclude=("attention",))` leaves SDPA to ATen. Process-wide; a thread inside `use_gems()`
    follows its scope instead.
    """
    state = STATE
    backends.check_environment()
    cfg = config(state, include, exclude)
    ensure_registered(state)
    state.global_cfg = cfg
    if state.fast is not None:
        state.fast.set_global(cfg_id(state, cfg))


def disable():
    """Stop serving ops outside `use_gems` scopes; with no scope active, restore ATen exactly."""
    state = STATE
    state.global_cfg = None
    if state.fast is not None:
        state.fast.set_global(-1)
    unregister_if_idle(state)


def active_config() -> Optional[frozenset]:
    """The canonical overload names Gems serves on the calling thread right now (None: Gems off)."""
    return active_config_of(STATE)


def is_enabled(name: Optional[str] = None) -> bool:
    """Whether Gems serves `name` (or anything at all) on the calling thread right now."""
    cfg = active_config_of(STATE)
    if cfg is None:
        return False
    return bool(cfg) if name is None else registry.canonical(name) in cfg


class use_gems:
    """Context manager: Gems on (for `include`, minus `exclude`) in this thread for the block.

    Nests (the inner scope's selection wins), restores the previous state on exit, and is
    thread-local like `torch.no_grad()`: other threads keep their own state. The first entry in a
    process registers the kernels; later entries only swap a thread-local pointer.
    """

    __slots__ = ("cfg", "_prev")

    def __init__(self, include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None):
        self.cfg = config(STATE, include, exclude)
        self._prev = []

    def __enter__(self):
        state = STATE
        ensure_registered(state)
        tls = state.thread
        self._prev.append((tls.scoped, tls.cfg))
        tls.scoped, tls.cfg = True, self.cfg
        stash_scope(self.cfg)
        with state.lock:
            state.scopes.append(self)
            _sync_any_scope(state)
        if state.fast is not None:
            state.fast.set_thread(cfg_id(state, self.cfg))
        return self

    def __exit__(self, *exc):
        state = STATE
        tls = state.thread
        tls.scoped, tls.cfg = self._prev.pop()
        stash_scope(tls.cfg if tls.scoped else None)
        with state.lock:
            # remove this scope's most recent entry (scopes of other threads may sit after it)
            scopes = state.scopes
            for i in range(len(scopes) - 1, -1, -1):
                if scopes[i] is self:
                    del scopes[i]
                    break
            _sync_any_scope(state)
        if state.fast is not None:
            state.fast.set_thread(cfg_id(state, tls.cfg) if tls.scoped else state.fast.UNSCOPED)
        return False
