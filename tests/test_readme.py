"""The README is executable documentation: its Python blocks must run as written on a CPU, and the test
command it gives must be the one CI runs. The README is located from this file, never from the cwd, and
each block runs in a fresh interpreter in an empty temporary directory, as a newcomer would paste it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"
PYTEST_COMMAND = re.compile(r"^python -m pytest\b.*$", re.MULTILINE)


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```<language> blocks of a Markdown text, in order."""
    return re.findall(rf"^```{language}[ \t]*\n(.*?)^```[ \t]*$", text, re.MULTILINE | re.DOTALL)


PYTHON_BLOCKS = fenced_blocks(README.read_text(), "python")


def test_readme_has_python_blocks():
    assert PYTHON_BLOCKS, "README.md has no ```python block to run"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(PYTHON_BLOCKS[index])
    # import this checkout's gems, whatever is installed; keep the suite's other settings (GEMS_STRICT:
    # a Gems error fails the block instead of falling back to ATen)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (f"README.md's python block {index} failed:\n{PYTHON_BLOCKS[index]}\n"
                                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")


def test_readme_test_command_is_what_ci_runs():
    stated = [line.strip() for block in fenced_blocks(README.read_text(), "bash")
              for line in block.splitlines() if PYTEST_COMMAND.match(line.strip())]
    run_by_ci = PYTEST_COMMAND.findall(CI_SCRIPT.read_text())
    assert len(stated) == 1, f"README.md should state one test command, found {stated}"
    assert run_by_ci == stated, f"README.md says {stated[0]!r}, .ci/run runs {run_by_ci}"
