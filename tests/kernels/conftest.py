"""Kernel tests run the Triton kernels through Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports kernels.paged_attention / kernels.cache_ops.  Only the Triton kernels read it; the rest of
the suite (the engine on CPU uses kernels.reference) is unaffected.  With a GPU nothing is set and
the same tests compile and run the kernels for real.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
