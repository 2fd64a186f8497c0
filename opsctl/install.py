"""`opsctl install` / `opsctl uninstall`: the systemd units, the config file and the engine's environment file.

The units in `systemd/` are complete, valid units written for a system-wide install
(`/usr/bin/python3`, 127.0.0.1:8000).  Installing renders them for this machine:

- `ExecStart=` runs *this* interpreter (`sys.executable`, or `--python`), so a pip install into a venv,
  pyenv or conda works without editing anything; a source checkout is put on `PYTHONPATH`;
- `ListenStream=` of the socket is `[engine] host:port` of the config file;
- `TimeoutStopSec=` is longer than the drain timeout (`[engine] drain_timeout`, `[supervisor] drain_timeout`);
- `ProtectHome=tmpfs` hides /root and /home from the services: an interpreter, checkout or model that
  lives there is made visible again, read-only, with `BindReadOnlyPaths=`.

`--prefix DIR` roots every path (like DESTDIR: the files' contents still name the final paths), for
packaging and tests.  With the real root and a running systemd, `systemctl daemon-reload` follows.

A named instance (`opsctl --instance NAME install`) gets systemd template units rendered from the same
files (`pagekeeper-engine@.service`, `pagekeeper-engine@.socket`, `pagekeeper-supervisor@.service`:
config `/etc/pagekeeper/%i.toml`, environment `/etc/pagekeeper/%i.env`, runtime dir
`/run/pagekeeper@%i`, state and cache dirs of its own) and, for what differs between instances (the
listen address, stop timeouts, read-only binds), drop-ins `pagekeeper-*@NAME.*.d/50-instance.conf`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.config import ConfigError
from opsctl.config import PagekeeperConfig, load_config
from opsctl.instances import DEFAULT_INSTANCE, config_path_for

ENGINE_UNIT = "pagekeeper-engine.service"
SOCKET_UNIT = "pagekeeper-engine.socket"
SUPERVISOR_UNIT = "pagekeeper-supervisor.service"
UNITS = (ENGINE_UNIT, SOCKET_UNIT, SUPERVISOR_UNIT)

UNIT_DIR = Path("/etc/systemd/system")
CONFIG_FILE = Path("/etc/pagekeeper/pagekeeper.toml")
ENV_FILE = Path("/etc/pagekeeper/engine.env")
TEMPLATE_PYTHON = "/usr/bin/python3"  # the interpreter the units in systemd/ name
# ProtectHome=tmpfs hides the first three, PrivateTmp=yes the last two (a checkout cloned into /tmp).
HIDDEN_FROM_SERVICES = (Path("/home"), Path("/root"), Path("/run/user"), Path("/tmp"), Path("/var/tmp"))

DEFAULT_CONFIG = """\
# pagekeeper: [engine] holds the flags of `python -m engine.server` (dashes as underscores),
# [supervisor] the thresholds of the supervisor (see README.md, "opsctl and the supervisor").
#
# host, port and drain_timeout are also written into the systemd units: after changing them run
# `opsctl install` again (it keeps this file) and `systemctl restart pagekeeper-engine.socket`.
# The engine runs as a transient user (DynamicUser=): a model directory must be world-readable.

[engine]
host = "127.0.0.1"
port = 8000
# model = "/srv/models/Qwen2-7B-Instruct"   # default: the embedded model
# max_model_len = 8192
drain_timeout = 60.0

[supervisor]
launcher = "systemd"   # start/stop/restart the engine unit with systemctl; `opsctl logs` reads the journal
poll_interval = 10
hang_seconds = 60
"""

ENV_CONTENT = """\
# Environment of the engine and its supervisor (EnvironmentFile=); one VAR=value per line.
# Mode 0600: this is where keys go, never on a command line (`ps` shows those to every local user):
#   PAGEKEEPER_API_KEY=...     clients must send it (Authorization: Bearer)
#   PAGEKEEPER_ADMIN_KEY=...   /drain and the other admin endpoints need it
# expandable_segments: the CUDA caching allocator grows segments in place instead of fragmenting;
# garbage_collection_threshold: it returns cached blocks before an allocation would fail.
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8
"""


class InstallError(Exception):
    """Something the user can fix (exit 2)."""


def units_source() -> Path:
    """The directory with the unit templates: the checkout's systemd/, or share/pagekeeper/systemd of a wheel."""
    for candidate in (Path(__file__).resolve().parents[1] / "systemd", Path(sys.prefix) / "share/pagekeeper/systemd"):
        if all((candidate / unit).is_file() for unit in UNITS):
            return candidate
    raise InstallError(
        "the systemd unit files are not installed with this copy of pagekeeper "
        f"(looked in the source tree and in {Path(sys.prefix) / 'share/pagekeeper/systemd'})"
    )


