#!/usr/bin/env bash
# Installs pagekeeper and its dependencies into the current Python environment.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test extra and the system packages the tests start
# torch is installed first and pinned to 2.13.0 unless a torch >= 2.6 is already there (GPU images
# bring their own CUDA build; an unpinned install would pull several GB of CUDA wheels).
# Each step is one line: what it does, then how long it took; a step's own output is shown only when it fails (the
# script then exits with that step's exit code).  Steps already done are skipped, so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

# -- progress ----------------------------------------------------------------------------------------------------
# Expected seconds per step: a fresh venv on a 2-core machine (docs/benchmarks.md, "The first hour"); apt's is not
# measured there (every package was installed already).
EST_TORCH=60 EST_PAGEKEEPER=90 EST_TEST_EXTRA=120 EST_REINSTALL=20 EST_CPU_EXT=15 EST_APT=90 EST_CHECKOV=90 EST_NPM=15
setup_started=$EPOCHREALTIME
step_no=0
steps_total=0
step_log=$(mktemp)
trap 'rm -f "$step_log"' EXIT

since() {  # seconds since the $EPOCHREALTIME given, e.g. "41 s" or "0.3 s"
  local now=${EPOCHREALTIME/[.,]/} then=${1/[.,]/}  # microseconds (the decimal point follows the locale)
  local us=$(( now - then ))
  if (( us < 10000000 )); then printf '%d.%d s' $(( us / 1000000 )) $(( us / 100000 % 10 )); else printf '%d s' $(( (us + 500000) / 1000000 )); fi
}

step() {  # step "what it does" COMMAND...: one line for the step; COMMAND's output only if it fails (its exit code)
  local what=$1 started=$EPOCHREALTIME rc=0
  shift
  step_no=$(( step_no + 1 ))
  printf 'setup: [%d/%d] %s ... ' "$step_no" "$steps_total" "$what"
  "$@" >"$step_log" 2>&1 || rc=$?
  if (( rc )); then
    printf 'failed after %s (exit %d):\n' "$(since "$started")" "$rc"
    cat "$step_log" >&2
    return "$rc"
  fi
  printf 'done in %s\n' "$(since "$started")"
}

skip() {  # skip "why": a step with nothing to do
  step_no=$(( step_no + 1 ))
  printf 'setup: [%d/%d] %s\n' "$step_no" "$steps_total" "$1"
}

# -- what this run has to do (nothing is installed yet) ------------------------------------------------------------
installed() {  # installed DISTRIBUTION: its version, or nothing
  "$PY" -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true
}
torch_version=$(installed torch)
need_torch=1
if [[ -n "$torch_version" ]]; then
  IFS=. read -r major minor _ <<<"$torch_version"
  (( major > 2 || (major == 2 && ${minor%%[!0-9]*} >= 6) )) && need_torch=0
fi

need_apt=()  # the packages the tests need that are missing (--test)
daemons=()   # the services those packages enable, disabled again (the tests start their own Prometheus)
if (( want_test )); then
  { command -v promtool && command -v prometheus; } >/dev/null || { need_apt+=(prometheus); daemons+=(prometheus.service); }
  command -v amtool >/dev/null || { need_apt+=(prometheus-alertmanager); daemons+=(prometheus-alertmanager.service); }
  command -v npm >/dev/null || need_apt+=(nodejs npm)
  # systemd (252 on Debian 12) + util-linux for tests/systemd/: the tests boot it as PID 1 of its own
  # namespaces, never on this machine; installing the package does not boot it.
  [[ -x /lib/systemd/systemd ]] && command -v systemd-analyze >/dev/null || need_apt+=(systemd)
  command -v nsenter >/dev/null && command -v setpriv >/dev/null || need_apt+=(util-linux)
  command -v tini >/dev/null || need_apt+=(tini)  # the container image's entrypoint, which tests/k8s/ runs
  command -v g++ >/dev/null || need_apt+=(g++)    # the CPU attention extension, which the tests require
fi
checkov_version=3.3.30
need_checkov=0
(( want_test )) && [[ "$(PY=.tools/checkov/bin/python installed checkov)" != "$checkov_version" ]] && need_checkov=1
npm_stale() {  # npm_stale DIR: its node_modules were not installed from its package-lock.json
  ! cmp -s "$1/package-lock.json" "$1/node_modules/.pagekeeper-lock"
}
typecheck=grafana/typecheck
crd=tests/k8s/crd  # the custom resources' schemas (@kubernetes-models, pinned in its package-lock.json)

expected=0
(( need_torch )) && expected=$(( expected + EST_TORCH ))
if [[ -z "$(installed pagekeeper)" ]]; then
  expected=$(( expected + EST_PAGEKEEPER ))
else
  expected=$(( expected + EST_REINSTALL ))
