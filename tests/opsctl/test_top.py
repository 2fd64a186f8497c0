"""`opsctl top` (issue 41): figures from two scrapes of the metrics Prometheus reads, and a live view in a real
terminal (a pty that is the process's controlling terminal) that moves under load and quits cleanly on q or Ctrl-C.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from opsctl.exporter import SupervisorMetrics, read_gpu_metrics
from opsctl.probes import GpuReading, scrape_engine_metrics
from opsctl.status import RestartRecord
from opsctl.top import DecisionLine, Sample, compute, quantile, recent_decisions
from tests.opsctl.harness import FAST_SUPERVISOR, Deployment, write_config
from tests.opsctl.test_status import sample as status_sample
from tests.server.harness import REPO, free_port

# -- the figures, from fixed scrapes --------------------------------------------------------------------------------


def _engine_text(gen: int, prompt: int, stop: int, length: int, ttft: list[int], tpot: list[int]) -> str:
    """An engine's /metrics with both name sets (--metrics-names both): each figure must be counted once."""
    ttft_bounds, tpot_bounds = ("0.01", "0.1", "1.0", "+Inf"), ("0.025", "0.05", "+Inf")
    lines = []
    for p in ("vllm:", "vllm_"):
        lines += [
            f"# TYPE {p}num_requests_running gauge",
            f'{p}num_requests_running{{model_name="m"}} 3.0',
            f"# TYPE {p}num_requests_waiting gauge",
            f'{p}num_requests_waiting{{model_name="m"}} 1.0',
            f"# TYPE {p}kv_cache_usage_perc gauge",
            f'{p}kv_cache_usage_perc{{model_name="m"}} 0.25',
            f"# TYPE {p}generation_tokens counter",
            f'{p}generation_tokens_total{{model_name="m"}} {gen}.0',
            f"# TYPE {p}prompt_tokens counter",
            f'{p}prompt_tokens_total{{model_name="m"}} {prompt}.0',
            f"# TYPE {p}request_success counter",
            f'{p}request_success_total{{finished_reason="stop",model_name="m"}} {stop}.0',
            f'{p}request_success_total{{finished_reason="length",model_name="m"}} {length}.0',
            f"# TYPE {p}time_to_first_token_seconds histogram",
            *(
                f'{p}time_to_first_token_seconds_bucket{{le="{b}",model_name="m"}} {c}.0'
                for b, c in zip(ttft_bounds, ttft)
            ),
            f'{p}time_to_first_token_seconds_count{{model_name="m"}} {ttft[-1]}.0',
            f'{p}time_to_first_token_seconds_sum{{model_name="m"}} 1.0',
            f"# TYPE {p}request_time_per_output_token_seconds histogram",
            *(
                f'{p}request_time_per_output_token_seconds_bucket{{le="{b}",model_name="m"}} {c}.0'
                for b, c in zip(tpot_bounds, tpot)
            ),
            f'{p}request_time_per_output_token_seconds_count{{model_name="m"}} {tpot[-1]}.0',
            f'{p}request_time_per_output_token_seconds_sum{{model_name="m"}} 1.0',
        ]
    return "\n".join(lines) + "\n"


BEFORE = _engine_text(gen=100, prompt=50, stop=3, length=1, ttft=[1, 2, 2, 2], tpot=[2, 2, 2])
AFTER = _engine_text(gen=300, prompt=90, stop=5, length=3, ttft=[5, 10, 12, 12], tpot=[3, 4, 6])


