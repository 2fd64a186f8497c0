#!/usr/bin/env bash
# Installs pagekeeper and its dependencies into the current Python environment.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test extra and the system packages the tests start
# torch is installed first and pinned to 2.13.0 unless a torch >= 2.6 is already there (GPU images
# bring their own CUDA build; an unpinned install would pull several GB of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) else 1)
PYEOF
then
  "$PY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi

if (( want_test )); then
  "$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
else
  "$PY" -m pip install --quiet --disable-pip-version-check -e .
fi
echo "pagekeeper installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