fi
(( want_test )) && [[ -z "$(installed schemathesis)" ]] && expected=$(( expected + EST_TEST_EXTRA ))
expected=$(( expected + EST_CPU_EXT ))
steps_total=3
if (( want_test )); then
  steps_total=7
  (( ${#need_apt[@]} )) && expected=$(( expected + EST_APT ))
  (( need_checkov )) && expected=$(( expected + EST_CHECKOV ))
  npm_stale "$typecheck" && expected=$(( expected + EST_NPM ))
  npm_stale "$crd" && expected=$(( expected + EST_NPM ))
fi
if (( expected >= 90 )); then
  printf -v about '%d minutes' $(( (expected + 30) / 60 ))
else
  about="$expected s"
fi
echo "setup: $steps_total steps, about $about here (expected on a 2-core machine; a step already done is skipped)"

# -- the steps ---------------------------------------------------------------------------------------------------
if (( need_torch )); then
  step "installing torch 2.13.0 (the CPU wheel; about $EST_TORCH s)" \
    "$PY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
else
  skip "torch $torch_version is installed: kept"
fi

if (( want_test )); then
  step "installing pagekeeper with its test tools (about $(( EST_PAGEKEEPER + EST_TEST_EXTRA )) s on a fresh environment)" \
    "$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
else
  step "installing pagekeeper and its dependencies (about $EST_PAGEKEEPER s on a fresh environment)" \
    "$PY" -m pip install --quiet --disable-pip-version-check -e .
fi

as_root=()
(( EUID == 0 )) || as_root=(sudo)
apt_install() {  # apt_install PACKAGE...
  "${as_root[@]}" apt-get update -qq || return
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null || return
  if (( ${#daemons[@]} )) && [[ -d /run/systemd/system ]]; then
    "${as_root[@]}" systemctl disable --now "${daemons[@]}" >/dev/null 2>&1 || true
  fi
}
if (( want_test )); then
  # prometheus + promtool and amtool for tests/alerts/; npm for the dashboard's type check; systemd, util-linux, tini
  # and g++ as said above
  if (( ${#need_apt[@]} )) && ! command -v apt-get >/dev/null; then
    skip "system packages: no apt-get here; install ${need_apt[*]} yourself (the tests that need them are skipped outside CI)"
  elif (( ${#need_apt[@]} )); then
    step "installing system packages: ${need_apt[*]} (about $EST_APT s)" apt_install "${need_apt[@]}"
  else
    skip "system packages (prometheus, alertmanager, npm, systemd, tini, g++): all there"
  fi
fi

# The CPU attention extension (kernels/cpu_ext.py), built now for this host so that no engine start pays for it.
# Serving without it falls back to torch's attention (slower decode) with a warning; the tests need it.
if (( want_test )); then
  step "building the CPU attention extension for this host (about $EST_CPU_EXT s once; seconds after)" \
    "$PY" -m kernels.cpu_ext
else
  step "building the CPU attention extension for this host (about $EST_CPU_EXT s once; seconds after)" \
    "$PY" -m kernels.cpu_ext ||
    echo "warning: the CPU attention extension was not built (see above); CPU decode uses torch's slower path" >&2
fi

# -- test tools (--test only; each step is skipped when already done) ---------------------------------------------
if (( want_test )); then
  # checkov (tests/k8s/test_security.py) in a venv of its own: it pins old versions of packages the engine shares
  # (networkx, packaging, boto3), which must not be downgraded in this environment.
  if (( need_checkov )); then
    install_checkov() {
      "$PY" -m venv .tools/checkov &&
        .tools/checkov/bin/pip install --quiet --disable-pip-version-check "checkov==$checkov_version"
    }
    step "installing checkov $checkov_version in a venv of its own (about $EST_CHECKOV s, once)" install_checkov
  else
    skip "checkov $checkov_version: installed"
  fi
  npm_install() {  # npm_install DIR: `npm ci` there, remembering which package-lock.json it installed
    npm ci --prefix "$1" --no-audit --no-fund --loglevel=error && cp "$1/package-lock.json" "$1/node_modules/.pagekeeper-lock"
  }
  for dir in "$typecheck" "$crd"; do
    what="$dir (npm: the dashboard's type checker)"
    [[ "$dir" == "$crd" ]] && what="$dir (npm: the Kubernetes custom resources' schemas)"
    if ! command -v npm >/dev/null; then
      skip "$what: no npm, skipped (the tests that need it are skipped outside CI)"
    elif npm_stale "$dir"; then
      step "installing $what (about $EST_NPM s, once)" npm_install "$dir"
    else
      skip "$what: installed"
    fi
  done
fi

summary="torch $(installed torch), pagekeeper $(installed pagekeeper)"
if (( want_test )); then
  summary+="; $(promtool --version 2>/dev/null | head -1 || echo 'no promtool');"
  summary+=" tsc $("$typecheck/node_modules/.bin/tsc" --version 2>/dev/null || echo missing)"
fi
echo "setup: done in $(since "$setup_started") ($summary)"
