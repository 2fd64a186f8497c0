"""The supervisor never causes an outage: a supervised engine under steady load while faults come one
at a time, every request recorded.

Eight clients (streaming and not, kept-alive and new-connection) run through: `opsctl restart`,
`opsctl restart --no-drain`, the policy's own drain-restart (a real backlog, made by a burst against
test thresholds), SIGTERM to the engine, SIGSTOP (a hang), kill -9 of the engine and kill -9 of the
supervisor (then `opsctl start` adopts the engine).  Pass: nothing refused; no error of any kind for a
request that was not in flight at the engine's kill -9; the requests in flight at kill -9 fail at once
(no hang) and their loss is counted by the supervisor; `--no-drain` answers its in-flight requests
with a clean, retryable 503 `engine_restarting` (never a reset), counted as well.  The supervisor's
own record agrees: SIGSTOP is decided a hang within its threshold plus one poll, and each fault's
restart is counted under its reason in /metrics.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

from tests.opsctl.load import Load, Record

pytestmark = pytest.mark.slow

PHASE_TIMEOUT = 120


def _lost(d, reason: str) -> float:
    return d.supervisor_metrics().get(f"pagekeeper_supervisor_requests_lost_total{{reason={reason}}}", 0.0)


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_no_request_fails_through_restarts_hangs_and_kills(deploy, record_property):
    d = deploy(
        engine={"max_num_seqs": 4, "drain_timeout": 60},
        # Backlog thresholds the steady load cannot reach but a burst does.  8 clients and 4 running leave at most
        # 4 waiting; at factor 1.0 a step that had just finished one (waiting 4 > 3 running) read as a backlog once
        # a slow CPU (AVX2 only, both engines still running after the hang's restart) kept requests waiting over
        # 1.5 s: a policy restart then overlapped the kill -9 phase.  Over 2 x running needs 5 waiting beside 2.
        supervisor={
            "backlog_factor": 2.0,
            "backlog_wait_seconds": 1.5,
            "events_to_act": 2,
            "max_restarts": 10,
            "handover": "overlap",
        },
    )
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
    load = Load(d.url).start()
    phases: list[tuple[str, float, float]] = []
    marks: dict[str, float] = {}

    def serving_with_new_pid(old: int) -> dict:
        st, _ = d.wait_for(
            lambda s: s["engine"]["state"] == "serving" and s["engine"]["pid"] not in (None, old),
            PHASE_TIMEOUT,
            f"a new engine (not {old}) serving",
        )
        return st

    def phase(name: str, act) -> None:  # type: ignore[no-untyped-def]
        time.sleep(2)  # steady load before each fault
        start = time.monotonic()
        act()
        phases.append((name, start, time.monotonic()))

    def restart(*args: str) -> None:
        old = d.status()["engine"]["pid"]
        r = d.opsctl("restart", *args)
        assert r.returncode == 0, r.stdout + r.stderr
        serving_with_new_pid(old)

    def policy_backlog() -> None:
        old = d.status()["engine"]["pid"]
        # 8 rounds of 4 x 240 tokens: the queue stays over the ratio and ages past 1.5 s for several polls
        # however fast the engine steps (a faster CPU once drained 24 x 96 tokens before 1.5 s had passed)
        load.burst(32, max_tokens=240)
        st = serving_with_new_pid(old)
        assert st["restarts"]["recent"][-1]["reason"] == "backlog", st["restarts"]

    def signal_engine(sig: signal.Signals) -> None:
        old = d.status()["engine"]["pid"]
        os.kill(old, sig)
        marks[sig.name] = time.time()  # wall clock, as the supervisor's decided_at
        serving_with_new_pid(old)

    def kill_engine() -> None:
        old = d.status()["engine"]["pid"]
        # one request certainly in flight: the steady load's requests are short, and a kill that landed between two
        # of them (5 had completed within 0.05 s before it, none had started) found nothing to lose
        assert load.hold_stream().wait(60), "the held stream got no token"
        marks["kill_sent"] = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while not _pid_gone(old):
            time.sleep(0.005)
        marks["engine_dead"] = time.monotonic()
        serving_with_new_pid(old)

    def kill_supervisor() -> None:
        st = d.status()
        engine, supervisor = st["engine"]["pid"], st["supervisor"]["pid"]
        os.kill(supervisor, signal.SIGKILL)
        while not _pid_gone(supervisor):
            time.sleep(0.01)
        time.sleep(2)  # the engine serves on, unsupervised
        orphan = d.opsctl("status")
        assert orphan.returncode == 7 and f"pid {engine}" in orphan.stdout, orphan.stdout
        again = d.opsctl("start")
        assert again.returncode == 0 and "adopted" in again.stdout, again.stdout + again.stderr
        # the adopting supervisor reports "starting" (exit 4) until its first probe of the engine answers, which
        # on a loaded machine may come after `opsctl start` has returned
        st, _ = d.wait_for(lambda st: st["engine"]["state"] == "serving", 60, "the adopted engine reported serving")
        assert st["engine"]["pid"] == engine and st["supervisor"]["pid"] != supervisor  # no second engine
        assert d.opsctl("status").returncode == 0

    lost_before = {"no_drain": 0.0, "engine_exited": 0.0}
    try:
        phase("opsctl restart", lambda: restart())
        lost_before["no_drain"] = _lost(d, "no_drain")
        phase("opsctl restart --no-drain", lambda: restart("--no-drain"))
        no_drain_lost = _lost(d, "no_drain") - lost_before["no_drain"]
        phase("policy drain-restart (backlog)", policy_backlog)
        phase("SIGTERM to the engine", lambda: signal_engine(signal.SIGTERM))
        phase("SIGSTOP (hang)", lambda: signal_engine(signal.SIGSTOP))
        after_hang, hang_metrics = d.status(), d.supervisor_metrics()  # this supervisor's record (it is killed later)
        lost_before["engine_exited"] = _lost(d, "engine_exited")
        exited_before = d.supervisor_metrics()["pagekeeper_supervisor_restarts_total{reason=engine_exited}"]
        phase("kill -9 of the engine", kill_engine)
        kill_lost = _lost(d, "engine_exited") - lost_before["engine_exited"]
        after_kill = d.supervisor_metrics()
        phase("kill -9 of the supervisor", kill_supervisor)
        time.sleep(3)
    finally:
        records = load.stop()

    def phase_of(rec: Record) -> str:
        name = "steady"
        for pname, start, _ in phases:
            if rec.start >= start - 3:
                name = pname
        return name

    def at_kill(rec: Record) -> bool:
        # In flight when the engine died: sent before it was gone, or within 0.1 s after on a kept-alive
        # connection whose close the client had not seen yet (the teardown and that notice take milliseconds).
        return rec.start <= marks["engine_dead"] + 0.1 and rec.end >= marks["kill_sent"]

    no_drain = next(p for p in phases if p[0] == "opsctl restart --no-drain")
    clean_503 = [
        r
        for r in records
        if r.outcome in ("http_503", "error_event")
        and "engine_restarting" in r.detail
        and no_drain[1] <= r.end <= no_drain[2]
    ]
    killed = [r for r in records if r.outcome != "ok" and at_kill(r)]
    other = [r for r in records if r.outcome != "ok" and r not in clean_503 and r not in killed]

    # The engine counts a request in flight until its handler returns, a moment after the last byte reached the
    # client: a request that completed just before the kill -9 may be counted as lost too (a full-suite run on
    # 2026-11-24: 4 counted, 3 failed).
    finished_at_kill = [
        r for r in records if r.outcome == "ok" and marks["kill_sent"] - 0.05 <= r.end <= marks["engine_dead"] + 0.1
    ]
    table = Counter((phase_of(r), r.outcome) for r in records)
    names = ["steady"] + [p[0] for p in phases]
    outcomes = sorted({r.outcome for r in records})
    lines = [f"{'phase':<34}" + "".join(f"{o:>12}" for o in outcomes)]
    for name in names:
        lines.append(f"{name:<34}" + "".join(f"{table[(name, o)]:>12}" for o in outcomes))
    lines.append(f"{'total':<34}" + "".join(f"{sum(table[(n, o)] for n in names):>12}" for o in outcomes))
    lines.append(
        f"in flight at kill -9 and failed: {len(killed)} (supervisor counted {kill_lost:.0f}; "
        f"{len(finished_at_kill)} completed within 0.05 s before it); "
        f"--no-drain clean 503s: {len(clean_503)} (supervisor counted {no_drain_lost:.0f}); "
        f"any other failure: {len(other)}"
    )
    for r in other:
        lines.append(
            f"unexplained: {r.client} {r.outcome} {r.detail} started "
            + ", ".join(f"{r.start - start:+.3f}s after {name!r}" for name, start, _ in phases[-3:])
            + f", {r.start - marks.get('kill_sent', 0):+.3f}s after kill -9, lasted {r.end - r.start:.3f}s"
        )
    print("\n" + "\n".join(lines))
    record_property("chaos_requests", len(records))
    record_property("chaos_other_failures", len(other))

    assert len(records) > 500
    assert not [r for r in records if r.outcome == "refused"]
    assert not other, other[:10]
    # in flight at kill -9: a prompt, clean failure (the connection closes; nothing hangs), and counted
    assert all(r.outcome in ("reset", "truncated") and r.end - marks["kill_sent"] < 10 for r in killed), killed
    # Never more than those that failed plus those that completed at the kill, never fewer than one.
    assert 1 <= kill_lost <= len(killed) + len(finished_at_kill), (kill_lost, killed, finished_at_kill)
    # --no-drain: in-flight requests were answered with a retryable 503 at once, and each was counted
    assert no_drain_lost == len(clean_503)
    # the supervisor's own view agrees: every restart was one we caused, none failed
    st = d.status()
    assert st["engine"]["state"] == "serving" and not st["crash_loop"]["gave_up"]
    hang = next(r for r in after_hang["restarts"]["recent"] if r["reason"] == "hang")
    detected = hang["decided_at"] - marks["SIGSTOP"]
    record_property("sigstop_to_hang_decision_seconds", round(detected, 2))
    print(f"SIGSTOP -> hang decided after {detected:.2f} s (under load)")
    # hang_seconds (2) + one poll: its interval (0.5) and its probe's timeout (1), + slack for the load
    assert detected <= 2 + 0.5 + 1 + 1.5, detected
    assert hang_metrics["pagekeeper_supervisor_restarts_total{reason=hang}"] == 1
    assert hang_metrics["pagekeeper_supervisor_decisions_total{action=restart,reason=hang}"] == 1
    assert after_kill["pagekeeper_supervisor_restarts_total{reason=engine_exited}"] == exited_before + 1
    assert after_kill["pagekeeper_supervisor_engine_up"] == 1
    assert after_kill["pagekeeper_supervisor_last_restart_timestamp_seconds"] > 0
