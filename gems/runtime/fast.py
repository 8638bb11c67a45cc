"""The C++ fast path (gems/csrc/, entry module.cpp): built with the machine's compiler and torch's
headers by `python -m gems.runtime.fast build` (scripts/setup.sh runs it after installing Gems),
cached on disk, loaded once per process.

Why a build step after the install instead of a pip build hook: pip builds in an isolated environment
where the torch that will run Gems is not importable, and the GPU machine brings its own torch build;
the extension must match the torch it is loaded into, so it is compiled against that one, keyed by
its version, and reused by every later process (and by parallel processes, under a file lock).

Why not at first use: the build takes 35-60 s, a stall inside `gems.enable()` a user cannot explain.
`load()` never compiles unless asked to (`GEMS_FAST_BUILD=auto`): when the module for this torch and
these sources is missing, Gems runs its Python path and says once on stderr how to build it
(`GEMS_QUIET=1` silences that line).

The codes and limits the C++ side shares with Python are defined once, in runtime/abi.py: the build
writes them as `gems_abi.h` into its directory (the C++ sources include it), and that header is part
of the build's cache key, like every source file under gems/csrc/.

`load()` returns the module or None. None means Gems runs its Python path, which serves the same
calls at a higher host cost; the reason is kept in `status()`.
`GEMS_FAST=0` turns the fast path off; `GEMS_FAST_BUILD_DIR` moves the build cache (default
~/.cache/gems).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import abi

_SRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
_MAIN = _SRC_DIR / "module.cpp"     # the one translation unit (it includes the other parts)
_HEADER = "gems_abi.h"
_NAME = "gems_fastpath"
_module = None
_status = "not loaded"
_tried = False
_noted = False

# `python -m gems.runtime.fast build` runs this file as __main__ after `import gems` has imported it as
# gems.runtime.fast (the dispatcher loads the module from here): runpy's warning about that is noise,
# since __main__ only calls into the imported module.
warnings.filterwarnings("ignore", message="'gems.runtime.fast' found in sys.modules", category=RuntimeWarning)


def enabled_by_env() -> bool:
    return os.environ.get("GEMS_FAST", "1") not in ("", "0")


def status() -> str:
    """'loaded: PATH', or why the fast path is not in use."""
    return _status


def _flags() -> list[str]:
    # torch's C++ headers, as torch.utils.cpp_extension.include_paths() lists them for a CPU build;
    # computed here because importing cpp_extension (setuptools and more) costs ~0.4 s of enable()
    torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
    inc = [torch_inc, os.path.join(torch_inc, "torch", "csrc", "api", "include"), sysconfig.get_paths()["include"]]
    return ([f"-I{p}" for p in inc] +
            ["-O2", "-std=c++17", "-fPIC", "-shared", "-w", f"-DTORCH_EXTENSION_NAME={_NAME}",
             "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"])


def _link_flags() -> list[str]:
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def _sources() -> list[Path]:
    """Every file the build reads from gems/csrc/ (the parts module.cpp includes)."""
    return sorted(p for p in _SRC_DIR.iterdir() if p.suffix in (".cpp", ".h"))


def _cache_dir() -> Path:
    base = os.environ.get("GEMS_FAST_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gems")
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(abi.header().encode())
    h.update(repr((torch.__version__, sys.version, _flags(), _link_flags())).encode())
    return Path(base) / "fastpath" / h.hexdigest()[:16]


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    return cxx


def _build(out: Path):
    """Compile into `out` (atomically: other processes only ever see a complete file), with the
    generated header beside it."""
    (out.parent / _HEADER).write_text(abi.header())
    cmd = [_compiler(), str(_MAIN), f"-I{out.parent}", *_flags(), *_link_flags()]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {_SRC_DIR.name}/{_MAIN.name} failed:\n{r.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _quiet() -> bool:
    return os.environ.get("GEMS_QUIET", "") not in ("", "0")


def _auto_build() -> bool:
    """GEMS_FAST_BUILD=auto: build a missing module on first use, in the foreground (for users who
    prefer that stall to a separate step)."""
    return os.environ.get("GEMS_FAST_BUILD", "").lower() in ("auto", "1")


def build_path() -> Path:
    """Where the module for this torch and these sources is (or would be) built."""
    return _cache_dir() / f"{_NAME}.so"


def is_built() -> bool:
    return build_path().exists()


def build(force: bool = False) -> Path:
    """Build the module for this torch and these sources unless it is already there (`force`: again),
    and return its path. Parallel callers: one builds, the rest wait for it."""
    d = _cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    so = d / f"{_NAME}.so"
    if force or not so.exists():
        with open(d / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if force or not so.exists():
                _build(so)
    return so


def _missing_note(so: Path) -> str:
    others = [p for p in so.parent.parent.glob(f"*/{_NAME}.so") if p != so] if so.parent.parent.is_dir() else []
    why = ("built for another torch version or older sources" if others else "not built")
    return (f"gems: the C++ fast path is {why}, so Gems runs its Python path (same results, more host "
            f"time per call); build it once (35-60 s) with: {sys.executable} -m gems.runtime.fast build")


def load():
    """The extension module; None if off, not built (said once on stderr, unless GEMS_QUIET=1) or
    failing to build or load (warned once). Never compiles unless GEMS_FAST_BUILD=auto. A module
    that was missing is looked for again at the next call (a later registration), so one built
    meanwhile (`build()`) is picked up."""
    global _module, _status, _tried, _noted
    if _tried:
        return _module
    if not enabled_by_env():
        _tried = True
        _status = "off (GEMS_FAST=0)"
        return None
    try:
        so = build_path()
        if not so.exists():
            if not _auto_build():
                _status = f"not built: {so} (python -m gems.runtime.fast build)"
                if not _noted and not _quiet():
                    print(_missing_note(so), file=sys.stderr)
                _noted = True
                return None
            print(f"gems: building the C++ fast path (once per torch version, GEMS_FAST_BUILD=auto) into "
                  f"{so.parent}", file=sys.stderr)
            build()
        _tried = True
        _module = _import(so)
        _status = f"loaded: {so}"
    except Exception as e:  # noqa: BLE001 - the Python path serves every call without it
        _tried = True
        _status = f"unavailable: {type(e).__name__}: {str(e)[:2000]}"
        warnings.warn(f"gems: the C++ fast path is unavailable, Gems runs on its Python path (slower host "
                      f"path, same results). {_status}", RuntimeWarning, stacklevel=2)
        _module = None
    return _module


def loaded():
    """The extension module if `load()` has loaded it (the dispatcher's first registration does, with
    call plans on), else None; never builds it."""
    return _module


def note_stream_mode(mode: int):
    """How the C++ side reads the current CUDA stream (0: it cannot, so it replays no CUDA plan)."""
    global _status
    if mode == 0:
        _status += "; no way to read the current CUDA stream: CUDA calls take the Python path"
        warnings.warn("gems: the C++ fast path cannot read the current CUDA stream with this torch; CUDA calls "
                      "take the Python path", RuntimeWarning, stacklevel=2)
    else:
        _status += "; stream via " + ("c10::Stream::native_handle" if mode == 1 else "CUDAStream::stream")


def main(argv=None) -> int:
    """`python -m gems.runtime.fast build [--force]`: build the module for the running torch (says where
    and how long it took); `python -m gems.runtime.fast status`: where it is, or that it is missing."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m gems.runtime.fast", description=main.__doc__)
    ap.add_argument("command", choices=("build", "status"))
    ap.add_argument("--force", action="store_true", help="build again even if the module is there")
    a = ap.parse_args(argv)
    so = build_path()
    if a.command == "status":
        print(f"built: {so}" if so.exists() else _missing_note(so))
        return 0 if so.exists() else 1
    if so.exists() and not a.force:
        print(f"gems: the C++ fast path is already built for this torch and these sources: {so}")
        return 0
    print(f"gems: building the C++ fast path into {so.parent} (35-60 s) ...", flush=True)
    t0 = time.perf_counter()
    try:
        build(force=a.force)
    except Exception as e:  # noqa: BLE001 - said plainly; Gems still runs without it
        print(f"gems: the C++ fast path did not build ({type(e).__name__}: {e}); Gems runs its Python "
              f"path (same results, more host time per call)", file=sys.stderr)
        return 1
    print(f"gems: built the C++ fast path in {time.perf_counter() - t0:.1f} s: {so}")
    return 0


if __name__ == "__main__":
    from gems.runtime import fast as module     # the imported module, whose state the build updates
    sys.exit(module.main())
