"""`opsctl`: start, stop, restart, drain and inspect a supervised pagekeeper engine.

`opsctl start` starts the supervisor daemon, which starts the engine (or adopts the one a dead
supervisor left serving); it returns once the engine serves, or says in one line why it does not.
Every other command talks to the running supervisor over its control socket.

Exit codes, for automation (`opsctl status` is 0 only when the engine serves, like `systemctl is-active`;
opsctl/state.py maps each engine state to its code):

| code | status                                       | start                                   |
|------|----------------------------------------------|-----------------------------------------|
| 0    | serving (also while its KV pool is recycled) | serving (started, adopted or already)   |
| 1    | the supervisor did not answer properly       | the engine did not come up in time      |
| 2    | usage or config error                        | usage/config error, or the engine exited|
|      |                                              | with 2 (a mistake it names; not retried)|
| 3    | not running                                  |                                         |
| 4    | starting, restarting or stopping             |                                         |
| 5    | draining (admits nothing until `resume`)     | running but drained                     |
| 6    | gave up (crash loop) or failed permanently   | the supervisor gave up                  |
| 7    | an engine serves without a supervisor        |                                         |
| 8    | unhealthy: exited, stalled or unresponsive,  |                                         |
|      | about to be restarted                        |                                         |
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import click

from engine.config import ConfigError
from opsctl import control
from opsctl.config import PagekeeperConfig, load_config
from opsctl.constants import COMMAND_TIMEOUT_S, ENGINE_LOG_NAME, EXIT_ALREADY_RUNNING, PID_NAME, SUPERVISOR_LOG_NAME
from opsctl.instances import INSTANCE_PATTERN, instance_record, pid_alive, port_clash, running_instances
from opsctl.launcher import recorded_engine, stop_unsupervised
from opsctl.runtime import open_private, prepare_runtime_dir, read_last_failure
from opsctl.state import EXIT_DRAINING, EXIT_ERROR, EXIT_GAVE_UP, EXIT_NOT_RUNNING, EXIT_USAGE, EngineState
from opsctl.status import Status, no_gpu_line


def _version() -> str:
    try:
        return version("pagekeeper")
    except PackageNotFoundError:
        return "0+unknown"


class Ctx:
    def __init__(self, config_path: str | None, runtime_dir: str | None, instance: str | None = None) -> None:
        self.config_path = config_path
        self.runtime_dir = runtime_dir
        self.instance = instance
        self._config: PagekeeperConfig | None = None

    def config(self, engine: dict[str, Any] | None = None, **supervisor_overrides: Any) -> PagekeeperConfig:
        """The config file with overrides: `[supervisor]` keys by name, `[engine]` keys in `engine`."""
        if self._config is not None and not supervisor_overrides and not engine:
            return self._config
        try:
            cfg = load_config(
                self.config_path,
                {
                    "supervisor": {"runtime_dir": self.runtime_dir, "instance": self.instance, **supervisor_overrides},
                    "engine": dict(engine or {}),
                },
            )
        except ConfigError as e:
            _fail(str(e), EXIT_USAGE)
        if not supervisor_overrides and not engine:
            self._config = cfg
        return cfg

    def runtime(self) -> Path:
        return self.config().supervisor.runtime_path()


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _send(ctx: Ctx, cmd: str, args: dict[str, Any] | None = None, timeout: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
    try:
        reply = control.send(ctx.runtime(), cmd, args, timeout)
    except control.SupervisorNotRunning as e:
        _fail(f"the supervisor is not running ({e}); start it with `opsctl start`", EXIT_NOT_RUNNING)
    if not reply.get("ok"):
        _fail(one_line(reply.get("error")) or "the supervisor refused the command")
    return reply


_INSTANCE = click.option(
    "--instance",
    "sub_instance",
    default=None,
    callback=lambda c, p, v: _check_instance(v),
    help="Instance name (as before the subcommand).",
)


_JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output: one JSON document.")


def _say(as_json: bool, sentence: str, document: dict[str, Any]) -> None:
    """One output style: a sentence for people, or with --json the same facts as one JSON document."""
    click.echo(json.dumps(document) if as_json else sentence)


def _check_instance(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(INSTANCE_PATTERN, value):
        raise click.BadParameter(f"{value!r}: use 1 to 32 of a-z, 0-9, '-' and '_', starting with a letter or digit")
    return value


def _location_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--config`/`--runtime-dir`/`--instance` after the subcommand too (`opsctl start --config F`)."""

    @click.option("--config", "sub_config", default=None, help="TOML config file (as before the subcommand).")
    @click.option("--runtime-dir", "sub_runtime", default=None, help="Runtime dir (as before the subcommand).")
    @_INSTANCE
    @functools.wraps(f)
    def wrapper(
        *args: Any, sub_config: str | None, sub_runtime: str | None, sub_instance: str | None, **kwargs: Any
    ) -> Any:
        ctx: Ctx = click.get_current_context().obj
        if sub_config:
            ctx.config_path, ctx._config = sub_config, None
        if sub_runtime:
            ctx.runtime_dir, ctx._config = sub_runtime, None
        if sub_instance:
            ctx.instance, ctx._config = sub_instance, None
        return f(*args, **kwargs)

    return wrapper


