"""The compiled CPU decode kernel (kernels/csrc/cpu_paged_decode.cpp) against the float64 oracle and against the
torch path it replaces, on random caches whose unowned slots are garbage: float32, bfloat16 and float16, grouped
query heads, block sizes 8/16/32, lengths that end inside a block, one-token contexts, batches larger than the
thread count, and padded (non-contiguous) outputs.  Also: the environment switch, the cache key, and that a
failed build falls back with its reason (auto) or fails (require)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import cpu_backend, cpu_ext, reference


@pytest.fixture(autouse=True)
def _built() -> None:
    """scripts/setup.sh --test builds the extension (and installs g++): here it must load, not be skipped."""
    assert cpu_ext.unavailable_reason() is None


def _case(batch: int, heads: int, kv_heads: int, block_size: int, dtype: torch.dtype, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (batch,), generator=g).int()
    lens[0] = 1  # a context of one token
    per_seq = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(per_seq) + 7
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)  # NHD, all random
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (batch, max(per_seq) + 3), generator=g, dtype=torch.int32)  # padding
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    query = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return query, cache, tables, lens


def _oracle(query, cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """float64 attention per sequence over its own blocks, gathered naively."""
    out = torch.empty(query.shape, dtype=torch.float64)
    heads, kv_heads = query.shape[1], cache.shape[3]
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : -(-n // cache.shape[2])].long()
        k = cache[0, blocks].reshape(-1, kv_heads, cache.shape[4])[:n].double()
        v = cache[1, blocks].reshape(-1, kv_heads, cache.shape[4])[:n].double()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", query[b].double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_equals_the_oracle(heads, kv_heads, block_size, dtype):
    query, cache, tables, lens = _case(13, heads, kv_heads, block_size, dtype, dim=64, seed=block_size * heads)
    out = torch.full_like(query, float("nan"))
    cpu_ext.paged_decode(out, query, cache[0], cache[1], tables, lens, 0.125)
    want = _oracle(query, cache, tables, lens, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_gives_what_the_torch_path_gives(dtype, monkeypatch):
    """Through cpu_backend.paged_attention (as the engine calls it) with and without the extension, including a
    mixed step (decodes first) and an output that is a row slice of a larger buffer."""
    query, cache, tables, lens = _case(9, 8, 4, 16, dtype, dim=32, seed=5)
    qsl = torch.arange(10, dtype=torch.int32)
    got = cpu_backend.paged_attention(query, cache, tables, lens, qsl, 0.2, 1, int(lens.max()))
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    want = cpu_backend.paged_attention(query, cache, tables, lens, qsl, 0.2, 1, int(lens.max()))
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_reference_layout_agrees():
    """The head-major reference over the same values (transposed) gives the same decode."""
    query, cache, tables, lens = _case(6, 4, 2, 16, torch.float32, dim=32, seed=9)
    out = torch.empty_like(query)
    cpu_ext.paged_decode(out, query, cache[0], cache[1], tables, lens, 0.3)
    head_major = cache.permute(0, 1, 3, 2, 4).contiguous()
    qsl = torch.arange(7, dtype=torch.int32)
    want = reference.paged_attention(query, head_major, tables, lens, qsl, 0.3, 1, int(lens.max()))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    query, cache, tables, lens = _case(3, 4, 2, 16, torch.float32, dim=32, seed=1)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ext.paged_decode(out, query, cache[0], cache[1], tables.long(), lens, 0.3)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ext.paged_decode(out, query.double(), cache[0], cache[1], tables, lens, 0.3)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_ext.paged_decode(out[:, :3].contiguous(), query[:, :3].contiguous(), cache[0], cache[1], tables, lens, 0.3)


def test_the_mode_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_ext.ENV, "sometimes")
    with pytest.raises(ValueError, match="PAGEKEEPER_CPU_KERNELS='sometimes' is not one of auto, off, require"):
        cpu_ext.mode()
    monkeypatch.setenv(cpu_ext.ENV, "OFF")
    assert cpu_ext.mode() == "off"


def test_a_failed_build_falls_back_or_fails_by_mode(monkeypatch):
    def no_compiler() -> None:
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(cpu_ext, "_build_and_load", no_compiler)
    cpu_ext.unavailable_reason.cache_clear()
    try:
        monkeypatch.setenv(cpu_ext.ENV, "auto")
        assert "g++: not found" in cpu_ext.unavailable_reason()
        cpu_ext.unavailable_reason.cache_clear()
        monkeypatch.setenv(cpu_ext.ENV, "require")
        with pytest.raises(cpu_ext.CpuKernelsUnavailable, match="g..: not found.*=require"):
            cpu_ext.unavailable_reason()
        cpu_ext.unavailable_reason.cache_clear()
        monkeypatch.setenv(cpu_ext.ENV, "off")
        assert cpu_ext.unavailable_reason() == "PAGEKEEPER_CPU_KERNELS=off"
    finally:
        cpu_ext.unavailable_reason.cache_clear()
        monkeypatch.undo()
        assert cpu_ext.available()  # loaded again (already in the process: no rebuild)


def test_the_build_key_follows_the_source_and_the_host(monkeypatch):
    key = cpu_ext.build_key()
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: "sse2")
    assert cpu_ext.build_key() != key


def test_the_build_runs_the_projects_own_ninja_whatever_path_holds(monkeypatch):
    """A distribution's ninja first on PATH (a systemd unit's PATH) would write a build log that the package's ninja
    cannot read, and rebuild what the other built: the package's comes first."""
    import shutil

    import ninja

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    cpu_ext._ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    cpu_ext._ninja_on_path()  # once is enough
    assert os.environ["PATH"].count(ninja.BIN_DIR) == 1


