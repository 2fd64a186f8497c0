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
    # opsctl's drain and resume carry the admin key from the config
    drained = d.opsctl("drain", "--timeout", "2")
    assert drained.returncode == 0 and json.loads(drained.stdout)["drained"] is True
    assert httpx.get(d.url + "/health").json() == {"status": "draining"}
    assert d.opsctl("resume").returncode == 0
    assert httpx.get(d.url + "/health").json() == {"status": "ok"}
    log = d.log("engine.log")
    assert '"admin_request_refused"' in log and '"auth": "admin_key"' in log  # who asked, logged
    assert API_KEY not in log and ADMIN_KEY not in log


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
    assert d.opsctl("drain", "--timeout", "2").returncode == 0  # the supervisor read the admin key file
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
