"""The pair-contention benchmark runs end to end on the embedded model: two real engine processes started together,
each timing its own decode (--quick: one thread each, 16 steps), and one alone."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import run_benchmark

pytestmark = pytest.mark.slow


def test_quick_run_times_two_engines_together_and_one_alone() -> None:
    r = run_benchmark("cpu_pair_contention", "--quick")
    assert r.returncode == 0, r.stderr[-2000:]
    print(r.stdout)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    runs = {row["run"]: row["engines"] for row in result["rows"]}
    assert set(runs) == {"alone 1", "pair 1+1"}
    assert [e["threads"] for e in runs["pair 1+1"]] == [1, 1] and [e["threads"] for e in runs["alone 1"]] == [1]
    assert all(e["ms_per_step"] > 0 for engines in runs.values() for e in engines)
    assert result["cores"] >= 1 and result["steps"] == 16 and result["model"] == "embedded default"
