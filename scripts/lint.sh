#!/usr/bin/env bash
# Lint, format check and type check, as CI runs them (README's test command calls this before pytest).
# The rule set and the type-checked modules are in pyproject.toml ([tool.ruff], [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
