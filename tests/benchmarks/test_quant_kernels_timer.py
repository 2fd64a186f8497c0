"""benchmarks/quant_kernels.py times each path on rotating copies of its weights (bench_rotating on CUDA): enough
copies that the smallest format's together exceed L2 several times, the kernels' inputs copied and the float32
references shared."""

from __future__ import annotations

import torch

from benchmarks.quant_kernels import COPIED, ROTATE_BYTES, _copy_inputs, rotations


def test_enough_copies_that_the_int4_weights_exceed_the_rotation_bytes():
    for k, n in ((4096, 4096), (4096, 6144), (4096, 28672), (14336, 4096)):
        r = rotations(k, n)
        assert r >= 2 and r * (k * n // 2) >= ROTATE_BYTES and (r - 1) * (k * n // 2) < ROTATE_BYTES or r == 2
    assert rotations(4096, 4096) == 24 and rotations(4096, 28672) == 4


def test_copies_hold_their_own_inputs_and_share_the_references():
    w = {key: torch.ones(4) for key in COPIED} | {"fp8_dense": torch.ones(4), "awq_dense": torch.ones(4)}
    c = _copy_inputs(w)
    assert all(c[key].data_ptr() != w[key].data_ptr() and torch.equal(c[key], w[key]) for key in COPIED)
    assert c["fp8_dense"] is w["fp8_dense"] and c["awq_dense"] is w["awq_dense"]


def test_kernel_benchmarks_refuse_a_run_they_cannot_time(monkeypatch, capsys):
    """benchmarks/quant_kernels.py and gemv_sweep.py: CUDA, or the CPU dry run under Triton's interpreter; anything
    else is one error line and exit 2 (`interpreted_or_cuda` returns None)."""
    from benchmarks.kernels import interpreted_or_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert interpreted_or_cuda(False) is None and "no CUDA device" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interpreted_or_cuda(True) is None and "TRITON_INTERPRET=1" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreted_or_cuda(True) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert interpreted_or_cuda(False) == torch.device("cuda") and interpreted_or_cuda(True) == torch.device("cpu")
