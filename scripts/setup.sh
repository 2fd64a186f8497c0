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
  echo "setup: installing torch 2.13.0 (the CPU wheel; a minute or two on a fresh environment)..."
  "$PY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi

if (( want_test )); then
  echo "setup: installing pagekeeper with its test tools (about a minute on a fresh environment; seconds after)..."
  "$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
else
  echo "setup: installing pagekeeper and its dependencies (about a minute on a fresh environment; seconds after)..."
  "$PY" -m pip install --quiet --disable-pip-version-check -e .
fi
echo "pagekeeper installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"

# The CPU attention extension (kernels/cpu_ext.py), built now for this host so that no engine start pays for it.
# Serving without it falls back to torch's attention (slower decode) with a warning; the tests need it (below).
if (( ! want_test )); then
  echo "setup: building the CPU attention extension for this host (once; tens of seconds)..."
  "$PY" -m kernels.cpu_ext || echo "warning: the CPU attention extension was not built (see above); CPU decode uses torch's slower path" >&2
fi

# -- test tools (--test only; each step is skipped when already done) ---------------------------------------------
# prometheus + promtool and amtool (Debian packages) for tests/alerts/; typescript + @grafana/schema (npm, pinned in
# grafana/typecheck/package-lock.json) for the dashboard type check.
if (( want_test )); then
  as_root=()
  (( EUID == 0 )) || as_root=(sudo)
  apt_updated=0
  apt_install() {  # apt_install PACKAGE...: install with apt-get if available (one `apt-get update` per run)
    if ! command -v apt-get >/dev/null; then
      echo "warning: apt-get not found; install $* yourself (the tests that need them are skipped outside CI)" >&2
      return 0
    fi
    if (( ! apt_updated )); then
      "${as_root[@]}" apt-get update -qq
      apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  }
  echo "setup: test tools: system packages (prometheus, alertmanager, npm, systemd, tini, g++) where missing..."
  new_daemons=()
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    apt_install prometheus && new_daemons+=(prometheus.service)
  fi
  if ! command -v amtool >/dev/null; then
    apt_install prometheus-alertmanager && new_daemons+=(prometheus-alertmanager.service)
  fi
  # the tests start their own Prometheus on a free port: the services the packages just enabled are not wanted
  if (( ${#new_daemons[@]} )) && [[ -d /run/systemd/system ]]; then
    "${as_root[@]}" systemctl disable --now "${new_daemons[@]}" >/dev/null 2>&1 || true
  fi
  command -v npm >/dev/null || apt_install nodejs npm
  # systemd (252 on Debian 12) + util-linux for tests/systemd/: the tests boot it as PID 1 of its own
  # namespaces, never on this machine; installing the package does not boot it.
  if [[ ! -x /lib/systemd/systemd ]] || ! command -v systemd-analyze >/dev/null; then
    apt_install systemd
  fi
  command -v nsenter >/dev/null && command -v setpriv >/dev/null || apt_install util-linux
  # tini: the container image's entrypoint, which tests/k8s/ runs as the pod's command
  command -v tini >/dev/null || apt_install tini
  # a C++ compiler for the CPU attention extension, which the tests require rather than skip
  command -v g++ >/dev/null || apt_install g++
  "$PY" -m kernels.cpu_ext

  # checkov (tests/k8s/test_security.py) in a venv of its own: it pins old versions of packages the engine shares
  # (networkx, packaging, boto3), which must not be downgraded in this environment.
  checkov_version=3.3.30
  if [[ "$(.tools/checkov/bin/checkov --version 2>/dev/null)" != "$checkov_version" ]]; then
    echo "setup: checkov $checkov_version in a venv of its own (a minute or two, once)..."
    "$PY" -m venv .tools/checkov
    .tools/checkov/bin/pip install --quiet --disable-pip-version-check "checkov==$checkov_version"
  fi

  typecheck=grafana/typecheck
  if command -v npm >/dev/null && ! cmp -s "$typecheck/package-lock.json" "$typecheck/node_modules/.pagekeeper-lock"; then
    echo "setup: the dashboard's type checker (npm ci, once)..."
    npm ci --prefix "$typecheck" --no-audit --no-fund --loglevel=error
    cp "$typecheck/package-lock.json" "$typecheck/node_modules/.pagekeeper-lock"
  fi
  crd=tests/k8s/crd  # the custom resources' schemas (@kubernetes-models, pinned in its package-lock.json)
  if command -v npm >/dev/null && ! cmp -s "$crd/package-lock.json" "$crd/node_modules/.pagekeeper-lock"; then
    npm ci --prefix "$crd" --no-audit --no-fund --loglevel=error
    cp "$crd/package-lock.json" "$crd/node_modules/.pagekeeper-lock"
  fi
  echo "test tools: $(promtool --version 2>/dev/null | head -1 || echo 'no promtool');" \
       "tsc $("$typecheck/node_modules/.bin/tsc" --version 2>/dev/null || echo missing)"
fi
