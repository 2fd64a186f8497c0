"""Two deployments on one host, each under its own instance name, with real supervisors and engines.

The runtime dirs come from the instance names alone (no --runtime-dir), under a private
PAGEKEEPER_RUNTIME_ROOT, exactly as an operator's `opsctl --instance NAME` would find them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.opsctl.harness import FAST_SUPERVISOR, Deployment, write_config
from tests.server.harness import REPO, free_port

MODEL = "pagekeeper-default"


@dataclass
class Instance(Deployment):
    name: str = "default"
    runtime_root: Path = Path("/nonexistent")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PAGEKEEPER_RUNTIME_DIR", "PAGEKEEPER_INSTANCE")}
        return {
            **env,
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "PAGEKEEPER_RUNTIME_ROOT": str(self.runtime_root),
            **(extra or {}),
        }

    def opsctl(
        self, *args: str, timeout: float = 180, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "opsctl.cli", "--instance", self.name, "--config", str(self.config), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(env), cwd=str(REPO))


@pytest.fixture
def instances(tmp_path):
    runtime_root = tmp_path / "run"
    runtime_root.mkdir(mode=0o700)
    made: list[Instance] = []

    def make(name: str, port: int | None = None, **supervisor) -> Instance:
        port = port or free_port()
        cfg = write_config(tmp_path / f"{name}.toml", {"port": port}, {**FAST_SUPERVISOR, **supervisor})
        inst = Instance(
            tmp_path,
            cfg,
            runtime_root / ("pagekeeper" if name == "default" else f"pagekeeper@{name}"),
            port,
            name=name,
            runtime_root=runtime_root,
        )
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.teardown()


def _complete(inst: Instance) -> int:
    r = httpx.post(inst.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}, timeout=60)
    return r.status_code


def test_two_named_instances_run_side_by_side_and_a_port_clash_is_refused(instances):
    a, b = instances("alpha"), instances("beta")
    for inst in (a, b):
        r = inst.opsctl("start")
        assert r.returncode == 0, r.stdout + r.stderr
    sa, sb = a.status(), b.status()
    print(
        f"alpha: {sa['supervisor']['runtime_dir']} pid {sa['engine']['pid']} {sa['engine']['url']}; "
        f"beta: {sb['supervisor']['runtime_dir']} pid {sb['engine']['pid']} {sb['engine']['url']}"
    )
    assert (sa["supervisor"]["instance"], sb["supervisor"]["instance"]) == ("alpha", "beta")
    assert sa["supervisor"]["runtime_dir"] == str(a.runtime) and sb["supervisor"]["runtime_dir"] == str(b.runtime)
    assert (a.runtime / "supervisor.sock").exists() and (b.runtime / "supervisor.sock").exists()
    assert oct(a.runtime.stat().st_mode & 0o777) == "0o700"
    assert _complete(a) == 200 and _complete(b) == 200
    human = a.opsctl("status")
    assert human.returncode == 0 and "instance alpha" in human.stdout, human.stdout

    # a third instance that wants alpha's port, or beta's supervisor metrics port: one line, exit 2, nothing runs
    beta_metrics = int(sb["supervisor"]["metrics_url"].rsplit(":", 1)[1].split("/")[0])
    for name, port, metrics_port, owner, key in (
        ("gamma", a.port, 0, "alpha", "[engine] port"),
        ("delta", None, beta_metrics, "beta", "[supervisor] metrics_port"),
    ):
        c = instances(name, port=port, metrics_port=metrics_port)
        r = c.opsctl("start", timeout=60)
        err = r.stderr.strip()
        print(f"{name}: exit {r.returncode}: {err}")
        assert r.returncode == 2 and len(err.splitlines()) == 1, r.stdout + r.stderr
        assert f"instance {owner!r}" in err and key in err, err
        assert not (c.runtime / "supervisor.sock").exists() and not (c.runtime / "supervisor.pid").exists()
        assert c.opsctl("status").returncode == 3
        # the supervisor checks too (systemd starts it without opsctl)
        r = subprocess.run(
            [sys.executable, "-m", "opsctl.supervisor", "--instance", name, "--config", str(c.config)],
            capture_output=True,
            text=True,
            timeout=60,
            env=c.env(),
            cwd=str(REPO),
        )
        assert r.returncode == 2 and f"instance {owner!r}" in r.stderr, r.stderr[-2000:]

    # the same instance name with another config file is refused, not reported as "already running"
    other = write_config(a.root / "other.toml", {"port": free_port()}, FAST_SUPERVISOR)
    r = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--instance", "alpha", "start", "--config", str(other)],
        capture_output=True,
        text=True,
        timeout=60,
        env=a.env(),
        cwd=str(REPO),
    )
    assert r.returncode == 2 and "already runs from" in r.stderr and "--instance" in r.stderr, r.stdout + r.stderr

    # restart and stop one: the other never notices (the instances are symmetric: one direction is enough)
    b_pid = sb["engine"]["pid"]
    r = a.opsctl("restart")
    assert r.returncode == 0, r.stdout + r.stderr
    assert a.status()["engine"]["pid"] != sa["engine"]["pid"]
    assert b.status()["engine"]["pid"] == b_pid and _complete(b) == 200
    r = a.opsctl("stop")
    assert r.returncode == 0, r.stdout + r.stderr
    assert a.opsctl("status").returncode == 3
    assert not (a.runtime / "instance.json").exists()
    st = b.status()
    assert st["engine"]["state"] == "serving" and st["engine"]["pid"] == b_pid and _complete(b) == 200
    assert b.opsctl("stop").returncode == 0


def test_log_rotation_keeps_the_engine_log_bounded_while_it_serves(instances):
    inst = instances("logs", log_max_bytes=8192, log_backups=2)
    r = inst.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr
    pid = inst.status()["engine"]["pid"]

    def rotations() -> float:
        return inst.supervisor_metrics().get("pagekeeper_supervisor_log_rotations_total{log=engine.log}", 0)

    # Requests until the supervisor (polling every 0.5 s) has rotated twice: each is an http_request line in
    # engine.log (about 150 bytes).  A fixed count was written in one poll interval by a fast CPU: one rotation.
    sent, deadline = 0, time.monotonic() + 90
    with httpx.Client(timeout=60) as client:
        while rotations() < 2:
            assert time.monotonic() < deadline, f"{sent} requests and fewer than two rotations of engine.log"
            for _ in range(25):
                body = {"model": MODEL, "prompt": f"n{sent}", "max_tokens": 1}
                assert client.post(inst.url + "/v1/completions", json=body).status_code == 200
                sent += 1
            time.sleep(0.3)
    log = inst.runtime / "engine.log"
    sizes = {p.name: p.stat().st_size for p in sorted(inst.runtime.glob("engine.log*"))}
    print(f"after {sent} requests: {sizes}, rotations {rotations():.0f}")
    assert set(sizes) <= {"engine.log", "engine.log.1", "engine.log.2"}, sizes  # two backups, no more
    assert "engine.log.1" in sizes and "engine.log.2" in sizes
    for name in sizes:
        assert oct((inst.runtime / name).stat().st_mode & 0o777) == "0o600"
    # the engine (the same process: it was never restarted) keeps appending to the truncated file
    assert inst.status()["engine"]["pid"] == pid
    before = log.stat().st_size
    assert _complete(inst) == 200
    # the engine logs the request once its response is out, so the line may land a moment after the client has it
    # (a loaded machine, 2026-11-26: read before it, the file still held only a stats line)
    deadline = time.monotonic() + 15
    while b'"http_request"' not in log.read_bytes()[before:] and time.monotonic() < deadline:
        time.sleep(0.05)
    text = log.read_bytes()
    assert len(text) > before and b"\0" not in text
    lines = [json.loads(line) for line in text[before:].decode().splitlines() if line.startswith("{")]
    assert any(line.get("event") == "http_request" for line in lines), lines[-3:]
    assert "http_request" in inst.opsctl("logs", "-n", "5").stdout
    assert inst.opsctl("stop").returncode == 0


def test_a_port_held_by_an_instance_with_its_own_runtime_dir_is_refused_naming_it(deploy):
    """Two deployments, each given its own runtime dir (not siblings: neither sees the other's instance.json), on
    one port: the second was refused with a bare "Address already in use"; now the line names the instance that
    holds the port, its runtime dir and its supervisor."""
    first = deploy()
    assert first.opsctl("start").returncode == 0
    second = deploy(engine={"port": first.port})
    assert second.runtime.parent != first.runtime.parent
    r = second.opsctl("start")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    print(f"second start on port {first.port}: exit {r.returncode}: {errors}")
    assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
    supervisor_pid = first.status()["supervisor"]["pid"]
    assert errors[0] == (
        f"error: [engine] port {first.port} is already used by instance 'default' (runtime dir {first.runtime}, "
        f"config {first.config.resolve()}, supervisor pid {supervisor_pid}); give this instance another [engine] port"
    )
    assert first.status()["engine"]["state"] == "serving"  # the first is untouched


def test_a_host_that_is_not_this_machines_is_blamed_not_the_port(deploy):
    d = deploy(engine={"host": "192.0.2.1"})  # TEST-NET-1: valid, never an address of this machine
    r = d.opsctl("start")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    print(f"host 192.0.2.1: exit {r.returncode}: {errors}")
    assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
    assert f"cannot listen on 192.0.2.1:{d.port}" in errors[0] and errors[0].endswith("change [engine] host")
    assert "port" not in errors[0].split(": ", 2)[-1]  # the hint names the host, never the port
