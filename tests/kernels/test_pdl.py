"""kernels/pdl.py: programmatic dependent launch stays off on the CPU, under Triton's interpreter and with
PAGEKEEPER_PDL=0 (a misspelt value is refused), and the small kernels take it at one row only, beside products that
take it (the GPU runs are in docs/decisions/quant-paths.md)."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl


def test_off_on_the_cpu_and_in_the_interpreter(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.pdl(cpu)
    assert not pdl.pdl_one_row(cpu, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl(torch.device("cuda", 0))  # never asks the device under the interpreter


def test_the_switch_and_the_row_rule(monkeypatch):
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setattr(pdl, "AVAILABLE", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gpu = torch.device("cuda", 0)
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.setattr(pdl, "_CHAINED", set())
    assert pdl.pdl(gpu)
    assert not pdl.pdl_one_row(gpu, 1)  # no product on the device took PDL yet (a bf16 model: cuBLAS)
    pdl.mark_chained(gpu)
    assert pdl.pdl_one_row(gpu, 1)
    assert not pdl.pdl_one_row(gpu, 8)
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.pdl(gpu)
    assert not pdl.pdl_one_row(gpu, 1)


def test_a_misspelt_switch_is_refused(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "no")
    with pytest.raises(ValueError, match="PAGEKEEPER_PDL='no' is not one of 1, 0"):
        pdl.mode()
    from engine.config import ConfigError
    from engine.runner.startup import check_gpu_kernel_env

    with pytest.raises(ConfigError, match="PAGEKEEPER_PDL"):
        check_gpu_kernel_env()
    monkeypatch.setenv(pdl.ENV, "0")
    check_gpu_kernel_env()


def test_launch_options():
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}
