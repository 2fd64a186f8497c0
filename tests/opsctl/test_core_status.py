"""`opsctl status` shows the engine core's own process: its pid, its restarts behind the front, the requests the
front resumed on a new core (engine/coreproc/).  The supervisor watches both processes; the front restarts the core
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