@click.group()
@click.version_option(_version(), prog_name="opsctl")
@click.option(
    "--config",
    "config_path",
    envvar="PAGEKEEPER_CONFIG",
    default=None,
    help="TOML config file (default /etc/pagekeeper/pagekeeper.toml, else built-in defaults).",
)
@click.option(
    "--runtime-dir",
    envvar="PAGEKEEPER_RUNTIME_DIR",
    default=None,
    help="Where the control socket, pid file and logs live (default: from the instance name).",
)
@click.option(
    "--instance",
    envvar="PAGEKEEPER_INSTANCE",
    default=None,
    callback=lambda c, p, v: _check_instance(v),
    help="Run several deployments on one host: the name scopes the runtime dir, the systemd units "
    "(pagekeeper-engine@NAME) and the default config file (/etc/pagekeeper/NAME.toml).",
)
@click.pass_context
def main(click_ctx: click.Context, config_path: str | None, runtime_dir: str | None, instance: str | None) -> None:
    """Operate the pagekeeper inference engine.

    \b
    Exit codes: 0 serving / done; 1 error; 2 usage or config error (also an
    engine that exited 2: a mistake it names, never retried); 3 not running;
    4 starting, restarting or stopping; 5 draining; 6 gave up or failed;
    7 an engine serves without a supervisor; 8 unhealthy (exited, stalled).
    """
    from engine.logs import configure_logging

    configure_logging()  # what a library logs (NVML's probe, say) goes to stderr: stdout is the command's answer
    click_ctx.obj = Ctx(config_path, runtime_dir, instance)


def _status_or_none(runtime: Path) -> Status | None:
    try:
        return control.read_status(runtime)
    except (control.SupervisorNotRunning, OSError, ValueError):
        return None


def _wait_until_serving(ctx: Ctx, proc: subprocess.Popen | None, timeout: float, what: str) -> Status:
    """Follow the supervisor until the engine serves; every other outcome is one line and its exit code."""
    runtime = ctx.runtime()
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last_state = None
    answered = False  # the supervisor has answered once: a silence after that is it going away, not starting
    while True:
        waited = time.monotonic() - start
        if proc is not None and proc.poll() is not None:
            _supervisor_exited(ctx, proc.returncode, timeout - waited)
            proc = None  # another supervisor won the race for this runtime dir: follow that one
        st = _status_or_none(runtime)
        answered = answered or st is not None
        state = st.engine.state if st else ("supervisor exiting" if answered else "starting supervisor")
        if st is not None and state == EngineState.SERVING:
            if tty:
                click.echo("", err=True)
            return st
        if st is not None and st.engine.state.gave_up:
            reason = one_line(st.crash_loop.reason)
            if state == EngineState.FAILED:
                # an engine that exited 2 named a mistake (the table above: start exits 2) in its own line, told as
                # is, whether this sees the failed state or the supervisor's own exit with 2 first
                _fail(f"{reason}; fix it, then `opsctl restart`", EXIT_USAGE)
            gave_up = f"the supervisor gave up after {st.restarts.total} restart(s)"
            _fail(f"the engine keeps failing; {gave_up}: {reason}; fix it, then `opsctl restart`", EXIT_GAVE_UP)
        if st is None and proc is None and waited > 5:
            _fail("the supervisor is gone; see `opsctl logs --supervisor`", EXIT_ERROR)
        if waited > timeout:
            _fail(f"the engine was not serving after {timeout:.0f} s (state: {state}); see `opsctl logs`")
        line = f"{what}: {state} ({waited:.1f} s)"
        if tty:
            click.echo("\r" + line.ljust(60), nl=False, err=True)
        elif state != last_state:
            click.echo(line, err=True)
        last_state = state
        time.sleep(0.05)  # returns within 50 ms of the engine serving (the supervisor follows a start as closely)


