from __future__ import annotations

import pytest

from tests.opsctl.harness import deployment


@pytest.fixture
def deploy(tmp_path):
    """deploy(engine={...}, supervisor={...}) -> a Deployment (not started); torn down by PID after."""
    made = []

    def make(**kw):
        d = deployment(tmp_path / f"d{len(made)}", **kw)
        d.root.mkdir(parents=True, exist_ok=True)
        made.append(d)
        return d

    yield make
    for d in made:
        d.teardown()