def test_rates_and_percentiles_cover_the_window_between_two_scrapes():
    st = status_sample()
    before = Sample(10.0, st, scrape_engine_metrics(BEFORE))
    after = Sample(12.0, st, scrape_engine_metrics(AFTER))
    f = compute("web", before, after, [])
    assert (f.instance, f.state, f.model, f.running, f.waiting, f.kv_cache_usage) == ("web", "serving", "m", 3, 1, 0.25)
    assert f.window_s == 2.0
    assert (f.generation_tokens_per_s, f.prompt_tokens_per_s, f.requests_per_s) == (100.0, 20.0, 2.0)
    # TTFT in the window: 4 at <= 10 ms, 4 more <= 100 ms, 2 more <= 1 s (10 in all); interpolated within buckets
    assert f.ttft.count == 10
    assert math.isclose(f.ttft.p50, 0.01 + 0.09 * (5 - 4) / 4)  # type: ignore[arg-type]
    assert math.isclose(f.ttft.p90, 0.1 + 0.9 * (9 - 8) / 2)  # type: ignore[arg-type]
    assert math.isclose(f.ttft.p99, 0.1 + 0.9 * (9.9 - 8) / 2)  # type: ignore[arg-type]
    # since the engine started the median is another figure: the window's is not the cumulative one
    assert not math.isclose(quantile(0.5, after.engine.histograms["ttft"]), f.ttft.p50)  # type: ignore[arg-type,union-attr]
    # TPOT in the window: 1 <= 25 ms, 1 <= 50 ms, 2 above the last bound: those read as the last finite bound
    assert f.tpot.count == 4 and math.isclose(f.tpot.p50, 0.05) and f.tpot.p99 == 0.05  # type: ignore[arg-type]


def test_one_scrape_has_gauges_but_no_rates_and_a_restarted_engine_counts_from_zero():
    st = status_sample()
    first = compute("web", None, Sample(1.0, st, scrape_engine_metrics(AFTER)), [])
    assert (first.running, first.window_s, first.generation_tokens_per_s, first.ttft.count) == (3, None, None, 0)
    # counters that went back (a new engine): all of the new one is in the window, as Prometheus' rate() counts it
    restarted = compute(
        "web", Sample(1.0, st, scrape_engine_metrics(AFTER)), Sample(3.0, st, scrape_engine_metrics(BEFORE)), []
    )
    assert restarted.generation_tokens_per_s == 50.0 and restarted.ttft.count == 2


def test_no_supervisor_is_a_figure_that_says_so():
    f = compute("batch", None, Sample(1.0, None, None, error="the supervisor is not running (no socket)"), [])
    assert (f.state, f.running, f.error) == ("not_running", None, "the supervisor is not running (no socket)")


def test_recent_decisions_are_the_changes_of_the_last_one_and_the_restarts_newest_first():
    st = status_sample()  # last decision none/healthy at t=1; one restart decided at t=0.5 for a hang
    seen: list[DecisionLine] = []
    assert [d.text for d in recent_decisions(seen, st)] == ["none (healthy)", "restart (hang)"]
    st.last_decision.time = 2.0  # type: ignore[union-attr]  # the same decision, remade by the next poll
    assert [d.text for d in recent_decisions(seen, st)] == ["none (healthy)", "restart (hang)"]
    st.last_decision.reason, st.last_decision.action, st.last_decision.time = "high_cache_persists", "recycle", 3.0  # type: ignore[union-attr]
    st.restarts.recent.append(RestartRecord(5.0, 4.0, "engine_exited", 2))
    texts = [d.text for d in recent_decisions(seen, st)]
    assert texts == [
        "restart (engine_exited), 2 request(s) lost",
        "recycle (high_cache_persists)",
        "none (healthy)",
        "restart (hang)",
    ]


def test_gpu_figures_read_back_from_the_supervisors_metrics():
    from prometheus_client.exposition import generate_latest

    class Source:
        last_gpu = [
            GpuReading(0, "H100", 12 * 2**30, 80 * 2**30, 0.37, 51.0, 2),
            GpuReading(1, "H100", 1, 2, None, None),
        ]

    read = read_gpu_metrics(generate_latest(SupervisorMetrics(Source()).registry).decode())
    assert read == [
        GpuReading(0, "", 12 * 2**30, 80 * 2**30, 0.37, 51.0, 2),
        GpuReading(1, "", 1, 2, None, None, 0),
    ]


def test_a_pipe_without_once_or_json_is_refused_in_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--runtime-dir", str(tmp_path / "run"), "top"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: `opsctl top` draws on a terminal and stdout is not one: use --once for one frame, or --json"
    ]


# -- a real engine, watched in a real terminal ----------------------------------------------------------------------

FAKE_GPU = [
    {
        "index": 0,
        "name": "Fake H100",
        "memory_used_bytes": 12 * 2**30,
        "memory_total_bytes": 80 * 2**30,
        "utilization_ratio": 0.37,
        "temperature_celsius": 51.0,
        "xid_errors_total": 0,
    }
]


