"""The online serving benchmark (benchmarks/serving.py) end to end on CPU: it starts the real server on
the embedded model itself (`--start-server`), runs two Poisson rates, writes its JSON with every
documented key and the PNG, and kills the server afterwards.  Plus fast checks of the parts that need
no server: the loopback-only rule and the seeded, capped workload.

The benchmark runs as a subprocess, exactly as a user runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serving

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 12
RATES = ("8", "16")
TOP_KEYS = ("gpu", "date", "command", "server_args", "server", "workload", "runs")
RUN_KEYS = (
    "label",
    "completed",
    "failed",
    "not_sent",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "ttfts_ms",
    "tpots_ms",
    "e2es_ms",
    "itl_quantiles_ms",
    "input_lens",
    "output_lens",
)
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_benchmark(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serving",
        "--start-server",
        "--request-rate",
        *RATES,
        "--num-prompts",
        str(NUM_PROMPTS),
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--max-input-len",
        "16",
        "--max-output-len",
        "16",
        "--vocab",
        "300",  # the embedded model's vocab_size is 384
        "--seed",
        "0",
        "--request-timeout",
        "60",
        "--max-duration",
        "120",
        "--no-progress",
        "--out",
        str(tmp_path / "serving.json"),
        "--server-log",
        str(tmp_path / "server.log"),
        *extra,
        "--",
        "--device",
        "cpu",
    ]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=150)


def assert_ordered(summary: dict, name: str) -> None:
    assert summary["p50"] is not None, (name, summary)
    assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"], (name, summary)


def test_two_rates_end_to_end(tmp_path: Path) -> None:
    proc = run_benchmark(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    out = tmp_path / "serving.json"
    r = json.loads(out.read_text())
    assert not [k for k in TOP_KEYS if k not in r]
    assert r["gpu"] == "cpu"
    assert r["server_args"] == ["--device", "cpu"]
    assert r["command"][:3] == ["python3", "-m", "benchmarks.serving"] and "--start-server" in r["command"]
    assert r["workload"]["num_prompts"] == NUM_PROMPTS and r["workload"]["vocab"] == 300
    assert r["server"]["model"] == "pagekeeper-default" and r["server"]["started_by_benchmark"] is True
    with pytest.raises(ProcessLookupError):  # the server was killed (and reaped) by the benchmark
        os.kill(r["server"]["pid"], 0)

    assert [run["request_rate"] for run in r["runs"]] == [float(x) for x in RATES]
    for run in r["runs"]:
        assert not [k for k in RUN_KEYS if k not in run], run["label"]
        assert (run["completed"], run["failed"], run["not_sent"]) == (NUM_PROMPTS, 0, 0), run["error_counts"]
        assert run["output_len_mismatch"] == 0  # ignore_eos: every request yields its max_tokens
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        assert run["total_token_throughput"] > run["output_throughput"]
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert_ordered(run[key], key)
        assert run["ttft_ms"]["mean"] > 0
        assert all(v is not None and v > 0 for v in run["ttfts_ms"])
        assert all(1 <= n <= 16 for n in run["input_lens"]) and all(1 <= n <= 16 for n in run["output_lens"])
        assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert len(run["itl_quantiles_ms"]) == serving.ITL_GRID

    png = tmp_path / "serving.png"
    if HAVE_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        redrawn = tmp_path / "redrawn.png"
        assert serving.main(["--plot-only", str(out), "--plot", str(redrawn)]) == 0
        assert redrawn.stat().st_size > 1000
    else:
        assert not png.exists()
        assert "matplotlib" in proc.stderr


@pytest.mark.parametrize("url", ["http://192.168.1.10:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_refuses_non_loopback_targets(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serving.main(["--url", url, "--request-rate", "1"])
    assert e.value.code == 2
    assert "only targets servers on this machine" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:9", "http://[::1]:8000", "http://127.0.0.2"]
)
def test_accepts_loopback_targets(url: str) -> None:
    serving.check_loopback(url)


def test_workload_is_seeded_long_tailed_and_capped() -> None:
    w = serving.Workload(
        num_prompts=400,
        input_len=32,
        output_len=16,
        max_input_len=128,
        max_output_len=64,
        len_sigma=0.8,
        vocab=300,
        min_token_id=10,
        seed=7,
    )
    a, b = serving.build_items(w, 0), serving.build_items(w, 0)
    assert a == b  # seeded
    other_run = serving.build_items(w, 1)
    assert [len(i.prompt_ids) for i in other_run] == [len(i.prompt_ids) for i in a]  # same lengths every run
    assert [i.prompt_ids for i in other_run] != [i.prompt_ids for i in a]  # fresh tokens (no prefix reuse)
    ins = sorted(len(i.prompt_ids) for i in a)
    outs = sorted(i.max_tokens for i in a)
    assert 1 <= ins[0] and ins[-1] <= 128 and 1 <= outs[0] and outs[-1] <= 64
    assert 24 <= ins[len(ins) // 2] <= 40  # median near --input-len
    assert ins[-1] >= 3 * 32 and ins.count(128) > 0  # long tail, reaching the cap
    assert all(10 <= t < 300 for i in a for t in i.prompt_ids)

    slow, fast = serving.arrival_offsets(50, 2.0, 7), serving.arrival_offsets(50, 4.0, 7)
    assert slow[0] == 0.0 and slow == sorted(slow)
    assert all(abs(s - 2 * f) < 1e-9 for s, f in zip(slow, fast))
    assert serving.arrival_offsets(5, float("inf"), 7) == [0.0] * 5
