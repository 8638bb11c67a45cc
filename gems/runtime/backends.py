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

BACKENDS = {
    "cuda": Backend("cuda", "cuda", "CUDA", _CUDA_TUNING, True),
    "interpreter": Backend("interpreter", "cpu", "CPU", _INTERP_TUNING, False),
}


def interpreting() -> bool:
    """Whether kernels run through the Triton interpreter (fixed when triton is imported). Never
    raises, so modules can choose code paths at import time on machines with no backend at all."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _detect() -> Backend:
    forced = os.environ.get("GEMS_BACKEND")
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if forced:
        if forced not in BACKENDS:
            raise RuntimeError(f"GEMS_BACKEND={forced!r}: expected one of {sorted(BACKENDS)}")
        if forced == "interpreter" and not interp:
            raise RuntimeError("GEMS_BACKEND=interpreter needs TRITON_INTERPRET=1 set before triton is imported")
        return BACKENDS[forced]
    if interp:
        return BACKENDS["interpreter"]
    import torch
    if torch.cuda.is_available() and torch.version.cuda:
        return BACKENDS["cuda"]
    raise RuntimeError("Gems found no backend: no NVIDIA GPU is visible and TRITON_INTERPRET=1 was not set "
                       "before importing gems (set it to run the kernels on CPU tensors through the Triton "
                       "interpreter), or set GEMS_BACKEND")


def backend() -> Backend:
    """The active backend; raises RuntimeError with the reason when there is none."""
    return _detect()
