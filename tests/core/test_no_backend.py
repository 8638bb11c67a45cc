"""The registry, the op table and gems-coverage on meta must work on a machine with no backend."""
import os
import subprocess
import sys


def test_registry_imports_without_a_backend():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GEMS_BACKEND")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = ("import gems, gems_coverage.optable\n"
            "n = len(gems.registry.all_impls()); assert n > 100, n\n"
            "try:\n    gems.enable()\nexcept RuntimeError as e:\n    assert 'no backend' in str(e)\n"
            "else:\n    raise SystemExit('enable() without a backend must raise')\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