# -- instances -------------------------------------------------------------------------------------

TEMPLATE_NAMES = {
    ENGINE_UNIT: "pagekeeper-engine@.service",
    SOCKET_UNIT: "pagekeeper-engine@.socket",
    SUPERVISOR_UNIT: "pagekeeper-supervisor@.service",
}
DROPIN_NAME = "50-instance.conf"

# What a unit of the default instance names, and what its template names instead (non-comment lines only).
_TEMPLATE_SUBSTITUTIONS = (
    ("pagekeeper-engine.socket", "pagekeeper-engine@%i.socket"),
    ("pagekeeper-engine.service", "pagekeeper-engine@%i.service"),
    ("/etc/pagekeeper/pagekeeper.toml", "/etc/pagekeeper/%i.toml"),
    ("/etc/pagekeeper/engine.env", "/etc/pagekeeper/%i.env"),
    ("--runtime-dir /run/pagekeeper", "--runtime-dir /run/pagekeeper@%i --instance %i"),
    ("/var/lib/pagekeeper", "/var/lib/pagekeeper-%i"),
    ("/var/cache/pagekeeper", "/var/cache/pagekeeper-%i"),
)
# Siblings, not subdirectories: with DynamicUser= the default instance's /var/lib/pagekeeper is a link
# into /var/lib/private owned by its own transient user, and nothing can be created under it.
_TEMPLATE_KEYS = {
    "RuntimeDirectory": "pagekeeper@%i",
    "StateDirectory": "pagekeeper-%i",
    "CacheDirectory": "pagekeeper-%i",
}


def instance_unit(unit: str, instance: str) -> str:
    """`pagekeeper-engine.service` of the default instance, `pagekeeper-engine@NAME.service` of another."""
    if instance == DEFAULT_INSTANCE:
        return unit
    stem, kind = unit.rsplit(".", 1)
    return f"{stem}@{instance}.{kind}"


def env_path_for(instance: str) -> Path:
    return ENV_FILE if instance == DEFAULT_INSTANCE else ENV_FILE.with_name(f"{instance}.env")


def as_template(text: str) -> str:
    """A default-instance unit as a template unit (%i = the instance name)."""
    out = [
        "# Template for named instances (pagekeeper-*@NAME), rendered by `opsctl --instance NAME install` from",
        "# the default instance's unit; what differs between instances is in pagekeeper-*@NAME.*.d/" + DROPIN_NAME,
    ]
    for line in text.splitlines():
        if line.startswith("#") or "=" not in line:
            out.append(line)
            continue
        key, value = line.split("=", 1)
        if key == "ListenStream":
            continue  # each instance's address comes from its drop-in
        for old, new in _TEMPLATE_SUBSTITUTIONS:
            value = value.replace(old, new)
        if key in _TEMPLATE_KEYS:
            value = _TEMPLATE_KEYS[key]
        elif key == "SyslogIdentifier":
            value += "@%i"
        elif key == "Description":
            value += " (instance %i)"
        out.append(f"{key}={value}")
    return "\n".join(out) + "\n"


# -- editing unit files ------------------------------------------------------------------------------


def _section_bounds(lines: list[str], section: str) -> tuple[int, int]:
    start = next((i for i, line in enumerate(lines) if line.strip() == f"[{section}]"), None)
    if start is None:
        raise ValueError(f"no [{section}] section")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    return start, end


def set_key(text: str, section: str, key: str, value: str) -> str:
    """Replace the value of the first `key=` line in `[section]`."""
    lines = text.splitlines()
    start, end = _section_bounds(lines, section)
    for i in range(start + 1, end):
        if lines[i].split("=", 1)[0].strip() == key:
            lines[i] = f"{key}={value}"
            return "\n".join(lines) + "\n"
    raise ValueError(f"no {key}= in [{section}]")


