"""Triton's C launcher built beside a kernel's compile instead of after it.

Why. On a launch-cache miss Triton compiles the kernel (front end, LLVM, ptxas) and then, at its first
launch, builds the kernel's C launcher with the host C compiler unless its disk cache holds one for
that signature: two serial steps of about 0.3 s each on an H200 host. In a fresh process with empty
caches a 1.1B Llama's first training step spent about 15 s of its 42.6 s in 45 launcher builds and
23 s compiling 74 kernels (a profile of `gems-coverage bench llama-1.1b --workload train --cold`).
A launcher's source depends only on the specialization's signature and constants, which Triton hands
to its `jit_cache_hook` before it compiles.

How. `building_ahead()` wraps a launch that may compile (runtime/launch.py's miss path). Its
jit_cache_hook starts the launcher's build on a thread (the C compiler runs as a subprocess, so the GIL
is free for Triton's compile meanwhile); its jit_post_compile_hook waits for that build, so the launch
that follows finds the launcher in Triton's disk cache instead of building it. The hooks Triton had
are called first and put back afterwards. Left to Triton as before: a kernel with tensor-descriptor
arguments (its launcher depends on the compiled metadata), a launch that compiles nothing, and any
build that fails here (Triton then builds it itself). `GEMS_LAUNCHER_AHEAD=0` turns this off (settings.py).
"""
from __future__ import annotations

import contextlib
import threading
import types

import triton

from . import settings

JOIN_S = 120.0     # how long a compile's end waits for its launcher before Triton builds one itself
# what CudaLauncher reads of a compiled kernel's metadata besides the source's signature and constants;
# the early build needs none of it (it only fills the disk cache), so neutral values
_META = dict(tensordesc_meta=None, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
             profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False)


def build(jf, signature, constants, attrs):
    """Build (into Triton's disk cache) the C launcher of `jf` specialized by (signature, constants,
    attrs), as CudaLauncher does at a kernel's first launch. Errors are swallowed: Triton builds it again."""
    try:
        src = jf.ASTSource(jf, signature, constants, attrs)
        triton.runtime.driver.active.launcher_cls(src, types.SimpleNamespace(**_META))
    except Exception:  # noqa: BLE001 - an early build is an optimization; Triton's own is the fallback
        pass


def _has_descriptors(signature) -> bool:
    return any(isinstance(t, str) and t.startswith("tensordesc") for t in signature.values())


@contextlib.contextmanager
def building_ahead(builder=build):
    """For the block: a compile Triton starts also starts its launcher's build on a thread, and Triton
    waits for that build when the compile ends. `builder(jf, signature, constants, attrs)` builds."""
    if not settings.LAUNCHER_AHEAD:
        yield
        return
    rt = triton.knobs.runtime
    before, after = rt.jit_cache_hook, rt.jit_post_compile_hook
    threads = {}

    def on_miss(**kw):
        if before is not None and before(**kw):
            return True      # an earlier hook skips the compile: nothing to launch, nothing to build
        try:    # Triton 3.6's hook arguments; a caller handing less gets Triton's own build
            comp, jf = kw["compile"], kw["fn"].jit_function
            job = (jf, comp["signature"], comp["constants"], comp["configs"][0])
        except (KeyError, AttributeError, IndexError, TypeError):
            return False
        if not _has_descriptors(job[1]):
            t = threading.Thread(target=builder, args=job, name="gems-launcher", daemon=True)
            t.start()
            threads[(id(jf), str(kw.get("key")))] = t
        return False

    def on_compiled(**kw):
        t = threads.pop((id(getattr(kw.get("fn"), "jit_function", None)), str(kw.get("key"))), None)
        if t is not None:
            t.join(JOIN_S)
        return after(**kw) if after is not None else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = on_miss, on_compiled
    try:
        yield
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