@pytest.fixture(scope="module")
def web(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Instance "web" serving the embedded model, its runtime dir under a root that holds every instance's, with a
    fake GPU (PAGEKEEPER_FAKE_NVML) so that the GPU figures have something to show."""
    root = tmp_path_factory.mktemp("top")
    port = free_port()
    config = write_config(root / "pagekeeper.toml", {"port": port}, {**FAST_SUPERVISOR, "instance": "web"})
    d = Deployment(root, config, root / "run" / "pagekeeper@web", port)
    (root / "gpu.json").write_text(json.dumps(FAKE_GPU))
    r = d.opsctl("start", env={"PAGEKEEPER_FAKE_NVML": str(root / "gpu.json")})
    assert r.returncode == 0, r.stdout + r.stderr
    yield d
    d.teardown()


_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
COLUMNS = ["instance", "state", "running", "waiting", "kv", "tok/s", "req/s", "ttft", "tpot", "model"]


class Terminal:
    """`opsctl top` on a pty of its own (its controlling terminal: Ctrl-C there is SIGINT), 45 x 150, whose output
    a thread collects; this side keeps the pty's follower open to read its modes before and after."""

    def __init__(self, d: Deployment, *args: str) -> None:
        self.leader, self.follower = os.openpty()
        fcntl.ioctl(self.follower, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 150, 0, 0))
        self.modes_before = termios.tcgetattr(self.follower)
        argv = [sys.executable, "-m", "opsctl.cli", "--config", str(d.config), "--runtime-dir", str(d.runtime)]
        env = {**d.env(), "TERM": "xterm-256color"}
        for name in ("NO_COLOR", "COLUMNS", "LINES"):
            env.pop(name, None)
        self.pid = os.fork()
        if self.pid == 0:  # the child: a session of its own on the pty, then opsctl
            try:
                os.close(self.leader)
                os.login_tty(self.follower)
                os.chdir(REPO)
                os.execve(sys.executable, [*argv, "top", *args], env)
            finally:
                os._exit(127)
        self.output = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.code: int | None = None

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.leader, 65536)
            except OSError:
                return
            if not chunk:
                return
            with self._lock:
                self.output += chunk

    def frames(self) -> list[str]:
        """The screens drawn so far, escape codes removed (each redraw starts at the top left: ESC [ H)."""
        with self._lock:
            raw = bytes(self.output)
        return [_ANSI.sub(b"", part).decode(errors="replace") for part in raw.split(b"\x1b[H")[1:]]

    def wait_for_row(self, instance: str, predicate: Callable[[dict[str, str]], bool], timeout: float, what: str):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        checked = 0
        while time.monotonic() < deadline:
            frames = self.frames()
            for frame in frames[checked:-1]:  # the last one may be half drawn
                row = _row(frame, instance)
                if row is not None and predicate(row):
                    return row, frame
            checked = max(checked, len(frames) - 1)
            assert self.poll() is None, f"opsctl top exited {self.code}: {self.text()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no frame showed {what} in {timeout} s; last frame:\n{(self.frames() or [''])[-1]}")

    def text(self) -> str:
        with self._lock:
            return _ANSI.sub(b"", bytes(self.output)).decode(errors="replace")

    def poll(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.code

    def close(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(10)
        os.close(self.follower)
        os.close(self.leader)
        self._reader.join(5)


def _row(frame: str, instance: str) -> dict[str, str] | None:
    for line in frame.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == len(COLUMNS) and cells[0] == instance:
            return dict(zip(COLUMNS, cells))
    return None


class Load:
    """Clients that each send completions back to back (48 tokens each, no early stop) until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.stop, self.done = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        body = {"model": "pagekeeper-default", "prompt": "hello", "max_tokens": 48, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                r = client.post(self.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                self.done += 1

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _number(cell: str) -> float:
    return float(cell.rstrip("%")) if cell not in ("-", "") else 0.0


@pytest.mark.slow
def test_top_shows_the_figures_move_under_load_and_quits_on_q(web):
    term = Terminal(web, "--interval", "0.5")
    load = None
    try:
        idle, frame = term.wait_for_row(
            "web", lambda r: r["state"] == "serving" and r["tok/s"] == "0.0", 60, "the idle engine"
        )
        assert (idle["running"], idle["waiting"], idle["model"]) == ("0", "0", "pagekeeper-default"), idle
        assert "Fake H100" in frame and "12.0 / 80.0" in frame and "37%" in frame, frame  # pagekeeper_gpu_*
        assert "none (healthy)" in frame, frame  # the supervisor's last decision
        in_cbreak = termios.tcgetattr(term.follower)
        assert not in_cbreak[3] & (termios.ICANON | termios.ECHO)  # keys come one at a time, unechoed

        started = time.monotonic()
        load = Load(web.url, clients=4)
        busy, frame = term.wait_for_row(
            "web",
            lambda r: int(r["running"]) >= 1 and _number(r["tok/s"]) > 0 and _number(r["kv"]) > 0,
            60,
            "requests running, tokens/s, KV blocks held",
        )
        print(f"under load after {time.monotonic() - started:.1f} s: {busy}")
        finished, _ = term.wait_for_row("web", lambda r: r["ttft"] != "-", 30, "TTFT percentiles of finished requests")
        assert all(float(v) > 0 for v in finished["ttft"].split("/")), finished
        load.finish()
        assert load.done > 0
        back, _ = term.wait_for_row("web", lambda r: r["running"] == "0" and r["tok/s"] == "0.0", 30, "idle again")

        os.write(term.leader, b"q")
        assert term.wait(10) == 0, term.text()[-3000:]
        assert termios.tcgetattr(term.follower) == term.modes_before  # the terminal's modes are put back
        with term._lock:
            tail = bytes(term.output[-200:])
        assert b"\x1b[?1049l" in tail and b"\x1b[?25h" in tail, tail  # left the alternate screen, cursor shown
        _assert_no_top_left(web)
    finally:
        if load is not None:
            load.finish()
        term.close()


@pytest.mark.slow
@pytest.mark.parametrize("how,code", [("ctrl-c", 0), ("sigterm", 128 + signal.SIGTERM)])
def test_top_quits_on_ctrl_c_or_sigterm_and_puts_the_terminal_back(web, how, code):
    term = Terminal(web, "--interval", "0.5")
    try:
        term.wait_for_row("web", lambda r: r["state"] == "serving", 60, "the engine")
        if how == "ctrl-c":
            os.write(term.leader, b"\x03")  # the terminal turns it into SIGINT for its foreground process group
        else:
            os.kill(term.pid, signal.SIGTERM)
        assert term.wait(10) == code, term.text()[-3000:]
        assert termios.tcgetattr(term.follower) == term.modes_before
        _assert_no_top_left(web)
    finally:
        term.close()


def _assert_no_top_left(d: Deployment) -> None:
    import psutil

    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "top" in (p.info["cmdline"] or ()) and str(d.config) in (p.info["cmdline"] or ())
    ]
    assert left == [], f"opsctl top processes left: {left}"


@pytest.mark.slow
def test_once_json_watches_several_instances(web):
    """Two instances by name under one runtime root: "web" serves, "batch" was never started (exit 3)."""
    env = {**web.env(), "PAGEKEEPER_RUNTIME_ROOT": str(web.runtime.parent)}
    env.pop("PAGEKEEPER_RUNTIME_DIR", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "opsctl.cli",
            "--config",
            str(web.config),
            "top",
            "--once",
            "--json",
            "--interval",
            "0.3",
        ]
        + ["--instance", "web", "--instance", "batch"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    served, absent = doc["instances"]
    assert (served["instance"], served["state"], served["running"], served["model"]) == (
        "web",
        "serving",
        0,
        "pagekeeper-default",
    )
    assert served["window_s"] >= 0.3 and served["generation_tokens_per_s"] is not None
    assert [(g["name"], g["memory_total_bytes"], g["utilization_ratio"]) for g in served["gpus"]] == [
        ("Fake H100", 80 * 2**30, 0.37)
    ]
    assert (absent["instance"], absent["state"]) == ("batch", "not_running") and "not running" in absent["error"]


def test_top_is_refused_with_one_runtime_dir_for_two_instances(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--runtime-dir", str(tmp_path), "top", "--once"]
        + ["--instance", "a", "--instance", "b"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert r.returncode == 2 and "both read runtime dir" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_kv_usage_below_one_percent_keeps_its_hundredths() -> None:
    from opsctl.top_view import percent

    assert (percent(0.0), percent(0.0005), percent(0.0123), percent(0.25)) == ("0.0%", "0.05%", "1.2%", "25.0%")
