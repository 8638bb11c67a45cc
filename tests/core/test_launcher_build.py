"""runtime/launcher_build.py: a kernel's C launcher is built on a thread while Triton compiles the kernel,
and the compile's end waits for it. The hooks' contract is checked with stand-ins on any device; on the
GPU a fresh process's first launches must build every launcher on those threads, none after a compile."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton

from gems.runtime import launcher_build, settings
from harness import ON_GPU

ROOT = Path(__file__).resolve().parents[2]


def _miss(rt, jf, key="k", signature=None, prev_calls=None):
    info = SimpleNamespace(jit_function=jf)
    comp = {"signature": signature or {"X": "*fp32", "n": "i32"}, "constants": {"BLOCK": 64},
            "configs": [{"attrs": 1}]}
    return rt.jit_cache_hook(key=key, repr="r", fn=info, compile=comp, is_manual_warmup=False,
                             already_compiled=False), info, comp


def test_the_build_runs_beside_the_compile_and_is_waited_for(monkeypatch):
    monkeypatch.setattr(settings, "LAUNCHER_AHEAD", True)
    rt = triton.knobs.runtime
    seen, release = [], threading.Event()
    prev_before = lambda **kw: seen.append(("before", kw["key"])) and False   # noqa: E731
    prev_after = lambda **kw: seen.append(("after", kw["key"]))               # noqa: E731

    def builder(jf, signature, constants, attrs):
        seen.append(("build", threading.current_thread().name, jf, dict(signature), dict(constants), attrs))
        release.wait(10)
        seen.append(("built",))
    monkeypatch.setattr(rt, "jit_cache_hook", prev_before)
    monkeypatch.setattr(rt, "jit_post_compile_hook", prev_after)
    jf = object()
    with launcher_build.building_ahead(builder):
        skip, info, comp = _miss(rt, jf)
        assert skip is False       # Triton compiles as usual
        threading.Timer(0.3, release.set).start()
        t0 = time.perf_counter()
        rt.jit_post_compile_hook(key="k", repr="r", fn=info, compile=comp, is_manual_warmup=False,
                                 already_compiled=False)
        # the compile's end waited for the build, then called the hook that was there before
        assert time.perf_counter() - t0 >= 0.25
        assert seen[-2:] == [("built",), ("after", "k")]
    assert seen[0] == ("before", "k")
    assert seen[1] == ("build", "gems-launcher", jf, {"X": "*fp32", "n": "i32"}, {"BLOCK": 64}, {"attrs": 1})
    # the hooks that were there are back
    assert rt.jit_cache_hook is prev_before and rt.jit_post_compile_hook is prev_after


def test_nothing_is_built_where_no_compile_follows_or_the_launcher_needs_the_binary(monkeypatch):
    monkeypatch.setattr(settings, "LAUNCHER_AHEAD", True)
    rt = triton.knobs.runtime
    built = []
    builder = lambda *a: built.append(a)    # noqa: E731
    # an earlier hook that skips the compile (gems.warmup's collect mode records instead)
    monkeypatch.setattr(rt, "jit_cache_hook", lambda **kw: True)
    monkeypatch.setattr(rt, "jit_post_compile_hook", None)
    with launcher_build.building_ahead(builder):
        assert _miss(rt, object())[0] is True
    # tensor-descriptor arguments: the launcher depends on the compiled metadata
    monkeypatch.setattr(rt, "jit_cache_hook", None)
    with launcher_build.building_ahead(builder):
        assert _miss(rt, object(), signature={"d": "tensordesc<bf16[64, 64]>", "n": "i32"})[0] is False
        assert rt.jit_post_compile_hook(key="k", fn=SimpleNamespace(jit_function=object())) is None
    assert built == []
    # switched off: Triton's hooks are not touched
    monkeypatch.setattr(settings, "LAUNCHER_AHEAD", False)
    with launcher_build.building_ahead(builder):
        assert rt.jit_cache_hook is None and rt.jit_post_compile_hook is None


_PROBE = r"""
import threading, torch, triton
import triton.runtime.build as B
import gems
triton.runtime.driver.active.get_current_device()    # the driver's own helper module is built here, before
where = []
real = B._build
def counted(*a, **kw):
    where.append(threading.current_thread().name)
    return real(*a, **kw)
B._build = counted
x = torch.randn(1000, device="cuda")
with gems.use_gems():
    y = (x * 3 + 1).exp().sum()
torch.cuda.synchronize()
print("BUILDS", sorted(set(where)), len(where))
"""


@pytest.mark.skipif(not ON_GPU, reason="Triton builds launchers only for a GPU")
def test_first_launches_build_their_launchers_ahead(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), GEMS_CACHE_DIR=str(tmp_path / "gems"))
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("BUILDS"))
    assert "MainThread" not in line and "gems-launcher" in line, line
