"""Must-show 2-7: fault injection against the real engine and the real supervisor process.

Each test runs `opsctl start` on the embedded model with fast policy settings (0.5 s polls,
2 s hang threshold), injects one fault, and checks what the supervisor did through
`opsctl status --json` and its /metrics.  The faults that end in a restart of a healthy deployment share one
(`shared`): each starts from a serving engine and reads only what happened since it began (the logs past their
length then, the counters' growth, the restarts past their count then).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.opsctl.harness import Deployment, deployment
from tests.opsctl.load import Load

pytestmark = pytest.mark.slow

MODEL = "pagekeeper-default"


def _start(d) -> dict:
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
    assert f"serving {MODEL} at {d.url}" in r.stdout
    return d.status()


# kill -9 of the engine and SIGSTOP (a hang) are checked under load, metrics included, in test_chaos.py.


@dataclass
class Since:
    """A deployment shared by the tests below, as one test sees it: what happened since the test began."""

    d: Deployment
    logs_at: dict[str, int] = field(default_factory=dict)
    restarts_at: int = 0
    metrics_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.logs_at = {name: len(self.d.log(name)) for name in ("supervisor.log", "engine.log")}
        self.restarts_at = self.d.status()["restarts"]["total"]
        self.metrics_at = self.d.supervisor_metrics()

    def log(self, name: str) -> str:
        return self.d.log(name)[self.logs_at[name] :]

    def restarts(self, st: dict) -> list[dict]:
        """The restarts since the test began (`recent` holds the last ten)."""
        new = st["restarts"]["total"] - self.restarts_at
        return st["restarts"]["recent"][-new:] if new else []

    def grown(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each counter's growth since the test began."""
        return {k: v - self.metrics_at.get(k, 0.0) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def _shared_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One supervised engine for the restart tests that need no fresh one: debug hooks on, the backlog rule off (only
    the fault under test acts), overlapping handovers (what "auto" is on the CPU), and room for their restarts in
    the crash-loop guard (each test's own restarts are checked by reason), none of which leaves its window while the
    module runs (a test compares the crash-loop count before and after its fault)."""
    d = deployment(
        tmp_path_factory.mktemp("shared"),
        engine={"enable_debug_hooks": True},
        supervisor={"backlog_factor": 1000.0, "handover": "overlap", "max_restarts": 20, "restart_window": 3600.0},
    )
    try:
        _start(d)
        yield d
    finally:
        d.teardown()


def _engine_servers(d: Deployment) -> list[int]:
    """The engine front processes of this deployment (each carries its private runtime dir on its command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "engine.server" in cmd and any(str(d.runtime) in arg for arg in cmd):
            found.append(proc.pid)
    return found


@pytest.fixture
def shared(_shared_deployment: Deployment) -> Since:
    """The shared deployment once it serves on one engine: an earlier test's restart is over, its old engine gone."""
    d = _shared_deployment
    d.wait_for(lambda s: s["engine"]["state"] == "serving" and s["engine"]["pid"], 120, "the shared engine serving")
    deadline = time.monotonic() + 60
    while len(_engine_servers(d)) > 1:
        assert time.monotonic() < deadline, f"an old engine is still there: {_engine_servers(d)}"
        time.sleep(0.1)
    return Since(d)


# The flood must keep the cache under pressure for several 0.5 s polls however fast the engine is: 24 requests
# lasted about 3 s once CPU decode read the cache in place, too few polls for 3 pressure events to be certain.
FLOOD = 72


def test_a_full_cache_is_recycled_first_then_drained_and_restarted_and_no_request_is_lost(deploy):
    """A cache that stays full under real overload: the cheap cure (a recycle in place, opsctl/policy.py) is tried
    first; the pressure persists, so the engine is drained and restarted.  Neither loses a request."""
    # 32 KV blocks of 16 tokens: a handful of long requests fills the cache for many seconds.
    # Many short prompts with long outputs: a block freed by a finished or preempted request is
    # taken by the next waiting one within a step, so the pool stays full.
    d = deploy(
        engine={
            "kv_cache_memory_bytes": 32 * 32768,
            "max_num_seqs": 64,
            "max_model_len": 256,
            "enable_debug_hooks": True,
        },
        # the backlog rule is switched off here so that only the cache rule can act
        supervisor={"cooldown_seconds": 0.5, "drain_timeout": 120, "backlog_factor": 1000.0},
    )
    _start(d)
    body = {"model": MODEL, "prompt": "Errors should", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    short = {**body, "max_tokens": 16}

    async def traffic() -> list:
        results = []

        async def one(client: httpx.AsyncClient, payload: dict) -> None:
            try:
                r = await client.post("/v1/completions", json=payload)
                tokens = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None
                results.append((r.status_code, tokens, payload["max_tokens"]))
            except httpx.HTTPError as e:
                results.append(("no answer", repr(e), payload["max_tokens"]))

        async with httpx.AsyncClient(base_url=d.url, timeout=180) as client:
            flood = [asyncio.create_task(one(client, body)) for _ in range(FLOOD)]
            await asyncio.sleep(0.5)
            # a steady trickle through the drain, the restart and 3 s of the new engine
            later, restarted_at, deadline = [], None, time.monotonic() + 150
            while time.monotonic() < deadline:
                later.append(asyncio.create_task(one(client, short)))
                await asyncio.sleep(0.25)
                st = await asyncio.to_thread(d.fast_status)
                if restarted_at is None and st["restarts"]["recent"]:
                    restarted_at = time.monotonic()
                if restarted_at is not None and time.monotonic() - restarted_at > 3:
                    break
            await asyncio.gather(*flood, *later)
        return results

    results = asyncio.run(traffic())
    st = d.status()
    reasons = [r["reason"] for r in st["restarts"]["recent"]]
    assert reasons and set(reasons) == {"high_cache_persists"}, (reasons, st["last_decision"])
    recycled = [json.loads(line) for line in d.log("supervisor.log").splitlines() if '"engine_recycled"' in line]
    assert recycled and recycled[0]["reason"] == "high_cache", "the cheap cure first"
    events = [json.loads(line) for line in d.log("supervisor.log").splitlines() if '"action": "drain_restart"' in line]
    assert events and events[0]["evidence"]["peak_cache_usage"] > 0.95
    assert events[0]["evidence"]["preemptions_in_window"] > 0  # pressure, not just a full cache
    assert events[0]["evidence"]["recycled_s_ago"] > 0
    lost = [r for r in results if r[0] != 200]
    print(
        f"stuck cache: {len(results)} requests, "
        + ", ".join(f"{sum(1 for r in results if r[0] == c)} x {c}" for c in sorted({r[0] for r in results}, key=str))
    )
    assert not lost, lost  # a drain-restart hands over: no 503, no reset, nothing refused
    assert all(tokens == wanted for code, tokens, wanted in results)  # complete outputs
    assert sum(1 for _, _, wanted in results if wanted == 240) == FLOOD  # the whole flood
    log = [json.loads(line) for line in d.log("supervisor.log").splitlines() if line.startswith("{")]
    order = [
        e["event"]
        for e in log
        if e["event"] in ("decision", "engine_restart") and e.get("action", "drain_restart") == "drain_restart"
    ]
    assert order[:2] == ["decision", "engine_restart"], order
    engine_log = [json.loads(line) for line in d.log("engine.log").splitlines() if line.startswith("{")]
    # the old engine handed over (it was not killed): what it held finished there, whether the flood was still
    # running when the new engine took over or had finished while the new one loaded (overlap)
    assert [e for e in engine_log if e["event"] == "handover_finished"][0]["handed_over"] is True
    m = d.supervisor_metrics()
    assert (
        sum(v for k, v in m.items() if k.startswith("pagekeeper_supervisor_decisions_total{action=drain_restart")) >= 1
    )
    assert sum(v for k, v in m.items() if k.startswith("pagekeeper_supervisor_requests_lost_total")) == 0


def test_an_engine_that_exits_2_is_started_once_and_start_says_why(deploy):
    d = deploy(engine={"model": "/nonexistent/model"}, supervisor={"max_restarts": 2})
    started = time.monotonic()
    r = d.opsctl("start")
    took = time.monotonic() - started
    print(f"opsctl start with a bad model path: exit {r.returncode} after {took:.1f} s: {r.stderr.strip()}")
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "/nonexistent/model" in errors[0] and "no such directory" in errors[0], r.stderr
    assert took < 15  # the issue asks for ~10 s; 3.6 s measured on the 2-core machine, 16.4 s once in a loaded CI
    # run before the engine checked the path ahead of importing torch
    assert d.log("engine.log").count("--- engine start") == 1  # started once, never retried
    st = d.opsctl("status")
    assert st.returncode == 3 and "last failure" in st.stdout and "/nonexistent/model" in st.stdout
    assert not (d.runtime / "supervisor.sock").exists()


@pytest.mark.parametrize("case", ["model", "truncated", "max_model_len", "api_key_file"])
def test_an_engine_side_config_error_names_the_config_key(deploy, tmp_path, checkpoint, case):
    """The engine's own checks name the flags opsctl passed it; `opsctl start` tells them as the config file's keys,
    in one line without a doubled prefix (it said `error: exit code 2: error: --model /nonexistent: ...`), and its
    progress never goes back to "starting supervisor" after the engine exited."""
    import shutil

    engine: dict = {}
    if case == "model":
        engine["model"] = "/nonexistent"
        wanted = '[engine] model = "/nonexistent": no such directory; '
    elif case == "truncated":
        model = tmp_path / "truncated"
        shutil.copytree(checkpoint("llama"), model)
        weights = next(model.glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        engine["model"] = str(model)
        wanted = f'[engine] model = "{model}": {weights}: not a readable safetensors file'
    elif case == "max_model_len":
        engine["max_model_len"] = 100000
        wanted = (
            "[engine] max_model_len = 100000 exceeds the model's limit of 256 tokens (max_position_embeddings); "
            "use [engine] max_model_len = 256 or less"
        )
    else:
        engine["api_key_file"] = str(tmp_path / "missing.key")
        wanted = f'[engine] api_key_file = "{tmp_path / "missing.key"}": No such file or directory'
    d = deploy(engine=engine)
    started = time.monotonic()
    r = d.opsctl("start")
    took = time.monotonic() - started
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    print(f"{case}: exit {r.returncode} after {took:.1f} s: {r.stderr.strip()}")
    assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
    assert errors[0].startswith(f"error: {d.config.resolve()}: {wanted}"), errors[0]
    assert "--" not in errors[0].replace(str(tmp_path), "") and "exit code" not in errors[0]
    progress = [ln.split(": ", 1)[1].rsplit(" (", 1)[0] for ln in r.stderr.splitlines() if ln.startswith("starting: ")]
    if "exited" in progress:
        assert "starting supervisor" not in progress[progress.index("exited") :], progress
    st = d.opsctl("status")
    assert st.returncode == 3 and wanted in st.stdout, st.stdout
    assert d.log("engine.log").count("--- engine start") == 1  # exit 2: never retried


def test_an_engine_that_keeps_crashing_ends_in_a_reported_crash_loop(deploy, tmp_path):
    # exit 1 (a bug, not a config mistake) is retried until the crash-loop guard gives up
    crasher = tmp_path / "sitecustomize.py"
    crasher.write_text(
        "import sys\nif 'engine.server' in sys.orig_argv:\n"
        "    print('boom: a crash on start-up', flush=True); sys.exit(1)\n"
    )
    d = deploy(supervisor={"max_restarts": 2})
    r = d.opsctl("start", env={"PYTHONPATH": f"{tmp_path}:{d.env()['PYTHONPATH']}"})
    assert r.returncode == 6, r.stdout + r.stderr
    assert "gave up" in r.stderr and "exit code 1" in r.stderr
    st = d.status()
    assert st["engine"]["state"] == "gave_up" and st["crash_loop"]["gave_up"] is True
    assert st["restarts"]["counted_for_crash_loop"] == 2
    text = d.opsctl("status")
    assert text.returncode == 6 and "GAVE UP" in text.stdout and "exit code 1" in text.stdout
    again = d.opsctl("start")
    assert again.returncode == 6 and "gave up" in again.stderr
    m = d.supervisor_metrics()
    assert m["pagekeeper_supervisor_crash_loop_gave_up"] == 1
    assert m["pagekeeper_supervisor_restarts_total{reason=engine_exited}"] == 2
    assert m["pagekeeper_supervisor_decisions_total{action=give_up,reason=crash_loop}"] == 1
    # a kubelet's liveness probe (the Helm chart's) now fails: restarting the container is the next level's job
    livez = httpx.get(st["supervisor"]["metrics_url"].replace("/metrics", "/livez"), timeout=5)
    assert livez.status_code == 503 and livez.text.startswith("gave up: ") and "exit code 1" in livez.text
    supervisor = psutil.Process(st["supervisor"]["pid"])
    busy_before = sum(supervisor.cpu_times()[:2])
    time.sleep(2)  # and it stays given up, no more restarts
    assert d.status()["restarts"]["total"] == 2
    busy = sum(supervisor.cpu_times()[:2]) - busy_before
    assert busy < 0.5, f"a supervisor that gave up used {busy:.2f} CPU-s in 2 s"  # it waits for its polls, idle


def test_fake_nvml_readings_are_exported(deploy, tmp_path):
    gpu_file = tmp_path / "gpus.json"
    gpu_file.write_text(
        json.dumps(
            [
                {
                    "index": 0,
                    "name": "Fake H100",
                    "memory_used_bytes": 60 * 2**30,
                    "memory_total_bytes": 80 * 2**30,
                    "utilization_ratio": 0.9,
                    "temperature_celsius": 71.0,
                    "xid_errors_total": 2,
                    "ecc_errors_total": 1,
                }
            ]
        )
    )
    d = deploy()
    r = d.opsctl("start", env={"PAGEKEEPER_FAKE_NVML": str(gpu_file)})
    assert r.returncode == 0, r.stderr
    m = d.supervisor_metrics()
    assert m["pagekeeper_gpu_memory_used_bytes{gpu=0}"] == 60 * 2**30
    assert m["pagekeeper_gpu_memory_total_bytes{gpu=0}"] == 80 * 2**30
    assert m["pagekeeper_gpu_utilization_ratio{gpu=0}"] == 0.9
    assert m["pagekeeper_gpu_temperature_celsius{gpu=0}"] == 71.0
    assert m["pagekeeper_gpu_xid_errors_total{gpu=0}"] == 2
    assert m["pagekeeper_gpu_ecc_errors_total{gpu=0}"] == 1
    assert "Fake H100" in d.opsctl("status").stdout
    # which engine this supervisor runs, and every restart/decision series present (at 0) from the start
    assert m[f"pagekeeper_supervisor_info{{engine_url={d.url},launcher=process,model_name={MODEL}}}"] == 1
    assert m["pagekeeper_supervisor_restarts_total{reason=hang}"] == 0
    assert m["pagekeeper_supervisor_decisions_total{action=give_up,reason=crash_loop}"] == 0


def test_dry_run_decides_and_logs_but_never_acts(deploy):
    d = deploy()
    r = d.opsctl("start", "--dry-run")
    assert r.returncode == 0, r.stderr
    st = d.status()
    old = st["engine"]["pid"]
    time.sleep(1.5)
    os.kill(old, signal.SIGSTOP)
    try:
        st, _ = d.wait_for(lambda s: (s["last_decision"] or {}).get("reason") == "hang", 15, "a hang decision")
        assert st["last_decision"]["dry_run"] is True and st["restarts"]["total"] == 0
        assert d.supervisor_metrics()["pagekeeper_supervisor_decisions_total{action=restart,reason=hang}"] >= 1
        assert d.status()["engine"]["pid"] == old
        assert '"dry_run": true' in d.log("supervisor.log") and '"event": "decision"' in d.log("supervisor.log")
    finally:
        os.kill(old, signal.SIGCONT)


def test_garbage_metrics_slow_metrics_and_no_nvml_are_reported_not_fatal(shared):
    d = shared.d
    st = d.status()
    supervisor = st["supervisor"]["pid"]
    assert st["gpu"]["available"] is False and "NVML unavailable" in st["gpu"]["detail"]
    assert d.supervisor_metrics()["pagekeeper_supervisor_nvml_available"] == 0

    httpx.post(d.url + "/debug/metrics", params={"mode": "garbage"})
    st, _ = d.wait_for(
        lambda s: (s["engine"]["metrics_error"] or "").startswith("unparseable metrics"),
        10,
        "the garbage to be reported",
    )
    assert st["engine"]["state"] == "serving"
    assert d.supervisor_metrics()["pagekeeper_supervisor_engine_metrics_ok"] == 0

    httpx.post(d.url + "/debug/metrics", params={"mode": "slow", "seconds": 3})
    st, _ = d.wait_for(
        lambda s: s["engine"]["metrics_error"] == "metrics endpoint timed out", 15, "the timeout to be reported"
    )
    assert st["engine"]["state"] == "serving" and shared.restarts(st) == []

    httpx.post(d.url + "/debug/metrics", params={"mode": "normal"})
    st, _ = d.wait_for(lambda s: s["engine"]["metrics_error"] is None, 15, "metrics to recover")
    m = d.supervisor_metrics()
    assert m["pagekeeper_supervisor_engine_metrics_ok"] == 1 and m["pagekeeper_supervisor_polls_total"] > 5
    # and polled on through these few seconds of bad metrics (0.5 s polls; 5 in 3.6 s on a loaded machine)
    assert shared.grown(m)["pagekeeper_supervisor_polls_total"] >= 3
    assert d.status()["supervisor"]["pid"] == supervisor  # still the same live supervisor


def _hold_a_stream(url: str, out: dict) -> None:
    """A long stream that sets out["first_token"] once a token arrived; its outcome and token count in `out`."""
    body = {"model": MODEL, "prompt": "Errors should", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    tokens, outcome = 0, "truncated"
    try:
        with (
            httpx.Client(base_url=url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    outcome = "ok"
                elif line.startswith("data: {"):
                    tokens += 1
                    out["first_token"].set()
    except (httpx.RemoteProtocolError, httpx.ReadError):
        outcome = "reset"
    except httpx.HTTPError as e:
        outcome = type(e).__name__
    out.update(outcome=outcome, tokens=tokens)


def test_an_engine_killed_while_its_successor_loads_has_its_requests_counted(shared):
    """kill -9 of the old engine during an overlapping restart (the OOM killer could): the restart completes on the
    new engine, and the requests the old one had in flight are counted as lost, never reported as a clean handover."""
    d = shared.d
    old = d.engine_pid()
    load = Load(d.url).start()
    restarted: dict[str, subprocess.CompletedProcess] = {}
    held_stream: dict = {"first_token": threading.Event()}
    try:
        time.sleep(2)  # steady load first
        restart = threading.Thread(target=lambda: restarted.update(r=d.opsctl("restart")), daemon=True)
        restart.start()
        deadline = time.monotonic() + 60
        while not any(
            e.get("event") == "engine_started" and e.get("pid") != old for e in _events(shared.log("supervisor.log"))
        ):
            assert time.monotonic() < deadline, d.log("supervisor.log")[-3000:]
            time.sleep(0.02)
        # One stream the old engine is surely serving at the kill: it has sent a token.  The load's own requests
        # may all sit unread in the socket's buffers at that instant on a loaded machine (a suite run under three
        # workers saw 4 resets, none of them read by a handler), so they alone cannot prove the count.
        held = threading.Thread(target=_hold_a_stream, args=(d.url, held_stream), daemon=True)
        held.start()
        assert held_stream["first_token"].wait(30), "the old engine sent no token of the held stream"
        kill_sent = time.monotonic()
        os.kill(old, signal.SIGKILL)  # the successor is still loading its model
        restart.join(180)
        held.join(30)
        engine_dead = time.monotonic()  # an upper bound: the supervisor reaped it before the restart returned
        time.sleep(2)
    finally:
        records = load.stop()
    r = restarted["r"]
    assert r.returncode == 0, r.stdout + r.stderr
    st = d.status()
    assert st["engine"]["state"] == "serving" and st["engine"]["pid"] != old
    assert [x["reason"] for x in shared.restarts(st)] == ["manual"]  # one restart, not a second for the exit
    metrics = shared.grown(d.supervisor_metrics())
    lost = metrics.get("pagekeeper_supervisor_requests_lost_total{reason=engine_exited}", 0.0)
    failed = [x for x in records if x.outcome != "ok"]
    at_kill = [x for x in failed if x.start <= engine_dead and x.end >= kill_sent]
    done_at_kill = [x for x in records if x.outcome == "ok" and kill_sent - 0.05 <= x.end <= kill_sent + 0.1]
    print(
        f"\nrequests: {len(records)}, ok {len(records) - len(failed)}, failed at the kill {len(at_kill)} "
        f"({sorted({x.outcome for x in at_kill})}), completed within 0.05 s before it {len(done_at_kill)}; "
        f"supervisor counted lost (engine_exited): {lost:.0f}; the held stream: {held_stream.get('outcome')} "
        f"after {held_stream.get('tokens')} tokens"
    )
    assert failed == at_kill, [x for x in failed if x not in at_kill][:5]  # nothing failed but what was on it
    assert all(x.outcome in ("reset", "truncated") for x in at_kill), at_kill
    assert held_stream.get("outcome") in ("reset", "truncated"), held_stream  # cut off by the kill, not finished
    # at least the held stream is counted; at most what failed at the kill, the held stream and what completed
    # just before it (its count may not have dropped yet)
    assert 1 <= lost <= len(at_kill) + 1 + len(done_at_kill), (lost, at_kill, done_at_kill)
    assert "engine_died_before_retiring" in shared.log("supervisor.log")


def test_requests_still_in_flight_at_the_drain_timeout_are_killed_and_counted(shared):
    """docs/operations.md: `--drain-timeout` bounds the drain; whatever is still in flight then is killed and
    counted.  The old engine's step loop is frozen (a debug hook), so what it holds cannot finish within a 1 s drain."""
    d = shared.d
    old = d.engine_pid()
    load = Load(d.url).start()
    try:
        time.sleep(2)  # steady load first
        httpx.post(d.url + "/debug/freeze", params={"seconds": 60}, timeout=10).raise_for_status()
        frozen_at = time.monotonic()
        r = d.opsctl("restart", "--drain-timeout", "1")
        restarted_at = time.monotonic()
        time.sleep(2)
    finally:
        records = load.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    st = d.status()
    assert st["engine"]["state"] == "serving" and st["engine"]["pid"] != old
    metrics = shared.grown(d.supervisor_metrics())
    killed = metrics.get("pagekeeper_supervisor_requests_lost_total{reason=killed}", 0.0)
    failed = [x for x in records if x.outcome != "ok"]
    on_old = [x for x in failed if x.start <= restarted_at and x.end >= frozen_at]
    print(
        f"\nrequests: {len(records)}, ok {len(records) - len(failed)}, failed {len(failed)} "
        f"({sorted({x.outcome for x in failed})}); supervisor counted killed: {killed:.0f}; "
        f"lost by reason: { {k: v for k, v in metrics.items() if 'requests_lost_total' in k} }"
    )
    assert failed == on_old, [x for x in failed if x not in on_old][:5]  # only what the frozen engine held
    assert failed and killed == len(failed), (killed, failed)
    assert "engine_kill" in shared.log("supervisor.log")


def test_requests_a_live_engine_holds_at_the_drain_timeout_are_answered_restarting_and_counted(shared):
    """The engine is well, but its requests outlast the drain timeout (long generations, a 0.5 s drain): what it
    still holds then is answered "restarting" (a retryable 503, an error event mid-stream), never cut without a
    word as the process exits, and the supervisor counts each one as lost at the drain timeout (`killed`)."""
    d = shared.d
    old = d.engine_pid()
    stop = threading.Event()
    outcomes: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def client(stream: bool, max_tokens: int) -> None:
        # Lengths differ by client, so that their requests do not all end together (a CI run restarted just as six
        # equal generations ended, and the drain had nothing left to time out on).
        body = {"model": MODEL, "prompt": "Errors should never", "max_tokens": max_tokens, "ignore_eos": True}
        with httpx.Client(base_url=d.url, timeout=120) as c:
            while not stop.is_set():
                start = time.monotonic()
                try:
                    outcome = (Load._stream if stream else _plain_long)(c, body | {"stream": stream})[0]
                except httpx.HTTPError as e:
                    outcome = type(e).__name__
                with lock:
                    outcomes.append((outcome, start, time.monotonic()))

    threads = [threading.Thread(target=client, args=(i % 2 == 1, 240 - 25 * i), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        restart_sent = time.monotonic()
        r = d.opsctl("restart", "--drain-timeout", "0.5")
        restart_done = time.monotonic()
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert r.returncode == 0, r.stdout + r.stderr
    assert d.status()["engine"]["pid"] != old
    metrics = shared.grown(d.supervisor_metrics())
    lost = {k: v for k, v in metrics.items() if "requests_lost_total" in k}
    failed = Counter(o for o, _, _ in outcomes if o != "ok")
    took = restart_done - restart_sent
    failures = [(o, round(a - restart_sent, 2), round(b - restart_sent, 2)) for o, a, b in outcomes if o != "ok"]
    print(
        f"\nrequests: {len(outcomes)}, ok {sum(o == 'ok' for o, _, _ in outcomes)}, failed {dict(failed)}; lost: {lost}"
        f"; failed (outcome, start, end) in s from the restart command, which took {took:.2f} s: {failures}"
    )
    drain_lines = [ln[:160] for ln in shared.log("engine.log").splitlines() if "handover" in ln or "drain" in ln]
    print("the old engine's drain:", drain_lines)
    assert set(failed) <= {"http_503", "error_event"}, failed  # answered, never reset or truncated
    assert sum(failed.values()) >= 1  # six generations of 115-240 tokens outlast a 0.5 s drain
    assert lost.get("pagekeeper_supervisor_requests_lost_total{reason=killed}") == sum(failed.values()), lost
    assert "drain_timeout_answered" in shared.log("engine.log")
    assert "engine_kill" not in shared.log("supervisor.log")  # it exited on its own, nothing was SIGKILLed


def _plain_long(c: httpx.Client, body: dict) -> tuple[str, str]:
    r = c.post("/v1/completions", json=body)
    if r.status_code != 200:
        return f"http_{r.status_code}", r.text[:200]
    done = r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    return ("ok", "") if done else ("truncated", "")


def test_sigterm_to_a_supervised_engine_drains_and_exits_without_waiting_for_the_probe_connection(shared):
    """SIGTERM from outside (an operator's kill): the engine finishes what it holds and exits at once, although the
    supervisor's probe polls it every 0.5 s on one kept-alive connection (a drain that waited for that connection
    to fall idle held the engine for its whole 60 s drain timeout), and the supervisor restarts it as an exit."""
    d = shared.d
    old = d.engine_pid()
    sent = time.monotonic()
    os.kill(old, signal.SIGTERM)
    while psutil.pid_exists(old) and psutil.Process(old).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() - sent < 30, "the engine is still draining 30 s after SIGTERM with nothing in flight"
        time.sleep(0.05)
    exited_after = time.monotonic() - sent
    st, _ = d.wait_for(
        lambda s: s["engine"]["state"] == "serving" and s["engine"]["pid"] not in (None, old), 120, "a new engine"
    )
    print(f"\nengine exited {exited_after:.2f} s after SIGTERM; restarts: {shared.restarts(st)}")
    assert [x["reason"] for x in shared.restarts(st)] == ["engine_exited"]
    assert '"handed_over": true' in shared.log("engine.log")


def test_an_engine_stopping_on_sigterm_longer_than_the_hang_timeout_is_waited_for_not_restarted_as_hung(shared):
    """An operator's SIGTERM: the engine hands over (nothing in flight), closes its connections, the supervisor's
    probe's too, and shuts down; until it exits, probes reach only the held listening socket and go unanswered.  A
    loaded CI machine took 2.44 s over that, longer than hang_seconds (2 s), and the engine was restarted as hung.
    Here its step loop is frozen for 5 s, which its shutdown waits for.  Its control socket says it is stopping
    within its own deadline: the supervisor reports it draining, waits, and restarts it as an exit."""
    d = shared.d
    old = d.engine_pid()
    httpx.post(d.url + "/debug/freeze", params={"seconds": 5}, timeout=10).raise_for_status()
    sent = time.monotonic()
    os.kill(old, signal.SIGTERM)
    health_seen: list[str] = []

    def running() -> bool:
        try:
            return psutil.Process(old).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while running():
        assert time.monotonic() - sent < 60, "the engine is still stopping 60 s after SIGTERM"
        health = d.status()["engine"].get("health", "?")
        if running():  # still there once the answer came: the supervisor's last reading was of a live engine
            health_seen.append(health)
        time.sleep(0.25)
    exited_after = time.monotonic() - sent
    st, _ = d.wait_for(
        lambda s: s["engine"]["state"] == "serving" and s["engine"]["pid"] not in (None, old), 120, "a new engine"
    )
    lost = {k: v for k, v in shared.grown(d.supervisor_metrics()).items() if "requests_lost_total" in k}
    print(
        f"\nengine exited {exited_after:.2f} s after SIGTERM; health `opsctl status` reported meanwhile: "
        f"{dict(Counter(health_seen))}; restarts: {shared.restarts(st)}; lost: {lost}"
    )
    assert exited_after >= 4.0  # silent for twice hang_seconds
    assert [x["reason"] for x in shared.restarts(st)] == ["engine_exited"]
    assert "draining" in health_seen and set(health_seen) <= {"ok", "draining"}  # never "timeout" while silent
    assert '"state": "unresponsive"' not in shared.log("supervisor.log")
    assert not any(v for v in lost.values()), lost
    assert '"reason": "hang"' not in shared.log("supervisor.log")
    assert '"handed_over": true' in shared.log("engine.log")


def _events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# The two tests below replace the shared deployment's supervisor (an adoption) and stop and start it again: they run
# last, and each leaves the deployment serving (checked).


def test_a_killed_engine_is_one_exit_and_an_adopting_supervisor_keeps_the_count(shared):
    """kill -9 of the engine is logged as one `engine_exited` (it was two: the restart noted it again), and the
    restart it caused is still counted after the supervisor dies and a new one adopts the engine (the count went
    back to 0); `opsctl start` says so in words ("pagekeeper is adopted the engine ..." before)."""
    d = shared.d
    st = d.status()
    old, counted = st["engine"]["pid"], st["restarts"]["counted_for_crash_loop"]
    os.kill(old, signal.SIGKILL)
    st, _ = d.wait_for(
        lambda s: s["engine"]["state"] == "serving" and s["engine"]["pid"] not in (None, old), 90, "a new engine"
    )
    exits = [e for e in _events(shared.log("supervisor.log")) if e.get("event") == "engine_exited"]
    print(f"engine_exited lines since the test began: {exits}")
    assert [(e["pid"], e["how"]) for e in exits if e["pid"] == old] == [(old, "killed by SIGKILL")]
    assert all(e["pid"] != st["engine"]["pid"] for e in exits)
    assert [r["reason"] for r in shared.restarts(st)] == ["engine_exited"]
    assert st["restarts"]["counted_for_crash_loop"] == counted + 1
    engine, supervisor = st["engine"]["pid"], st["supervisor"]["pid"]
    os.kill(supervisor, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(supervisor) and time.monotonic() < deadline:
        time.sleep(0.05)
    again = d.opsctl("start")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[0] == f"pagekeeper adopted the engine serving {MODEL} at {d.url}", again.stdout
    st, _ = d.wait_for(lambda s: s["engine"]["state"] == "serving", 60, "the adopted engine serving")
    assert st["engine"]["pid"] == engine and st["supervisor"]["pid"] != supervisor
    restarts = st["restarts"]
    print(f"after the adoption: {restarts}")
    assert restarts["total"] == shared.restarts_at + 1 and restarts["counted_for_crash_loop"] == counted + 1
    assert [r["reason"] for r in shared.restarts(st)] == ["engine_exited"]


def test_cli_restart_drain_resume_stop_and_logs(shared):
    d = shared.d
    st = d.status()
    old, counted = st["engine"]["pid"], st["restarts"]["counted_for_crash_loop"]
    again = d.opsctl("start")
    assert again.returncode == 0 and "already running" in again.stdout
    r = d.opsctl("restart", "--drain-timeout", "5")
    assert r.returncode == 0 and "restarted" in r.stdout
    st = d.status()
    assert st["engine"]["pid"] != old and st["restarts"]["recent"][-1]["reason"] == "manual"
    assert [x["reason"] for x in shared.restarts(st)] == ["manual"]
    assert st["restarts"]["counted_for_crash_loop"] == counted  # manual restarts are not crashes
    drained = json.loads(d.opsctl("drain", "--timeout", "5", "--json").stdout)
    assert drained["drained"] is True
    assert httpx.get(d.url + "/health").json() == {"status": "draining"}
    st = d.opsctl("status")
    assert st.returncode == 5 and st.stdout.startswith("engine      draining"), st.stdout  # not stale
    assert d.opsctl("start").returncode == 5
    r = d.opsctl("resume")
    assert r.returncode == 0 and "resumed" in r.stdout
    assert httpx.get(d.url + "/health").json() == {"status": "ok"}
    st = d.opsctl("status")
    assert st.returncode == 0 and st.stdout.startswith("engine      serving"), st.stdout
    assert "None" not in st.stdout and ".0 " not in st.stdout  # integers, nothing unknown printed
    assert "engine_ready" in d.opsctl("logs", "--supervisor").stdout
    assert "serving" in d.opsctl("logs").stdout
    r = d.opsctl("stop")
    assert r.returncode == 0 and "stopped" in r.stdout
    assert d.opsctl("status").returncode == 3
    assert d.opsctl("stop").returncode == 0  # stopping what is stopped is done, like systemctl stop
    with pytest.raises(httpx.ConnectError):
        httpx.get(d.url + "/health", timeout=2)
    _start(d)  # serving again, for whatever runs after
    assert httpx.get(d.url + "/health", timeout=5).json() == {"status": "ok"}
