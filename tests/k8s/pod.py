"""A rendered pod's container run as a plain process, the way a kubelet would run it: a stand-in for a cluster.

Everything comes from the manifests and the Dockerfile, nothing is restated here: the command is the image's
ENTRYPOINT (the Dockerfile's exec form) followed by the container's `args`; the environment is the container's
`env`, with `secretKeyRef`s read from a Secret object; the config file is the ConfigMap's data, written where the
volume is mounted; emptyDirs are fresh directories.  Mount paths are the only thing moved (into the test's
private directory), so that several pods and tests run side by side.  The probes are the container's own
(httpGet on a named port), run at their period and thresholds; terminating runs the preStop hook's command, then
SIGTERM to the container's main process, and SIGKILL at terminationGracePeriodSeconds, as the kubelet does.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from tests.cpu_kernel_cache import seed_cpu_kernels
from tests.k8s.chart import REPO, by_kind

DOCKERFILE = REPO / "Dockerfile"


def image_entrypoint(target: str = "cpu") -> list[str]:
    """The ENTRYPOINT (exec form) of the Dockerfile's `target` stage."""
    stage = None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            stage = m.group(1)
        elif stage == target and line.startswith("ENTRYPOINT "):
            return list(json.loads(line[len("ENTRYPOINT ") :]))
    raise AssertionError(f"no ENTRYPOINT in the Dockerfile's {target} stage")


def container_spec(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, its one container) of the rendered Deployment."""
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


@dataclass
class Pod:
    name: str
    root: Path
    pod_spec: dict[str, Any]
    container: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    events: list[str] = field(default_factory=list)

    # -- ports and probes ---------------------------------------------------------------------------------

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        for p in self.container["ports"]:
            if p["name"] == name_or_number:
                return int(p["containerPort"])
        raise KeyError(f"no container port named {name_or_number}")

    def probe_once(self, kind: str) -> tuple[bool, str]:
        """One run of the container's `kind` probe (httpGet): success is a status in 200..399, as the kubelet's."""
        probe = self.container[kind]
        get = probe["httpGet"]
        url = f"http://127.0.0.1:{self.port(get['port'])}{get['path']}"
        try:
            r = httpx.get(url, timeout=probe.get("timeoutSeconds", 1))
        except httpx.HTTPError as e:
            return False, type(e).__name__
        return 200 <= r.status_code < 400, f"{r.status_code} {r.text.strip()[:80]}"

    def wait_started(self) -> float:
        """Run the startupProbe until it succeeds (seconds since the start) or fails failureThreshold times."""
        probe = self.container["startupProbe"]
        failures = 0
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.stdout()[-3000:]}")
            ok, detail = self.probe_once("startupProbe")
            if ok:
                return time.monotonic() - self.started_at
            failures += 1
            if failures >= probe["failureThreshold"]:
                raise AssertionError(
                    f"{self.name}: startupProbe failed {failures} times ({detail}); the kubelet would restart it"
                )
            time.sleep(probe["periodSeconds"])

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Pod:
        self.started_at = time.monotonic()
        out = open(self.root / "container.log", "wb")  # the container's stdout and stderr, as the runtime keeps them
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        return self

    def run_prestop(self) -> subprocess.CompletedProcess:
        """The preStop hook's exec command, in the container's environment (as `kubectl exec` would run it)."""
        command = self.container["lifecycle"]["preStop"]["exec"]["command"]
        grace = self.pod_spec["terminationGracePeriodSeconds"]
        return subprocess.run(command, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=grace)

    def terminate(self, after_prestop: Callable[[], None] | None = None) -> dict[str, Any]:
        """The kubelet's termination: preStop, then SIGTERM, then SIGKILL once the grace period is over.
        `after_prestop` runs between the hook and the signal (to look at the pod then)."""
        assert self.proc is not None
        grace = self.pod_spec["terminationGracePeriodSeconds"]
        start = time.monotonic()
        hook = self.run_prestop()
        hook_s = time.monotonic() - start
        if after_prestop is not None:
            after_prestop()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(max(1.0, grace - (time.monotonic() - start)))
            killed = False
        except subprocess.TimeoutExpired:
            self.kill()
            code, killed = self.proc.returncode, True
        return {
            "prestop_rc": hook.returncode,
            "prestop_out": (hook.stdout + hook.stderr).strip(),
            "prestop_s": round(hook_s, 2),
            "exit_code": code,
            "total_s": round(time.monotonic() - start, 2),
            "killed": killed,
        }

    def kill(self) -> None:
        """SIGKILL the container's processes (tini, the supervisor, the engine in its own session), by PID."""
        if self.proc is None:
            return
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stdout(self) -> str:
        path = self.root / "container.log"
        return path.read_text(errors="replace") if path.exists() else ""


def make_pod(name: str, root: Path, objects: list[dict[str, Any]], secrets: list[dict[str, Any]]) -> Pod:
    """The container of the rendered Deployment, ready to start: volumes laid out, env resolved, argv built."""
    root.mkdir(parents=True, exist_ok=True)
    pod_spec, container = container_spec(objects)
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    moved: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if mount["mountPath"] in ("/tmp", "/dev/shm"):
            continue  # the host's own serve (nothing in the command names them)
        where = root / ("vol-" + mount["name"])
        where.mkdir(mode=0o777, exist_ok=True)
        if "configMap" in volume:
            for key, text in configmaps[volume["configMap"]["name"]]["data"].items():
                (where / key).write_text(text)
        moved[mount["mountPath"]] = str(where)

    def relocate(value: str) -> str:
        for path, where in sorted(moved.items(), key=lambda kv: -len(kv[0])):
            if value == path or value.startswith(path + "/"):
                return where + value[len(path) :]
        return value

    secret_data = {s["metadata"]["name"]: s.get("data", {}) for s in secrets}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = relocate(var["value"])
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        data = secret_data.get(ref["name"], {})
        if ref["key"] in data:
            env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
        elif not ref.get("optional"):
            raise AssertionError(f"secret {ref['name']} has no key {ref['key']}: the pod would not start")
    argv = list(container.get("command") or image_entrypoint()) + [relocate(a) for a in container.get("args", [])]
    if env.get("XDG_CACHE_HOME", "").startswith(str(root)):  # the pod's own cache volume: no compile at start
        seed_cpu_kernels(env)
    return Pod(name, root, pod_spec, container, argv, env)


def secret(name: str, **data: str) -> dict[str, Any]:
    """A Secret object, as `kubectl create secret generic NAME --from-literal=key=value` makes it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "type": "Opaque",
        "data": {k.replace("_", "-"): base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }
