"""The unit files and `opsctl install` without booting anything: systemd-analyze verify / security,
systemd 252 compatibility, the rendered units, install/uninstall under --prefix, and the launcher's
systemctl calls."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from opsctl.config import load_config
from opsctl.install import (
    DEFAULT_CONFIG,
    DROPIN_NAME,
    ENGINE_UNIT,
    SOCKET_UNIT,
    SUPERVISOR_UNIT,
    TEMPLATE_NAMES,
    UNITS,
    Layout,
    get_key,
    render_units,
)
from opsctl.launcher import SystemdLauncher
from tests.server.harness import REPO

UNIT_DIR = REPO / "systemd"
MAX_EXPOSURE = 4.0
# Keys that systemd 252 (Debian 12) does not know: units must not use them.
NEWER_THAN_252 = (
    "RestartSteps",
    "RestartMaxDelaySec",
    "OpenFile",
    "ExitType=cgroup",
    "Type=notify-reload",
    "ReloadSignal",
    "MemoryZSwapMax",
    "SurviveFinalKillSignal",
    "ImportCredential",
    "ProtectHostname=private",
    "PrivatePIDs",
    "DelegateSubgroup",
    "MemoryPressureWatch",
)

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (scripts/setup.sh --test installs systemd)",
)


def opsctl(*args: str, config: Path | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opsctl.cli", *(["--config", str(config)] if config else []), *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("prefix")
    r = opsctl("install", "--prefix", str(prefix))
    assert r.returncode == 0, r.stderr
    return prefix


def unit_files(installed: Path) -> list[Path]:
    return [UNIT_DIR / u for u in UNITS] + [installed / "etc/systemd/system" / u for u in UNITS]


@needs_analyze
def test_systemd_analyze_verify_is_silent_for_every_unit(installed):
    """`verify` exits 0 on warnings, so stderr must be empty: any warning fails the test."""
    for unit in unit_files(installed):
        r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "" and r.stdout == "", f"{unit}:\n{r.stdout}{r.stderr}"


@needs_analyze
def test_engine_unit_exposure_is_at_most_4(installed, record_property):
    scores = {}
    for unit in (UNIT_DIR / ENGINE_UNIT, installed / "etc/systemd/system" / ENGINE_UNIT, UNIT_DIR / SUPERVISOR_UNIT):
        r = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
        assert m, r.stdout + r.stderr
        scores[str(unit.relative_to(unit.parents[1]))] = float(m.group(1))
    record_property("exposure", scores)
    print(f"systemd-analyze security exposure: {scores}")
    assert all(score <= MAX_EXPOSURE for unit, score in scores.items() if ENGINE_UNIT in unit), scores


def test_units_use_no_key_newer_than_systemd_252():
    for unit in UNITS:
        text = (UNIT_DIR / unit).read_text()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        for key in NEWER_THAN_252:
            assert not any(ln.startswith(key) for ln in lines), f"{unit}: {key} needs systemd > 252"


def test_engine_unit_has_the_required_settings():
    text = (UNIT_DIR / ENGINE_UNIT).read_text()
    get = lambda key, section="Service": get_key(text, section, key)  # noqa: E731
    assert get("Type") == "notify" and get("NotifyAccess") == "main"
    assert int(get("WatchdogSec")) > 0 and get("Restart") == "on-failure"
    assert get("StartLimitBurst", "Unit") and get("StartLimitIntervalSec", "Unit")
    assert get("KillSignal") == "SIGTERM"
    assert int(get("TimeoutStopSec")) > 60  # the server's default --drain-timeout
    assert get("EnvironmentFile") == "/etc/pagekeeper/engine.env"
    assert get("LimitMEMLOCK") == "infinity" and get("DevicePolicy") == "closed"
    allowed = re.findall(r"^DeviceAllow=(\S+)", text, re.M)
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "char-nvidia"} <= set(allowed)
    for key, value in (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("RestrictNamespaces", "yes"),
    ):
        assert get(key) == value, key
    assert get("ProtectHome") in ("yes", "tmpfs")
    assert get("StateDirectory") and get("CacheDirectory")
    keys = {ln.split("=", 1)[0] for ln in text.splitlines() if "=" in ln and not ln.startswith("#")}
    assert not keys & {"PrivateDevices", "MemoryDenyWriteExecute"}  # CUDA needs the devices and W+X memory
    assert get("Requires", "Unit") == SOCKET_UNIT


def test_environment_file_sets_the_cuda_allocator(installed):
    env = (installed / "etc/pagekeeper/engine.env").read_text()
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8\n" in env


def test_install_renders_the_interpreter_listen_address_and_stop_timeout(tmp_path):
    cfg_file = tmp_path / "my.toml"
    cfg_file.write_text(
        '[engine]\nhost = "0.0.0.0"\nport = 8123\ndrain_timeout = 300\n[supervisor]\ndrain_timeout = 100\n'
    )
    prefix = tmp_path / "root"
    r = opsctl("install", "--prefix", str(prefix), config=cfg_file)
    assert r.returncode == 0, r.stderr
    units = prefix / "etc/systemd/system"
    engine = (units / ENGINE_UNIT).read_text()
    assert (
        get_key(engine, "Service", "ExecStart")
        == f"{sys.executable} -m engine.server --config /etc/pagekeeper/pagekeeper.toml"
    )
    assert get_key(engine, "Service", "TimeoutStopSec") == "330"  # > the drain timeout
    assert get_key((units / SOCKET_UNIT).read_text(), "Socket", "ListenStream") == "0.0.0.0:8123"
    supervisor = (units / SUPERVISOR_UNIT).read_text()
    assert get_key(supervisor, "Service", "ExecStart").startswith(f"{sys.executable} -m opsctl.supervisor ")
    assert "--launcher systemd" in supervisor
    # the config given with --config is installed, and kept on a second install
    assert (prefix / "etc/pagekeeper/pagekeeper.toml").read_text() == cfg_file.read_text()
    r = opsctl("install", "--prefix", str(prefix))
    assert r.returncode == 0 and "keep" in r.stdout
    assert get_key((units / SOCKET_UNIT).read_text(), "Socket", "ListenStream") == "0.0.0.0:8123"
    assert stat.S_IMODE((units / ENGINE_UNIT).stat().st_mode) == 0o644
    assert stat.S_IMODE((prefix / "etc/pagekeeper/engine.env").stat().st_mode) == 0o600  # where keys go


def test_install_dry_run_writes_nothing_and_shows_the_units(tmp_path):
    r = opsctl("install", "--prefix", str(tmp_path / "root"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "root").exists()
    assert "would install" in r.stdout and "| Type=notify" in r.stdout and "| ListenStream=127.0.0.1:8000" in r.stdout


def test_uninstall_removes_what_install_wrote_and_keeps_an_edited_config(tmp_path):
    prefix = tmp_path / "root"
    assert opsctl("install", "--prefix", str(prefix)).returncode == 0
    assert (prefix / "etc/pagekeeper/pagekeeper.toml").read_text() == DEFAULT_CONFIG
    r = opsctl("uninstall", "--prefix", str(prefix), "--dry-run")
    assert r.returncode == 0 and (prefix / "etc/systemd/system" / ENGINE_UNIT).exists()
    r = opsctl("uninstall", "--prefix", str(prefix))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in prefix.rglob("*") if p.is_file()) == []  # the default config went too

    assert opsctl("install", "--prefix", str(prefix)).returncode == 0
    cfg = prefix / "etc/pagekeeper/pagekeeper.toml"
    cfg.write_text(cfg.read_text().replace("port = 8000", "port = 8001"))
    r = opsctl("uninstall", "--prefix", str(prefix))
    assert r.returncode == 0 and "keep" in r.stdout and cfg.exists()
    assert not (prefix / "etc/systemd/system" / ENGINE_UNIT).exists()
    assert opsctl("uninstall", "--prefix", str(prefix), "--purge").returncode == 0 and not cfg.exists()


def test_install_refuses_a_bad_config_with_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nmax_num_seqz = 3\n")
    r = opsctl("install", "--prefix", str(tmp_path / "root"), config=bad)
    assert r.returncode == 2 and "max_num_seqz" in r.stderr
    assert not (tmp_path / "root").exists()


def test_paths_under_home_directories_are_bound_read_only_into_the_units(tmp_path):
    cfg = load_config(None)
    cfg.engine["model"] = "/home/alice/models/llama"
    layout = Layout.detect(cfg, python="/home/alice/venv/bin/python")
    assert Path("/home/alice/models/llama") in layout.visible and Path("/home/alice/venv/bin/python") in layout.visible
    cfg.engine["model"] = "/tmp/ci/models/llama"  # PrivateTmp=yes hides /tmp and /var/tmp alike
    layout = Layout.detect(cfg, python="/var/tmp/venv/bin/python")
    assert Path("/tmp/ci/models/llama") in layout.visible and Path("/var/tmp/venv/bin/python") in layout.visible
    cfg.engine["model"] = "/home/alice/models/llama"
    layout = Layout(
        python="/home/alice/venv/bin/python",
        code_root=Path("/home/alice/src/pagekeeper"),
        visible=[Path("/home/alice/venv"), Path("/home/alice/src/pagekeeper")],
    )
    units = render_units(cfg, layout)
    engine = units[ENGINE_UNIT]
    assert re.findall(r"^BindReadOnlyPaths=(.*)$", engine, re.M) == ["/home/alice/venv", "/home/alice/src/pagekeeper"]
    assert "Environment=PYTHONPATH=/home/alice/src/pagekeeper" in engine
    assert get_key(engine, "Service", "ExecStart").startswith("/home/alice/venv/bin/python -m engine.server")


def test_systemd_launcher_restarts_the_service_never_the_socket(tmp_path, monkeypatch):
    log = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    launcher = SystemdLauncher(ENGINE_UNIT)
    launcher.restart()
    launcher.start()
    launcher.stop(5)
    # --no-drain: SIGINT to the engine (it answers in-flight requests 503 at once), then the restart
    launcher.restart(drain=False)
    assert log.read_text().splitlines() == [
        f"restart {ENGINE_UNIT}",
        f"start {ENGINE_UNIT}",
        f"stop {SOCKET_UNIT} {ENGINE_UNIT}",
        f"kill --kill-whom=main --signal=SIGINT {ENGINE_UNIT}",
        f"restart {ENGINE_UNIT}",
    ]


def _instance_config(tmp_path: Path, name: str, port: int) -> Path:
    cfg = tmp_path / f"{name}-src.toml"
    cfg.write_text(f'[engine]\nport = {port}\ndrain_timeout = 20\n[supervisor]\nlauncher = "systemd"\n')
    return cfg


def test_named_instances_install_template_units_and_their_own_drop_ins(tmp_path):
    prefix = tmp_path / "root"
    units = prefix / "etc/systemd/system"
    r = opsctl("--instance", "b", "install", "--prefix", str(prefix))
    assert r.returncode == 2 and "needs a config of its own" in r.stderr  # the default's ports are taken
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[engine]\nport = 8200\n[supervisor]\ninstance = "c"\n')
    r = opsctl("--instance", "b", "install", "--prefix", str(prefix), config=wrong)
    assert r.returncode == 2 and "instance = 'c'" in r.stderr, r.stderr
    for name, port in (("b", 8101), ("c", 8102)):
        r = opsctl(
            "--instance", name, "install", "--prefix", str(prefix), config=_instance_config(tmp_path, name, port)
        )
        assert r.returncode == 0, r.stderr
        assert (
            f"systemctl enable --now pagekeeper-engine@{name}.socket pagekeeper-supervisor@{name}.service" in r.stdout
        )
    assert sorted(p.name for p in units.iterdir()) == sorted(
        [
            *TEMPLATE_NAMES.values(),
            "pagekeeper-engine@b.service.d",
            "pagekeeper-engine@b.socket.d",
            "pagekeeper-supervisor@b.service.d",
            "pagekeeper-engine@c.service.d",
            "pagekeeper-engine@c.socket.d",
            "pagekeeper-supervisor@c.service.d",
        ]
    )
    engine = (units / "pagekeeper-engine@.service").read_text()
    assert get_key(engine, "Service", "ExecStart").endswith("-m engine.server --config /etc/pagekeeper/%i.toml")
    assert get_key(engine, "Service", "EnvironmentFile") == "/etc/pagekeeper/%i.env"
    assert get_key(engine, "Service", "StateDirectory") == "pagekeeper-%i"
    assert get_key(engine, "Unit", "Requires") == "pagekeeper-engine@%i.socket"
    supervisor = (units / "pagekeeper-supervisor@.service").read_text()
    assert "--runtime-dir /run/pagekeeper@%i --instance %i" in get_key(supervisor, "Service", "ExecStart")
    assert get_key(supervisor, "Service", "RuntimeDirectory") == "pagekeeper@%i"
    assert "ListenStream" not in "".join(
        ln for ln in (units / "pagekeeper-engine@.socket").read_text().splitlines() if not ln.startswith("#")
    )
    socket_dropin = (units / f"pagekeeper-engine@c.socket.d/{DROPIN_NAME}").read_text()
    assert socket_dropin.splitlines()[1:] == ["[Socket]", "ListenStream=", "ListenStream=127.0.0.1:8102"]
    assert "TimeoutStopSec=50" in (units / f"pagekeeper-engine@b.service.d/{DROPIN_NAME}").read_text()
    assert stat.S_IMODE((prefix / "etc/pagekeeper/b.env").stat().st_mode) == 0o600
    assert "port = 8101" in (prefix / "etc/pagekeeper/b.toml").read_text()

    # removing one instance keeps the templates the other still uses; the last one takes them along
    r = opsctl("--instance", "b", "uninstall", "--prefix", str(prefix), "--purge")
    assert r.returncode == 0, r.stderr
    assert (units / "pagekeeper-engine@.service").exists() and not (units / "pagekeeper-engine@b.service.d").exists()
    assert not (prefix / "etc/pagekeeper/b.toml").exists() and (prefix / "etc/pagekeeper/c.toml").exists()
    assert opsctl("--instance", "c", "uninstall", "--prefix", str(prefix), "--purge").returncode == 0
    assert sorted(str(p.relative_to(prefix)) for p in prefix.rglob("*") if p.is_file()) == []


@needs_analyze
def test_systemd_analyze_verify_is_silent_for_an_instance_of_each_template(tmp_path):
    """The templates with their drop-ins, instantiated as `NAME@b.*` (how systemd loads them), verify cleanly."""
    prefix = tmp_path / "root"
    r = opsctl("--instance", "b", "install", "--prefix", str(prefix), config=_instance_config(tmp_path, "b", 8101))
    assert r.returncode == 0, r.stderr
    units = prefix / "etc/systemd/system"
    check = tmp_path / "check"
    check.mkdir()
    for unit, template in TEMPLATE_NAMES.items():
        stem, kind = unit.rsplit(".", 1)
        instance = f"{stem}@b.{kind}"
        text = (units / template).read_text().replace("%i", "b")
        (check / instance).write_text(text + "\n" + (units / f"{instance}.d" / DROPIN_NAME).read_text())
    for path in sorted(check.iterdir()):
        r = subprocess.run(
            ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60, cwd=str(check)
        )
        assert r.returncode == 0 and r.stderr == "" and r.stdout == "", f"{path.name}:\n{r.stdout}{r.stderr}"
