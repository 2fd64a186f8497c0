"""Broken checkpoints: the engine server exits 2 with one line naming the file, and `opsctl doctor`
shows [FAIL] for the same problem, without starting anything."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tests.server.harness import REPO, free_port


def _break(kind: str, src, dst):  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    weights = next(dst.glob("*.safetensors"))
    if kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind == "corrupt":
        weights.write_bytes(b"\x00\x01 not a safetensors file " * 64)
    elif kind == "missing-tensor":
        tensors = load_file(str(weights))
        del tensors[next(k for k in tensors if k.endswith("mlp.down_proj.weight"))]
        save_file(tensors, str(weights))
    return weights


@pytest.mark.parametrize(
    "kind,words",
    [("truncated", "corrupt or truncated"), ("corrupt", "corrupt or truncated"), ("missing-tensor", "lacks 1 weight")],
)
def test_a_broken_checkpoint_is_one_line_naming_it_and_exit_2(checkpoint, tmp_path, kind, words):
    model = tmp_path / kind
    weights = _break(kind, checkpoint("llama"), model)
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--model", str(model), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    print(f"{kind}: exit {r.returncode}: {lines}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]
    assert (str(weights) if kind != "missing-tensor" else str(model)) in lines[0]
    assert "Traceback" not in r.stderr + r.stdout

    cfg = tmp_path / f"{kind}.toml"
    cfg.write_text(f'[engine]\nmodel = "{model}"\nport = 1\n[supervisor]\nruntime_dir = "{tmp_path / "run"}"\n')
    doctor = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--config", str(cfg), "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    failed = [ln for ln in doctor.stdout.splitlines() if ln.startswith("[FAIL] checkpoint")]
    assert doctor.returncode == 1 and len(failed) == 1 and words in failed[0], doctor.stdout + doctor.stderr


def test_doctor_passes_a_sound_checkpoint(checkpoint, tmp_path):
    cfg = tmp_path / "ok.toml"
    cfg.write_text(f'[engine]\nmodel = "{checkpoint("llama")}"\n')
    doctor = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--config", str(cfg), "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    assert "[ok  ] checkpoint" in doctor.stdout, doctor.stdout + doctor.stderr


def test_a_tokenizer_that_is_not_a_directory_fails_at_once(tmp_path):
    import time

    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--tokenizer", "meta-llama/Llama-2-7b-hf", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    took = time.monotonic() - start
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    print(f"--tokenizer NAME: exit {r.returncode} after {took:.1f} s: {lines}")
    assert r.returncode == 2 and len(lines) == 1 and "no such directory" in lines[0] and took < 30


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
        (["--model", "{empty}"], "no config.json in the directory"),
        (["--tokenizer", "meta-llama/Llama-2-7b-hf"], "--tokenizer meta-llama/Llama-2-7b-hf: no such directory"),
    ],
)
def test_a_missing_model_or_tokenizer_directory_is_refused_before_torch_is_imported(tmp_path, flags, message):
    # the imports take seconds, 12 s on a loaded 2-core CI host, which an `opsctl start` with a typo waited for
    (tmp_path / "empty").mkdir()
    flags = [f.format(empty=tmp_path / "empty") for f in flags]
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "engine.server", *flags, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")]
    errors = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
    heavy = sorted({m for m in imported if m.split(".")[0] in ("torch", "transformers", "triton")})
    print(f"{flags}: exit {r.returncode}, {len(imported)} modules imported, heavy: {heavy[:5]}, {errors}")
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr[-2000:]
    assert not heavy
