"""Test set-up shared by the whole suite; runs before anything imports triton.

CPU (default, CI): kernels run on CPU tensors through the Triton interpreter.
GPU: GEMS_TEST_DEVICE=cuda runs the same tests on the GPU backend.
"""
import os
import sys
import tempfile

_DEVICE = os.environ.get("GEMS_TEST_DEVICE", "cpu")
if _DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("GEMS_STRICT", "1")   # a Gems error fails the test instead of falling back
os.environ.setdefault("GEMS_POISON", "1")   # fresh outputs start as NaN: unwritten elements fail
# the first calls of each overload's first 6 signatures answer from their new call plans (every
# signature: "all", about 1.6x the suite's time under the interpreter)
os.environ.setdefault("GEMS_PLAN_CHECK", "6")
# ... which needs the first call to record (the default records at a signature's second call:
# tests/core/test_plan.py tests that policy in subprocesses)
os.environ.setdefault("GEMS_PLAN_AFTER", "1")
# every kernel compiles at its first launch, so a test's first call is Gems' (background compilation,
# the library's default, would let ATen answer it: tests/core/test_background.py tests that mode)
os.environ.setdefault("GEMS_COMPILE", "inline")
os.environ.setdefault("GEMS_CACHE_DIR", tempfile.mkdtemp(prefix="gems-test-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GEMS_FAST_BUILD", "auto")  # the suite tests the C++ layer: build it where set-up did not (or sources changed)
sys.path.insert(0, os.path.dirname(__file__))

import warnings  # noqa: E402

if _DEVICE == "cpu" and os.environ.get("GEMS_COMPILE_RECORD"):   # scripts/compile_check.py
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import compile_check  # noqa: E402

    compile_check.install_recorder(os.environ["GEMS_COMPILE_RECORD"])

# the interpreter evaluates masked-out lanes too (e.g. -inf - -inf); numpy's warnings about them are noise
warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning)
warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)
warnings.filterwarnings("ignore", message="divide by zero encountered", category=RuntimeWarning)


import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# One seed per test, from its id: a failure reproduces when the test is run alone, under any -n/order.
# GEMS_TEST_SEED=N mixes N in to draw other inputs (run the suite with a few seeds to hunt edge cases).
_SEED_SALT = int(os.environ.get("GEMS_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = (zlib.crc32(request.node.nodeid.encode()) + _SEED_SALT) % (2**31)
    torch.manual_seed(seed)
    yield


def _gems_env():
    return {k: v for k, v in os.environ.items() if k.startswith("GEMS_")}


@pytest.fixture(autouse=True)
def _gems_env_unchanged():
    """A test that leaves a GEMS_ variable changed fails, and the variables are put back: the library's
    knobs are read by the subprocesses later tests start, so a leak would change what those tests test
    (a GEMS_GEMM=triton left behind sends the shipped-table test to another tuner and table file)."""
    before = _gems_env()
    yield
    after = _gems_env()
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test left environment variables changed: {changed} (use monkeypatch.setenv)")


# A CUDA fault (an illegal address, a device-side assert) poisons the process's CUDA context: every later
# test in that process would error in its set-up. On the GPU, end the process after such a test, so
# that xdist names it as the test that crashed the worker and runs the rest in a fresh one.
_FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure",
               "misaligned address", "an illegal instruction")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _DEVICE != "cuda" or call.excinfo is None:
        return
    text = str(call.excinfo.value)
    if any(s in text for s in _FATAL_CUDA):
        report = outcome.get_result()
        sys.stderr.write(f"\nCUDA context lost in {item.nodeid} ({call.when}): {text[:300]}\n")
        sys.stderr.flush()
        if report.failed:
            os._exit(3)
