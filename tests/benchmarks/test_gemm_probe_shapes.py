"""benchmarks.gemm_probe's shape table (CPU): the 8B projections as before, and one rank's share of Llama-3.1-70B at
tensor parallel 4, which issue 36's target is judged against (docs/decisions/tp-bound-target.md)."""

from __future__ import annotations

import pytest

from benchmarks import gemm_probe
from benchmarks.gemm_probe import SHAPES, llama_shape


def test_8b_is_the_probes_original_table():
    shape = SHAPES["8b"]
    assert shape.layers == 32
    assert shape.projections == {
        "qkv": (4096, 6144),
        "o": (4096, 4096),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
    }


def test_70b_tp4_is_one_ranks_share():
    shape = SHAPES["70b-tp4"]
    assert shape.layers == 80
    # qkv: 64/4 query heads + 2 * 8/4 KV heads of 128; o and down split by input rows, gate_up by output columns
    assert shape.projections == {"qkv": (8192, 2560), "o": (2048, 8192), "gate_up": (8192, 14336), "down": (7168, 8192)}
    assert shape.weight_bytes == 80 * sum(2 * k * n for k, n in shape.projections.values())
    # a quarter of the unsplit 70B projections' bf16 bytes
    assert 4 * shape.weight_bytes == llama_shape(8192, 28672, 64, 8, 128, 80).weight_bytes
    assert shape.weight_bytes == 34_225_520_640


def test_tensor_parallel_must_divide_the_heads():
    with pytest.raises(AssertionError):
        llama_shape(8192, 28672, 64, 8, 128, 80, tp=16)


def test_an_unknown_shape_is_one_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        gemm_probe.main(["--shape", "405b"])
    assert e.value.code == 2
    assert "--shape" in capsys.readouterr().err.strip().splitlines()[-1]
