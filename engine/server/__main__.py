"""`python -m engine.server`: the OpenAI-compatible HTTP server.

Start-up order is chosen so that mistakes surface fast and clearly: parse flags and check that the
--model and --tokenizer directories exist (before torch is imported, which takes seconds), bind the port
(taken → exit 2 at once, before minutes of model loading), load the engine (configuration or
memory problems → exit 2 with the numbers), then serve.  SIGTERM drains: no new requests (503),
in-flight ones finish, then exit 0.  A second SIGTERM or SIGINT stops at once.

Under systemd (`Type=notify`, see systemd/) it reports loading / serving / draining through sd_notify,
pings the watchdog from the step loop, and serves on the socket-activated listening socket.  When the
listening socket is inherited (systemd or opsctl hold it), SIGTERM hands over instead of refusing: the
engine stops accepting (new connections wait in the kernel's queue for the next engine), serves what
reaches it on the connections it has with `Connection: close`, closes idle keep-alive connections and
exits (engine/server/handover.py).  A bare server, which nobody else holds a socket for, keeps
accepting during its drain and answers 503 + Retry-After.  SIGINT, or a second SIGTERM, stops at once:
requests in flight are answered with a clean error (503 `engine_restarting`, or an error event in a
stream) instead of being cut off.
"""

from __future__ import annotations

import time as _time

_MODULE_STARTED = _time.time()  # before anything heavy is imported: the start-up timeline's first mark

from engine.gc_heap import pause_startup_collections  # noqa: E402
from engine.lean_imports import import_structlog_without_rich  # noqa: E402
from engine.openmp_waits import set_default_waits  # noqa: E402

set_default_waits()  # before anything loads torch, which loads libgomp (engine/openmp_waits.py)
if __name__ == "__main__":  # this process is the server: no collections until its heap is frozen (engine/gc_heap.py)
    pause_startup_collections()
    import_structlog_without_rich()  # before any module of ours imports structlog (engine/lean_imports.py)

import argparse
import asyncio
import asyncio.selector_events
import atexit
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import structlog
import uvicorn

from engine.chat import load_chat_template
from engine.config import ConfigError, EngineConfig, add_flags
from engine.core_share import CoreShare
from engine.gc_heap import freeze_startup_heap, resume_startup_collections
from engine.lifecycle import LIFECYCLE, PROCESS_EXIT, Phase
from engine.logs import configure_logging
from engine.model.checkpoint_dir import require_checkpoint_dir, require_tokenizer_dir
from engine.ops_contract.inflight import InflightFile
from engine.ops_contract.secrets import SECRET_ENV
from engine.ops_contract.sockets import bind, inherited_socket
from engine.server.config_file import in_file_terms, load_engine_section, split_section
from engine.server.control import ControlSocket, admin_handlers
from engine.server.handover import RESTARTING_MESSAGE, HandoverDrain, HttpTracker
from engine.server.limits import AcceptErrorsCondensed, BodyLimit, connection_limit, guarded_protocol
from engine.server.notify import get_notifier
from engine.server.settings import ServerConfig, resolve_key_files

if TYPE_CHECKING:
    from engine.loop.async_engine import AsyncEngine

log = structlog.get_logger("pagekeeper.server")


def build_parser() -> argparse.ArgumentParser:
    """The server's flags and the engine's, each generated from its settings dataclass (no defaults here: a flag
    not given is absent, so that a config file's value or the environment's can stand)."""
    parser = argparse.ArgumentParser(prog="python -m engine.server", description="pagekeeper OpenAI-compatible server")
    add_flags(ServerConfig, parser.add_argument_group("server"), defaults=False, bools="store_true")
    EngineConfig.add_cli_args(parser.add_argument_group("engine"), defaults=False)
    return parser


