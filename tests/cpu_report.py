"""Each test's CPU seconds inside the pytest process, written where PAGEKEEPER_TEST_CPU_LOG names a directory.

Why: `benchmarks/suite_cpu.py` attributes the CPU of every process a test starts (servers, cores, supervisors) to
that test through the PYTEST_CURRENT_TEST they inherit, but the pytest workers' own CPU (a quarter of a run: models
loaded in-process, interpreted Triton kernels, the harness's polling) had no such split.  A worker's own CPU time
(every thread of it: an in-process engine's step thread too) read before and after each test's setup, call and
teardown is that test's share; a module-scoped fixture's start-up counts under the first test that asked for it.
Off unless the variable is set: one line of JSON per test, appended to `<dir>/<pid>.jsonl`, which the benchmark sums.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

ENV = "PAGEKEEPER_TEST_CPU_LOG"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    where = os.environ.get(ENV)
    if not where:
        yield
        return
    before = time.process_time()
    yield
    used = time.process_time() - before
    with (Path(where) / f"{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(used, 4)}) + "\n")