def test_the_cache_root_of_another_processs_environment(tmp_path):
    assert cpu_ext.cache_root({"CACHE_DIRECTORY": f"{tmp_path}/a:{tmp_path}/b"}) == tmp_path / "a"
    assert cpu_ext.cache_root({"PAGEKEEPER_CACHE_DIR": str(tmp_path), "CACHE_DIRECTORY": "/x"}) == tmp_path
    assert cpu_ext.cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pagekeeper"


@pytest.mark.parametrize(
    "value,expected",
    [
        ("sometimes", "PAGEKEEPER_CPU_KERNELS='sometimes' is not one of auto, off, require"),
        ("require", "could not be built or loaded"),
    ],
)
def test_the_server_refuses_to_start_on_a_bad_mode_or_a_required_kernel_it_cannot_build(value, expected, tmp_path):
    """Checked at start-up with exit 2 and one line, before the model loads (not at the first decode).  The second
    case points the cache at a file, so the build cannot write its folder."""
    import subprocess
    import sys

    from tests.server.harness import REPO, free_port

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {**os.environ, cpu_ext.ENV: value, "PAGEKEEPER_CACHE_DIR": str(blocker)}
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=str(REPO), env=env,
    )  # fmt: skip
    last = r.stderr.strip().splitlines()[-1]
    print(last)
    assert r.returncode == 2 and expected in last, r.stderr[-2000:]


def test_off_serves_through_the_torch_path(tmp_path):
    """PAGEKEEPER_CPU_KERNELS=off: an engine decodes without the extension and gives the same greedy tokens."""
    import subprocess
    import sys

    from tests.server.harness import REPO

    script = (
        "from engine import LLM, SamplingParams\n"
        "from kernels import cpu_ext\n"
        "llm = LLM(dtype='float32', max_model_len=256)\n"
        "out = llm.generate(['The quick brown fox', 'Hello'], SamplingParams(temperature=0, max_tokens=24))\n"
        "print('KERNEL', cpu_ext.available())\n"
        "print('TOKENS', [o.outputs[0].token_ids for o in out])\n"
    )
    runs = {}
    for mode in ("off", "require"):
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(REPO),
            env={**os.environ, cpu_ext.ENV: mode},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("KERNEL", "TOKENS")))
        runs[mode] = lines
    print({m: v["KERNEL"] for m, v in runs.items()})
    assert runs["off"]["KERNEL"] == "False" and runs["require"]["KERNEL"] == "True"
    assert runs["off"]["TOKENS"] == runs["require"]["TOKENS"]
