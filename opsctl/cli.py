"""`opsctl`: start, stop, restart, drain and inspect a supervised pagekeeper engine.

`opsctl start` starts the supervisor daemon, which starts the engine; it returns once the engine
serves (or says why it never will).  Every other command talks to the running supervisor over its
control socket.  Mistakes the user can fix exit 2 with one line; a supervisor that is not running
is exit 3 (as `systemctl status` reports an inactive unit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import click

from engine.config import ConfigError
from opsctl import control
from opsctl.config import PagekeeperConfig, load_config
from opsctl.supervisor import SUPERVISOR_LOG_NAME

EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3


def _version() -> str:
    try:
        return version("pagekeeper")
    except PackageNotFoundError:
        return "0+unknown"


class Ctx:
    def __init__(self, config_path: str | None, runtime_dir: str | None) -> None:
        self.config_path = config_path
        self.runtime_dir = runtime_dir

    def config(self, **supervisor_overrides: Any) -> PagekeeperConfig:
        try:
            return load_config(self.config_path, {"supervisor": {"runtime_dir": self.runtime_dir,
                                                                 **supervisor_overrides}})
        except ConfigError as e:
            _fail(str(e), EXIT_USAGE)

    def runtime(self) -> Path:
        return self.config().supervisor.runtime_path()


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _send(ctx: Ctx, cmd: str, args: dict[str, Any] | None = None, timeout: float = 900.0) -> dict[str, Any]:
    try:
        reply = control.send(ctx.runtime(), cmd, args, timeout)
    except control.SupervisorNotRunning as e:
        _fail(f"the supervisor is not running ({e}); start it with `opsctl start`", EXIT_NOT_RUNNING)
    if not reply.get("ok"):
        _fail(reply.get("error", "the supervisor refused the command"))
    return reply


@click.group()
@click.version_option(_version(), prog_name="opsctl")
@click.option("--config", "config_path", envvar="PAGEKEEPER_CONFIG", default=None,
              help="TOML config file (default /etc/pagekeeper/pagekeeper.toml, else built-in defaults).")
@click.option("--runtime-dir", envvar="PAGEKEEPER_RUNTIME_DIR", default=None,
              help="Where the control socket, pid file and logs live.")
@click.pass_context
def main(click_ctx: click.Context, config_path: str | None, runtime_dir: str | None) -> None:
    """Operate the pagekeeper inference engine."""
    click_ctx.obj = Ctx(config_path, runtime_dir)


def _wait_until_serving(ctx: Ctx, proc: subprocess.Popen | None, timeout: float, what: str) -> dict[str, Any]:
    runtime = ctx.runtime()
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last_state = None
    while True:
        waited = time.monotonic() - start
        if proc is not None and proc.poll() is not None:
            log = (runtime / SUPERVISOR_LOG_NAME).read_text(errors="replace")[-2000:]
            _fail(f"the supervisor exited with {proc.returncode}:\n{log}", proc.returncode or 1)
        try:
            st = control.status(runtime)
        except (control.SupervisorNotRunning, OSError, ValueError):
            st = None
        state = st["engine"]["state"] if st else "starting supervisor"
        if state == "serving":
            if tty:
                click.echo("", err=True)
            return st  # type: ignore[return-value]
        if state == "gave_up":
            _fail(f"the engine keeps failing; the supervisor gave up after {st['restarts']['total']} restart(s).\n"
                  f"last exit: {st['crash_loop']['reason']}")
        if waited > timeout:
            _fail(f"the engine was not serving after {timeout:.0f} s (state: {state}); see `opsctl logs`")
        line = f"{what}: {state} ({waited:.1f} s)"
        if tty:
            click.echo("\r" + line.ljust(60), nl=False, err=True)
        elif state != last_state:
            click.echo(line, err=True)
        last_state = state
        time.sleep(0.25)


@main.command()
@click.option("--foreground", is_flag=True, help="Run the supervisor in this terminal (Ctrl-C stops everything).")
@click.option("--dry-run", is_flag=True, help="The supervisor decides and logs, but never acts.")
@click.option("--launcher", type=click.Choice(["auto", "process", "systemd"]), default=None)
@click.option("--timeout", type=float, default=None, help="Seconds to wait for the engine (default ready_timeout).")
@click.pass_obj
def start(ctx: Ctx, foreground: bool, dry_run: bool, launcher: str | None, timeout: float | None) -> None:
    """Start the supervisor, which starts the engine; return when it serves."""
    cfg = ctx.config(dry_run=True if dry_run else None, launcher=launcher)
    runtime = cfg.supervisor.runtime_path()
    if control.is_running(runtime):
        st = control.status(runtime)
        click.echo(f"already running: {st['engine']['state']} at {st['engine']['url']} (supervisor pid "
                   f"{st['supervisor']['pid']})")
        return
    runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
    args = [sys.executable, "-m", "opsctl.supervisor", "--runtime-dir", str(runtime)]
    if ctx.config_path:
        args += ["--config", ctx.config_path]
    if dry_run:
        args.append("--dry-run")
    if launcher:
        args += ["--launcher", launcher]
    if foreground:
        from opsctl.supervisor import main as supervisor_main

        sys.exit(supervisor_main(args[3:]))
    with open(runtime / SUPERVISOR_LOG_NAME, "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    st = _wait_until_serving(ctx, proc, timeout or cfg.supervisor.ready_timeout, "starting")
    click.echo(f"pagekeeper is serving {st['engine']['model']} at {st['engine']['url']}")
    click.echo(f"  supervisor pid {st['supervisor']['pid']}, metrics {st['supervisor']['metrics_url']}, "
               f"logs: opsctl logs")


@main.command()
@click.option("--no-drain", is_flag=True, help="Do not wait for in-flight requests.")
@click.option("--drain-timeout", type=float, default=None)
@click.pass_obj
def stop(ctx: Ctx, no_drain: bool, drain_timeout: float | None) -> None:
    """Drain and stop the engine, then the supervisor."""
    runtime = ctx.runtime()
    pid_file = runtime / "supervisor.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    args: dict[str, Any] = {"drain": not no_drain}
    if drain_timeout is not None:
        args["drain_timeout"] = drain_timeout
    _send(ctx, "stop", args)
    deadline = time.monotonic() + 30
    while pid and time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.1)
    click.echo("stopped")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@main.command()
@click.option("--no-drain", is_flag=True, help="Restart at once instead of letting in-flight requests finish.")
@click.option("--drain-timeout", type=float, default=None)
@click.pass_obj
def restart(ctx: Ctx, no_drain: bool, drain_timeout: float | None) -> None:
    """Drain (unless --no-drain), restart the engine, wait until it serves again."""
    args: dict[str, Any] = {"drain": not no_drain}
    if drain_timeout is not None:
        args["drain_timeout"] = drain_timeout
    _send(ctx, "restart", args)
    st = _wait_until_serving(ctx, None, ctx.config().supervisor.ready_timeout, "restarting")
    click.echo(f"restarted: serving at {st['engine']['url']}")


@main.command()
@click.option("--timeout", type=float, default=None, help="Seconds to wait for in-flight requests.")
@click.pass_obj
def drain(ctx: Ctx, timeout: float | None) -> None:
    """Stop admitting new requests and wait for in-flight ones (the engine stays up)."""
    reply = _send(ctx, "drain", {"timeout": timeout} if timeout is not None else {})
    result = reply["drain"]
    click.echo(json.dumps(result))
    if not result.get("drained"):
        sys.exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def status(ctx: Ctx, as_json: bool) -> None:
    """Engine state, KV usage, queues, GPU, last decision and its evidence, restarts."""
    try:
        st = control.status(ctx.runtime())
    except (control.SupervisorNotRunning, OSError) as e:
        if as_json:
            click.echo(json.dumps({"supervisor": None, "error": str(e)}))
        else:
            click.echo(f"supervisor: not running ({e})")
        sys.exit(EXIT_NOT_RUNNING)
    if as_json:
        click.echo(json.dumps(st, indent=2, default=str))
        return
    e, d, r, c, s = st["engine"], st["last_decision"], st["restarts"], st["crash_loop"], st["supervisor"]
    pct = f"{e['kv_cache_usage'] * 100:.1f}%" if e["kv_cache_usage"] is not None else "?"
    click.echo(f"engine      {e['state']}  pid {e['pid']}  up {e['uptime_s']}s  {e['url']}  model {e['model']}")
    click.echo(f"kv cache    {pct} used   running {e['running']}  waiting {e['waiting']}")
    if e.get("metrics_error"):
        click.echo(f"probe       {e['metrics_error']}")
    gpu = st["gpu"]
    if gpu["devices"]:
        for g in gpu["devices"]:
            click.echo(f"gpu {g['index']}       {g['name']}  {g['memory_used_bytes'] / 2**30:.1f} / "
                       f"{g['memory_total_bytes'] / 2**30:.1f} GiB  util {g['utilization_ratio']}  "
                       f"{g['temperature_celsius']} C  xid {g['xid_errors_total']}")
    else:
        click.echo(f"gpu         {gpu['detail']}")
    if d:
        click.echo(f"decision    {d['action']} ({d['reason']}) {json.dumps(d['evidence'])}")
    guard = f"GAVE UP: {c['reason']}" if c["gave_up"] else f"ok (max {c['max_restarts']} in {c['restart_window_s']:.0f}s)"
    click.echo(f"restarts    {r['total']}  crash loop: {guard}")
    if e.get("last_exit"):
        click.echo(f"last exit   {e['last_exit']}")
    click.echo(f"supervisor  pid {s['pid']}  launcher {s['launcher']}{'  DRY-RUN' if s['dry_run'] else ''}  "
               f"metrics {s['metrics_url']}")


@main.command()
@click.option("-f", "--follow", is_flag=True)
@click.option("--supervisor", "which", flag_value="supervisor", help="Show the supervisor's log instead.")
@click.option("-n", "--lines", type=int, default=50)
@click.pass_obj
def logs(ctx: Ctx, follow: bool, which: str | None, lines: int) -> None:
    """The engine's log (or the supervisor's)."""
    cfg = ctx.config()
    runtime = cfg.supervisor.runtime_path()
    if which != "supervisor" and cfg.supervisor.launcher == "systemd":
        os.execvp("journalctl", ["journalctl", "-u", cfg.supervisor.unit, "-n", str(lines)] + (["-f"] if follow else []))
    path = runtime / (SUPERVISOR_LOG_NAME if which == "supervisor" else "engine.log")
    if not path.exists():
        _fail(f"no log at {path} yet")
    with open(path, errors="replace") as f:
        for line in f.readlines()[-lines:]:
            click.echo(line, nl=False)
        while follow:
            line = f.readline()
            if line:
                click.echo(line, nl=False)
            else:
                time.sleep(0.2)


@main.command()
@click.pass_obj
def doctor(ctx: Ctx) -> None:
    """Check the environment and show the memory plan for the configured model, without starting it."""
    from opsctl.doctor import run_checks

    ok = run_checks(ctx.config(), click.echo)
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--prefix", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Root every path under this directory (packaging, tests); file contents name the final paths.")
@click.option("--dry-run", is_flag=True, help="Show what would be written (and the rendered units); write nothing.")
@click.option("--python", "python", default=None, help="Interpreter for ExecStart= (default: the one running opsctl).")
@click.pass_obj
def install(ctx: Ctx, prefix: str, dry_run: bool, python: str | None) -> None:
    """Install the systemd units, /etc/pagekeeper/pagekeeper.toml (if absent) and the engine's environment file.

    The config file comes from --config when given (and none is installed yet), else a commented default.
    """
    from opsctl.install import InstallError, install as do_install

    try:
        do_install(prefix, dry_run=dry_run, config_source=ctx.config_path, python=python, echo=click.echo)
    except InstallError as e:
        _fail(str(e), EXIT_USAGE)


@main.command()
@click.option("--prefix", default="/", show_default=True, type=click.Path(file_okay=False))
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option("--purge", is_flag=True, help="Remove the config file even if it was edited.")
@click.pass_obj
def uninstall(ctx: Ctx, prefix: str, dry_run: bool, purge: bool) -> None:
    """Stop and disable the units (on this machine's systemd), then remove what `opsctl install` wrote."""
    from opsctl.install import InstallError, uninstall as do_uninstall

    try:
        do_uninstall(prefix, dry_run=dry_run, purge=purge, echo=click.echo)
    except InstallError as e:
        _fail(str(e), EXIT_USAGE)


@main.group()
def config() -> None:
    """The effective configuration."""


@config.command("show")
@click.pass_obj
def config_show(ctx: Ctx) -> None:
    """Print the effective configuration as TOML (file values over built-in defaults)."""
    import tomli_w

    cfg = ctx.config()
    data = cfg.as_dict()
    data["supervisor"] = {k: v for k, v in data["supervisor"].items() if v is not None}
    click.echo(f"# source: {cfg.source}")
    click.echo(tomli_w.dumps(data))


if __name__ == "__main__":
    main()
