"""How the supervisor starts, restarts, stops and adopts the engine: as its child, or through systemd.

`ProcessLauncher` binds the engine's listening socket once, in the supervisor, and hands it to every
engine it starts (`--listen-fd`), so a restart hands traffic over instead of refusing it:

- the old engine is told over its private control socket (engine/server/control.py) to hand over:
  it stops calling accept(), so new connections wait in the kernel's queue, serves what reaches it on
  its open connections with `Connection: close`, and exits;
- with `handover = "overlap"` (the default on CPU, where two engines fit) the new engine is started
  first and the old one leaves only once the new one serves: nothing waits for a model load; a new
  engine that fails to start leaves the old one serving.  On a GPU one engine at a time
  (`"sequential"`): queued connections wait for the new engine's load.

Each engine publishes its requests in flight in a small file; after an engine dies without warning the
supervisor reads it to count what the crash cost.  `engine.json` in the runtime dir names the engine
that serves (pid, control socket), so that a supervisor that starts after its predecessor died adopts
that engine, and the listening socket with it, instead of starting a second one.

`SystemdLauncher` drives the engine unit with systemctl (socket activation gives the same handover
there; see systemd/).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import structlog

from engine.config import ConfigError
from engine.ops_contract import control
from engine.ops_contract.inflight import InflightFile
from engine.ops_contract.sockets import bind
from opsctl.constants import (
    ADOPT_TIMEOUT_S,
    ENGINE_CONTROL_TIMEOUT_S,
    ENGINE_STATE_NAME,
    EXIT_CONFIG_ERROR,
    STOP_NOW_GRACE_S,
)
from opsctl.instances import instance_holding
from opsctl.keeper import KeeperProcess
from opsctl.runtime import open_private, write_private

log = structlog.get_logger("pagekeeper.supervisor")

# A spare engine not standing by this long after its start is stuck (a 70B spare at TP=4 stands by in about 20 s).
SPARE_READY_S = 180.0
# A spare starts once the serving engine has settled (its graphs captured, its kernels warmed), at the latest this
# long after the supervisor first saw it serving: a spare starting beside an engine's first requests took device
# time from them, and one started later leaves the engine without a spare for longer (under load, start-up work
# is paced and can take a minute at TP=4: a rank killed 37 s after a promotion found no spare).
SPARE_SETTLE_MAX_S = 10.0

_LOG_TAIL_BYTES = 4096
LEAVING_STATES = ("draining", "handing_over", "stopping")  # an engine in these is on its way out by itself
# How far past its own deadline an engine that says it is draining is still believed (a loaded host is late);
# the retire path's SIGKILL allows the same.
STOPPING_MARGIN_S = 2.0


@dataclass
class Retired:
    """What retiring one engine cost: requests in flight that did not get their answer, by why.

    Reasons: `engine_exited` (the engine died before or while it was retired, e.g. killed while its successor
    loaded or while it drained), `killed` (still in flight when the drain timeout ran out: answered "restarting"
    by the engine then, or taken by the SIGKILL that follows a drain it could not end), `no_drain` (answered a
    retryable 503 by a stop-now)."""

    lost_by_reason: dict[str, int] = field(default_factory=dict)
    successor_serving: bool = False  # the new engine was already serving when the old one left (overlap)

    @classmethod
    def of(cls, **counts: int) -> Retired:
        return cls({reason: n for reason, n in counts.items() if n > 0})

    @property
    def lost(self) -> int:
        return sum(self.lost_by_reason.values())


class Launcher(ABC):
    """What the supervisor needs from whatever runs the engine.  The differences between a child process
    and a systemd unit that the supervisor must know about are attributes here, never type checks."""

    name: str
    # While the engine starts, the supervisor checks `alive()` this often between polls (None: only at polls, for a
    # launcher whose alive() is not cheap).
    exit_watch_s: float | None = None
    overlap: bool = False  # a restart starts the new engine before the old one leaves (handover = "overlap")
    engine_outlives_supervisor: bool = False  # the supervisor's own exit (a signal) leaves the engine running
    drain_timeout_per_command: bool = True  # `--drain-timeout` can bound one restart/stop's drain

    def __init__(self) -> None:
        self._last_exit: str | None = None  # how the engine last exited, for status and the give-up reason
        self._last_code: int | None = None
        self._last_error: str | None = None  # the engine's own line about why, when it wrote one

    @abstractmethod
    def start(self) -> None: ...
    @abstractmethod
    def restart(self, drain: bool, timeout: float, ready_timeout: float) -> Retired: ...
    @abstractmethod
    def stop(self, drain: bool, timeout: float) -> Retired: ...
    @abstractmethod
    def pid(self) -> int | None: ...
    @abstractmethod
    def alive(self) -> bool: ...
    @abstractmethod
    def log_path(self) -> Path | None: ...
    @abstractmethod
    def close(self) -> None: ...

    def recycle(self, timeout: float) -> dict | None:
        """Rebuild the engine's KV pool in place (engine/core/engine_core.py: recycle); its report, or None when
        this launcher has no private channel to the engine (the supervisor then uses the engine's HTTP admin
        route)."""
        return None

    @property
    def handover_mode(self) -> str:
        """How a restart hands over: overlap (new engine first), standby (the new one waits with the kept weights
        for the old one's exit), sequential (the new one starts after the old one left)."""
        return "overlap" if self.overlap else "sequential"

    def keeper_status(self) -> dict | None:
        """The weights keeper's pid and state (None: this deployment runs none)."""
        return None

    def spare_status(self) -> dict | None:
        """The spare engine standing by (None: this deployment keeps none)."""
        return None

    def maintain(self) -> None:  # noqa: B027 - a hook: most launchers keep nothing ready
        """Between polls: keep what the launcher keeps ready (a spare engine) in place."""

    def draining_on_its_own(self) -> str | None:
        """Why an engine whose HTTP side is silent is still well: draining or stopping within its own deadline
        (a SIGTERM from outside stops it accepting).  None: nothing says so, and silence may be a hang."""
        return None

    def loading(self) -> bool:
        """The engine is still starting: it checks its settings, loads its model, and its HTTP side cannot answer
        yet (a probe would wait for its timeout)."""
        return False

    def serving_now(self) -> bool:
        """The engine says it serves, through a private channel cheap enough to ask several times a second while
        it starts (False where there is none: the next poll's HTTP probe finds out)."""
        return False

    def admin(self, cmd: str, timeout: float, **args: object) -> dict | None:
        """`opsctl drain` / `resume` ("drain", "resume") over the engine's private control socket: its reply, or
        RuntimeError with the reason in one line.  None where this launcher has no such channel (systemd): the
        engine's HTTP `/drain` serves then, with the admin key once an API key is set."""
        return None

    def exit_summary(self) -> str | None:
        return self._last_exit

    def exit_error(self) -> str | None:
        """The engine's own one-line reason for its last exit (an exit 2 names the setting to fix), or None."""
        return self._last_error

    def exit_is_permanent(self) -> bool:
        """The engine exited with 2: a mistake a person must fix, never retried."""
        return self._last_code == EXIT_CONFIG_ERROR

    def forget_exit(self) -> None:
        """The exit has been dealt with (a restart): the next one is news."""
        self._last_exit = None
        self._last_code = None
        self._last_error = None


def tail(path: Path | None, max_bytes: int = _LOG_TAIL_BYTES) -> str:
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - max_bytes))
        return f.read().decode(errors="replace")


