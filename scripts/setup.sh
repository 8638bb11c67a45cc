#!/usr/bin/env bash
# Install Gems and what it needs into the current Python environment (use a venv).
# - keeps an existing torch (e.g. the CUDA build on a GPU machine); otherwise installs the pinned
#   CPU build first, because a bare `pip install torch` pulls several GB of CUDA packages;
# - triton 3.6.0 with numpy < 2.3 (newer numpy breaks triton 3.6's CPU interpreter);
# - transformers 5.17.0 for the model recipes of gems-coverage;
# - Gems in editable mode with its test extra and its plot extra (matplotlib, for gems-coverage's pictures);
# - then Gems' C++ fast path, compiled against this torch (35-60 s, once; `python -m gems.runtime.fast
#   build` again after changing torch or gems/csrc/): pip cannot build it, its build isolation hides the
#   torch that loads it. Without a compiler Gems runs its Python path (same results), so a failed build
#   is reported, not fatal.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
if ! $PY -c "import triton" 2>/dev/null; then
  $PY -m pip install -q triton==3.6.0 "numpy<2.3"
fi
$PY -m pip install -q "numpy<2.3" transformers==5.17.0
$PY -m pip install -q -e ".[test,plot]"
$PY -m gems.runtime.fast build || echo "setup.sh: continuing without the C++ fast path (see above)" >&2