def add_lines(text: str, section: str, after_key: str, new: list[str]) -> str:
    """Insert `new` lines after the last `after_key=` line of `[section]`."""
    if not new:
        return text
    lines = text.splitlines()
    start, end = _section_bounds(lines, section)
    at = max((i for i in range(start + 1, end) if lines[i].split("=", 1)[0].strip() == after_key), default=None)
    if at is None:
        raise ValueError(f"no {after_key}= in [{section}]")
    lines[at + 1 : at + 1] = new
    return "\n".join(lines) + "\n"


def get_key(text: str, section: str, key: str) -> str:
    lines = text.splitlines()
    start, end = _section_bounds(lines, section)
    for i in range(start + 1, end):
        name, _, value = lines[i].partition("=")
        if name.strip() == key:
            return value.strip()
    raise ValueError(f"no {key}= in [{section}]")


def _exec_word(path: str) -> str:
    """A path as one word of an Exec*= line (systemd's quoting)."""
    if re.fullmatch(r"[A-Za-z0-9_./+:@%-]+", path) and "%" not in path:
        return path
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def _listen_address(host: str, port: int) -> str:
    if host in ("", "::") or ":" in host:
        return f"[{host or '::'}]:{port}"
    return f"{host}:{port}"


# -- what to install ---------------------------------------------------------------------------------


@dataclass
class Layout:
    """Where this copy of pagekeeper runs from, as the units must see it."""

    python: str
    code_root: Path | None  # a source checkout to put on PYTHONPATH (None: a regular install)
    visible: list[Path]  # paths under /root, /home, /run/user, /tmp or /var/tmp the services must still read

    @classmethod
    def detect(cls, cfg: PagekeeperConfig, python: str | None = None) -> Layout:
        python = python or sys.executable
        if not os.path.isabs(python):
            raise InstallError(f"--python must be an absolute path, got {python!r}")
        import engine

        code_root = Path(engine.__file__).resolve().parents[1]
        site_dirs = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
        in_site = any(code_root == d or d in code_root.parents for d in site_dirs)
        needed = [Path(python), Path(sys.prefix), Path(sys.base_prefix), Path(python).resolve()]
        if not in_site:
            needed.append(code_root)
        model = cfg.engine.get("model")
        if model and os.path.isabs(str(model)):
            needed.append(Path(str(model)))
        hidden = sorted(
            {
                Path(os.path.abspath(p))
                for p in needed
                if any(h in Path(os.path.abspath(p)).parents for h in HIDDEN_FROM_SERVICES)
            }
        )
        visible = [p for p in hidden if not any(q in p.parents for q in hidden)]  # outermost paths only
        return cls(python=python, code_root=None if in_site else code_root, visible=visible)


def _stop_timeouts(cfg: PagekeeperConfig) -> dict[str, int]:
    engine_drain = float(cfg.engine.get("drain_timeout", 60.0))
    return {ENGINE_UNIT: int(engine_drain) + 30, SUPERVISOR_UNIT: int(cfg.supervisor.drain_timeout + engine_drain) + 30}


