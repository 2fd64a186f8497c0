"""Programmatic dependent launch (PDL) for a decode step's chain of short kernels, on Hopper and later.

A kernel launched with Triton's ``launch_pdl=True`` may start while the kernel before it in the stream is still
running, once every program of that kernel has called ``gdc_launch_dependents`` (or ended).  It must then call
``gdc_wait`` (PTX ``griddepcontrol.wait``: the kernel before has ended and its writes are visible) before it reads
anything a kernel before it wrote, and before its first store.  Work before the wait may touch only data no kernel
of the step writes (weights).  A trigger in a kernel whose successor is launched plainly has no effect, and a wait
in a kernel launched plainly returns at once, so each kernel is correct whatever its neighbours do.

`pdl(device)` says whether the kernels take this path: a CUDA device of compute capability 9.0 or more, Triton's
interpreter off, and ``PAGEKEEPER_PDL`` not ``0`` (read at each call, so an A/B run can switch it in one process;
CUDA graphs keep the programmatic edges of a captured stream).  Elsewhere (CPU, TRITON_INTERPRET=1, pre-Hopper
GPUs) the kernels compile with the constexpr ``PDL`` False, without the instructions, and launch as before.

Who takes it: kernels/fp8_gemv.py's one-row streaming product; at one row, on a device where such a product took
it (`pdl_one_row`, `mark_chained`), RMSNorm, rotary and SiLU-mul (kernels/fused_ops.py) and decode attention's
combine (kernels/paged_attention.py), each waiting first and
triggering right after its wait; the decode kernel (launched plainly, after the KV write) triggers as it starts.
A trigger before the wait was much slower (a batch-1 FP8 layer 81 -> 109 us on an H200): the next product's
programs then launched while the product before still streamed and took whatever SM slots were free, unevenly.
docs/decisions/quant-paths.md ("Programmatic dependent launch") has the measurements.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.cpu_ext import env_choice

try:  # Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # pragma: no cover - an older Triton: the kernels never take the PDL branch
    gdc_launch_dependents = gdc_wait = None
    AVAILABLE = False

ENV = "PAGEKEEPER_PDL"  # "1" (the default): on where the device supports it; "0": off
MODES = ("1", "0")
# Devices whose one-row products have launched with PDL (kernels/fp8_gemv.py marks them): only beside those do the
# small kernels take it too, since beside cuBLAS's bf16 products the same launches cost a batch-1 step about 1 %.
_CHAINED: set[int] = set()


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (module docstring)."""
    if not AVAILABLE or device.type != "cuda" or mode() == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(_index(device))


def mode() -> str:
    """PAGEKEEPER_PDL, checked: a value other than 1 or 0 is an error (the engine's start refuses it), never silently
    on."""
    return env_choice(ENV, MODES)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def mark_chained(device: torch.device) -> None:
    """A one-row product on `device` launched with PDL: the small kernels around it may take it too."""
    _CHAINED.add(_index(device))


def pdl_one_row(device: torch.device, rows: int) -> bool:
    """PDL for a small kernel (RMSNorm, rotary, SiLU-mul, decode attention's combine) of `rows` rows: only at one
    row, the decode step of one sequence, and only on a device whose products take PDL (kernels/fp8_gemv.py's
    streaming kernel, `mark_chained`).  (At 8 sequences the same launches made the FP8 step 1 % slower, and beside
    bf16's cuBLAS products a batch-1 step about 1 %; docs/decisions/quant-paths.md.)"""
    return rows == 1 and device.type == "cuda" and pdl(device) and _index(device) in _CHAINED


def launch_options(on: bool) -> dict:
    """The launch keyword for a kernel taking the PDL path (none otherwise: the interpreter knows no such option)."""
    return {"launch_pdl": True} if on else {}