def _supervisor_exited(ctx: Ctx, code: int, time_left: float) -> None:
    runtime = ctx.runtime()
    if code == EXIT_ALREADY_RUNNING:
        return  # a concurrent `opsctl start` started one first; the caller follows it
    failure = read_last_failure(runtime)
    if failure is not None:
        _fail(one_line(failure["reason"]), EXIT_USAGE if code == EXIT_USAGE else code or EXIT_ERROR)
    log = (runtime / SUPERVISOR_LOG_NAME).read_text(errors="replace").strip().splitlines()
    detail = next((ln for ln in reversed(log) if ln.startswith("error:")), log[-1] if log else "no log")
    _fail(f"the supervisor exited with {code}: {one_line(detail)}", code or EXIT_ERROR)


def one_line(text: str | None) -> str:
    """A multi-line reason (a log tail) as the single line a person reads first."""
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    if not lines:
        return ""
    head = lines[0]
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors and errors[-1] not in head:
        head = f"{head.rstrip(':')}: {errors[-1]}"
    return head if len(head) <= 400 else head[:397] + "..."


@main.command()
@_location_options
@click.option("--foreground", is_flag=True, help="Run the supervisor in this terminal (Ctrl-C stops everything).")
@click.option("--dry-run", is_flag=True, help="The supervisor decides and logs, but never acts.")
@click.option("--launcher", type=click.Choice(["auto", "process", "systemd"]), default=None)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds to wait for the engine (default ready_timeout).",
)
@click.option(
    "--model",
    default=None,
    help="Checkpoint directory or Hugging Face Hub id (org/name) to serve, over the config's [engine] model.",
)
@click.option("--port", type=int, default=None, help="Port to serve on, over the config's [engine] port.")
@click.option("--host", default=None, help="Address to serve on, over the config's [engine] host.")
@_JSON
@click.pass_obj
def start(
    ctx: Ctx,
    foreground: bool,
    dry_run: bool,
    launcher: str | None,
    timeout: float | None,
    model: str | None,
    port: int | None,
    host: str | None,
    as_json: bool,
) -> None:
    """Start the supervisor, which starts (or adopts) the engine; return when it serves."""
    engine = {k: v for k, v in (("model", model), ("port", port), ("host", host)) if v is not None}
    cfg = ctx.config(engine, dry_run=True if dry_run else None, launcher=launcher)
    runtime = cfg.supervisor.runtime_path()
    st = _status_or_none(runtime)
    if st is not None:
        state = st.engine.state
        where = f"{st.engine.url} (supervisor pid {st.supervisor.pid})"
        if engine:
            given = " ".join(f"--{k} {v}" for k, v in engine.items())
            _fail(
                f"instance {cfg.supervisor.instance!r} already runs, serving {st.engine.model} at {where}; {given} "
                "would not change it: `opsctl stop` first, or start this one as its own instance "
                "(`opsctl --instance NAME start ...`)",
                EXIT_USAGE,
            )
        running_config = st.supervisor.config
        if running_config != cfg.source:
            _fail(
                f"instance {cfg.supervisor.instance!r} already runs from {running_config} at {where}; "
                f"to run {cfg.source} beside it, give it its own instance name "
                f"(`opsctl --instance NAME start`, or [supervisor] instance)",
                EXIT_USAGE,
            )
        if state.gave_up:
            _fail(
                f"already running but the supervisor gave up at {where}: {one_line(st.crash_loop.reason)}; "
                f"`opsctl restart` retries, `opsctl stop` stops",
                EXIT_GAVE_UP,
            )
        if state == EngineState.DRAINING:
            _fail(f"already running at {where} but drained (admits nothing); `opsctl resume` undoes it", EXIT_DRAINING)
        if state != EngineState.SERVING:
            st = _wait_until_serving(ctx, None, timeout or cfg.supervisor.ready_timeout, "already starting")
        _say(as_json, f"already running: serving at {where}", _serving_document(st, already_running=True))
        return
    try:
        prepare_runtime_dir(runtime)
        clash = port_clash(
            instance_record(cfg, runtime, cfg.supervisor.metrics_port, os.getpid()), running_instances(runtime)
        )
        if clash:
            raise ConfigError(clash)
        open_private(runtime / ENGINE_LOG_NAME).close()  # both logs are checked before anything starts
        log = open_private(runtime / SUPERVISOR_LOG_NAME)
    except ConfigError as e:
        _fail(str(e), EXIT_USAGE)
    args = [sys.executable, "-m", "opsctl.supervisor", "--runtime-dir", str(runtime)]
    if ctx.config_path:
        args += ["--config", ctx.config_path]
    if dry_run:
        args.append("--dry-run")
    if launcher:
        args += ["--launcher", launcher]
    if ctx.instance:
        args += ["--instance", ctx.instance]
    for key, value in engine.items():
        args += [f"--{key}", str(value)]
    if foreground:
        from opsctl.supervisor import main as supervisor_main

        log.close()
        sys.exit(supervisor_main(args[3:]))
    adopting = recorded_engine(runtime) is not None
    with log:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    st = _wait_until_serving(ctx, proc, timeout or cfg.supervisor.ready_timeout, "starting")
    verb = "adopted the engine serving" if adopting else "is serving"
    _say(
        as_json,
        f"pagekeeper {verb} {st.engine.model} at {st.engine.url}\n"
        f"  supervisor pid {st.supervisor.pid}, metrics {st.supervisor.metrics_url}, logs: opsctl logs",
        _serving_document(st, adopted=adopting),
    )