def render_units(
    cfg: PagekeeperConfig, layout: Layout, source: Path | None = None, instance: str = DEFAULT_INSTANCE
) -> dict[str, str]:
    """The unit files (paths relative to the unit dir), rendered for this machine and configuration.

    The default instance: the three units with every value in them.  A named one: the three template
    units (the same for every instance of this installation) and its drop-ins.
    """
    source = source or units_source()
    texts = {name: (source / name).read_text() for name in UNITS}
    named = instance != DEFAULT_INSTANCE
    stop_timeouts = _stop_timeouts(cfg)
    env_lines = [f"Environment=PYTHONPATH={_exec_word(str(layout.code_root))}"] if layout.code_root else []
    bind_lines = [f"BindReadOnlyPaths={_exec_word(str(p))}" for p in layout.visible]
    for name in (ENGINE_UNIT, SUPERVISOR_UNIT):
        text = texts[name]
        exec_start = get_key(text, "Service", "ExecStart")
        if not exec_start.startswith(TEMPLATE_PYTHON + " "):
            raise InstallError(f"{source / name}: ExecStart= does not start with {TEMPLATE_PYTHON}")
        text = set_key(text, "Service", "ExecStart", _exec_word(layout.python) + exec_start[len(TEMPLATE_PYTHON) :])
        text = add_lines(text, "Service", "Environment", env_lines)
        if not named:
            text = set_key(text, "Service", "TimeoutStopSec", str(stop_timeouts[name]))
            text = add_lines(text, "Service", "ProtectHome", bind_lines)
        texts[name] = text
    listen = _listen_address(cfg.host, cfg.port)
    if not named:
        texts[SOCKET_UNIT] = set_key(texts[SOCKET_UNIT], "Socket", "ListenStream", listen)
        return texts
    rendered = {TEMPLATE_NAMES[name]: as_template(text) for name, text in texts.items()}
    dropins = {
        ENGINE_UNIT: ["[Service]", f"TimeoutStopSec={stop_timeouts[ENGINE_UNIT]}", *bind_lines],
        SOCKET_UNIT: ["[Socket]", "ListenStream=", f"ListenStream={listen}"],
        SUPERVISOR_UNIT: ["[Service]", f"TimeoutStopSec={stop_timeouts[SUPERVISOR_UNIT]}", *bind_lines],
    }
    for unit, lines in dropins.items():
        header = f"# instance {instance!r} of {TEMPLATE_NAMES[unit]}: written by `opsctl --instance {instance} install`"
        rendered[f"{instance_unit(unit, instance)}.d/{DROPIN_NAME}"] = "\n".join([header, *lines]) + "\n"
    return rendered


@dataclass
class FileAction:
    path: Path  # the final path (without the prefix)
    content: str
    overwrite: bool  # False: keep a file that exists (the admin's config)
    mode: int = 0o644  # the environment file may hold keys (PAGEKEEPER_API_KEY): 0600, read by PID 1


def _rooted(prefix: Path, path: Path) -> Path:
    return prefix / path.relative_to("/")


def _systemd_running(prefix: Path) -> bool:
    return (
        prefix.resolve() == Path("/") and Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None
    )


def install(
    prefix: str | os.PathLike[str] = "/",
    dry_run: bool = False,
    config_source: str | None = None,
    python: str | None = None,
    echo: Callable[[str], None] = print,
    instance: str | None = None,
) -> list[FileAction]:
    """Write the units, the config file (if absent) and the environment file under `prefix`."""
    root = Path(prefix)
    instance = instance or DEFAULT_INSTANCE
    config_file = config_path_for(instance)
    config_path = _rooted(root, config_file)
    if config_path.exists():
        config_text, config_from = config_path.read_text(), f"{config_file} (kept)"
    elif config_source:
        config_text, config_from = Path(config_source).read_text(), f"--config {config_source}"
    elif instance == DEFAULT_INSTANCE:
        config_text, config_from = DEFAULT_CONFIG, "the default configuration"
    else:  # the default one's ports are the default instance's
        raise InstallError(
            f"instance {instance!r} needs a config of its own (ports that no other instance uses): "
            f"`opsctl --instance {instance} --config FILE install`"
        )
    cfg = _parse_config(config_text, config_from)
    if cfg.supervisor.instance not in (DEFAULT_INSTANCE, instance):
        raise InstallError(
            f"{config_from} says [supervisor] instance = {cfg.supervisor.instance!r} but this is "
            f"instance {instance!r}; remove the key or use `opsctl --instance "
            f"{cfg.supervisor.instance} install`"
        )
    layout = Layout.detect(cfg, python)
    units = render_units(cfg, layout, instance=instance)
    env_file = env_path_for(instance)
    actions = [FileAction(UNIT_DIR / name, text, True) for name, text in units.items()]
    actions += [FileAction(config_file, config_text, False), FileAction(env_file, ENV_CONTENT, False, mode=0o600)]

    what = "engine" if instance == DEFAULT_INSTANCE else f"instance {instance!r}: engine"
    echo(
        f"{'would install' if dry_run else 'installing'} into {root}: {what} on {cfg.engine_url} "
        f"(config: {config_from}), python {layout.python}"
        + (f", PYTHONPATH {layout.code_root}" if layout.code_root else "")
        + (f", read-only binds {', '.join(map(str, layout.visible))}" if layout.visible else "")
    )
    for action in actions:
        target = _rooted(root, action.path)
        if target.exists() and not action.overwrite:
            echo(f"  keep   {target}")
            continue
        verb = "replace" if target.exists() else "write"
        echo(f"  {verb:<6} {target}")
        if dry_run:
            if UNIT_DIR in action.path.parents:
                echo("".join(f"    | {line}\n" for line in action.content.splitlines()).rstrip("\n"))
            continue
        _write(target, action.content, action.mode)
    if dry_run:
        return actions
    enable = " ".join(instance_unit(u, instance) for u in (SOCKET_UNIT, SUPERVISOR_UNIT))
    if _systemd_running(root):
        _systemctl(echo, "daemon-reload")
        echo(f"enable and start: systemctl enable --now {enable}")
    else:
        echo(
            f"units written to {_rooted(root, UNIT_DIR)}; after copying them into place: systemctl daemon-reload && "
            f"systemctl enable --now {enable}"
        )
    return actions


