#!/usr/bin/env bash
# Issue 39's device run on one GPU (H100 or H200): see benchmarks/quant_device_run.py.
#
#   OUT=/path/to/results bash benchmarks/quant_device_run.sh [quant_device_run.py options, e.g. --stages kernels]
#
# Fits one device call of 9 minutes (the default deadline is 520 s, the package check and start-up come first).
# The image has torch, triton, transformers and pytest but not every package the engine imports: those missing are
# installed from wheels carried in .whl/ at the repository root (pip download --no-deps -d .whl structlog), or the
# run stops here with one line naming them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the folder the results and logs go to}"
mkdir -p "$OUT"

# module:distribution for everything the engine, the benchmarks and the GPU tests import
needed="torch:torch triton:triton transformers:transformers tokenizers:tokenizers safetensors:safetensors
numpy:numpy structlog:structlog tqdm:tqdm psutil:psutil httpx:httpx prometheus_client:prometheus-client
pynvml:nvidia-ml-py click:click jinja2:jinja2 pytest:pytest"
missing=$(python3 - "$needed" <<'PY'
import importlib.util, sys
pairs = [p.split(":") for p in sys.argv[1].split()]
print(" ".join(dist for module, dist in pairs if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing from .whl/: $missing"
        python3 -m pip install --quiet --no-index --find-links .whl $missing || exit 2
    else
        echo "quant_device_run: python packages missing: $missing; carry their wheels in .whl/ (pip download --no-deps -d .whl $missing)" >&2
        exit 2
    fi
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
exec python3 -m benchmarks.quant_device_run --out "$OUT" "$@"
