from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.harness import ServerProcess, start_server


@pytest.fixture
def launch(tmp_path: Path):
    """launch(*flags) -> a running ServerProcess; every one is killed by PID after the test."""
    started: list[ServerProcess] = []

    def go(*args: str, **kwargs) -> ServerProcess:
        server = start_server(tmp_path, *args, **kwargs)
        started.append(server)
        return server

    yield go
    for server in started:
        server.kill()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory):
    """One server on the embedded model for tests that only send requests."""
    server = start_server(tmp_path_factory.mktemp("shared"), "--max-num-seqs", "8")
    yield server
    server.kill()
