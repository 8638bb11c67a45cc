"""The environment knobs Gems reads, parsed once, at import, in this one place.

Every module that depends on one of them imports it from here (the dispatcher, planned fused
functions, allocation); nothing else reads these variables. They are process settings: set them
before `import gems`.

GEMS_STRICT=1
    An implementation that raises where ATen succeeds re-raises instead of falling back to ATen
    (the test suite sets it, so a Gems bug fails the test that meets it).
GEMS_PLANS=0
    Call plans off: every call takes the full path (for debugging and A/B timing). Also keeps the
    C++ fast path unloaded, since it only replays plans.
GEMS_PLAN_CHECK=N
    The first call of each of an overload's (or planned fused function's) first N signatures is
    answered by its freshly built plan instead of the recorded run ("all": every signature), so the
    op tests also test the plans. The test suite sets it.
GEMS_PLAN_AFTER=2
    The call of a signature that records its plan: 2 (the default) or 1. Why not the first:
    recording costs 3-4x a plain call (a new `cat` signature: 250 us against 70 on a CPU host), and
    decode meets signatures it never sees again (the KV cache grows a token per step): ops called
    once per token (mask updates) then never record; ops called per layer record at their second
    call, the first layer's second op, and replay for the other layers. The test suite sets 1 (with
    GEMS_PLAN_CHECK the op tests' first calls check their plans).
GEMS_POISON=1
    Fresh outputs start as NaN (or -1 for integers), so an element a kernel forgets to write can
    never pass as a right answer, in plans too (a test aid).
GEMS_COMPILE=background (the default) or inline
    background: a functional op's call that needs a kernel not compiled yet is answered by ATen
    (counted) while the kernel compiles on a thread pool; its later calls run Gems once the binary is
    in (runtime/background.py). In-place and out= ops, and kernels launched outside the dispatcher
    (gems.patch's fused modules), still compile on the calling thread. inline: every kernel compiles
    on the calling thread at its first launch, so the first call is Gems' too (the test suite, and
    gems-coverage's timed and parity runs, set it; `background.inline()` does it for a block).
GEMS_COMPILE_WORKERS=N
    Background compilation's threads (default: the CPU count less one, 1 to 16).
GEMS_LOAD_INLINE=0
    With background compilation, a kernel whose binary Triton already has on disk (a run after the
    first) goes through the pool like a compile, not loaded on the calling thread (for an A/B of a
    second run's first-call time).
GEMS_LAUNCHER_AHEAD=0
    A kernel's C launcher is built after its compile, as Triton does, not on a thread beside it
    (runtime/launcher_build.py; for an A/B of first-call time).
"""
from __future__ import annotations

import os


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default) not in ("", "0")


STRICT: bool = _flag("GEMS_STRICT", "0")
PLANS: bool = _flag("GEMS_PLANS", "1")
_check = os.environ.get("GEMS_PLAN_CHECK", "0")
PLAN_CHECK: int = 1 << 62 if _check == "all" else int(_check or 0)
PLAN_AFTER: int = int(os.environ.get("GEMS_PLAN_AFTER", "2") or 2)
if PLAN_AFTER not in (1, 2):
    raise ValueError(f"GEMS_PLAN_AFTER must be 1 or 2, not {PLAN_AFTER}")
POISON: bool = _flag("GEMS_POISON", "0")
LAUNCHER_AHEAD: bool = _flag("GEMS_LAUNCHER_AHEAD", "1")
LOAD_INLINE: bool = _flag("GEMS_LOAD_INLINE", "1")
_compile = os.environ.get("GEMS_COMPILE", "")
if _compile not in ("", "inline", "background"):
    raise ValueError(f"GEMS_COMPILE must be 'inline' or 'background', not {_compile!r}")
BACKGROUND_COMPILE: bool = _compile != "inline"
COMPILE_WORKERS: int = int(os.environ.get("GEMS_COMPILE_WORKERS", "0") or 0)
del _compile
del _check
