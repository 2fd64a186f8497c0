"""The pod's container, run as plain processes with the pod's exact command, probes and preStop hook.

No container runtime runs a container on this machine (podman's crun may not set rlimits here; see
docs/kubernetes.md), so tests/k8s/pod.py plays the kubelet over the rendered Deployment and the Dockerfile's
ENTRYPOINT, and tests/k8s/proxy.py plays the Service.  A rolling update of one of two replicas under steady load
(the Deployment's strategy: a surge pod first, then the old one terminates: endpoint removal after a lag, the
preStop hook, SIGTERM) must fail no request, and the container's log must be JSON lines.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.alerts.tools import in_ci
from tests.k8s.chart import render
from tests.k8s.pod import Pod, image_entrypoint, make_pod, secret
from tests.k8s.proxy import RoundRobinProxy
from tests.opsctl.load import Load, tally
from tests.server.harness import free_port

pytestmark = pytest.mark.slow

API_KEY = "test-api-key-0123456789"
ADMIN_KEY = "test-admin-key-9876543210"
SECRETS = [secret("pagekeeper-keys", api_key=API_KEY, admin_key=ADMIN_KEY)]
ENDPOINT_LAG_S = 0.3  # how long the endpoints take to drop a terminating pod (shorter than the preStop delay)


def pod_values() -> dict[str, Any]:
    """What an operator sets; each replica gets its own ports only because they share this host."""
    return {
        "engine": {"port": free_port()},
        "supervisor": {"metricsPort": free_port(), "drainTimeoutSeconds": 30},
        "secrets": {"existingSecret": "pagekeeper-keys"},
        "probes": {"periodSeconds": 1, "timeoutSeconds": 1, "coldStartSeconds": 60},
        "lifecycle": {"endpointDelaySeconds": 1},
    }


def new_pod(name: str, tmp_path: Path) -> Pod:
    return make_pod(name, tmp_path / name, render(pod_values()), SECRETS)


def require_entrypoint() -> None:
    tini = image_entrypoint()[0]
    if shutil.which(tini) is None or shutil.which("opsctl") is None:
        message = f"{tini} or opsctl missing (scripts/setup.sh --test installs tini and pagekeeper)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


def become_ready(pod: Pod, proxy: RoundRobinProxy) -> float:
    """Startup probe, then the readiness probe: only then does the Service send it connections."""
    cold = pod.wait_started()
    ok, detail = pod.probe_once("readinessProbe")
    assert ok, f"{pod.name} not ready after its startup probe passed: {detail}"
    proxy.add(pod.port("http"))
    return cold


def test_rolling_update_under_load_fails_no_request(tmp_path: Path) -> None:
    require_entrypoint()
    proxy = RoundRobinProxy().start()
    # Two replicas, and the pod the rollout surges with.  It starts with them, to keep the test short on two
    # cores; it joins the Service only when the rollout begins, once its probes pass, as a surge pod does.
    old, other, surge = pods = [new_pod("a", tmp_path), new_pod("b", tmp_path), new_pod("a2", tmp_path)]
    load = None
    try:
        for pod in pods:
            pod.start()
        colds = [become_ready(old, proxy)]
        unauthorized = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert unauthorized.status_code == 401  # the API key reached the engine from the Secret, through env
        # The load starts while the old pod is the only endpoint, so the kept-alive clients are pinned to it (as
        # clients of a Service are to whichever pod their connection reached): its termination must move them.
        load = Load(proxy.url, clients_per_kind=1, headers={"Authorization": f"Bearer {API_KEY}"}).start()
        colds.append(become_ready(other, proxy))
        for pod in (old, other):
            assert pod.probe_once("livenessProbe") == (True, "200 ok")
        time.sleep(1.0)

        # The rolling update (maxSurge 1, maxUnavailable 0): the surge pod is ready, then the old pod terminates.
        become_ready(surge, proxy)
        t_term = time.monotonic()
        threading.Timer(ENDPOINT_LAG_S, proxy.remove, args=(old.port("http"),)).start()
        open_at_term = proxy.open_now[old.port("http")]
        at_handover: dict[str, int] = {}  # connections still open to it when the hook's delay is over
        delay = old.container["lifecycle"]["preStop"]["exec"]["command"][-1]
        threading.Timer(float(delay), lambda: at_handover.update(open=proxy.open_now[old.port("http")])).start()
        probes_after_hook: dict[str, tuple[bool, str]] = {}
        result = old.terminate(
            after_prestop=lambda: probes_after_hook.update(
                live=old.probe_once("livenessProbe"), ready=old.probe_once("readinessProbe")
            )
        )
        time.sleep(1.0)
        records = load.stop()
        load = None
    finally:
        if load is not None:
            load.stop()
        for pod in pods:
            pod.kill()
        proxy.stop()

    counts = tally(records)
    in_flight = sum(1 for r in records if r.in_flight_at(t_term + float(delay)))
    failed = sum(n for outcome, n in counts.items() if outcome != "ok")
    print(f"start to the startup probe's first success (2-3 pods at once): {', '.join(f'{c:.1f} s' for c in colds)}")
    print(
        f"requests sent {len(records)}, failed {failed}, outcomes {dict(counts)}; in flight (all pods) when the "
        f"old pod began to hand over: {in_flight}; connections open to the old pod at termination {open_at_term}, "
        f"at the hand-over (kept alive past the endpoint removal) {at_handover.get('open')}; connections per "
        f"endpoint: {dict(proxy.connections)}"
    )
    print(f"termination of the old pod: {result}; probes after preStop: {probes_after_hook}")
    assert failed == 0, [r for r in records if r.outcome != "ok"][:5]
    assert at_handover["open"] >= 1, "no kept-alive client was on the old pod: the hand-over was not exercised"
    assert len(records) >= 20 and proxy.connections[surge.port("http")] > 0
    assert result["prestop_rc"] == 0 and result["exit_code"] == 0 and not result["killed"], result
    assert probes_after_hook["live"][0], "a retired supervisor must stay live until SIGTERM"
    assert not probes_after_hook["ready"][0], "a retired engine must not be ready"

    lines = [ln for ln in old.stdout().splitlines() if ln.strip()]
    parsed = [json.loads(ln) for ln in lines]  # every line of the container's log is JSON
    events = {p.get("event") for p in parsed}
    assert {"supervisor_started", "engine_retired", "supervisor_stopped"} <= events
    assert "handover_finished" in events  # the engine's own log lines reach the container's stdout
    print(f"container log: {len(lines)} lines, all JSON")
