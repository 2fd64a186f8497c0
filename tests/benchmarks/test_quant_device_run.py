"""Issue 39's device run (benchmarks/quant_device_run.py) on the CPU: its stages' command lines, the summary it
derives from the stages' files, a stage stopped at its limit (recorded, the rest still run, exit 1, partial files
kept), issue 39's keys in benchmarks/quantization.py, and the whole run in its --quick form through the shell
script, so that argument parsing and JSON writing cannot fail on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import quant_device_run as qdr
from benchmarks.quantization import ISSUE39_KEYS, issue39_keys


def test_stage_commands(tmp_path):
    cmd, env = qdr.commands("engines", tmp_path, quick=False, sweep_s=40)
    assert cmd[1:4] == ["-m", "benchmarks.quantization", "--skip-kernels"] and env == {}
    assert cmd[cmd.index("--configs") + 1 : cmd.index("--batches")] == qdr.ENGINE_CONFIGS
    assert cmd[cmd.index("--batches") + 1 :] == ["1", "8", "32"]
    cmd, env = qdr.commands("legacy", tmp_path, quick=False, sweep_s=40)
    assert env == {"PAGEKEEPER_QUANT_KERNELS": "legacy"} and cmd[-2:] == ["--tag", "legacy"]
    assert cmd[cmd.index("--configs") + 1 : cmd.index("--batches")] == ["fp8_weights", "awq"]
    cmd, env = qdr.commands("gemv", tmp_path, quick=False, sweep_s=40)
    assert env == {"PAGEKEEPER_QUANT_KERNELS": "gemv"} and cmd[-2:] == ["--tag", "gemv"]
    assert cmd[cmd.index("--batches") + 1 : cmd.index("--tag")] == ["1", "8"]
    cmd, env = qdr.commands("kernels", tmp_path, quick=True, sweep_s=5)
    assert "benchmarks.quant_kernels" in cmd and "--quick" in cmd and env == {"TRITON_INTERPRET": "1"}
    cmd, _ = qdr.commands("tests", tmp_path, quick=False, sweep_s=0)
    assert cmd[cmd.index("-m", 2) + 1] == "gpu" and all(f in cmd for f in qdr.TEST_FILES)


def test_the_perplexity_and_serving_stages_commands(tmp_path):
    """perplexity trains for its share of the stage and merges into the engines stage's file when there is one (not
    the legacy arm's); serving stops its deployments (which outlive a kill of the stage) before the stage's limit."""
    cmd, env = qdr.commands("perplexity", tmp_path, quick=False, sweep_s=40)
    assert cmd[1:3] == ["-m", "benchmarks.perplexity"] and env == {} and "--merge" not in cmd and "--quick" not in cmd
    assert cmd[cmd.index("--train-seconds") + 1] == str(qdr.PERPLEXITY_TRAIN_S)
    assert qdr.PERPLEXITY_TRAIN_S < qdr.STAGE_LIMIT_S["perplexity"] - 120  # data, checkpoints, four engines
    (tmp_path / "quantization-h100-2026-01-01.json").write_text("{}")
    (tmp_path / "quantization-h100-2026-01-01-legacy.json").write_text("{}")
    (tmp_path / "quantization-h100-2026-01-01-gemv.json").write_text("{}")
    cmd, _ = qdr.commands("perplexity", tmp_path, quick=True, sweep_s=40)
    assert cmd[cmd.index("--merge") + 1] == str(tmp_path / "quantization-h100-2026-01-01.json") and "--quick" in cmd
    cmd, env = qdr.commands("serving", tmp_path, quick=False, sweep_s=40, limit_s=150)
    assert cmd[1:3] == ["-m", "benchmarks.quant_serving"] and env == {}
    assert cmd[cmd.index("--deadline-s") + 1] == str(150 - qdr.STOP_MARGIN_S)
    assert not {"perplexity", "serving"} & set(qdr.DEFAULT_STAGES)  # a device call of their own


def test_issue39_keys_from_the_engine_rows():
    engines = {
        "bf16": {"throughput_tok_s": 9000.0, "batch1": {"over_floor": 1.27}},
        "fp8_weights": {"throughput_tok_s": 12000.0, "batch1": {"over_floor": 1.2}},
        "fp8_weights_fp8_kv": {"throughput_tok_s": 13500.0},
        "awq": {"error": "RuntimeError: no"},
    }
    keys = issue39_keys(engines)
    assert set(ISSUE39_KEYS) <= set(keys)
    assert keys["fp8_throughput_ratio"] == 1.333 and keys["fp8_batch1_over_floor"] == 1.2
    assert keys["fp8_fp8_kv_throughput_ratio"] == 1.5
    assert keys["awq_throughput_ratio"] is None and keys["awq_batch1_over_floor"] is None
    assert keys["ppl_ratio_fp8"] is None  # no trained model in this benchmark


def test_summary_gathers_the_stages_files(tmp_path):
    engines = {
        "fp8_throughput_ratio": 1.4,
        "awq_batch1_over_floor": 1.25,
        "engines": {"bf16": {"throughput_tok_s": 9000.0, "memory_plan": "..."}, "awq": {"error": "X"}},
    }
    (tmp_path / "quantization-h100-2026-01-01.json").write_text(json.dumps(engines))
    kernels = {
        "rule": {"1": {"fp8_fastest": "fp8_w8a16_cuda_core", "layer_ms": {"bf16": 0.1}}},
        "rows": [{"layer": "o_proj", "M": 1, "errors": {"awq_dot": "wrong"}}, {"layer": "o_proj", "M": 8}],
    }
    (tmp_path / "quant-kernels-h100-2026-01-01.json").write_text(json.dumps(kernels))
    summary: dict = {}
    qdr.summarize(summary, tmp_path, "h100", "2026-01-01")
    assert summary["fp8_throughput_ratio"] == 1.4 and summary["awq_batch1_over_floor"] == 1.25
    assert summary["engines"] == {"bf16": {"throughput_tok_s": 9000.0}, "awq": {"error": "X"}}
    assert summary["kernel_rule"] == {"1": {"fp8_fastest": "fp8_w8a16_cuda_core"}}
    assert summary["kernel_errors"] == {"o_proj M=1": {"awq_dot": "wrong"}}
    assert "legacy" not in summary


def test_summary_takes_the_perplexity_and_serving_stages_files(tmp_path):
    """The perplexity file's ratios replace the engines file's nulls; the serving file's weight ratios come along."""
    (tmp_path / "quantization-h100-2026-01-01.json").write_text(
        json.dumps({"fp8_throughput_ratio": 1.4, **dict.fromkeys(ISSUE39_KEYS[4:])})
    )
    ppl = {
        "ppl_bf16": 4.0,
        "ppl_ratio_fp8": 1.003,
        "ppl_ratio_fp8_kv": 1.001,
        "ppl_ratio_awq": None,
        "greedy_agreement": {"fp8": {"prefix": 0.9, "full": 0.7}},
        "engines": {"bf16": {"ppl": 4.0}, "awq": {"error": "RuntimeError: no"}},
    }
    (tmp_path / "perplexity-h100-2026-01-01.json").write_text(json.dumps(ppl))
    serving = {
        "weight_ratio_fp8": 0.566,
        "linear_weight_ratio_awq": 0.26,
        "configs": {"awq": {"completion": {"status": 200}, "doctor_weights_line": "int32 ...", "engine": {}}},
    }
    (tmp_path / "quant-serving-h100-2026-01-01.json").write_text(json.dumps(serving))
    summary: dict = {}
    qdr.summarize(summary, tmp_path, "h100", "2026-01-01")
    assert summary["fp8_throughput_ratio"] == 1.4 and summary["ppl_ratio_fp8"] == 1.003
    assert summary["ppl_ratio_fp8_kv"] == 1.001 and summary["ppl_ratio_awq"] is None
    assert summary["perplexity"]["greedy_agreement"] == ppl["greedy_agreement"]
    assert summary["perplexity"]["errors"] == {"awq": "RuntimeError: no"}
    assert summary["serving"] == {
        "weight_ratio_fp8": 0.566,
        "linear_weight_ratio_awq": 0.26,
        "configs": {"awq": {"completion": {"status": 200}, "doctor_weights_line": "int32 ..."}},
    }


