#!/usr/bin/env bash
# Lint, format check and type check, as CI runs them (README's test command calls this before pytest).
# The rule set and the type checks are in pyproject.toml ([tool.ruff], [tool.mypy]): mypy reads all of engine/,
# kernels/ and opsctl/, strictly the modules its override lists.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
