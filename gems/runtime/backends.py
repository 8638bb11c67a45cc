"""Backends: a small description of where kernels run, never a copy of the ops.

A backend says which device type tensors live on, which dispatcher key Gems registers at, and the
tuning table (launch configs per kernel family) for each GPU architecture. Another chip is another
`Backend(...)` entry here.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    name: str                 # "cuda" | "interpreter"
    device_type: str          # torch device type of the tensors it serves
    dispatch_key: str         # dispatcher key Gems registers at
    tuning: dict = field(default_factory=dict, compare=False, hash=False)
    can_benchmark: bool = True  # autotuning needs real timings; the interpreter has none
    # dtypes this backend cannot compute exactly, by torch name, with the reason: a call with a tensor or
    # a dtype argument of one of them goes to ATen (counted under the reason), whatever the op declares
    unserved_dtypes: dict = field(default_factory=dict, compare=False, hash=False)

    @functools.cached_property
    def arch(self) -> str:
        if self.name == "cuda":
            import torch
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
        return "cpu"

    def config(self, family: str) -> dict:
        """Launch parameters for a kernel family on this backend's architecture ('default' otherwise)."""
        per_arch = self.tuning.get(family, {})
        return per_arch.get(self.arch) or per_arch["default"]


# Tuning tables. Values are starting points for kernels that are not autotuned; autotuned kernels
# list their search spaces next to their code and only use this table on the interpreter.
_CUDA_TUNING = {
    # contiguous elementwise: 16-byte vectors, several in flight per thread
    "pointwise": {"default": {"BLOCK": 1024, "num_warps": 4}, "sm90": {"BLOCK": 2048, "num_warps": 8}},
    # strided pointwise (nd kernel): elements per program, the square tile used when an input is
    # transposed relative to the output, warps
    "pointwise_nd": {"default": {"block": 4096, "square": 64, "num_warps": 8}},
    "row": {"default": {"max_block": 16384}},
    "blas": {"default": {}},
}
_INTERP_TUNING = {
    # the interpreter runs each program instance in Python: few, wide programs are fastest
    "pointwise": {"default": {"BLOCK": 1024, "num_warps": 1}},
    "pointwise_nd": {"default": {"block": 1024, "square": 32, "num_warps": 1}},
    "row": {"default": {"max_block": 1024}},
    "blas": {"default": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}},
}

# The Triton interpreter (3.6 and 3.8) keeps bfloat16 as raw uint16 bits: fp32 -> bf16 casts truncate
# instead of rounding to nearest even (and turn overflow and some NaNs into finite values or inf),
# arithmetic on unconverted bf16 values adds bit patterns, and bf16 tl.dot is wrong by ~1e10. No Gems
# result in bf16 can be trusted there, so the interpreter serves none: ATen computes every bf16 call.
# On CUDA the same kernels round in hardware and bf16 is served.
_INTERP_UNSERVED = {"bfloat16": "bfloat16: not exact on the interpreter backend"}

BACKENDS = {
    "cuda": Backend("cuda", "cuda", "CUDA", _CUDA_TUNING, True),
    "interpreter": Backend("interpreter", "cpu", "CPU", _INTERP_TUNING, False, _INTERP_UNSERVED),
}


def interpreting() -> bool:
    """Whether kernels run through the Triton interpreter (fixed when triton is imported). Never
    raises, so modules can choose code paths at import time on machines with no backend at all.
    Reads the variable as triton does (1, true, on, yes; any case)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


_TRUE = ("1", "true", "on", "yes")


def triton_interprets():
    """Whether the imported triton defines kernels for its interpreter: triton reads TRITON_INTERPRET
    when a `@triton.jit` function is defined, and its own library (tl.sum, tl.sigmoid, ...) is defined
    at import. None while triton is not imported."""
    import sys
    std = sys.modules.get("triton.language.standard")
    if std is None:
        return None
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(getattr(std, "sigmoid", None), InterpretedFunction)


def check_environment():
    """Raise RuntimeError (one line) when TRITON_INTERPRET changed after triton was imported: kernels
    defined before and after the change could not call each other (a half-working Gems)."""
    t = triton_interprets()
    if t is not None and t != interpreting():
        now = os.environ.get("TRITON_INTERPRET")
        now = "unset" if now is None else f"{now!r}"
        raise RuntimeError(f"TRITON_INTERPRET is {now} now but was {'1' if t else 'unset'} when triton was "
                           f"imported (`import gems` imports it): set TRITON_INTERPRET before importing gems")


def _cuda_usable():
    import torch
    return bool(torch.version.cuda) and torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _detect() -> Backend:
    forced = os.environ.get("GEMS_BACKEND")
    interp = interpreting()
    check_environment()
    if forced:
        if forced not in BACKENDS:
            raise RuntimeError(f"GEMS_BACKEND={forced!r}: expected one of {sorted(BACKENDS)}")
        if forced == "interpreter" and not interp:
            raise RuntimeError("GEMS_BACKEND=interpreter needs TRITON_INTERPRET=1 set before triton is imported")
        if forced == "cuda":
            if interp:
                raise RuntimeError("GEMS_BACKEND=cuda conflicts with TRITON_INTERPRET=1 (kernels would run "
                                   "through the interpreter): unset one of them")
            if not _cuda_usable():
                import torch
                why = ("this torch has no CUDA support" if not torch.version.cuda else "no CUDA GPU is visible")
                raise RuntimeError(f"GEMS_BACKEND=cuda but {why} (torch {torch.__version__}); to run on CPU "
                                   f"tensors set GEMS_BACKEND=interpreter and TRITON_INTERPRET=1 before importing gems")
        return BACKENDS[forced]
    if interp:
        return BACKENDS["interpreter"]
    if _cuda_usable():
        return BACKENDS["cuda"]
    raise RuntimeError("Gems found no backend: no NVIDIA GPU is visible and TRITON_INTERPRET=1 was not set "
                       "before importing gems (set it to run the kernels on CPU tensors through the Triton "
                       "interpreter), or set GEMS_BACKEND")


def backend() -> Backend:
    """The active backend; raises RuntimeError with the reason when there is none."""
    return _detect()


def unserved_dtypes(be: Backend) -> dict:
    """{torch dtype: reason} of the dtypes `be` leaves to ATen (see Backend.unserved_dtypes)."""
    import torch
    return {getattr(torch, name): why for name, why in be.unserved_dtypes.items()}