def test_a_stage_past_its_limit_is_stopped_and_the_next_still_runs(tmp_path, monkeypatch):
    """A stage that hangs is killed at its limit; the run records it, goes on, keeps its files and exits 1."""

    def commands(stage, out, quick, sweep_s, limit_s=None):
        if stage == "kernels":
            return [sys.executable, "-c", "import time; print('hanging', flush=True); time.sleep(60)"], {}
        return [sys.executable, "-c", "import os; print('env', os.environ.get('PAGEKEEPER_QUANT_KERNELS'))"], {
            "PAGEKEEPER_QUANT_KERNELS": "legacy"
        }

    monkeypatch.setattr(qdr, "commands", commands)
    monkeypatch.setattr(qdr, "STAGE_LIMIT_S", {**qdr.STAGE_LIMIT_S, "kernels": 3})
    rc = qdr.main(["--quick", "--out", str(tmp_path), "--stages", "kernels", "legacy"])
    assert rc == 1
    (summary_path,) = tmp_path.glob("quant-device-run-cpu-*.json")
    stages = json.loads(summary_path.read_text())["stages"]
    assert [s["name"] for s in stages] == ["kernels", "legacy"]
    assert stages[0]["timed_out"] and stages[0]["seconds"] < 30
    assert stages[1]["rc"] == 0 and stages[1]["env"] == {"PAGEKEEPER_QUANT_KERNELS": "legacy"}
    log = (tmp_path / "run.log").read_text()
    assert "[kernels] hanging" in log and "[legacy] env legacy" in log
    assert os.environ.get("PAGEKEEPER_QUANT_KERNELS") is None  # the stage's environment was not left behind


