from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cpu_kernel_cache import seed_cpu_kernels
from tests.opsctl.harness import write_config
from tests.server.harness import REPO, free_port
from tests.systemd.box import Box, BoxUnavailable, check_available

ENGINE = "pagekeeper-engine.service"
SOCKET = "pagekeeper-engine.socket"
SUPERVISOR = "pagekeeper-supervisor.service"
CONFIG = "/etc/pagekeeper/pagekeeper.toml"


@pytest.fixture(scope="session")
def box_support() -> None:
    try:
        check_available()
    except BoxUnavailable as e:
        pytest.skip(f"cannot boot systemd in namespaces here: {e}")


@dataclass
class Deployment:
    """The units `opsctl install` rendered, running in a box."""

    box: Box
    port: int
    instance_ports: dict[str, int] | None = None  # named instances installed beside the default one

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def show(self, unit: str = ENGINE, *props: str) -> dict[str, str]:
        return self.box.show(
            unit,
            *(props or ("ActiveState", "SubState", "MainPID", "NRestarts", "Result", "StatusText", "ExecMainStatus")),
        )

    def main_pid(self) -> int:
        return int(self.show(ENGINE, "MainPID")["MainPID"])

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_serving(self, timeout: float = 90, not_pid: int | None = None) -> tuple[int, float]:
        """Wait until the engine unit is active with a MainPID other than `not_pid` and /health is 200."""
        start = time.monotonic()
        last: dict[str, str] = {}
        while time.monotonic() - start < timeout:
            last = self.show()
            pid = int(last.get("MainPID", "0") or 0)
            if last.get("ActiveState") == "active" and pid not in (0, not_pid) and self.healthy():
                return pid, time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"engine not serving after {timeout}s: {last}\n{self.box.journal(ENGINE)[-4000:]}")

    def opsctl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return self.box.run(
            sys.executable,
            "-m",
            "opsctl.cli",
            "--config",
            CONFIG,
            "--runtime-dir",
            "/run/pagekeeper",
            *args,
            timeout=timeout,
            env={"PYTHONPATH": str(REPO)},
        )

    def write(self, path: str, text: str) -> None:
        r = self.box.run("sh", "-c", 'mkdir -p "$(dirname "$0")" && cat > "$0"', path, input=text)
        assert r.returncode == 0, r.stderr

    def events(self, unit: str, event: str) -> list[dict[str, Any]]:
        """The structured log events of a unit's journal (JSON lines) named `event`."""
        out = self.box.run("journalctl", "--no-pager", "-o", "cat", f"--unit={unit}").stdout
        found = []
        for line in out.splitlines():
            if line.startswith("{"):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") == event:
                    found.append(e)
        return found


@pytest.fixture
def deploy(box_support, tmp_path: Path, request: pytest.FixtureRequest):
    """deploy(engine={...}, supervisor={...}, dropins={name: text}) -> a Deployment in a fresh box.

    The host runs `opsctl install --prefix` with the config; the box boots with that tree copied in
    (and the drop-ins in /run/systemd/system/pagekeeper-engine.service.d/).  Every box is torn down
    after the test, failed or not, and on failure its journal is printed.
    """
    boxes: list[Box] = []

    def make(
        engine: dict[str, Any] | None = None,
        supervisor: dict[str, Any] | None = None,
        dropins: dict[str, str] | None = None,
        installed: bool = True,
        instances: dict[str, dict[str, Any]] | None = None,
        env_file: str | None = None,
    ) -> Deployment:
        port = free_port()
        stage = tmp_path / f"install{len(boxes)}"
        (stage / "etc/pagekeeper").mkdir(parents=True)
        write_config(
            stage / "etc/pagekeeper/pagekeeper.toml",
            {"port": port, **(engine or {})},
            {"launcher": "systemd", "metrics_port": 0, **(supervisor or {})},
        )
        instance_ports = {}
        for name, instance_engine in (instances or {}).items():
            instance_ports[name] = free_port()
            write_config(
                stage / f"{name}.toml",
                {"port": instance_ports[name], **instance_engine},
                {"launcher": "systemd", "metrics_port": 0, **(supervisor or {})},
            )
        if installed:
            for args in [["install"]] + [
                ["--instance", name, "--config", str(stage / f"{name}.toml"), "install"] for name in instance_ports
            ]:
                r = subprocess.run(
                    [sys.executable, "-m", "opsctl.cli", *args, "--prefix", str(stage)],
                    cwd=str(REPO),
                    capture_output=True,
                    text=True,
                    timeout=120,
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                )
                assert r.returncode == 0, r.stdout + r.stderr
            if env_file is not None:  # appended to every instance's environment file (keys, for example)
                for env in (stage / "etc/pagekeeper").glob("*.env"):
                    env.write_text(env.read_text() + env_file)
        else:  # only the config: the test runs `opsctl install` inside the box
            (stage / "etc/pagekeeper/pagekeeper.toml").rename(stage / "pagekeeper-test.toml")
        units = {f"{ENGINE}.d/{name}.conf": text for name, text in (dropins or {}).items()}
        # the unit's cache (CacheDirectory=pagekeeper) holds this machine's CPU kernel (tests/cpu_kernel_cache.py)
        seed_cpu_kernels({"CACHE_DIRECTORY": str(stage / "var/cache/pagekeeper")})
        box = Box(tmp_path, run_units=units, files_from=stage, name=f"box{len(boxes)}")
        boxes.append(box)
        box.start()
        print(f"box booted in {box.boot_seconds:.2f} s (PID 1 = host pid {box.pid}), engine port {port}")
        return Deployment(box, port, instance_ports)

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for box in boxes:
        if failed and box.pid is not None:
            try:
                print(f"--- journal of {box.name} ---\n{box.journal(lines=150)}")
            except Exception:
                pass
        box.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