def _serving_document(st: Status, **facts: Any) -> dict[str, Any]:
    return {
        "serving": True,
        "url": st.engine.url,
        "model": st.engine.model,
        "engine_pid": st.engine.pid,
        "supervisor_pid": st.supervisor.pid,
        "metrics_url": st.supervisor.metrics_url,
        **facts,
    }


def _drain_args(no_drain: bool, drain_timeout: float | None) -> dict[str, Any]:
    args: dict[str, Any] = {"drain": not no_drain}
    if drain_timeout is not None:
        args["drain_timeout"] = drain_timeout
    return args


_DRAIN_TIMEOUT = click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds the old engine gets to finish in-flight requests (default "
    "[supervisor] drain_timeout); what it still holds then is answered 503 (retryable) and counted.",
)


@main.command()
@_location_options
@click.option("--no-drain", is_flag=True, help="Answer in-flight requests with a 503 now instead of finishing them.")
@_DRAIN_TIMEOUT
@_JSON
@click.pass_obj
def stop(ctx: Ctx, no_drain: bool, drain_timeout: float | None, as_json: bool) -> None:
    """Drain and stop the engine, then the supervisor (an engine left without one is stopped too)."""
    runtime = ctx.runtime()
    pid_file = runtime / PID_NAME
    timeout = drain_timeout if drain_timeout is not None else ctx.config().supervisor.drain_timeout
    if _status_or_none(runtime) is None:
        orphan = recorded_engine(runtime)
        if orphan is None:
            _say(as_json, "not running", {"stopped": False, "running": False})
            return
        retired = stop_unsupervised(orphan, drain=not no_drain, timeout=timeout)
        _say(
            as_json,
            f"stopped the engine (pid {orphan.pid}) that ran without a supervisor"
            + (f"; {retired.lost} request(s) in flight were lost" if retired.lost else ""),
            {"stopped": True, "engine_pid": orphan.pid, "supervised": False, "lost": retired.lost},
        )
        return
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    if not as_json:
        click.echo(f"stopping (in-flight requests get up to {timeout:g} s)...", err=True)
    _send(ctx, "stop", _drain_args(no_drain, drain_timeout), timeout=timeout + 60)
    deadline = time.monotonic() + 30
    while pid and time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    _say(as_json, "stopped", {"stopped": True, "supervisor_pid": pid, "supervised": True})


@main.command()
@_location_options
@click.option(
    "--no-drain",
    is_flag=True,
    help="Do not wait for in-flight requests: they are answered with a 503 at once (new requests "
    "still wait for the new engine, none is refused).",
)
@_DRAIN_TIMEOUT
@_JSON
@click.pass_obj
def restart(ctx: Ctx, no_drain: bool, drain_timeout: float | None, as_json: bool) -> None:
    """Hand over to a new engine (no request refused); return when it serves."""
    timeout = drain_timeout if drain_timeout is not None else ctx.config().supervisor.drain_timeout
    started = time.monotonic()
    if not as_json:
        how = "answering in-flight requests 503 now" if no_drain else f"in-flight requests get up to {timeout:g} s"
        click.echo(f"restarting: a new engine takes over ({how})...", err=True)
    _send(
        ctx,
        "restart",
        _drain_args(no_drain, drain_timeout),
        timeout=timeout + ctx.config().supervisor.ready_timeout + 60,
    )
    st = _wait_until_serving(ctx, None, ctx.config().supervisor.ready_timeout, "restarting")
    took = round(time.monotonic() - started, 1)
    _say(
        as_json,
        f"restarted in {took:g} s: engine pid {st.engine.pid} serving at {st.engine.url}",
        _serving_document(st, restarted=True, seconds=took),
    )


