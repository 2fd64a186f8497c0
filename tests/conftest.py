"""Shared fixtures: random-weight checkpoints per architecture, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path):
    """checkpoint(arch) -> directory of a float32 random-weight checkpoint saved by transformers."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_checkpoint(arch, checkpoint_root / arch)
        return made[arch]

    return get
