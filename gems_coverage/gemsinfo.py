"""Lazy access to the Gems registry and backend.

The coverage tool must work (and tell what a model calls) even if ``gems`` cannot be imported or has no
backend on this machine, so every access goes through here and degrades to "unknown".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional


def prepare_interpreter_env() -> None:
    """Use the Triton interpreter when there is no GPU, before anything imports triton.

    Only sets ``TRITON_INTERPRET=1`` when the user has not chosen and no CUDA device is present, and only
    takes effect if triton is not imported yet.
    """
    if "TRITON_INTERPRET" in os.environ:
        return
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"


@dataclass
class ImplInfo:
    name: str
    category: str = ""
    dtypes: tuple = ()
    backward: bool = False


@dataclass
class GemsInfo:
    available: bool                     # gems imported and its registry read
    impls: dict = field(default_factory=dict)   # overload name -> ImplInfo
    backend: Optional[str] = None       # "cuda" / "interpreter" / None
    backend_device: Optional[str] = None
    error: str = ""                     # why gems or its backend is unavailable
    version: str = ""

    def covers(self, name: str) -> bool:
        return name in self.impls

    @property
    def registered_ops(self) -> int:
        return len(self.impls)


def _short_dtype(dt) -> str:
    s = str(dt).replace("torch.", "")
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64",
            "int32": "i32", "bool": "bool", "int8": "i8", "uint8": "u8", "int16": "i16",
            "complex64": "c64", "complex128": "c128"}.get(s, s)


def load(need_backend: bool = False) -> GemsInfo:
    """Read the Gems registry (no GPU needed) and, if possible, the active backend."""
    try:
        import gems  # noqa: F401
        import gems.registry as reg
    except Exception as e:  # ImportError, or the core failing at import
        return GemsInfo(available=False, error=f"gems cannot be imported: {type(e).__name__}: {e}")
    info = GemsInfo(available=True, version=str(getattr(gems, "__version__", "")))
    try:
        be = gems.backend()
        info.backend = str(getattr(be, "name", be))
        info.backend_device = str(getattr(be, "device_type", "") or "")
    except Exception as e:
        info.error = f"no Gems backend on this machine ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    try:
        # the active backend's registrations (what `enable()` registers), all of them without a backend
        impls = reg.all_impls(info.backend)
    except Exception as e:
        return GemsInfo(available=False, error=f"gems registry unreadable: {type(e).__name__}: {e}")
    dtypes_on = getattr(reg, "dtypes_on", None)
    for im in impls:
        name = str(getattr(im, "name", im))
        dts = dtypes_on(im, info.backend) if dtypes_on else getattr(im, "dtypes", ())
        info.impls[name] = ImplInfo(name=name, category=str(getattr(im, "category", "") or ""),
                                    dtypes=tuple(dts or ()), backward=bool(getattr(im, "backward", False)))
    return info


def dtype_supported(impl: Optional[ImplInfo], first_dtypes) -> Optional[bool]:
    """Whether Gems declares the dtypes seen for the first tensor argument (the one its dispatcher checks)."""
    if impl is None or not impl.dtypes or not first_dtypes:
        return None
    declared = {_short_dtype(d) for d in impl.dtypes}
    return all(d in declared for d in first_dtypes)


def stats() -> dict:
    import gems
    try:
        return {k: dict(v) for k, v in gems.stats().items()}
    except Exception:
        return {}


def reset_stats() -> None:
    import gems
    try:
        gems.reset_stats()
    except Exception:
        pass


def stats_delta(before: dict, after: dict) -> dict:
    """Per-op {served, fallback, reasons} that happened between two ``gems.stats()`` snapshots."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        served = int(a.get("served", 0)) - int(b.get("served", 0))
        fb = int(a.get("fallback", 0)) - int(b.get("fallback", 0))
        reasons = {}
        for r, c in (a.get("reasons") or {}).items():
            d = int(c) - int((b.get("reasons") or {}).get(r, 0))
            if d:
                reasons[r] = d
        if served or fb:
            out[name] = {"served": served, "fallback": fb, "reasons": reasons}
    return out