@dataclass(frozen=True)
class CommandLine:
    """What `python -m engine.server ARGV` was given: the flags on the command line and the checked [engine]
    section of its `--config` file (flags over the environment's keys over the file)."""

    flags: dict[str, Any]
    section: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the config file, resolved

    @classmethod
    def read(cls, argv: list[str]) -> CommandLine:
        flags = vars(build_parser().parse_args(argv))
        path = flags.get("config")
        if not path:
            return cls(flags)
        return cls(flags, load_engine_section(path), str(Path(path).resolve()))

    def values(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """Every setting given, one dict: the file's, then the environment's keys, then the flags."""
        keys = {key: environ[env] for key, env in SECRET_ENV.items() if environ.get(env)}  # never flags
        return {**self.section, **keys, **self.flags}

    def in_file_terms(self, message: str) -> str:
        """An error about a value the file gave (no flag overrode it) names the file's key, after its path."""
        from_file = [key for key in self.section if key not in self.flags]
        return in_file_terms(message, self.source, self.section, from_file) if self.section else message


def parse_args(argv: list[str] | None) -> tuple[ServerConfig, EngineConfig]:
    """Flags over the environment over the config file, built into the settings once (their schema checks them)."""
    return settings(CommandLine.read(list(sys.argv[1:] if argv is None else argv)))


def settings(command_line: CommandLine) -> tuple[ServerConfig, EngineConfig]:
    server_values, engine_values = split_section(command_line.values(os.environ))
    server = ServerConfig(**server_values)
    load_chat_template(server.chat_template)  # a path that is not there fails now, before the model loads
    engine = EngineConfig(**engine_values)
    require_checkpoint_dir(Path(engine.model_path()))  # before anything imports torch (resolved_device may)
    require_tokenizer_dir(engine.tokenizer or engine.model_path())
    if server.cpu_reserved_cores and (engine.resolved_device().startswith("cuda") or engine.tensor_parallel_size > 1):
        raise ConfigError(
            f"--cpu-reserved-cores {server.cpu_reserved_cores} sets a CPU engine's threads; this engine runs on "
            f"{'a GPU' if engine.resolved_device().startswith('cuda') else 'tensor-parallel ranks'}: leave it out"
        )
    return resolve_key_files(server), engine


class StartupTimeline:
    """Where a start's seconds went, from the process's creation to serving (logged with `serving`): the
    interpreter and the server's modules, then each phase of the engine's start (engine_core.py, startup.py),
    then the HTTP side.  `total_s` is the sum; the phases that are not marked here are the engine's own."""

    def __init__(self) -> None:
        import psutil

        from engine.lifecycle import process_age_s

        age = process_age_s()
        created = _time.time() - age if age is not None else psutil.Process().create_time()
        self.seconds: dict[str, float] = {"interpreter": round(_MODULE_STARTED - created, 3)}
        self._created = created
        self._mark = _MODULE_STARTED

    def mark(self, name: str) -> None:
        now = _time.time()
        self.seconds[name] = round(now - self._mark, 3)
        self._mark = now
        self.seconds["total_s"] = round(now - self._created, 3)

    def add(self, phases: dict[str, float]) -> None:
        """The engine's own phases, measured inside it; the time they do not cover is `engine_other`."""
        now = _time.time()
        self.seconds.update(phases)
        self.seconds["engine_other"] = round(max(0.0, now - self._mark - sum(phases.values())), 3)
        self._mark = now
        self.seconds["total_s"] = round(now - self._created, 3)


def log_inapplicable_flags(engine_config: EngineConfig, device: str) -> None:
    if device.startswith("cuda"):
        return
    defaults = EngineConfig()
    for name in (
        "gpu_memory_utilization",
        "swap_space",
        "enforce_eager",
        "fragmentation_buffer_factor",
    ):
        if getattr(engine_config, name) != getattr(defaults, name):
            log.info("flag_ignored_on_cpu", flag="--" + name.replace("_", "-"), value=getattr(engine_config, name))


def _engine_in_process(
    server_config: ServerConfig, engine_config: EngineConfig, threads: Any, engine_thread: Any
) -> tuple[Any, Any]:
    """The engine core in this process, on the step loop's thread; what follows a `--engine-core thread` start."""
    import torch

    from engine.cpu_threads import bind_compute_thread
    from engine.loop.llm_engine import LLMEngine

    engine_thread.call(lambda: bind_compute_thread(threads))
    # Beside the engine it replaces, this one loads and serves on half the threads (engine/core_share.py).
    core_share = CoreShare(engine_thread.call(torch.get_num_threads), server_config.share_cores_with)
    engine_thread.call(core_share)
    # graph capture and warm-ups run after serving starts (engine/runner/deferred.py): a restart's gap ends sooner
    engine = engine_thread.call(lambda: LLMEngine(engine_config, defer_startup_work=True))
    return engine, core_share


class _CoreShareByMessage:
    """The core's thread share, where the core runs in its own process: it applies it (engine/core_share.py);
    the front only passes on the hand-over's "keep the other half"."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __call__(self) -> None:
        pass

    def yield_to_successor(self) -> None:
        self.core.yield_cores()


def _spawn_core(server_config: ServerConfig, engine_config: EngineConfig) -> Any:
    """The engine core's process, started before the front imports its HTTP side: the two load side by side."""
    from engine.loop.remote import RemoteCore

    return RemoteCore(
        engine_config,
        log_level=server_config.log_level,
        stall_s=server_config.health_stall_seconds,
        max_resumes=server_config.max_resumes,
        resume_timeout_s=server_config.resume_timeout,
        cpu_reserved_cores=server_config.cpu_reserved_cores,
        share_cores_with=server_config.share_cores_with,
        wait=False,
        # with the weights kept by the supervisor's keeper a spare core costs a CUDA context, not a second copy of
        # the model: a core's death then costs the new KV cache and the first steps, not a core's whole start
        spare_core=engine_config.weights_keeper is not None,
    )


def _front_of_core_process(engine_config: EngineConfig, engine_thread: Any, core: Any) -> tuple[Any, Any]:
    """A front whose engine core runs in its own process (engine/loop/): no torch here, and the requests in
    flight outlive the core.  `core`: the RemoteCore `_spawn_core` started, ready or not."""
    from engine.loop.llm_engine import LLMEngine
    from engine.loop.remote import CoreStartFailed

    def start() -> Any:
        try:
            core.wait_ready()
        except BaseException:
            core.close()
            raise
        return LLMEngine(engine_config, defer_startup_work=True, core=core)

    try:
        engine = engine_thread.call(start)
    except CoreStartFailed as e:
        log.error("engine_core_failed_to_start", error=str(e))
        raise SystemExit(1) from None
    return engine, _CoreShareByMessage(engine.core)


def serve(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    sock: socket.socket,
    inherited: bool = False,
    control: ControlSocket | None = None,
) -> int:
    timeline = StartupTimeline()
    core = _spawn_core(server_config, engine_config) if server_config.engine_core == "process" else None
    from engine.cpu_threads import CpuThreadPlan, available_cores, bind_serving_threads, plan_cpu_threads
    from engine.loop.async_engine import AsyncEngine
    from engine.loop.engine_thread import EngineThread
    from engine.server.app import build_app
    from engine.server.metrics import EngineMetrics
    from engine.server.state import ServerState
    from engine.server.stats_log import StatsLogger, interval_from_env

    timeline.mark("imports_and_flags")
    notifier = get_notifier()
    notifier.status(f"loading {engine_config.model_name()}")
    # bound to its cores, then building the engine, then stepping it: one thread (engine/loop/engine_thread.py)
    engine_thread = EngineThread()
    if core is not None:
        engine, core_share = _front_of_core_process(engine_config, engine_thread, core)
        threads = engine.core.cpu_plan or CpuThreadPlan(available_cores(), ())  # as the core chose them
    else:
        threads = CpuThreadPlan(available_cores(), ())
        if engine_config.resolved_device() == "cpu" and engine_config.tensor_parallel_size == 1:
            threads = plan_cpu_threads(threads.compute_cores, server_config.cpu_reserved_cores)
        engine, core_share = _engine_in_process(server_config, engine_config, threads, engine_thread)
    facts = engine.core.facts
    timeline.add(facts.phases)
    log_inapplicable_flags(engine_config, facts.device)
    model_name = engine_config.model_name()
    cache_info = {
        "block_size": str(engine_config.block_size),
        "cache_dtype": engine_config.kv_cache_dtype,  # vLLM's label: auto, fp8, fp8_e4m3
        "num_gpu_blocks": str(facts.num_blocks),
        "num_cpu_blocks": str(facts.num_cpu_blocks),
        "gpu_memory_utilization": str(engine_config.gpu_memory_utilization),
        "enable_prefix_caching": str(engine_config.enable_prefix_caching),
        "max_model_len": str(facts.config.max_model_len),
    }
    metrics = EngineMetrics(
        model_name,
        cache_info,
        fragmentation_buffer_bytes=facts.fragmentation_buffer_bytes,
        names=server_config.metrics_names,
        max_model_len=facts.config.max_model_len,
    )
    if server_config.engine_core == "process":  # the core's ends and the requests resumed, counted
        engine.core.on_core_ended = metrics.core_ended
        engine.core.on_resumed = lambda r: metrics.request_resumed(r.reason, r.seconds)
    async_engine = AsyncEngine(
        engine,
        metrics,
        server_config.health_stall_seconds,
        server_config.max_waiting,
        engine_thread,
        LIFECYCLE,
        status=lambda text: get_notifier().status(text),
    )
    bind_serving_threads(threads)
    state = ServerState(
        engine=engine,
        async_engine=async_engine,
        metrics=metrics,
        model_name=model_name,
        model_root=engine_config.model_path(),
        api_key=server_config.api_key,
        admin_key=server_config.admin_key,
        enable_debug_hooks=server_config.enable_debug_hooks,
        log_requests=not server_config.disable_log_requests,
        chat_template=load_chat_template(server_config.chat_template),
        tool_call_parser=server_config.tool_call_parser,
        enable_auto_tool_choice=server_config.enable_auto_tool_choice,
    )
    if not server_config.disable_log_stats:
        async_engine.add_step_hook(StatsLogger(engine.stats, interval_from_env()))
    inflight = InflightFile(server_config.inflight_file) if server_config.inflight_file else None
    app = build_app(state, docs=not server_config.disable_fastapi_docs)
    tracker = HttpTracker(BodyLimit(app, server_config.max_request_body_bytes), inflight)
    max_connections = server_config.max_connections or connection_limit()
    protocol = guarded_protocol(max_connections, server_config.header_timeout)

    config = uvicorn.Config(
        tracker,
        log_level=server_config.uvicorn_log_level,
        log_config=None,  # uvicorn's lines go through our JSON renderer (engine/logs.py), not its own plain format
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="off",
        http=protocol,
    )
    host, port = sock.getsockname()[:2]
    server = DrainOnTermServer(
        config,
        async_engine,
        tracker,
        server_config.drain_timeout,
        handover=inherited,
        serving_status=f"serving {model_name} on {host}:{port}",
        control=control,
        core_share=core_share,
    )
    async_engine.add_loop_hook(core_share)
    # The watchdog is pinged from the step loop, and only while the HTTP loop is alive too.
    async_engine.add_step_hook(lambda: server.http_loop_alive(notifier.watchdog_interval) and notifier.watchdog())
    # everything built so far lives as long as the server: out of the collector's full passes (engine/gc_heap.py)
    frozen = freeze_startup_heap()
    async_engine.start()

    def announce() -> None:
        timeline.mark("http_server")
        log.info(
            "serving",
            url=f"http://{host}:{port}",
            model=model_name,
            pid=os.getpid(),
            socket="inherited" if inherited else "bound",
            systemd_notify=notifier.enabled,
            watchdog_s=notifier.watchdog_interval,
            gc_frozen_objects=frozen,
            startup=timeline.seconds,
        )

    server.announce = announce  # logged once the server listens with its signal handlers in place
    try:
        server.run(sockets=[sock])
    finally:
        async_engine.stop()
        if server_config.engine_core == "process":
            engine.close()  # the core leaves (and frees its device) before this process does
    log.info("stopped", reason=server.exit_reason)
    return 0


# After the listening socket is closed on SIGTERM, connections accepted just before get this long to
# send their request (it is admitted, not refused) before the drain starts answering 503.
ACCEPT_GRACE_S = 0.25
# A stop without draining still answers what is in flight (503 "restarting") and closes idle
# kept-alive connections cleanly, for at most this long.
STOP_NOW_GRACE_S = 2.0


def stop_accepting(servers: list[asyncio.Server]) -> None:
    """Stop taking connections off the listening sockets, without closing the servers yet.

    asyncio accepts a connection in one loop iteration and attaches its transport to the server in
    the next; `Server.close()` in between makes that attach fail, and the connection, whose request
    may already be in its buffer, is dropped with a TCP reset.  So the selector loop first stops
    watching the listening sockets, and the servers are closed only after the connections already
    accepted have attached (and sent their requests, which are admitted and drained).  Other loops
    (uvloop) have no such step and are closed directly.
    """
    loop = asyncio.get_running_loop()
    for server in servers:
        if isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
            for sock in server.sockets:
                loop.remove_reader(sock.fileno())
        else:
            server.close()


class DrainOnTermServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM drains (or hands over) and whose SIGINT fails in-flight work cleanly.

    `handover` (the listening socket is inherited: systemd or opsctl hold it open): SIGTERM stops
    accepting and hands the traffic over to the next engine (engine/server/handover.py), no 503 at
    all.  Otherwise SIGTERM refuses new requests with 503 while in-flight ones finish.  SIGINT or a
    second SIGTERM stops now; a third exits without waiting.  The supervisor sends the same requests
    over the control socket, with its own timeout.  Tells systemd: READY=1 once serving, STOPPING=1.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        async_engine: AsyncEngine,
        tracker: HttpTracker,
        drain_timeout: float,
        handover: bool = False,
        serving_status: str = "serving",
        control: ControlSocket | None = None,
        core_share: CoreShare | None = None,
    ) -> None:
        super().__init__(config)
        self.core_share = core_share
        self.async_engine = async_engine
        self.tracker = tracker
        self.drain_timeout = drain_timeout
        self.handover = handover
        self.serving_status = serving_status
        self.control = control
        self.exit_reason = "signal"
        self._stopping: str | None = None  # "drain" | "now" once asked
        self._last_tick = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        # The `serving` line, said from `startup`: uvicorn sets its signal handlers as it starts serving, and a
        # SIGTERM right after a `serving` said earlier met the default action (the process died, nothing drained).
        self.announce: Callable[[], None] = lambda: None
        if control is not None:
            control.set_in_flight_reader(lambda: tracker.in_flight)
            control.set_settled_reader(lambda: not async_engine.startup_work_pending)
            control.handlers["drain_exit"] = self._drain_exit
            control.handlers["stop_now"] = lambda req: self._request_stop("now", 0.0)
            control.handlers.update(admin_handlers(async_engine, lambda: self._loop))  # opsctl drain / resume
            control.handlers["recycle"] = self._recycle

    def _recycle(self, req: dict) -> dict:
        """The supervisor's in-place cure: rebuild the KV pool between two steps (EngineCore.recycle)."""
        try:
            report = self.async_engine.recycle().result(timeout=float(req.get("timeout_s", 30.0)))
        except ValueError as e:  # not serving
            return {"ok": False, "error": str(e)}
        except TimeoutError:
            return {"ok": False, "error": "the step loop did not reach the recycle in time"}
        return {"ok": True, **report}

    def _drain_exit(self, req: dict) -> dict:
        """The supervisor's handover: with a successor that serves already, keep half the threads while draining."""
        if req.get("successor_serving") and self.core_share is not None:
            self.core_share.yield_to_successor()
        return self._request_stop("drain", float(req.get("timeout_s", self.drain_timeout)))

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(AcceptErrorsCondensed())
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self.announce()
            get_notifier().ready(self.serving_status)
            if self.async_engine.lifecycle.phase == Phase.LOADING:
                self.async_engine.lifecycle.move(Phase.SERVING)

    async def on_tick(self, counter: int) -> bool:
        self._last_tick = time.monotonic()
        return await super().on_tick(counter)

    def http_loop_alive(self, within: float | None) -> bool:
        """The HTTP event loop ticked (every 0.1 s) within half of `within` seconds (None: always true)."""
        return within is None or time.monotonic() - self._last_tick < within / 2

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self._stopping is None:
            self._request_stop("drain", self.drain_timeout)
        elif self._stopping != "now":
            self._request_stop("now", 0.0)
        else:
            super().handle_exit(sig, frame)  # a third signal: uvicorn's own (forced) exit

    def _request_stop(self, how: str, timeout: float) -> dict:
        """Thread-safe (signal handler, control thread): start a drain/handover or an immediate stop."""
        if self._stopping == "now" or (self._stopping == how):
            return {"ok": True, "already": self._stopping}
        self._stopping = how
        if how == "now":
            # From here on every new request is answered "restarting" at once, and counted where the supervisor
            # reads what the stop cost (the engine's admission refuses in the STOPPING phase too).
            self.tracker.stopping = True
            self.async_engine.lifecycle.move(Phase.STOPPING)
        elif self.handover:  # at once, so that a supervisor asking next hears it (the drain itself starts on the loop)
            self.async_engine.lifecycle.move(Phase.HANDING_OVER)
        if self.control is not None:
            # A drain that times out then answers what is left within STOP_NOW_GRACE_S; a stop takes at most that.
            self.control.stop_deadline = time.monotonic() + timeout + STOP_NOW_GRACE_S
        loop = self._loop or asyncio.get_event_loop()
        coro = self._stop_now if how == "now" else (lambda: self._drain_then_exit(timeout))
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(coro()))
        return {"ok": True, "pid": os.getpid(), "in_flight": self.tracker.in_flight}

    async def _stop_accepting(self, reason: str) -> None:
        """Leave the held listening socket to the next engine (connections queue in the kernel)."""
        servers = getattr(self, "servers", [])
        stop_accepting(servers)
        log.info(
            "stopped_accepting",
            reason=reason,
            in_flight=self.tracker.in_flight,
            queued_connections="wait for the next engine",
        )
        await asyncio.sleep(ACCEPT_GRACE_S)
        for server in servers:
            server.close()  # our copy of the listening socket; the holder keeps it open

    async def _drain_then_exit(self, timeout: float) -> None:
        get_notifier().stopping(f"draining: {self.async_engine.num_in_flight} request(s) in flight")
        start = time.monotonic()
        if self.handover:
            await self._stop_accepting("drain")
            self.async_engine.begin_handover()
            drain = HandoverDrain(self.server_state.connections, self.tracker)
            drain.begin()
            done = await drain.wait(
                max(0.0, timeout - (time.monotonic() - start)), busy=lambda: self.async_engine.num_in_flight > 0
            )
            log.info(
                "handover_finished",
                handed_over=done,
                seconds=round(time.monotonic() - start, 3),
                in_flight=self.tracker.in_flight,
            )
            self.exit_reason = "handed_over" if done else "drain_timeout"
        else:
            result = await self.async_engine.drain(timeout)
            self.exit_reason = "drained" if result.drained else "drain_timeout"
        if self._stopping == "drain":
            if self.exit_reason == "drain_timeout":
                # Requests still running are answered "restarting" (a retryable 503, or an error event mid-stream),
                # counted where the supervisor reads them, rather than cut without a word when the process exits.
                # With none running, kept-alive client connections may still be open: they too are closed only once
                # idle, a request sent on one meanwhile answered "restarting".  uvicorn's own shutdown closes them at
                # once, and resets a request its client sends at that moment (a CI run lost two requests so).
                aborted = await self._answer_restarting()
                log.warning("drain_timeout_answered", aborted=aborted, unanswered=self.tracker.in_flight)
            self.should_exit = True

    async def _answer_restarting(self) -> int:
        """Fail every admitted request with "restarting" and let each handler write it; returns how many."""
        self.tracker.closing = True
        self.tracker.stopping = True  # requests that reach it from now on are answered "restarting" at once,
        # and it counts each one the abort below answers with a 503 or an error event
        aborted = self.async_engine.abort_all(RESTARTING_MESSAGE)
        # Let each handler write its error response, and close kept-alive connections only once they
        # are idle (a request that arrives on one meanwhile is answered "restarting", with Connection:
        # close): closing a connection at the moment its client sends on it is a reset, not a 503.
        drain = HandoverDrain(self.server_state.connections, self.tracker)
        drain.begin()
        await drain.wait(STOP_NOW_GRACE_S, busy=lambda: self.async_engine.num_in_flight > 0)
        return aborted

    async def _stop_now(self) -> None:
        get_notifier().stopping("stopping without draining")
        if self.handover:
            await self._stop_accepting("stop_now")
        aborted = await self._answer_restarting()
        log.warning("stopped_now", aborted=aborted, unanswered=self.tracker.in_flight)
        self.exit_reason = "stopped_now"
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    pause_startup_collections()  # until the start-up heap is frozen (engine/gc_heap.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line = CommandLine({})
    try:
        command_line = CommandLine.read(argv)
        server_config, engine_config = settings(command_line)
        configure_logging(server_config.log_level, force=True)
        inherited = inherited_socket(server_config.listen_fd)
        sock = inherited or bind(server_config.host, server_config.port)
        control = ControlSocket(server_config.control_socket, sock, LIFECYCLE) if server_config.control_socket else None
        try:
            return serve(server_config, engine_config, sock, inherited=inherited is not None, control=control)
        finally:
            if control is not None:
                control.close()
    except ConfigError as e:
        print(f"error: {command_line.in_file_terms(str(e))}", file=sys.stderr)  # a --config file's keys, not flags
        return 2
    finally:
        resume_startup_collections()  # a start that failed before the freeze: the collector back on


def exit_without_teardown(code: int) -> NoReturn:
    """Leave once the server has stopped, skipping the interpreter's module teardown.

    With torch loaded that teardown took about 2 s on a 2-core host (0.1 s without it); since the start-up heap
    is frozen (engine/gc_heap.py) it takes 0.35 s of CPU against 0.12 s (`python -m benchmarks.startup_phases`).
    It frees nothing the kernel does not free with the process: sockets, files, GPU memory.  Those seconds
    delayed every restart (the successor waits for the exit where the old engine holds the GPU), and kept a
    silent process that a supervisor could take for hung.  What registered for the exit still runs first:
    tensor-parallel workers are stopped, logs flushed.
    """
    started = time.monotonic()
    PROCESS_EXIT.without_teardown = True  # the exit functions may skip an orderly leave (engine/lifecycle.py)
    atexit._run_exitfuncs()
    if code == 0:  # an engine that served (a refusal's exit 2 stays its one error line)
        log.info("exiting", code=code, exit_functions_s=round(time.monotonic() - started, 3))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
