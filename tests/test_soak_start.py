"""When README's command may run the soak, xdist's controller starts it before the workers collect (tests/conftest.py):
half a minute less added to the run.  Which selections count as "may run it", read before anything is collected."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import _soak_may_run

REPO = Path(__file__).resolve().parents[1]


def _config(*args: str, markexpr: str = "", keyword: str = "", collectonly: bool = False, at: Path = REPO):  # type: ignore[no-untyped-def]
    option = SimpleNamespace(markexpr=markexpr, keyword=keyword, collectonly=collectonly)
    return SimpleNamespace(option=option, args=list(args), invocation_params=SimpleNamespace(dir=at))


@pytest.mark.parametrize(
    "args,at",
    [
        (("tests",), REPO),  # README's command: no paths given, testpaths
        (("tests/opsctl",), REPO),
        (("tests/engine", "tests/opsctl/test_soak.py::test_ten_minutes_of_healthy_load_cause_no_policy_action"), REPO),
        (("opsctl/test_soak.py",), REPO / "tests"),
    ],
)
def test_a_selection_that_holds_the_soak_starts_it_early(args, at) -> None:  # type: ignore[no-untyped-def]
    assert _soak_may_run(_config(*args, at=at))


@pytest.mark.parametrize(
    "config",
    [
        _config("tests/engine", "tests/server"),
        _config("tests", markexpr="not slow"),  # README's quick loop
        _config("tests", keyword="scheduler"),
        _config("tests", collectonly=True),
    ],
    ids=["other-paths", "marker", "keyword", "collect-only"],
)
def test_a_selection_that_leaves_it_out_or_may_does_not(config) -> None:  # type: ignore[no-untyped-def]
    assert not _soak_may_run(config)
