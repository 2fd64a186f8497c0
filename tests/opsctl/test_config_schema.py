"""Bad config values: each is one line naming the key, exit 2, and nothing is started.

Every case runs the real `opsctl start` against a config file with one mistake (types, ranges,
strings for booleans, unknown keys, combinations); the engine server's own `--config` reads the same
schema.  Found by trying the product as a new user would (2026-11-23): before the schema, several of
these started an engine that then misbehaved (a truthy "no", a blind supervisor, a crash loop).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.server.harness import REPO, free_port

CASES = [  # (section, key, TOML value)
    ("supervisor", "dry_run", '"no"'),
    ("supervisor", "dry_run", "1"),
    ("supervisor", "history_size", "0"),
    ("supervisor", "history_size", "20"),  # shorter than the longest rule window at this poll
    ("supervisor", "cache_usage_threshold", "-1"),
    ("supervisor", "cache_usage_threshold", "1.5"),
    ("supervisor", "poll_interval", '"fast"'),
    ("supervisor", "poll_interval", "0"),
    ("supervisor", "probe_timeout", "-2"),
    ("supervisor", "hang_seconds", "0"),
    ("supervisor", "events_to_act", "0"),
    ("supervisor", "events_to_act", "2.5"),
    ("supervisor", "max_restarts", "0"),
    ("supervisor", "restart_window", '"15m"'),
    ("supervisor", "cooldown_seconds", "-1"),
    ("supervisor", "backlog_factor", "0"),
    ("supervisor", "fragmentation_threshold", "2"),
    ("supervisor", "metrics_port", "-1"),
    ("supervisor", "metrics_port", "70000"),
    ("supervisor", "launcher", '"docker"'),
    ("supervisor", "handover", '"parallel"'),
    ("supervisor", "unit", '"pagekeeper"'),
    ("supervisor", "drain_timeout", "-5"),
    ("supervisor", "poll_intervall", "10"),  # a typo is an unknown key, not a silent default
    ("engine", "host", '"999.1.1.1"'),  # it passed, and the bind's failed lookup blamed the port
    ("engine", "host", '"my host"'),
    ("supervisor", "metrics_host", '"1.2.3"'),
    ("engine", "port", '"abc"'),
    ("engine", "port", "70000"),
    ("engine", "port", "0"),
    ("engine", "max_waiting", "0"),
    ("engine", "max_waiting", '"ten"'),
    ("engine", "max_num_seqs", "0"),
    ("engine", "block_size", "12"),
    ("engine", "dtype", '"fp8"'),
    ("engine", "gpu_memory_utilization", "1.5"),
    ("engine", "enable_prefix_caching", '"yes"'),
    ("engine", "health_stall_seconds", "0"),
    ("engine", "log_level", '"verbose"'),
    ("engine", "metrics_names", '"prometheus"'),
    ("engine", "listen_fd", "3"),  # set by opsctl for its engines, never by a config file
    ("engine", "modle", '"/data/llama"'),
]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("section,key,value", CASES, ids=[f"{s}.{k}={v}" for s, k, v in CASES])
def test_a_bad_value_is_one_line_naming_the_key_and_starts_nothing(tmp_path, section, key, value):
    port = free_port()
    lines = {"engine": [f"port = {port}"], "supervisor": ["metrics_port = 0", 'launcher = "process"']}
    lines[section] = [ln for ln in lines[section] if not ln.startswith(f"{key} =")] + [f"{key} = {value}"]
    cfg = tmp_path / "bad.toml"
    cfg.write_text("\n".join(f"[{s}]\n" + "\n".join(body) for s, body in lines.items()) + "\n")
    runtime = tmp_path / "run"
    # the file both before and after the subcommand
    where = ["--config", str(cfg), "start"] if len(key) % 2 else ["start", "--config", str(cfg)]
    r = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--runtime-dir", str(runtime), *where],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    print(f"[{section}] {key} = {value}: exit {r.returncode}: {r.stderr.strip()}")
    assert r.returncode == 2, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and key in err[0], r.stderr
    assert not r.stdout.strip()
    assert not (runtime / "supervisor.pid").exists() and not (runtime / "engine.json").exists()
    assert not _listening(port)


def test_overlap_under_systemd_is_refused_not_ignored(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text(
        f'[engine]\nport = {free_port()}\n[supervisor]\nlauncher = "systemd"\nhandover = "overlap"\n'
        f'metrics_port = 0\nruntime_dir = "{tmp_path / "run"}"\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--config", str(cfg), "start"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "handover" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "key,value", [("max_waiting", "0"), ("port", '"abc"'), ("dry_run", "true"), ("metrics_names", '"seeds"')]
)
def test_the_engine_server_reads_the_same_schema(tmp_path, key, value):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f"[engine]\n{key} = {value}\n")
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and key in r.stderr, r.stderr


def test_the_engine_names_its_config_files_keys_and_its_command_lines_flags(tmp_path):
    """`python -m engine.server --config F` (the systemd unit's command): an error about a value the file gave names
    the file's key; one about a flag given on the command line names the flag."""
    cfg = tmp_path / "engine.toml"
    cfg.write_text(f'[engine]\nmodel = "/nonexistent"\nport = {free_port()}\n')
    for extra, wanted in (
        ((), f'error: {cfg.resolve()}: [engine] model = "/nonexistent": no such directory; '),
        (("--model", "/elsewhere"), "error: --model /elsewhere: no such directory; "),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "engine.server", "--config", str(cfg), *extra],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(REPO),
        )
        print(r.stderr.strip())
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(wanted), r.stderr
