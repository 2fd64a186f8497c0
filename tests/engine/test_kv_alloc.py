"""The KV cache is one allocation, each layer a view of it (engine/memory/kv_alloc.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.memory.kv_alloc import allocate_kv_caches, expandable_segments_on

REPO = Path(__file__).resolve().parents[2]


def test_every_layer_is_a_zeroed_contiguous_view_of_one_allocation():
    caches = allocate_kv_caches((3, 2, 4, 5), torch.bfloat16, torch.device("cpu"), 4)
    assert len(caches) == 4
    base = caches[0].untyped_storage().data_ptr()
    for i, c in enumerate(caches):
        assert c.shape == (3, 2, 4, 5) and c.dtype == torch.bfloat16 and c.is_contiguous()
        assert c.untyped_storage().data_ptr() == base
        assert c.data_ptr() == base + i * c.numel() * c.element_size()  # back to back, no overlap
        assert torch.count_nonzero(c) == 0
    caches[2].fill_(1.0)  # one layer's writes stay in that layer
    assert [int(torch.count_nonzero(c)) for c in caches] == [0, 0, caches[2].numel(), 0]


def test_fp8_caches_allocate_too():
    caches = allocate_kv_caches((2, 3), torch.float8_e4m3fn, torch.device("cpu"), 2)
    assert [c.dtype for c in caches] == [torch.float8_e4m3fn] * 2


@pytest.mark.parametrize(
    ("conf", "on"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:64, expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("max_split_size_mb:64", False),
        ("", False),
    ],
)
def test_expandable_segments_are_read_from_the_allocator_settings(monkeypatch, conf, on):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert expandable_segments_on() is on


@pytest.mark.gpu
def test_on_a_gpu_the_cache_is_one_plain_segment_while_the_rest_expands():
    """In a fresh process with the engine's allocator defaults: the KV cache is one segment that does not expand,
    and an allocation after it still lands in an expandable one."""
    code = (
        "import torch\n"
        "from engine.memory.budget import set_allocator_defaults\n"
        "from engine.memory.kv_alloc import allocate_kv_caches\n"
        "set_allocator_defaults(); torch.cuda.init()\n"
        "caches = allocate_kv_caches((512, 2, 16, 8, 128), torch.bfloat16, torch.device('cuda'), 8)\n"
        "after = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')\n"
        "segs = torch.cuda.memory_snapshot()\n"
        "kv = [s for s in segs if any(b['address'] == caches[0].data_ptr() for b in s['blocks'])]\n"
        "other = [s for s in segs if any(b['address'] == after.data_ptr() for b in s['blocks'])]\n"
        "whole = kv[0]['total_size'] >= 8 * caches[0].nbytes\n"
        "print(len(kv), kv[0]['is_expandable'], whole, other[0]['is_expandable'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "False", "True", "True"]