@main.command()
@_location_options
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Keep serving this many seconds first: the time a load balancer (a Kubernetes Service) takes to stop "
    "sending new connections here.",
)
@_DRAIN_TIMEOUT
@_JSON
@click.pass_obj
def retire(ctx: Ctx, delay: float, drain_timeout: float | None, as_json: bool) -> None:
    """Hand the traffic over and stop the engine, but leave the supervisor running until it is stopped.

    A pod's preStop hook: in-flight requests finish, clients on kept-alive connections are told to reconnect
    (`Connection: close`; no 503), and the engine exits; the supervisor, the container's main process, stays so
    that the hook is not cut off, and exits at once on the SIGTERM that follows (`opsctl restart` starts an engine
    again).  `opsctl drain` instead keeps the engine up and answers 503 until `opsctl resume`.
    """
    timeout = drain_timeout if drain_timeout is not None else ctx.config().supervisor.drain_timeout
    if delay:
        click.echo(f"serving {delay:g} s more before handing over", err=True)
        time.sleep(delay)
    reply = _send(ctx, "retire", _drain_args(False, drain_timeout), timeout=timeout + 60)
    lost = int(reply.get("lost") or 0)
    _say(
        as_json,
        "retired: the engine handed over and stopped" + (f"; {lost} request(s) in flight were lost" if lost else ""),
        {"retired": True, "lost": lost},
    )
    if lost:
        sys.exit(EXIT_ERROR)


@main.command()
@_location_options
@click.option("--timeout", type=click.FloatRange(min=0), default=None, help="Seconds to wait for in-flight requests.")
@click.option("--cancel", is_flag=True, help="Undo a drain (the same as `opsctl resume`).")
@_JSON
@click.pass_obj
def drain(ctx: Ctx, timeout: float | None, cancel: bool, as_json: bool) -> None:
    """Stop admitting new requests (503, for a load balancer) and wait for in-flight ones; the engine stays up."""
    if cancel:
        _resume(ctx, as_json)
        return
    reply = _send(ctx, "drain", {"timeout": timeout} if timeout is not None else {})
    result = reply["drain"]
    at_start, left, waited = (
        result.get("in_flight_at_start", 0),
        result.get("in_flight", 0),
        result.get("waited_seconds"),
    )
    if result.get("drained"):
        sentence = (
            f"drained: the {at_start} request(s) in flight finished in {waited} s; new requests get 503 until "
            "`opsctl resume`"
        )
    else:
        sentence = (
            f"not drained: {left} of {at_start} request(s) still in flight after {waited} s; new requests get 503 "
            "until `opsctl resume`"
        )
    _say(as_json, sentence, result)
    if not result.get("drained"):
        sys.exit(EXIT_ERROR)


def _resume(ctx: Ctx, as_json: bool) -> None:
    _send(ctx, "resume")
    _say(as_json, "resumed: admitting requests again", {"resumed": True})


@main.command()
@_location_options
@_JSON
@click.pass_obj
def resume(ctx: Ctx, as_json: bool) -> None:
    """Undo `opsctl drain`: admit requests again."""
    _resume(ctx, as_json)


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@main.command()
@_location_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def status(ctx: Ctx, as_json: bool) -> None:
    """Engine state, KV usage, queues, GPU, last decision and its evidence, restarts.

    Exits 0 only while the engine serves; see `opsctl --help` for the other codes.
    """
    runtime = ctx.runtime()
    st = _status_or_none(runtime)
    if st is None:
        document, state = unsupervised_status(runtime)
        orphan, failure = document["engine"]["pid"], document["last_failure"]
        if as_json:
            click.echo(json.dumps(document))
        elif orphan is not None:
            click.echo(
                f"engine      serving without a supervisor (pid {orphan}); "
                f"`opsctl start` adopts it, `opsctl stop` stops it"
            )
        else:
            click.echo("not running" + (f" (last failure: {one_line(failure['reason'])})" if failure else ""))
        sys.exit(state.exit_code)
    code = st.engine.state.exit_code
    if as_json:
        click.echo(json.dumps(st.to_json(), indent=2, default=str))
        sys.exit(code)
    for line in _status_lines(st):
        click.echo(line)
    sys.exit(code)


