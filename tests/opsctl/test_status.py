"""`opsctl status --json` is a contract: the typed Status keeps its JSON shape and reads back to itself."""

from __future__ import annotations

import json

from opsctl.probes import GpuReading, ProcessReading
from opsctl.state import EngineState
from opsctl.status import (
    CrashLoopStatus,
    Decision,
    EngineStatus,
    GpuStatus,
    RestartRecord,
    RestartsStatus,
    Status,
    SupervisorStatus,
)

_RUNNING = ProcessReading(True, 42, "running", 1000, 1.5)


def sample(process: ProcessReading | None = _RUNNING) -> Status:
    return Status(
        engine=EngineStatus(
            EngineState.SERVING,
            "ok",
            "",
            42,
            3.2,
            "http://127.0.0.1:8000",
            "m",
            0.25,
            1,
            0,
            None,
            77,
            None,
            process,
            None,
        ),
        gpu=GpuStatus(True, "driver 1", [GpuReading(0, "GPU", 1, 2, 0.5, 40.0, 0)]),
        last_decision=Decision("none", "healthy", {}, 1.0, False),
        restarts=RestartsStatus(1, [RestartRecord(1.0, 0.5, "hang", 0)], 1),
        crash_loop=CrashLoopStatus(False, None, False, 5, 900.0),
        supervisor=SupervisorStatus(
            7,
            "process",
            False,
            9.0,
            "http://127.0.0.1:1/metrics",
            "built-in defaults",
            "default",
            "/run/x",
            10.0,
            "overlap",
        ),
        engine_log="/run/x/engine.log",
    )


def test_json_shape_is_the_one_opsctl_status_printed():
    data = sample().to_json()
    assert list(data) == ["engine", "gpu", "last_decision", "restarts", "crash_loop", "supervisor", "engine_log"]
    assert list(data["engine"]) == [
        "state",
        "health",
        "health_detail",
        "pid",
        "uptime_s",
        "url",
        "model",
        "kv_cache_usage",
        "running",
        "waiting",
        "oldest_waiting_s",
        "steps_total",
        "metrics_error",
        "process",
        "last_exit",
        "readings_age_s",
        "core_restarts",
        "requests_resumed",
    ]
    assert data["engine"]["state"] == "serving" and type(data["engine"]["state"]) is str
    assert list(data["gpu"]) == ["available", "detail", "devices"]
    assert list(data["last_decision"]) == ["action", "reason", "evidence", "time", "dry_run"]
    assert list(data["restarts"]) == ["total", "recent", "counted_for_crash_loop"]
    assert list(data["restarts"]["recent"][0]) == ["time", "decided_at", "reason", "lost"]
    assert list(data["crash_loop"]) == ["gave_up", "reason", "permanent", "max_restarts", "restart_window_s"]
    assert list(data["supervisor"]) == [
        "pid",
        "launcher",
        "dry_run",
        "uptime_s",
        "metrics_url",
        "config",
        "instance",
        "runtime_dir",
        "poll_interval_s",
        "handover",
        "weights_keeper",
        "spare_engine",
    ]


def test_round_trip_through_the_socket():
    for st in (sample(), sample(process=None)):
        wire = json.loads(json.dumps(st.to_json()))
        assert Status.from_json(wire) == st
        assert Status.from_json(wire).to_json() == wire


def test_a_reply_that_is_not_a_status_is_a_value_error():
    import pytest

    wire = sample().to_json()
    wire["engine"]["state"] = "dancing"
    with pytest.raises(ValueError):
        Status.from_json(wire)
    with pytest.raises(ValueError):
        Status.from_json({"engine": {}})
