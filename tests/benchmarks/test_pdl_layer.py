"""benchmarks/pdl_layer.py: one FP8 decode layer with PAGEKEEPER_PDL off and on. The timing needs a Hopper GPU
(docs/decisions/quant-paths.md has its runs); here, what it refuses and the arms' settings."""

from __future__ import annotations

import pytest
import torch

from benchmarks import pdl_layer


def test_the_arms_switch_pdl_through_its_variable() -> None:
    assert pdl_layer._arm_env("off") == {"PAGEKEEPER_PDL": "0"}
    assert pdl_layer._arm_env("on") == {"PAGEKEEPER_PDL": "1"}


def test_no_rounds_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(SystemExit) as e:
        pdl_layer.main(["--out", str(tmp_path), "--rounds", "0"])
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys) -> None:
    assert pdl_layer.main(["--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
