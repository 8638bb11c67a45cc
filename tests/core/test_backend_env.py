"""A backend that cannot work says so at enable(), in one line: GEMS_BACKEND=cuda without a GPU, or
TRITON_INTERPRET changed after triton was imported (kernels defined before and after could not call
each other)."""
import os
import subprocess
import sys

import pytest
import torch


def _run(code, **env_over):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GEMS_BACKEND")}
    env.update(env_over)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


_EXPECT_ERROR = """
import gems, torch
try:
    gems.enable()
except RuntimeError as e:
    msg = str(e)
    assert "\\n" not in msg, msg
    print(msg)
else:
    raise SystemExit("enable() must raise")
# nothing was left half registered
from gems import dispatch
assert not dispatch.is_registered() and not gems.is_enabled()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_gems_backend_cuda_without_a_gpu():
    out = _run(_EXPECT_ERROR, GEMS_BACKEND="cuda", CUDA_VISIBLE_DEVICES="")
    assert "GEMS_BACKEND=cuda but" in out and "TRITON_INTERPRET=1" in out


def test_gems_backend_cuda_conflicts_with_the_interpreter():
    out = _run(_EXPECT_ERROR, GEMS_BACKEND="cuda", TRITON_INTERPRET="1")
    assert "conflicts with TRITON_INTERPRET=1" in out


def test_triton_interpret_set_after_import():
    code = "import os\nimport gems\nos.environ['TRITON_INTERPRET'] = '1'\n" + _EXPECT_ERROR
    out = _run(code, CUDA_VISIBLE_DEVICES="")
    assert "TRITON_INTERPRET is '1' now but was unset when triton was imported" in out


def test_triton_interpret_unset_after_import():
    code = "import os\nimport gems\ndel os.environ['TRITON_INTERPRET']\n" + _EXPECT_ERROR
    out = _run(code, TRITON_INTERPRET="1")
    assert "set TRITON_INTERPRET before importing gems" in out


def test_interpreter_flag_read_like_triton():
    # triton takes "true"/"on" as set: so does Gems (else the two would disagree on the backend)
    out = _run("import gems\nprint(gems.backend().name)", TRITON_INTERPRET="true")
    assert out.strip() == "interpreter"
