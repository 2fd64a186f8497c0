"""Triton kernel variants compiled or loaded while the engine runs are logged with their seconds
(engine/runner/kernel_loads.py).  Off a GPU Triton compiles nothing (TRITON_INTERPRET runs kernels as Python), so the
hooks are driven as Triton's JIT calls them, around a timed stand-in for the compile; on a GPU a real compile."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")

from engine.runner import kernel_loads  # noqa: E402


@pytest.fixture
def hooks(monkeypatch):
    monkeypatch.setattr(kernel_loads, "_installed", False)
    chained: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: chained.append("before"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: chained.append("after"))
    assert kernel_loads.watch_kernel_loads()
    return chained


def _compile(seconds: float, name: str = "paged_attention_kernel") -> None:
    fn, key = SimpleNamespace(name=name), ("i32", 16, 128)
    assert knobs.runtime.jit_cache_hook(key=key, repr="r", fn=fn, compile={}, is_manual_warmup=False) is None
    time.sleep(seconds)
    knobs.runtime.jit_post_compile_hook(key=key, repr="r", fn=fn, compile={}, is_manual_warmup=False)


def test_a_slow_load_is_named_with_its_seconds_and_the_hooks_before_it_still_run(hooks):
    kernel_loads.serving.set()
    try:
        with capture_logs() as logs:
            _compile(0.12)
            _compile(0.0, "fast_kernel")  # under SLOW_S: not logged
    finally:
        kernel_loads.serving.clear()
    (line,) = [e for e in logs if e["event"] == "kernel_compiled"]
    assert line["kernel"] == "paged_attention_kernel" and line["seconds"] >= 0.12 and line["serving"] is True
    assert hooks == ["before", "after", "before", "after"]  # hooks set before ours are chained, not replaced


@pytest.mark.gpu
def test_on_a_gpu_a_fresh_kernel_variant_is_logged(hooks, tmp_path, monkeypatch):
    import torch
    import triton.language as tl

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # nothing cached: a real compile

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(100, device="cuda")
    with capture_logs() as logs:
        add_one[(1,)](x, 100, BLOCK=128)
        torch.cuda.synchronize()
    names = [e["kernel"] for e in logs if e["event"] == "kernel_compiled"]
    assert len(names) == 1 and names[0].endswith("add_one"), names  # its qualified name
