"""Secrets stay off command lines, and an API key makes the admin endpoints need the admin key.

Any local user can read every process's command line (`ps`, /proc/PID/cmdline); the supervisor hands
the engine its keys through the environment, which only the same user (or root) can read.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow

API_KEY = "sk-test-7f3a9c1e5b2d"
ADMIN_KEY = "adm-test-4e8b0d6f2a1c"


def test_keys_never_reach_a_command_line_and_drain_needs_the_admin_key(deploy):
    d = deploy(engine={"api_key": API_KEY, "admin_key": ADMIN_KEY})
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr
    st = d.status()
    engine_pid, supervisor_pid = st["engine"]["pid"], st["supervisor"]["pid"]

    leaks = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if API_KEY in line or ADMIN_KEY in line:
            leaks.append((proc.info["pid"], line[:200]))
    print(f"processes scanned: {len(psutil.pids())}; command lines holding a key: {len(leaks)}")
    assert not leaks
    assert "--api-key" not in Path(f"/proc/{engine_pid}/cmdline").read_bytes().decode(errors="replace")
    assert psutil.pid_exists(supervisor_pid)

    # the keys still work: the engine got them through its environment
    body = {"model": "pagekeeper-default", "prompt": "Now is", "max_tokens": 4}
    assert httpx.post(d.url + "/v1/completions", json=body).status_code == 401
    ok = httpx.post(d.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200

    # loopback alone no longer drains an engine that has an API key
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}):
        refused = httpx.post(d.url + "/drain", params={"timeout": 1}, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_key"
    assert httpx.get(d.url + "/health").json() == {"status": "ok"}  # nothing changed
    # the admin key opens it (a load balancer's drain); opsctl's drain and resume go over the control socket
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(d.url + "/drain", params={"timeout": 1}, headers=admin).json()["drained"] is True
    assert httpx.delete(d.url + "/drain", headers=admin).status_code == 200
    drained = d.opsctl("drain", "--timeout", "2", "--json")
    assert drained.returncode == 0 and json.loads(drained.stdout)["drained"] is True
    assert httpx.get(d.url + "/health").json() == {"status": "draining"}
    assert d.opsctl("resume").returncode == 0
    assert httpx.get(d.url + "/health").json() == {"status": "ok"}
    log = d.log("engine.log")
    assert '"admin_request_refused"' in log and '"auth": "admin_key"' in log  # who asked, logged
    assert API_KEY not in log and ADMIN_KEY not in log


def test_drain_and_resume_work_with_an_api_key_and_no_admin_key(deploy):
    """The supervisor drains over the engine's private control socket, its own credential: an engine with an API
    key and no admin key is drained and resumed by `opsctl` (it failed with 401 and a traceback in the supervisor's
    log), while HTTP /drain still wants the admin key.  A command that fails is one line, for the caller and in the
    supervisor's log."""
    d = deploy(engine={"api_key": API_KEY})
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr
    supervisor_pid = d.status()["supervisor"]["pid"]
    refused = httpx.post(d.url + "/drain", params={"timeout": 1}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert refused.status_code == 401  # the HTTP endpoint, for load balancers, is as guarded as before
    drained = d.opsctl("drain", "--timeout", "2", "--json")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert json.loads(drained.stdout)["drained"] is True
    assert httpx.get(d.url + "/health").json() == {"status": "draining"}
    body = {"model": "pagekeeper-default", "prompt": "Now is", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(d.url + "/v1/completions", json=body, headers=auth).status_code == 503
    resumed = d.opsctl("resume")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stdout + resumed.stderr
    assert httpx.get(d.url + "/health").json() == {"status": "ok"}
    assert httpx.post(d.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    engine_log = [json.loads(ln) for ln in d.log("engine.log").splitlines() if ln.startswith("{")]
    asked = [(e["command"], e["peer_pid"]) for e in engine_log if e["event"] == "control_request"]
    assert ("drain", supervisor_pid) in asked and ("resume", supervisor_pid) in asked  # who asked, logged

    # a command that fails (the engine's control socket gone): one line for the caller, one in the log
    for sock in d.runtime.glob("eng-*.sock"):
        sock.unlink()
    failed = d.opsctl("drain", "--timeout", "0")
    errors = [ln for ln in failed.stderr.splitlines() if ln.strip()]
    print(f"drain without the engine's socket: exit {failed.returncode}: {errors}")
    assert failed.returncode == 1 and len(errors) == 1 and errors[0].startswith("error: ")
    assert "control socket did not answer 'drain'" in errors[0]
    log = d.log("supervisor.log")
    assert "Traceback" not in log
    lines = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
    assert [e["error"] for e in lines if e["event"] == "command_failed"] == [errors[0].removeprefix("error: ")]


def test_keys_from_files_that_only_their_owner_can_read(deploy, tmp_path):
    api, admin = tmp_path / "api.key", tmp_path / "admin.key"
    api.write_text(API_KEY + "\n")
    admin.write_text(ADMIN_KEY + "\n")
    api.chmod(0o644)
    admin.chmod(0o600)
    d = deploy(engine={"api_key_file": str(api), "admin_key_file": str(admin)})
    r = d.opsctl("start")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "chmod 600" in errors[0], r.stderr  # a readable key file
    api.chmod(0o600)
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr
    body = {"model": "pagekeeper-default", "prompt": "Now is", "max_tokens": 4}
    assert httpx.post(d.url + "/v1/completions", json=body).status_code == 401
    assert (
        httpx.post(d.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code
        == 200
    )
    assert d.opsctl("drain", "--timeout", "2").returncode == 0  # over the control socket: no key needed
    assert d.opsctl("resume").returncode == 0
    assert not [p for p in psutil.process_iter(["cmdline"]) if API_KEY in " ".join(p.info["cmdline"] or [])]


def test_the_engine_reading_its_config_file_itself_takes_the_keys_in_it(tmp_path):
    """`python -m engine.server --config F`, as the systemd unit runs it: a key in [engine] is a key (it was
    once dropped silently, serving without one), and a file holding a key must be private."""
    from tests.server.harness import start_server

    cfg = tmp_path / "keys.toml"
    cfg.write_text(f'[engine]\napi_key = "{API_KEY}"\nadmin_key = "{ADMIN_KEY}"\n[supervisor]\npoll_interval = 5\n')
    cfg.chmod(0o644)
    env = {"PAGEKEEPER_API_KEY": "", "PAGEKEEPER_ADMIN_KEY": ""}
    refused = start_server(tmp_path, "--config", str(cfg), env=env, wait=False)
    assert refused.proc.wait(60) == 2
    errors = [ln for ln in refused.log().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "chmod 600" in errors[0] and "api_key" in errors[0], refused.log()[-2000:]
    cfg.chmod(0o600)
    server = start_server(tmp_path, "--config", str(cfg), env=env)
    try:
        body = {"model": "pagekeeper-default", "prompt": "Now is", "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(
            server.url + "/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert ok.status_code == 200
        assert httpx.post(server.url + "/drain", params={"timeout": 0}, timeout=10).status_code == 401
        assert API_KEY not in " ".join(server.args)
    finally:
        server.terminate()


def test_an_http_drain_without_the_admin_key_says_in_one_line_what_to_set(tmp_path):
    """Under systemd the supervisor has no control socket to its engine and drains over HTTP: with an API key and
    no admin key, the refusal is one line naming the setting (it was httpx's 401 with a "For more information"
    line and a URL)."""
    from opsctl.probes import EngineProbe
    from tests.server.harness import start_server

    server = start_server(tmp_path, env={"PAGEKEEPER_API_KEY": API_KEY, "PAGEKEEPER_ADMIN_KEY": ADMIN_KEY})
    try:
        for key in (None, API_KEY):
            with pytest.raises(RuntimeError) as e:
                EngineProbe(server.url, 5.0, admin_key=key).drain(1.0)
            print(e.value)
            assert "\n" not in str(e.value) and "HTTP 401" in str(e.value) and "admin_key_file" in str(e.value)
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # nothing was drained
        with_key = EngineProbe(server.url, 5.0, admin_key=ADMIN_KEY)
        assert with_key.drain(1.0)["drained"] is True and with_key.resume() == {"status": "ok"}
    finally:
        server.kill()
