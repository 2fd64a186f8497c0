"""`opsctl status` shows the engine core's own process: its pid, its restarts behind the front, the requests the
front resumed on a new core (engine/loop/).  The supervisor watches both processes; the front restarts the core
on its own, so a killed core is not a supervisor restart."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "pagekeeper-default"


def test_status_names_the_core_and_counts_its_restarts_behind_the_front(deploy) -> None:  # type: ignore[no-untyped-def]
    d = deploy(engine={"engine_core": "process"})
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
    st, _ = d.wait_for(
        lambda s: (s["engine"]["process"] or {}).get("core_pid") and s["engine"]["core_restarts"] == 0,
        timeout=30,
        what="a core pid and its restart count in the status",
    )
    front, core = st["engine"]["pid"], st["engine"]["process"]["core_pid"]
    assert core != front

    text = d.opsctl("status")
    assert f"core        pid {core}  restarts 0  resumed 0 request(s)" in text.stdout, text.stdout

    os.kill(core, signal.SIGKILL)
    st, _ = d.wait_for(
        lambda s: (
            s["engine"]["core_restarts"] == 1 and (s["engine"]["process"] or {}).get("core_pid") not in (None, core)
        ),
        timeout=60,
        what="the killed core counted and a new one in the status",
    )
    assert st["engine"]["pid"] == front  # the front lived: no supervisor restart
    assert st["restarts"]["total"] == 0
    reply = httpx.post(d.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200, reply.text
    text = d.opsctl("status")
    assert f"core        pid {st['engine']['process']['core_pid']}  restarts 1" in text.stdout, text.stdout


def test_with_kept_weights_a_spare_core_stands_by_and_takes_over_a_killed_one(deploy) -> None:  # type: ignore[no-untyped-def]
    """Weights kept by the supervisor's keeper: the front keeps a spare core standing by behind the serving one
    (imports and weights done), promotes it when the serving core dies, and starts the next spare behind it."""
    import json

    import psutil

    d = deploy(
        engine={"engine_core": "process"},
        supervisor={"keep_weights": "on", "handover": "sequential", "spare_engine": "off"},
    )
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]

    def spares(front: int) -> list[int]:
        return [p.pid for p in psutil.Process(front).children(recursive=True) if "--spare" in p.cmdline()]

    st, _ = d.wait_for(
        lambda s: (s["engine"]["process"] or {}).get("core_pid") and spares(s["engine"]["pid"]),
        timeout=60,
        what="a serving core and a spare behind it",
    )
    front, core = st["engine"]["pid"], st["engine"]["process"]["core_pid"]
    (spare,) = spares(front)
    assert spare != core
    os.kill(core, signal.SIGKILL)
    st, _ = d.wait_for(
        lambda s: s["engine"]["core_restarts"] == 1 and (s["engine"]["process"] or {}).get("core_pid") == spare,
        timeout=60,
        what="the spare serving in the killed core's place",
    )
    reply = httpx.post(d.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert st["engine"]["pid"] == front
    d.wait_for(lambda s: spares(front) not in ([], [spare]), timeout=60, what="a new spare behind the promoted core")
    events = [json.loads(ln) for ln in d.log("engine.log").splitlines() if ln.startswith("{")]
    starting = [e for e in events if e.get("event") == "engine_core_starting"]
    assert starting and starting[-1]["pid"] == spare and starting[-1]["spare"] is True, starting
    ready = [e for e in events if e.get("event") == "engine_core_ready"]
    first, promoted = ready[0], ready[-1]
    print(f"first core ready after {first['seconds']} s; the promoted spare after {promoted['seconds']} s")
    assert promoted["pid"] == spare and promoted["seconds"] < first["seconds"]