@main.command()
@click.option("--config", "sub_config", default=None, help="TOML config file (as before the subcommand).")
@click.option("--runtime-dir", "sub_runtime", default=None, help="Runtime dir (as before the subcommand).")
@click.option(
    "--instance",
    "instances",
    multiple=True,
    callback=lambda c, p, v: tuple(_check_instance(x) for x in v),
    help="An instance to watch; repeat it to watch several (default: the configured instance).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes: rates and percentiles cover this window.",
)
@click.option("--once", is_flag=True, help="Print one frame (two scrapes --interval apart) and exit.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Figures as JSON: one document with --once, else one per line at each refresh.",
)
@click.pass_obj
def top(
    ctx: Ctx,
    sub_config: str | None,
    sub_runtime: str | None,
    instances: tuple[str, ...],
    interval: float,
    once: bool,
    as_json: bool,
) -> None:
    """A live view: requests, KV cache, tokens/s, TTFT and TPOT percentiles, GPUs and the supervisor's recent
    decisions, from the metrics Prometheus scrapes.  q or Ctrl-C quits.

    Exits 0; with --once, 3 when an instance's supervisor is not running.
    """
    if not (once or as_json) and not sys.stdout.isatty():
        _fail("`opsctl top` draws on a terminal and stdout is not one: use --once for one frame, or --json", EXIT_USAGE)
    from opsctl.top import Watcher

    watchers: list[Watcher] = []
    seen: dict[Path, str] = {}
    timeout = max(1.0, min(interval, 5.0))
    for name in dict.fromkeys(instances or (ctx.instance,)):
        sup = Ctx(sub_config or ctx.config_path, sub_runtime or ctx.runtime_dir, name).config().supervisor
        runtime = sup.runtime_path()
        if runtime in seen:
            _fail(
                f"instances {seen[runtime]!r} and {sup.instance!r} both read runtime dir {runtime}: "
                "--runtime-dir (or [supervisor] runtime_dir) names one instance's dir; leave it out to watch several",
                EXIT_USAGE,
            )
        seen[runtime] = sup.instance
        watchers.append(Watcher(sup.instance, runtime, timeout))
    from opsctl.top_view import run

    sys.exit(run(watchers, interval, once=once, as_json=as_json))


def unsupervised_status(runtime: Path) -> tuple[dict[str, Any], EngineState]:
    """`opsctl status --json`'s document when no supervisor answers: an engine left serving, or nothing."""
    orphan = recorded_engine(runtime)
    state = EngineState.UNSUPERVISED if orphan is not None else EngineState.NOT_RUNNING
    document = {
        "supervisor": None,
        "engine": {"state": state.value, "pid": orphan.pid if orphan else None},
        "last_failure": read_last_failure(runtime),
    }
    return document, state


def status_document(runtime: Path) -> dict[str, Any]:
    """What `opsctl status --json` prints for this runtime directory, without a process of its own."""
    st = _status_or_none(runtime)
    if st is None:
        return unsupervised_status(runtime)[0]
    return json.loads(json.dumps(st.to_json(), default=str))