def uninstall(
    prefix: str | os.PathLike[str] = "/",
    dry_run: bool = False,
    purge: bool = False,
    echo: Callable[[str], None] = print,
    instance: str | None = None,
) -> list[Path]:
    """Stop and disable the units (real root only), then remove what `install` wrote.

    The config file is removed only when it is still the default one, or with `purge`.  A named
    instance's template units go with the last instance that uses them.
    """
    root = Path(prefix)
    instance = instance or DEFAULT_INSTANCE
    removed: list[Path] = []
    units = [instance_unit(u, instance) for u in (SUPERVISOR_UNIT, SOCKET_UNIT, ENGINE_UNIT)]
    if _systemd_running(root):
        if dry_run:
            echo(f"  would run systemctl disable --now {' '.join(units)}")
        else:
            _systemctl(echo, "disable", "--now", *units, check=False)
    config_file = config_path_for(instance)
    if instance == DEFAULT_INSTANCE:
        files = [UNIT_DIR / name for name in UNITS]
    else:
        files = [UNIT_DIR / f"{u}.d" / DROPIN_NAME for u in units]
        others = [
            d
            for d in _rooted(root, UNIT_DIR).glob("pagekeeper-engine@*.service.d")
            if d.name != f"{instance_unit(ENGINE_UNIT, instance)}.d"
        ]
        if not others:
            files += [UNIT_DIR / name for name in TEMPLATE_NAMES.values()]
    for path in files + [env_path_for(instance), config_file]:
        target = _rooted(root, path)
        if not target.exists():
            continue
        if path == config_file and not purge and target.read_text() != DEFAULT_CONFIG:
            echo(f"  keep   {target} (edited; --purge removes it)")
            continue
        echo(f"  {'would remove' if dry_run else 'remove'} {target}")
        if not dry_run:
            target.unlink()
            if target.name == DROPIN_NAME and not any(target.parent.iterdir()):
                target.parent.rmdir()
        removed.append(target)
    config_dir = _rooted(root, CONFIG_FILE.parent)
    if not dry_run and config_dir.is_dir() and not any(config_dir.iterdir()):
        config_dir.rmdir()
    if not dry_run and _systemd_running(root):
        _systemctl(echo, "daemon-reload")
    return removed


def _parse_config(text: str, source: str) -> PagekeeperConfig:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        try:
            cfg = load_config(f.name)
        except ConfigError as e:
            raise InstallError(str(e).replace(f.name, source)) from e
    cfg.source = source
    return cfg


def _write(target: Path, content: str, mode: int = 0o644) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(content)
        tmp.chmod(mode)
        os.replace(tmp, target)
    except PermissionError as e:
        raise InstallError(f"cannot write {target}: {e.strerror} (run as root, or use --prefix)") from e


def _systemctl(echo: Callable[[str], None], *args: str, check: bool = True) -> None:
    echo(f"  systemctl {' '.join(args)}")
    r = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and check:
        raise InstallError(f"systemctl {' '.join(args)} failed: {r.stderr.strip()}")