def last_error_line(log_text: str) -> str:
    """The one line a person needs from an engine's log: its `error:` line (exit 2), else the last
    exception line of a traceback, else the last line; a JSON log line is reduced to its event/error."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip() and not ln.startswith("--- engine")]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln
    for ln in reversed(lines):
        if not ln.startswith(("{", " ", "File ", "Traceback")) and ("Error" in ln or "Exception" in ln):
            return ln
    for ln in reversed(lines):
        if ln.startswith("{"):
            try:
                event = json.loads(ln)
            except ValueError:
                continue
            if event.get("level") in ("error", "critical", "exception"):
                return " ".join(str(event[k]) for k in ("event", "error") if event.get(k))
    return lines[-1][:300] if lines else ""


class EngineProcess:
    """One engine process: started by this supervisor (a child) or adopted from a predecessor."""

    def __init__(
        self,
        pid: int,
        control_path: Path,
        inflight_path: Path,
        popen: subprocess.Popen | None,
        create_time: float | None = None,
    ) -> None:
        self.pid = pid
        self.control_path = control_path
        self.inflight_path = inflight_path
        self.popen = popen
        self.create_time = create_time if create_time is not None else _create_time(pid)
        # The counters as the engine left them, kept when its files are removed: whoever notices the exit first
        # cleans up, and whoever retires it later must still read what it had in flight.
        self._final_counts: tuple[int, int] | None = None
        self._stopping: tuple[str, float] | None = None  # (state, deadline) once it said it is stopping on its own

    @property
    def adopted(self) -> bool:
        return self.popen is None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            p = psutil.Process(self.pid)
            return p.create_time() == self.create_time and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal); None while alive or for an adopted engine."""
        return self.popen.poll() if self.popen is not None else None

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def signal_group(self, sig: signal.Signals) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.pid, sig)  # the engine leads its own process group
        except (ProcessLookupError, PermissionError):
            pass

    def request(self, cmd: str, timeout: float = ENGINE_CONTROL_TIMEOUT_S, **args: object) -> dict:
        return control.request(self.control_path, cmd, timeout, **args)

    def state(self) -> str | None:
        """The engine's lifecycle phase (engine/lifecycle.py: loading, standby, serving, recycling, draining,
        handing_over, stopping), or None when the control socket does not answer."""
        return self.state_and_settled()[0]

    def state_and_settled(self) -> tuple[str | None, bool]:
        """The phase, and whether the engine serves with its start-up work done (an engine that does not say
        counts as settled)."""
        try:
            reply = self.request("state", timeout=1.0)
        except (OSError, ValueError):
            return None, False
        return str(reply.get("state")), bool(reply.get("settled", True))

    def stopping_within_deadline(self) -> str | None:
        """ "draining" / "stopping" while the engine is stopping on its own and its deadline (plus the supervisor's
        margin for a loaded host) has not passed; None when nothing says it is.

        The deadline is remembered from the engine's last answer: it closes its control socket as it exits, and
        the interpreter's teardown that follows (about 2 s with torch loaded, more on a busy host) is silent.
        """
        now = time.monotonic()
        try:
            reply = self.request("state", timeout=1.0)
        except (OSError, ValueError):
            reply = {}
        state, left = reply.get("state"), reply.get("stop_left_s")
        if state in LEAVING_STATES and isinstance(left, (int, float)):
            self._stopping = (str(state), now + float(left))
        if self._stopping is None:
            return None
        state, deadline = self._stopping
        return state if now < deadline + STOPPING_MARGIN_S else None

    def _counts(self) -> tuple[int, int] | None:
        return self._final_counts or InflightFile.read(self.inflight_path)

    def in_flight(self) -> int:
        counts = self._counts()
        return max(0, counts[0]) if counts else 0

    def aborted(self) -> int:
        """Requests a stop-now answered with a retryable 503 (in flight then, or arriving after)."""
        counts = self._counts()
        return max(0, counts[1]) if counts else 0

    def cleanup(self) -> None:
        if self._final_counts is None and not self.alive():
            self._final_counts = InflightFile.read(self.inflight_path)
        for path in (self.control_path, self.inflight_path):
            path.unlink(missing_ok=True)

    def as_json(self) -> dict:
        return {
            "pid": self.pid,
            "create_time": self.create_time,
            "control": str(self.control_path),
            "inflight": str(self.inflight_path),
        }


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def recorded_engine(runtime: Path) -> EngineProcess | None:
    """The live engine `engine.json` names (one a dead supervisor left serving), or None."""
    try:
        recorded = json.loads((runtime / ENGINE_STATE_NAME).read_text())
        engine = EngineProcess(
            int(recorded["pid"]),
            Path(recorded["control"]),
            Path(recorded["inflight"]),
            None,
            recorded.get("create_time"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return engine if engine.alive() else None


def stop_unsupervised(engine: EngineProcess, drain: bool, timeout: float) -> Retired:
    """Stop an engine whose supervisor is gone (opsctl stop without a supervisor)."""
    retired = ProcessLauncher.retire(engine, drain, timeout)
    (engine.control_path.parent / ENGINE_STATE_NAME).unlink(missing_ok=True)
    return retired


class ProcessLauncher(Launcher):
    name = "process"
    exit_watch_s = 0.05  # alive() is a waitpid; serving_now() one control-socket request

    def __init__(
        self,
        engine_args: list[str],
        host: str,
        port: int,
        runtime: Path,
        log_file: Path,
        overlap: bool,
        env: dict[str, str] | None = None,
        keeper: KeeperProcess | None = None,
        spare: bool = False,
        explain: Callable[[str], str] | None = None,
    ) -> None:
        """`explain`: rewords the engine's error line for the person who configured it (the config file's keys
        for the flags the supervisor passed: opsctl/supervisor.py)."""
        self.engine_args = engine_args
        # A spare engine standing by behind the serving one (`maintain` starts it): it wakes by itself when the
        # serving engine exits (a crash, a kill, a restart's drain), and is then promoted instead of a start.
        self.spare_enabled = spare and not overlap
        self.spare: EngineProcess | None = None
        self._serving_seen: tuple[int, float] | None = None  # (engine pid, when maintain first saw it serving)
        self.explain = explain
        self.runtime = runtime
        self.log_file = log_file
        self.overlap = overlap
        self.env = env
        self.keeper = keeper  # the weights keeper (opsctl/keeper.py), or None: every engine loads its own weights
        super().__init__()
        self.engine: EngineProcess | None = None
        self._lost_at_exit = 0
        self._serial = 0
        self.sock = self._adopt() or self._bind(host, port)

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        """The engines' listening socket; a port another pagekeeper instance holds is refused naming that one."""
        try:
            return bind(host, port, hint="change [engine] port", host_hint="change [engine] host")
        except ConfigError as e:
            cause = e.__cause__
            owner = instance_holding(port) if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE else None
            if owner is None:
                raise
            raise ConfigError(
                f"[engine] port {port} is already used by {owner}; give this instance another [engine] port"
            ) from None

    # -- adoption ---------------------------------------------------------------------------------

    def _adopt(self) -> socket.socket | None:
        """Take over the engine a dead predecessor left serving, with its listening socket (or None)."""
        state_file = self.runtime / ENGINE_STATE_NAME
        engine = recorded_engine(self.runtime)
        if engine is None:
            state_file.unlink(missing_ok=True)
            return None
        engine.signal_group(signal.SIGCONT)
        try:
            sock = control.receive_listening_socket(engine.control_path, timeout=ADOPT_TIMEOUT_S)
        except (OSError, ValueError) as e:
            # Alive but not answering: it cannot be handed a successor, so it is stopped like a hung one.
            log.warning("adoption_failed", pid=engine.pid, error=str(e), action="stopping it")
            self.retire(engine, drain=True, timeout=10.0)
            state_file.unlink(missing_ok=True)
            return None
        self.engine = engine
        log.warning(
            "engine_adopted",
            pid=engine.pid,
            detail="the previous supervisor died; this one took over its running engine",
        )
        return sock

    # -- starting ---------------------------------------------------------------------------------

    def _spawn(self, beside: int | None = None, standby_after: int | None = None, spare: bool = False) -> EngineProcess:
        """`beside`: the pid of an engine this one runs next to until it leaves (an overlapping handover): the new
        engine runs half the CPU threads meanwhile (engine/core_share.py).  `standby_after`: the pid of the
        engine this one replaces, whose exit it waits for before it takes device memory (a standby handover)."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._serial += 1
        token = f"{os.getpid()}-{self._serial}"
        control_path = self.runtime / f"eng-{token}.sock"
        inflight_path = self.runtime / f"eng-{token}.inflight"
        fd = self.sock.fileno()
        cmd = [
            sys.executable,
            "-m",
            "engine.server",
            *self.engine_args,
            "--listen-fd",
            str(fd),
            "--control-socket",
            str(control_path),
            "--inflight-file",
            str(inflight_path),
            *(("--share-cores-with", str(beside)) if beside is not None else ()),
            *(("--standby-after", str(standby_after)) if standby_after is not None else ()),
            *(("--standby-spare",) if spare else ()),
            *(("--weights-keeper", str(self.keeper.socket)) if self.keeper is not None and self.keeper.alive() else ()),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with open_private(self.log_file) as logf:
            logf.write(f"\n--- engine start {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
            logf.flush()
            popen = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(fd,),
                start_new_session=True,
            )
        log.info("engine_started", launcher=self.name, pid=popen.pid)
        return EngineProcess(popen.pid, control_path, inflight_path, popen)

    def _record(self) -> None:
        path = self.runtime / ENGINE_STATE_NAME
        if self.engine is None:
            path.unlink(missing_ok=True)
            return
        write_private(path, json.dumps(self.engine.as_json()))

    def start(self) -> None:
        if self.alive():
            return
        if self.keeper is not None:
            self.keeper.ensure()  # nothing holds the GPU now: a dead keeper is started again, loading beside the engine
        self.engine = self._spawn()
        self._record()

    @property
    def handover_mode(self) -> str:
        if self.overlap:
            return "overlap"
        return "standby" if self.keeper is not None else "sequential"

    def keeper_status(self) -> dict | None:
        return self.keeper.describe() if self.keeper is not None else None

    def spare_status(self) -> dict | None:
        if not self.spare_enabled:
            return None
        spare = self.spare
        if spare is None or not spare.alive():
            return {"pid": None, "state": "none"}
        return {"pid": spare.pid, "state": spare.state()}

    def maintain(self) -> None:
        """Start a spare behind a serving engine when there is none (or it died); the keeper must be there, so that
        the spare maps the weights instead of loading a second copy."""
        if not self.spare_enabled:
            return
        if self.spare is not None and not self.spare.alive():
            log.warning("spare_engine_exited", pid=self.spare.pid, how=_describe(self.spare.returncode()))
            self.spare.cleanup()
            self.spare = None
        engine = self.engine
        if self.spare is not None or engine is None or not engine.alive():
            return
        if self.keeper is not None and not self.keeper.alive():
            return
        state, settled = engine.state_and_settled()
        if state != "serving":
            return
        if self._serving_seen is None or self._serving_seen[0] != engine.pid:
            self._serving_seen = (engine.pid, time.monotonic())
        waited = time.monotonic() - self._serving_seen[1]
        if not settled and waited < SPARE_SETTLE_MAX_S:
            return
        self.spare = self._spawn(standby_after=engine.pid, spare=True)
        log.info(
            "spare_engine_started", pid=self.spare.pid, behind=engine.pid, settled=settled, waited_s=round(waited, 1)
        )

    def _spare_standing_by(self, timeout: float) -> bool:
        """The spare is ready to take over (it may still be importing: wait for it, it is the fastest way).  One
        that does not get there is stopped: a second successor must never wake beside it at the old one's exit.
        One that has not stood by SPARE_READY_S after its start never will (a rank waiting for a collective that
        another never joins): the restart then goes on without it instead of waiting `timeout` for it."""
        spare = self.spare
        started = spare.create_time if spare is not None and spare.create_time else time.time()
        deadline = min(time.time() + timeout, started + SPARE_READY_S)
        while spare is not None and spare.alive() and time.time() < deadline:
            if spare.state() == "standby":
                return True
            time.sleep(0.05)
        if spare is not None and spare.alive():
            log.warning(
                "spare_engine_not_ready",
                pid=spare.pid,
                seconds_since_start=round(time.time() - started, 1),
                action="stopped; the restart starts its successor without it",
            )
        self._stop_spare()
        return False

    def _promote_spare(self) -> bool:
        """The spare (awake, or waking: the engine it stood behind has exited) becomes the engine."""
        spare, self.spare = self.spare, None
        if spare is None or not spare.alive():
            return False
        self.engine = spare
        self._record()
        log.info("spare_engine_promoted", pid=spare.pid)
        return True

    def _stop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            self.retire(spare, drain=False, timeout=0)  # standing by: it holds no request and no KV cache

    def recycle(self, timeout: float) -> dict | None:
        engine = self.engine
        if engine is None or not engine.alive():
            return {"ok": False, "error": "no engine is running"}
        return engine.request("recycle", timeout=timeout + ENGINE_CONTROL_TIMEOUT_S, timeout_s=timeout)

    def _wait_standby(self, engine: EngineProcess, old: EngineProcess, timeout: float) -> bool:
        """The new engine is ready to take over (standby: its weights are mapped) or already past it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not engine.alive():
                return False
            if engine.state() in ("standby", "serving") or not old.alive():
                return True
            time.sleep(0.05)
        return False

    def _wait_serving(self, engine: EngineProcess, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not engine.alive():
                return False
            if engine.state() == "serving":
                return True
            time.sleep(0.1)
        return False

    # -- retiring ---------------------------------------------------------------------------------

    @staticmethod
    def retire(engine: EngineProcess, drain: bool, timeout: float, successor_serving: bool = False) -> Retired:
        """Hand over (drain) or stop now; SIGKILL whatever is left after `timeout` (drain) or a few seconds.

        SIGCONT first: a stopped engine (SIGSTOP, a debugger) resumes and finishes what it holds.
        The control socket carries the timeout; signals are the fallback when it does not answer.
        """
        if not engine.alive():  # it died first (killed while its successor loaded, say): its requests are lost
            lost = engine.in_flight()
            if lost:
                log.warning("engine_died_before_retiring", pid=engine.pid, in_flight=lost)
            engine.cleanup()
            return Retired.of(engine_exited=lost)
        engine.signal_group(signal.SIGCONT)
        cmd = "drain_exit" if drain else "stop_now"
        aborted = 0
        try:
            reply = engine.request(
                cmd, timeout=ENGINE_CONTROL_TIMEOUT_S, timeout_s=timeout, successor_serving=successor_serving
            )
            aborted = 0 if drain else int(reply.get("in_flight") or 0)
        except (OSError, ValueError):
            os.kill(engine.pid, signal.SIGTERM if drain else signal.SIGINT)
        # A drain that times out is followed by the engine answering what it still holds "restarting"; those
        # answers are requests lost at the drain timeout, as are those a SIGKILL takes (`killed`).
        late = "killed" if drain else "no_drain"
        grace = timeout + STOP_NOW_GRACE_S + STOPPING_MARGIN_S if drain else STOP_NOW_GRACE_S
        if engine.wait(grace):
            aborted = engine.aborted() or aborted  # the engine's own count includes late arrivals
            # A request's count drops when its handler returns, so an engine that exits on its own leaves none in
            # flight; one killed mid-drain (kill -9, the OOM killer) leaves those it was serving.  After a stop-now
            # the count may still hold requests already answered 503 (counted above), so only a death counts there.
            code = engine.returncode()
            died = engine.in_flight() if drain or (code is not None and code != 0) else 0
            if died:
                log.warning("engine_died_while_retiring", pid=engine.pid, how=_describe(code), in_flight=died)
            result = Retired.of(engine_exited=died, **{late: aborted})
        else:
            aborted = engine.aborted() or aborted
            lost = engine.in_flight()
            log.warning("engine_kill", pid=engine.pid, after_s=round(grace, 1), in_flight=lost)
            engine.signal_group(signal.SIGKILL)
            engine.wait(10)
            result = Retired.of(killed=aborted + lost) if drain else Retired.of(no_drain=aborted, killed=lost)
        if engine.popen is not None:
            engine.popen.poll()
        engine.cleanup()
        return result

    def restart(self, drain: bool, timeout: float, ready_timeout: float) -> Retired:
        """Replace the engine.  Overlap: new one first, the old one leaves once it serves."""
        old = self.engine if self.engine is not None and self.engine.alive() else None
        if old is None:  # it died: what it had in flight is lost
            self._note_exit()
            lost = self._lost_at_exit
            self.forget_exit()
            self.engine = None  # its exit is noted and dealt with: start() must not note (and log) it again
            if not self._promote_spare():  # the spare woke at the exit and is taking the GPU already
                self.start()
            return Retired.of(engine_exited=lost)
        if self.spare is not None and self._spare_standing_by(ready_timeout):
            retired = self.retire(old, drain, timeout)  # the spare wakes when the old engine exits
            self.forget_exit()
            if self._promote_spare():
                return retired
            self.engine = None
            self.start()
            return retired
        if not self.overlap and self.keeper is not None and self.keeper.alive():
            return self._restart_standby(old, drain, timeout, ready_timeout)
        if self.overlap:
            new = self._spawn(beside=old.pid)
            if not self._wait_serving(new, ready_timeout):
                self.retire(new, drain=False, timeout=0)
                code = new.returncode()
                raise RestartFailed(
                    f"the new engine did not come up ({_describe(code)}: {self._engine_error()}); "
                    "the old one keeps serving"
                )
            self.engine = new
            self._record()
            retired = self.retire(old, drain, timeout, successor_serving=True)
            retired.successor_serving = True
            return retired
        retired = self.retire(old, drain, timeout)
        self.forget_exit()
        self.engine = None  # retired: not an exit to report
        self.start()
        return retired

    def _restart_standby(self, old: EngineProcess, drain: bool, timeout: float, ready_timeout: float) -> Retired:
        """One GPU, weights kept: the new engine starts (imports, CUDA context, the kept weights mapped) while the
        old one still serves, then waits for its exit; the old one hands over, and the GPU memory it frees goes to
        the new one's KV cache at once.  A new engine that does not get that far leaves the old one serving."""
        new = self._spawn(standby_after=old.pid)
        if not self._wait_standby(new, old, ready_timeout):
            self.retire(new, drain=False, timeout=0)
            raise RestartFailed(
                f"the new engine did not come up ({_describe(new.returncode())}: "
                f"{last_error_line(tail(self.log_file))}); the old one keeps serving"
            )
        self.engine = new
        self._record()
        log.info("engine_standing_by", pid=new.pid, replaces=old.pid)
        return self.retire(old, drain, timeout)

    def stop(self, drain: bool, timeout: float) -> Retired:
        self._stop_spare()  # first: it would wake and serve when the engine exits
        engine, self.engine = self.engine, None
        retired = self.retire(engine, drain, timeout) if engine is not None else Retired()
        self._record()
        if self.keeper is not None:
            self.keeper.stop()
        return retired

    # -- observing --------------------------------------------------------------------------------

    def serving_now(self) -> bool:
        engine = self.engine
        return engine is not None and engine.state() == "serving"

    def loading(self) -> bool:
        """Its control socket says "loading", or is not there yet (the engine makes it once its flags are checked
        and its port bound)."""
        engine = self.engine
        return engine is not None and engine.alive() and engine.state() in (None, "loading")

    def admin(self, cmd: str, timeout: float, **args: object) -> dict | None:
        engine = self.engine
        if engine is None or not engine.alive():
            raise RuntimeError("the engine is not running")
        try:
            reply = engine.request(cmd, timeout=timeout, **args)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the engine's control socket did not answer {cmd!r}: {e}") from None
        if not reply.get("ok"):
            raise RuntimeError(f"the engine refused {cmd!r}: {reply.get('error', 'no reason given')}")
        return reply

    def pid(self) -> int | None:
        return self.engine.pid if self.engine is not None else None

    def draining_on_its_own(self) -> str | None:
        engine = self.engine
        state = engine.stopping_within_deadline() if engine is not None and engine.alive() else None
        if state is None:
            return None
        return f"{state} on its own (told by a signal, not by this supervisor): it stopped accepting"

    def alive(self) -> bool:
        if self.engine is None:
            return False
        if self.engine.alive():
            return True
        self._note_exit()
        return False

    def _note_exit(self) -> None:
        engine = self.engine
        if engine is None or engine.alive() or self._last_exit is not None:
            return
        code = engine.returncode()
        self._last_code = code
        self._lost_at_exit = engine.in_flight()
        detail = self._engine_error()
        what = _describe(code) if not engine.adopted else "exited (adopted engine: exit status unknown)"
        self._last_exit = f"{what}: {detail}" if detail else what
        self._last_error = detail or None
        log.info("engine_exited", pid=engine.pid, how=what, in_flight=self._lost_at_exit)
        engine.cleanup()

    def forget_exit(self) -> None:
        super().forget_exit()
        self._lost_at_exit = 0

    def _engine_error(self) -> str:
        """The engine log's line about why it stopped, without its own "error: " (whoever shows it adds theirs),
        in the terms of the configuration it was started from."""
        line = last_error_line(tail(self.log_file)).removeprefix("error: ")
        return self.explain(line) if self.explain is not None and line else line

    def log_path(self) -> Path | None:
        return self.log_file

    def close(self) -> None:
        """Let go of the listening socket; an engine still running keeps serving for a successor to adopt."""
        self.sock.close()


class RestartFailed(RuntimeError):
    """The replacement engine did not come up; the one that was serving still does."""


def _describe(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class SystemdLauncher(Launcher):
    name = "systemd"
    overlap = False  # systemd runs one engine unit at a time; its socket unit queues connections meanwhile
    engine_outlives_supervisor = True  # the engine is a unit of its own
    drain_timeout_per_command = False  # the engine drains for its own drain_timeout, bounded by TimeoutStopSec=

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=check, timeout=600)

    def _ctl_acting(self, *args: str) -> None:
        """start/restart: a unit that fails to start is the engine failing (the policy sees it exited and
        the crash-loop guard counts it), never an exception that takes the supervisor down."""
        r = self._ctl(*args, check=False)
        if r.returncode != 0:  # the next poll's alive() reads the unit's result into the exit summary
            log.warning("systemctl_failed", command=list(args), returncode=r.returncode, stderr=r.stderr.strip()[:500])

    def start(self) -> None:
        self._ctl_acting("start", self.unit)

    @property
    def socket_unit(self) -> str:
        return self.unit.rsplit(".", 1)[0] + ".socket"

    def stop(self, drain: bool = True, timeout: float = 0) -> Retired:
        """Stop the service and its listening socket: with the socket left active, the next connection
        would start the engine again (socket activation).  The engine drains on systemd's SIGTERM."""
        if not drain:
            self._ctl("kill", "--kill-whom=main", "--signal=SIGINT", self.unit, check=False)
        self._ctl("stop", self.socket_unit, self.unit, check=False)
        return Retired()

    def restart(self, drain: bool = True, timeout: float = 0, ready_timeout: float = 0) -> Retired:
        """Restart the service (never the socket, so queued connections survive).  The engine hands over
        on SIGTERM within its own --drain-timeout (TimeoutStopSec= bounds it); no drain is SIGINT first."""
        if not drain:
            self._ctl("kill", "--kill-whom=main", "--signal=SIGINT", self.unit, check=False)
        self._ctl_acting("restart", self.unit)
        return Retired()

    def pid(self) -> int | None:
        out = self._ctl("show", "-p", "MainPID", "--value", self.unit, check=False).stdout.strip()
        return int(out) if out.isdigit() and int(out) > 0 else None

    def alive(self) -> bool:
        state = self._ctl("is-active", self.unit, check=False).stdout.strip()
        if state in ("active", "activating", "reloading", "deactivating"):
            return True
        shown = self._ctl("show", "-p", "Result", "-p", "ExecMainStatus", self.unit, check=False).stdout
        values = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
        status = values.get("ExecMainStatus", "")
        self._last_code = int(status) if status.isdigit() else None
        self._last_exit = f"unit {state}: result {values.get('Result', '?')}, exit status {status or '?'}"
        return False

    def log_path(self) -> Path | None:
        return None  # journalctl -u <unit>

    def close(self) -> None:
        pass  # the engine is a unit of its own


def systemd_available(unit: str) -> bool:
    """PID 1 is systemd and the engine unit is installed."""
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return False
    r = subprocess.run(["systemctl", "cat", unit], capture_output=True, text=True)
    return r.returncode == 0