def test_a_stage_with_too_little_time_left_is_skipped(tmp_path):
    assert qdr.main(["--quick", "--out", str(tmp_path), "--stages", "tests", "--deadline-s", "5"]) == 1
    (summary_path,) = tmp_path.glob("quant-device-run-cpu-*.json")
    (stage,) = json.loads(summary_path.read_text())["stages"]
    assert stage["name"] == "tests" and "left before the deadline" in stage["skipped"]


@pytest.mark.slow
def test_the_whole_run_on_the_cpu(tmp_path):
    """Every stage in its --quick form through the shell script the device runs: the kernel table on small shapes
    in Triton's interpreter, the engines on the embedded model, the GPU tests collected and skipped, the legacy
    A/B arm."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(qdr.REPO)}
    proc = subprocess.run(
        ["bash", "benchmarks/quant_device_run.sh", "--quick", "--deadline-s", "1500", "--sweep-budget-s", "5"],
        cwd=qdr.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1600,
    )
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    names = sorted(p.name for p in out.iterdir())
    prefixes = ["gpu-quant-tests-cpu-", "quant-device-run-cpu-", "quant-kernels-cpu-", "quantization-cpu-", "run.log"]
    assert len(names) == 6 and all(any(n.startswith(p) for n in names) for p in prefixes), names
    assert sum(n.endswith("-legacy.json") for n in names) == 1, names
    (summary_path,) = out.glob("quant-device-run-cpu-*.json")
    data = json.loads(summary_path.read_text())
    assert [s["name"] for s in data["stages"]] == ["kernels", "engines", "tests", "legacy"]
    assert all(s["rc"] == 0 and not s["timed_out"] for s in data["stages"])
    assert data["fp8_throughput_ratio"] > 0 and data["awq_batch1_over_floor"] > 0 and data["ppl_ratio_awq"] is None
    assert set(data["engines"]) == {"bf16", "fp8_weights", "awq"}
    assert set(data["engines"]["awq"]["decode"]["by_batch"]) == {"1", "2"}
    assert data["kernel_rule"]["1"]["fp8_fastest"] in ("fp8_w8a16_cuda_core", "fp8_w8a16_dot", "fp8_scaled_mm")
    assert data["kernel_errors"] == {}
    assert set(data["legacy"]) == {"fp8_weights", "awq"}