def _status_lines(st: Status) -> list[str]:
    """The human view: integers, nothing it does not know, one line per topic."""
    e, d, r, c, s = st.engine, st.last_decision, st.restarts, st.crash_loop, st.supervisor
    head = [f"engine      {e.state}"]
    if e.pid:
        head.append(f"pid {e.pid}")
    if e.uptime_s is not None:
        head.append(f"up {_fmt_seconds(e.uptime_s)}")
    head.append(e.url)
    if e.model:
        head.append(f"model {e.model}")
    lines = ["  ".join(head)]
    core_pid = e.process.core_pid if e.process else None
    if core_pid:
        core = [f"core        pid {core_pid}"]
        if e.core_restarts is not None:
            core.append(f"restarts {e.core_restarts}")
        if e.requests_resumed is not None:
            core.append(f"resumed {e.requests_resumed} request(s)")
        lines.append("  ".join(core))
    queue = []
    if e.kv_cache_usage is not None:
        queue.append(f"kv cache {e.kv_cache_usage * 100:.1f}% used")
    for key, value in (("running", e.running), ("waiting", e.waiting)):
        if value is not None:
            queue.append(f"{key} {int(value)}")
    if e.oldest_waiting_s:
        queue.append(f"oldest waiting {e.oldest_waiting_s:.1f}s")
    if queue:
        if e.readings_age_s is not None:
            queue.append(
                f"(as of {_fmt_seconds(e.readings_age_s)} ago, polled every {_fmt_seconds(s.poll_interval_s)})"
            )
        lines.append("requests    " + "  ".join(queue))
    if e.metrics_error and e.state != EngineState.EXITED:
        lines.append(f"probe       {e.metrics_error}")
    gpu = st.gpu
    for g in gpu.devices:
        parts = [g.name, f"{g.memory_used_bytes / 2**30:.1f} / {g.memory_total_bytes / 2**30:.1f} GiB"]
        if g.utilization_ratio is not None:
            parts.append(f"util {int(g.utilization_ratio * 100)}%")
        if g.temperature_celsius is not None:
            parts.append(f"{int(g.temperature_celsius)} C")
        parts.append(f"xid {int(g.xid_errors_total)}")
        lines.append(f"gpu {g.index}       " + "  ".join(parts))
    if not gpu.devices:
        lines.append(f"gpu         {no_gpu_line(gpu.detail)}")
    if d:
        evidence = ", ".join(f"{k}={v}" for k, v in (d.evidence or {}).items() if v is not None)
        lines.append(f"decision    {d.action} ({d.reason})" + (f": {evidence}" if evidence else ""))
    if c.gave_up:
        guard = ("FAILED: " if c.permanent else "GAVE UP: ") + one_line(c.reason)
    else:
        guard = f"ok (max {int(c.max_restarts)} in {_fmt_seconds(c.restart_window_s)})"
    lines.append(f"restarts    {int(r.total)}  crash loop: {guard}")
    if e.last_exit and not c.gave_up:
        lines.append(f"last exit   {one_line(e.last_exit)}")
    instance = f"  instance {s.instance}" if s.instance not in (None, "default") else ""
    lines.append(
        f"supervisor  pid {s.pid}{instance}  launcher {s.launcher}  handover {s.handover}"
        f"{'  DRY-RUN' if s.dry_run else ''}  metrics {s.metrics_url}"
    )
    return lines


@main.command()
@_location_options
@click.option("-f", "--follow", is_flag=True)
@click.option("--supervisor", "which", flag_value="supervisor", help="Show the supervisor's log instead.")
@click.option("-n", "--lines", type=int, default=50)
@click.option("--json", "as_json", is_flag=True, help="The log's own JSON lines, unrendered.")
@click.pass_obj
def logs(ctx: Ctx, follow: bool, which: str | None, lines: int, as_json: bool) -> None:
    """The engine's log (or the supervisor's), one readable line per event (--json: as written)."""
    cfg = ctx.config()
    runtime = cfg.supervisor.runtime_path()
    if which != "supervisor" and cfg.supervisor.launcher == "systemd":
        os.execvp(
            "journalctl",
            ["journalctl", "-u", cfg.supervisor.engine_unit(), "-n", str(lines)] + (["-f"] if follow else []),
        )
    path = runtime / (SUPERVISOR_LOG_NAME if which == "supervisor" else ENGINE_LOG_NAME)
    if not path.exists():
        _fail(f"no log at {path} yet")
    show = (lambda line: line) if as_json else render_log_line
    with open(path, errors="replace") as f:
        for line in f.readlines()[-lines:]:
            click.echo(show(line), nl=False)
        while follow:
            line = f.readline()
            if line:
                click.echo(show(line), nl=False)
            else:
                time.sleep(0.2)


def render_log_line(line: str) -> str:
    """`{"event": "serving", "url": ..., "timestamp": ..., "level": "info"}` as `11:20:56.163 info  serving
    url=...`; a line that is not a JSON object (a banner, a library's traceback) as it is."""
    try:
        event = json.loads(line) if line.startswith("{") else None
    except ValueError:
        event = None
    if not isinstance(event, dict) or "event" not in event:
        return line
    stamp = str(event.pop("timestamp", ""))[11:23]
    level = str(event.pop("level", ""))
    name = str(event.pop("event"))
    event.pop("logger", None)
    fields = " ".join(f"{k}={v if isinstance(v, str) and ' ' not in v else json.dumps(v)}" for k, v in event.items())
    return f"{stamp} {level:<7} {name}  {fields}".rstrip() + "\n"


