"""`opsctl start --model ID_OR_DIR --port N --host H`, like `vllm serve MODEL`: the flags override the config file,
a Hugging Face Hub id is served from the HF cache (here offline, from a cache laid out as the Hub's client writes it),
one that cannot be resolved is one line naming both the Hub and the cache, and a running instance is not silently
left as it is."""

from __future__ import annotations

import shutil

import httpx

from tests.server.harness import free_port

REPO_ID = "pagekeeper-test/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(root):  # type: ignore[no-untyped-def]
    """`<root>/hub/models--pagekeeper-test--tiny-llama/{refs/main,snapshots/REVISION/}`, as huggingface_hub writes."""
    from engine.default_model import DEFAULT_MODEL_DIR

    repo = root / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.suffix in (".json", ".safetensors", ".jinja"):
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Now is", "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_a_hub_id_is_served_from_the_hf_cache_on_the_port_given(deploy, tmp_path):
    env = _hf_cache(tmp_path / "hf")
    d = deploy()
    port = free_port()
    r = d.opsctl("start", "--model", REPO_ID, "--port", str(port), "--host", "127.0.0.1", timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"127.0.0.1:{port}" in r.stdout and REPO_ID in r.stdout
    answer = _complete(f"http://127.0.0.1:{port}", REPO_ID)
    assert answer.status_code == 200 and answer.json()["model"] == REPO_ID
    again = d.opsctl("start", "--port", str(free_port()), env=env)
    assert again.returncode == 2 and "already runs" in again.stderr and "opsctl stop" in again.stderr, again.stderr


def test_a_checkpoint_directory_and_port_override_the_config_file(deploy, tmp_path):
    from engine.default_model import DEFAULT_MODEL_DIR

    local = tmp_path / "my-model"
    shutil.copytree(DEFAULT_MODEL_DIR, local, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    d = deploy(engine={"model": "/nonexistent/from-the-file"})
    port = free_port()
    r = d.opsctl("start", "--model", str(local), "--port", str(port), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    answer = _complete(f"http://127.0.0.1:{port}", "my-model")
    assert answer.status_code == 200, answer.text


def test_a_hub_id_neither_the_hub_nor_the_cache_has_is_one_line(deploy, tmp_path):
    env = _hf_cache(tmp_path / "hf")
    d = deploy()
    r = d.opsctl("start", "--model", "nobody-here/no-such-model", timeout=180, env=env)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "--model nobody-here/no-such-model: not a local directory, not in the Hugging Face cache" in out, out
    assert "HF_HUB_OFFLINE is set" in out and "huggingface-cli download nobody-here/no-such-model" in out, out
