"""The GPU-only benchmarks (step_phases, launch_overhead, decode_long_tailed, overlap_probe) on a machine without
CUDA: one line saying so and exit 2, never a traceback; their bad arguments are refused the same way.  Their
measurements run on the device (results under benchmarks/results/)."""

from __future__ import annotations

import importlib

import pytest
import torch

from benchmarks.decode_long_tailed import contexts

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")

MODULES = [
    "benchmarks.step_phases",
    "benchmarks.launch_overhead",
    "benchmarks.decode_long_tailed",
    "benchmarks.overlap_probe",
]
BAD_ARGS = [
    ("benchmarks.launch_overhead", ["--decodes", "0"]),
    ("benchmarks.decode_long_tailed", ["--batches", "x"]),
    ("benchmarks.overlap_probe", ["--m-step", "-32"]),
    ("benchmarks.step_phases", ["--kernel-profile", "-1"]),
    ("benchmarks.step_phases", ["--kernel-profile", "4", "--kernel-profile-every", "0"]),
]


@pytest.mark.parametrize("module", MODULES)
def test_without_a_gpu_it_says_so_and_exits_2(module, capsys, tmp_path):
    assert importlib.import_module(module).main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"{module} needs a CUDA GPU"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("module,args", BAD_ARGS)
def test_a_bad_argument_is_one_usage_error(module, args, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_long_tailed_contexts_are_seeded_capped_and_skewed():
    lens = contexts(1000, seed=3)
    assert lens == contexts(1000, seed=3) and lens != contexts(1000, seed=4)
    assert min(lens) >= 16 and max(lens) == 3072  # the cap is reached: a tail of long contexts
    mean, median = sum(lens) / len(lens), sorted(lens)[500]
    assert mean > 1.2 * median  # long-tailed: the mean well above the median


def test_gemm_probe_without_a_gpu_says_so_in_one_line_and_exits_2(capsys, tmp_path):
    from benchmarks import gemm_probe

    assert gemm_probe.main(["--out", str(tmp_path), "--ms", "256,320", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == "benchmarks.gemm_probe needs a CUDA GPU"
    assert not any(tmp_path.iterdir())
