"""A real deployment for tests: `opsctl start` with a TOML config in a temp dir, torn down by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import REPO, free_port

FAST_SUPERVISOR = {
    "poll_interval": 0.5,
    "probe_timeout": 1.0,
    "hang_seconds": 2.0,
    "cooldown_seconds": 1.0,
    "ready_timeout": 90.0,
    "event_window": 30.0,
    "events_to_act": 3,
    "max_restarts": 3,
    "restart_window": 300.0,
    "drain_timeout": 60.0,
    "metrics_port": 0,
    "launcher": "process",
}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def write_config(path: Path, engine: dict[str, Any], supervisor: dict[str, Any]) -> Path:
    lines = ["[engine]"] + [f"{k} = {_toml_value(v)}" for k, v in engine.items()]
    lines += ["", "[supervisor]"] + [f"{k} = {_toml_value(v)}" for k, v in supervisor.items()]
    path.write_text("\n".join(lines) + "\n")
    if engine.get("api_key") or engine.get("admin_key"):
        path.chmod(0o600)  # a file that holds a key must be private (both the engine and opsctl check)
    return path


@dataclass
class Deployment:
    root: Path
    config: Path
    runtime: Path
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(extra or {})}

    def opsctl(
        self, *args: str, timeout: float = 180, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "opsctl.cli",
            "--config",
            str(self.config),
            "--runtime-dir",
            str(self.runtime),
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(env), cwd=str(REPO))

    def status(self) -> dict[str, Any]:
        """What `opsctl status --json` prints, computed in this process by the function the command runs: a test
        polls it every 0.2 s while engines start, and a CLI process per poll cost ~1 s of CPU each (358 processes,
        340 s of CPU in one suite run), taken from the engines being waited for.  The command itself is run where
        a test checks the command (test_exit_codes.py, test_cli_*)."""
        from opsctl.cli import status_document

        return status_document(self.runtime)

    def cli_status(self) -> dict[str, Any]:
        """`opsctl status --json` as a process."""
        r = self.opsctl("status", "--json", timeout=30)
        return json.loads(r.stdout)

    def fast_status(self) -> dict[str, Any]:
        """Status straight from the control socket (no subprocess), for tight loops."""
        from opsctl import control

        return control.status(self.runtime)

    def engine_pid(self) -> int | None:
        return self.status()["engine"]["pid"]

    def supervisor_metrics(self) -> dict[str, float]:
        url = self.status()["supervisor"]["metrics_url"]
        out = {}
        for fam in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_for(self, predicate, timeout: float, what: str) -> tuple[dict[str, Any], float]:  # type: ignore[no-untyped-def]
        start = time.monotonic()
        last: dict[str, Any] = {}
        while time.monotonic() - start < timeout:
            try:
                last = self.status()
                if predicate(last):
                    return last, time.monotonic() - start
            except (ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise AssertionError(
            f"timed out waiting for {what}; last status: {json.dumps(last)[:3000]}\n"
            f"supervisor log: {self.log('supervisor.log')[-3000:]}"
        )

    def log(self, name: str) -> str:
        p = self.runtime / name
        return p.read_text(errors="replace") if p.exists() else ""

    def teardown(self) -> None:
        """Kill the engine's process group and the supervisor, by PID, whatever state they are in."""
        engine_pid = None
        try:
            engine_pid = self.status().get("engine", {}).get("pid")
        except Exception:
            pass
        pid_file = self.runtime / "supervisor.pid"
        supervisor_pid = int(pid_file.read_text()) if pid_file.exists() else None
        for kill, pid in ((os.killpg, engine_pid), (os.kill, supervisor_pid)):
            if pid is None:
                continue
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        # Any other process of this deployment (an engine a failed test left behind: status names only the current
        # one) carries the private runtime dir on its command line (--control-socket, --runtime-dir).
        import psutil

        mine = str(self.runtime)
        for proc in psutil.process_iter(["cmdline"]):
            if proc.pid != os.getpid() and any(mine in arg for arg in proc.info["cmdline"] or ()):
                try:
                    proc.resume()
                    proc.kill()
                except psutil.Error:
                    pass


def deployment(
    tmp_path: Path, engine: dict[str, Any] | None = None, supervisor: dict[str, Any] | None = None
) -> Deployment:
    port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    runtime = tmp_path / "run"
    cfg = write_config(
        tmp_path / "pagekeeper.toml", {"port": port, **(engine or {})}, {**FAST_SUPERVISOR, **(supervisor or {})}
    )
    return Deployment(tmp_path, cfg, runtime, port)
