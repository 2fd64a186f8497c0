"""The bridge between HTTP handlers (asyncio) and the engine's step loop (its own thread).

The step loop runs in one dedicated thread so that a long step never blocks the event loop, and
so that "the loop is alive" is a single fact the health check can read: every iteration stamps
`heartbeat`.  Handlers never touch the engine: they post typed commands to an inbox and wait on a
per-request slot.  A stream's slot receives deltas (only what is new each step) and the handler
merges whatever piled up since it last looked, so a slow client costs the memory of its unsent
text, and a fast one O(1) work per token however long its output grows.

What the engine admits follows its lifecycle phase (engine/lifecycle.py): serving admits, a load balancer's drain
refuses with 503 until resumed, a handover keeps serving what reaches it, a stop fails everything at once.  A
recycle of the KV pool (the supervisor's cheapest cure for a pool that stays full) runs on the step thread between
two steps; requests that arrive meanwhile wait in the inbox.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol, Sequence, Union

import structlog

from engine.core.admission import ValidRequest
from engine.lifecycle import Lifecycle, Phase
from engine.loop.engine_thread import EngineThread
from engine.loop.llm_engine import LLMEngine, RequestRejected
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from engine.stats import EngineSnapshot

log = structlog.get_logger("pagekeeper.server")

_IDLE_WAKEUP_S = 0.25  # an idle loop still wakes to stamp its heartbeat


class EngineOverloaded(Exception):
    """The waiting queue is at --max-waiting; the client should retry later (HTTP 429)."""


class EngineDraining(Exception):
    """The engine is draining and admits nothing new (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The step that was running this request raised; the request is failed, the engine goes on."""


class EngineStopping(RuntimeError):
    """The engine was told to stop without draining (`opsctl restart --no-drain`); the client may retry."""


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    request: ValidRequest
    kind: RequestOutputKind
    arrival_time: float


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    reason: str


@dataclass(frozen=True)
class Recycle:
    done: Future[dict[str, object]]


Command = Union[AddRequest, AbortRequest, AbortAll, Recycle]


@dataclass(eq=False)
class _Slot:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: deque[RequestOutput] = field(default_factory=deque)  # outputs not yet taken, in order
    error: BaseException | None = None
    done: bool = False

    def publish(self, out: RequestOutput | None = None, error: BaseException | None = None, wake: bool = True) -> None:
        """Called from the step-loop thread; `wake=False` leaves waking the reader to `wake_all` (one
        thread-safe call for a whole step's outputs instead of one per request: each costs a write to the
        event loop's self-pipe and a loop iteration)."""
        if out is not None:
            self.pending.append(out)
            self.done = out.finished
        if error is not None:
            self.error = error
            self.done = True
        if wake:
            self.loop.call_soon_threadsafe(self.event.set)

    def take(self) -> RequestOutput | None:
        """Everything published since the last take, as one output (deltas are joined)."""
        outs = []
        while self.pending:
            outs.append(self.pending.popleft())
        if len(outs) <= 1:
            return outs[0] if outs else None
        return merge_deltas(outs)


def wake_all(slots: list[_Slot]) -> None:
    """Wake the readers of `slots` with one thread-safe call per event loop (a server has one)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Slot]] = {}
    for slot in slots:
        by_loop.setdefault(slot.loop, []).append(slot)
    for loop, group in by_loop.items():
        loop.call_soon_threadsafe(_set_events, group)


def _set_events(slots: list[_Slot]) -> None:
    for slot in slots:
        slot.event.set()


def merge_deltas(outs: list[RequestOutput]) -> RequestOutput:
    """Join consecutive DELTA outputs of one request into one (the last one's state wins)."""
    last = outs[-1]
    merged: dict[int, CompletionOutput] = {}
    for out in outs:
        for c in out.outputs:
            m = merged.get(c.index)
            if m is None:
                merged[c.index] = CompletionOutput(
                    c.index,
                    c.text,
                    list(c.token_ids),
                    c.cumulative_logprob,
                    list(c.logprobs) if c.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
                continue
            m.text += c.text
            m.token_ids.extend(c.token_ids)
            if m.logprobs is not None and c.logprobs is not None:
                m.logprobs.extend(c.logprobs)
            m.cumulative_logprob, m.finish_reason, m.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
    return RequestOutput(
        last.request_id,
        last.prompt,
        last.prompt_token_ids,
        [merged[i] for i in sorted(merged)],
        last.finished,
        last.metrics,
    )


def _report_loop_end(loop: Future[None]) -> None:
    """A step loop that raised is logged with its traceback (health then reads "stalled" and the supervisor or
    systemd restarts the engine); one that was stopped returns quietly."""
    error = loop.exception()
    if error is not None:
        log.error("step_loop_died", error=f"{type(error).__name__}: {error}", exc_info=error)


@dataclass
class DrainResult:
    drained: bool
    in_flight_at_start: int
    in_flight: int
    waited_seconds: float


class EngineObserver(Protocol):
    """What the bridge reports: each step's snapshot and each request's end.  The HTTP server's Prometheus metrics
    (engine/server/metrics.py) are one; the loop itself keeps plain numbers."""

    def update(self, s: EngineSnapshot) -> None: ...

    def request_finished(
        self,
        reason: str,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
        num_prompt_tokens: int,
        output_token_counts: Sequence[int],
    ) -> None: ...

    def request_failed(self, reason: str) -> None: ...

    def set_draining(self, draining: bool) -> None: ...


def _say_nothing(text: str) -> object:
    return None


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineObserver,
        health_stall_seconds: float = 30.0,
        max_waiting: int | None = None,
        engine_thread: EngineThread | None = None,
        lifecycle: Lifecycle | None = None,
        status: Callable[[str], object] = _say_nothing,
    ) -> None:
        """`status`: where a drain's or a handover's progress is told (the server passes systemd's notifier)."""
        self.engine = engine
        self.status = status
        # the thread that built the engine runs its step loop (engine/loop/engine_thread.py says why)
        self._engine_thread = engine_thread or EngineThread()
        self._loop: Future[None] | None = None
        self.metrics = metrics
        self.health_stall_seconds = health_stall_seconds
        self.max_waiting = max_waiting
        self.lifecycle = lifecycle or Lifecycle()
        self.lifecycle.listen(self._phase_changed)
        self.stop_reason = ""
        self.heartbeat = time.monotonic()
        # The latest snapshot says start-up work (graph captures, warm-ups) is still to run: not settled yet.
        self.startup_work_pending = True
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: deque[Command] = deque()
        self._slots: dict[str, _Slot] = {}
        self._num_waiting = 0  # the scheduler's waiting count; written by the step loop only
        self._stop = False
        self.loop_iterations = 0  # vllm:engine_steps_total: advances whenever the loop runs
        self._on_step: list[Callable[[], object]] = []  # e.g. the systemd watchdog ping
        self._on_loop: list[Callable[[], None]] = []  # run before each iteration (test hooks)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = self._engine_thread.submit(self._run)
        self._loop.add_done_callback(_report_loop_end)

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self.engine.wake()  # a loop waiting for the core (its idle wait) sees it now
        if self._loop is not None:
            try:
                self._loop.result(timeout=10)
            except Exception:  # noqa: BLE001 - a loop that died was already reported as stalled
                pass

    def add_step_hook(self, hook: Callable[[], object]) -> None:
        """Run `hook` on the step-loop thread after every iteration (a hung loop stops calling it); what it
        returns is ignored."""
        self._on_step.append(hook)

    def add_loop_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook` on the step-loop thread before every iteration, holding no lock (a test hook
        that sleeps there makes the loop hang)."""
        self._on_loop.append(hook)

    @property
    def draining(self) -> bool:
        """Refusing new requests (503): a load balancer's drain, or a stop."""
        return self.lifecycle.phase in (Phase.DRAINING, Phase.STOPPING)

    @property
    def handing_over(self) -> bool:
        """Serving what reaches it while the next engine takes new connections."""
        return self.lifecycle.phase == Phase.HANDING_OVER

    @property
    def stopping(self) -> bool:
        """Stopped without draining: every request fails with EngineStopping."""
        return self.lifecycle.phase == Phase.STOPPING

    def _phase_changed(self, old: Phase, new: Phase) -> None:
        self.metrics.set_draining(new in (Phase.DRAINING, Phase.HANDING_OVER, Phase.STOPPING))

    # -- admission and generation (event-loop side) ---------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._slots)

    def queue_depth(self) -> int:
        with self._lock:
            return self._num_waiting + sum(1 for c in self._inbox if isinstance(c, AddRequest))

    def check_admission(self) -> None:
        if self.stopping:
            raise EngineStopping(self.stop_reason)
        if self.draining:
            raise EngineDraining("the engine is draining and accepts no new requests")
        if self.max_waiting is not None and self.queue_depth() >= self.max_waiting:
            raise EngineOverloaded(f"{self.max_waiting} requests are already waiting (--max-waiting)")

    def admit(self, request_id: str, request: ValidRequest, stream: bool) -> _Slot:
        """Accept a validated request into the engine's inbox, or raise; atomic on the event loop.

        Check and enqueue happen with no await in between, so a burst of concurrent handlers can
        never overshoot --max-waiting, and a refusal happens before any response header is sent.
        A stream gets deltas; anything else one final output.
        """
        self.check_admission()
        slot = _Slot(asyncio.get_running_loop())
        self._slots[request_id] = slot
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        self._post(AddRequest(request_id, request, kind, time.monotonic()))
        return slot

    async def results(self, request_id: str, slot: _Slot) -> AsyncIterator[RequestOutput]:
        """Yield an admitted request's outputs (deltas for a stream) until it finishes.

        Leaving early (client gone, handler cancelled) aborts the request, which frees its KV
        blocks at the next step.
        """
        try:
            while True:
                await slot.event.wait()
                slot.event.clear()
                if slot.error is not None:
                    raise slot.error
                out = slot.take()
                if out is not None:
                    yield out
                if slot.done and not slot.pending:
                    return
        finally:
            self.release(request_id, slot)

    def release(self, request_id: str, slot: _Slot) -> None:
        """Forget a request's slot; abort it in the engine if it has not finished."""
        self._slots.pop(request_id, None)
        if not slot.done:
            slot.done = True
            self._post(AbortRequest(request_id))

    def _post(self, command: Command) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()
        self.engine.wake()

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> DrainResult:
        """Stop admitting, then wait until every in-flight request finished or `timeout` passed."""
        if self.lifecycle.phase in (Phase.LOADING, Phase.SERVING, Phase.RECYCLING):
            self.lifecycle.move(Phase.DRAINING)
            log.info("drain_started", in_flight=self.num_in_flight, timeout_s=timeout)
            self.status(f"draining: {self.num_in_flight} request(s) in flight")
        start = time.monotonic()
        at_start = self.num_in_flight
        while self._slots and time.monotonic() - start < timeout:
            await asyncio.sleep(0.05)
        result = DrainResult(
            drained=not self._slots,
            in_flight_at_start=at_start,
            in_flight=self.num_in_flight,
            waited_seconds=round(time.monotonic() - start, 3),
        )
        log.info("drain_finished", **result.__dict__)
        return result

    def begin_handover(self) -> None:
        """Report draining (health, metric) while still admitting requests on open connections."""
        self.lifecycle.move(Phase.HANDING_OVER)
        self.status(f"handing over: {self.num_in_flight} request(s) in flight")
        log.info("handover_started", in_flight=self.num_in_flight)

    def abort_all(self, reason: str) -> int:
        """Refuse new requests and fail every admitted one with EngineStopping; returns how many."""
        self.stop_reason = reason
        self.lifecycle.move(Phase.STOPPING)
        count = self.num_in_flight
        self._post(AbortAll(reason))
        log.warning("aborting_in_flight", requests=count, reason=reason)
        return count

    def resume(self) -> None:
        """Undo a drain (admit again); an engine that is handing over or stopping cannot be resumed."""
        if self.lifecycle.phase != Phase.DRAINING:
            return
        self.lifecycle.move(Phase.SERVING)
        self.status("serving (drain cancelled)")
        log.info("drain_cancelled")

    # -- recycling the KV pool --------------------------------------------------------------------

    def recycle(self) -> Future[dict[str, object]]:
        """Rebuild the KV pool between two steps (EngineCore.recycle); the future holds its report.  Refused
        (ValueError) unless serving: a draining or leaving engine is not worth curing."""
        if self.lifecycle.phase not in (Phase.SERVING, Phase.RECYCLING):
            raise ValueError(f"the engine is {self.lifecycle.phase.value}: nothing to recycle")
        done: Future[dict[str, object]] = Future()
        self._post(Recycle(done))
        return done

    def _recycle(self, cmd: Recycle) -> None:
        moved = self.lifecycle.phase == Phase.SERVING and self.lifecycle.move(Phase.RECYCLING)
        try:
            outputs, report = self.engine.recycle()
            self._publish(outputs)
            cmd.done.set_result({**report.__dict__, "in_flight": self.num_in_flight})
        except Exception as e:  # a bug: report it to the caller, keep serving
            log.exception("recycle_failed")
            cmd.done.set_exception(e)
        finally:
            if moved and self.lifecycle.phase == Phase.RECYCLING:
                self.lifecycle.move(Phase.SERVING)

    # -- health ---------------------------------------------------------------------------------

    def health(self) -> str:
        """'ok', 'draining' or 'stalled' (work is waiting and the loop has not advanced in time)."""
        if self._loop is None or not self._engine_thread.running(self._loop):
            return "stalled"
        if self.draining or self.handing_over:
            return "draining"
        with self._lock:
            has_work = bool(self._inbox) or self.engine.has_unfinished_requests()
        if has_work and time.monotonic() - self.heartbeat > self.health_stall_seconds:
            return "stalled"
        return "ok"

    # -- the step loop (its own thread) ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                idle = not self._inbox and not self.engine.has_unfinished_requests()
                if idle and not self._stop and not self.engine.has_deferred_work():
                    self._wake.wait(timeout=_IDLE_WAKEUP_S)
                if self._stop:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
                self._apply(commands)
                stats = self.engine.stats()
                self._num_waiting = stats.waiting
            for hook in self._on_loop:
                hook()
            self.heartbeat = time.monotonic()
            self.loop_iterations += 1
            if self.engine.has_unfinished_requests():
                self._step()
                stats = self.engine.stats()
                with self._lock:
                    self._num_waiting = stats.waiting
            elif self.engine.has_deferred_work():
                self.engine.run_deferred()  # start-up work left for after serving began (engine/runner/deferred.py)
            stats.steps = self.loop_iterations  # the loop's heartbeat, idle iterations included
            self.startup_work_pending = stats.startup_work_pending
            self.metrics.update(stats)
            for step_hook in self._on_step:
                step_hook()

    def _apply(self, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, AbortAll):
                self._fail_everything(EngineStopping(cmd.reason))
            elif isinstance(cmd, Recycle):
                self._recycle(cmd)
            elif isinstance(cmd, AbortRequest):
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self._finished(out)
            else:
                try:
                    self.engine.add_request(
                        cmd.request_id, cmd.request, arrival_time=cmd.arrival_time, output_kind=cmd.kind
                    )
                except RequestRejected as e:  # e.g. a request id already in flight
                    self.metrics.request_failed("rejected")
                    slot = self._slots.get(cmd.request_id)
                    if slot is not None:
                        slot.publish(error=e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug, not an input: fail the batch, keep serving
            log.exception("step_failed")
            self._fail_everything(EngineStepError(f"the engine step failed: {e}"))
            return
        self._publish(outputs)
        for request_id, why in self.engine.take_failed():  # resumed too often (engine/loop/)
            self.metrics.request_failed("error")
            slot = self._slots.get(request_id)
            if slot is not None:
                slot.publish(error=EngineStopping(why))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        woken: list[_Slot] = []
        for out in outputs:
            slot = self._slots.get(out.request_id)
            if out.finished:
                self._finished(out)
            if slot is not None:
                slot.publish(out, wake=False)
                woken.append(slot)
        wake_all(woken)

    def _finished(self, out: RequestOutput) -> None:
        t = out.metrics
        if t is not None:
            counts = t.output_token_counts or [len(c.token_ids) for c in out.outputs]
            self.metrics.request_finished(
                out.outputs[0].finish_reason or "abort",
                t.arrival_time,
                t.first_scheduled_time,
                t.first_token_time,
                t.finished_time or time.monotonic(),
                num_prompt_tokens=len(out.prompt_token_ids),
                output_token_counts=counts,
            )

    def _fail_everything(self, error: Exception) -> None:
        for request_id in list(self.engine.request_ids()):
            self.engine.abort_request(request_id)
            self.metrics.request_failed("error")
            slot = self._slots.get(request_id)
            if slot is not None:
                slot.publish(error=error)