@main.command()
@_location_options
@_JSON
@click.pass_obj
def doctor(ctx: Ctx, as_json: bool) -> None:
    """Check the environment and show the memory plan for the configured model, without starting it."""
    from opsctl.doctor import run_checks

    checks: list[dict[str, Any]] = []
    ok = run_checks(ctx.config(), (lambda line: None) if as_json else click.echo, checks)
    if as_json:
        click.echo(json.dumps({"ok": ok, "checks": checks}))
    sys.exit(0 if ok else 1)


@main.command()
@click.option(
    "--prefix",
    default="/",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Root every path under this directory (packaging, tests); file contents name the final paths.",
)
@click.option("--dry-run", is_flag=True, help="Show what would be written (and the rendered units); write nothing.")
@click.option("--python", "python", default=None, help="Interpreter for ExecStart= (default: the one running opsctl).")
@click.pass_obj
def install(ctx: Ctx, prefix: str, dry_run: bool, python: str | None) -> None:
    """Install the systemd units, /etc/pagekeeper/pagekeeper.toml (if absent) and the engine's environment file.

    The config file comes from --config when given (and none is installed yet), else a commented default.
    """
    from opsctl.install import InstallError
    from opsctl.install import install as do_install

    try:
        do_install(
            prefix,
            dry_run=dry_run,
            config_source=ctx.config_path,
            python=python,
            echo=click.echo,
            instance=ctx.instance,
        )
    except InstallError as e:
        _fail(str(e), EXIT_USAGE)


@main.command()
@click.option("--prefix", default="/", show_default=True, type=click.Path(file_okay=False))
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option("--purge", is_flag=True, help="Remove the config file even if it was edited.")
@click.pass_obj
def uninstall(ctx: Ctx, prefix: str, dry_run: bool, purge: bool) -> None:
    """Stop and disable the units (on this machine's systemd), then remove what `opsctl install` wrote."""
    from opsctl.install import InstallError
    from opsctl.install import uninstall as do_uninstall

    try:
        do_uninstall(prefix, dry_run=dry_run, purge=purge, echo=click.echo, instance=ctx.instance)
    except InstallError as e:
        _fail(str(e), EXIT_USAGE)


@main.group()
def config() -> None:
    """The effective configuration."""


@config.command("show")
@_location_options
@_JSON
@click.pass_obj
def config_show(ctx: Ctx, as_json: bool) -> None:
    """Every value in effect, as TOML, each with where it came from (the file, or the built-in default)."""
    cfg = ctx.config()
    sections = effective_config(cfg)
    if as_json:
        click.echo(json.dumps({"source": cfg.source, **sections}, default=str))
        return
    import tomli_w

    click.echo(f"# file: {cfg.source}")
    for name, values in sections.items():
        click.echo(f"\n[{name}]")
        for key, item in values.items():
            if item["value"] is None:
                click.echo(f"# {key} is unset ({item['from']})")
                continue
            text = tomli_w.dumps({key: item["value"]}).strip()
            click.echo(f"{text}  # {item['from']}")


def effective_config(cfg: PagekeeperConfig) -> dict[str, dict[str, dict[str, Any]]]:
    """{section: {key: {"value": ..., "from": "file" | "default"}}} for every key a config file may set."""
    from engine.config import EngineConfig
    from engine.ops_contract.secrets import SECRET_ENV
    from engine.server.config_file import SERVER_KEYS, engine_file_keys

    def origin(section: str, key: str, flags: tuple[str, ...]) -> str:
        if key in flags:
            return "command line"
        return "file" if key in cfg.keys_in_file.get(section, ()) else "default"

    def default(f: dataclasses.Field[Any]) -> Any:
        return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()

    defaults = {f.name: default(f) for f in dataclasses.fields(EngineConfig)} | dict(SERVER_KEYS)
    engine = {
        key: {
            "value": "(set, not shown)"
            if key in SECRET_ENV and cfg.engine.get(key)
            else cfg.engine.get(key, defaults[key]),
            "from": origin("engine", key, cfg.engine_from_command_line),
        }
        for key in sorted((engine_file_keys() | set(SERVER_KEYS)) & set(defaults))
    }
    supervisor = {
        f.name: {
            "value": getattr(cfg.supervisor, f.name),
            "from": origin("supervisor", f.name, cfg.supervisor_from_command_line),
        }
        for f in dataclasses.fields(cfg.supervisor)
    }
    return {"engine": engine, "supervisor": supervisor}


if __name__ == "__main__":
    main()
