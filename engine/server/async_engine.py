"""The bridge between HTTP handlers (asyncio) and the engine's step loop (its own thread).

The step loop runs in one dedicated thread so that a long step never blocks the event loop, and
so that "the loop is alive" is a single fact the health check can read: every iteration stamps
`heartbeat`.  Handlers never touch the engine: they post commands to an inbox and wait on a
per-request slot that always holds the request's latest (cumulative) output, so a slow client
costs memory for one output, not for a queue of them.

Drain is a state of this object: no new admissions, in-flight requests run to completion.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import structlog
from engine.llm_engine import LLMEngine, RequestRejected
from engine.metrics import EngineMetrics, EngineSnapshot
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.notify import get_notifier

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


@dataclass(eq=False)
class _Slot:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None
    done: bool = False

    def publish(self, out: RequestOutput | None = None, error: BaseException | None = None) -> None:
        """Called from the step-loop thread."""
        if out is not None:
            self.latest = out
            self.done = out.finished
        if error is not None:
            self.error = error
            self.done = True
        self.loop.call_soon_threadsafe(self.event.set)


@dataclass
class DrainResult:
    drained: bool
    in_flight_at_start: int
    in_flight: int
    waited_seconds: float


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, health_stall_seconds: float = 30.0,
                 max_waiting: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.health_stall_seconds = health_stall_seconds
        self.max_waiting = max_waiting
        self.draining = False  # refusing new requests (503): a load balancer's drain
        self.handing_over = False  # serving what reaches it while the next engine takes new connections
        self.stopping = False  # stopped without draining: every request fails with EngineStopping
        self.stop_reason = ""
        self.heartbeat = time.monotonic()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: deque[tuple[str, object]] = deque()
        self._slots: dict[str, _Slot] = {}
        self._num_waiting = 0  # scheduler's waiting count, updated under _lock with the inbox
        self._stop = False
        self._freeze_until = 0.0  # debug hook: the loop sleeps (holding no lock) until then
        self.loop_iterations = 0  # vllm_engine_steps_total: advances whenever the loop runs
        self._on_step: list[Callable[[], None]] = []  # e.g. the systemd watchdog ping
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def add_step_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook` on the step-loop thread after every iteration (a hung loop stops calling it)."""
        self._on_step.append(hook)

    # -- admission and generation (event-loop side) ---------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._slots)

    def queue_depth(self) -> int:
        with self._lock:
            return self._num_waiting + sum(1 for op, _ in self._inbox if op == "add")

    def check_admission(self) -> None:
        if self.stopping:
            raise EngineStopping(self.stop_reason)
        if self.draining:
            raise EngineDraining("the engine is draining and accepts no new requests")
        if self.max_waiting is not None and self.queue_depth() >= self.max_waiting:
            raise EngineOverloaded(f"{self.max_waiting} requests are already waiting (--max-waiting)")

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              prompt: str | None = None) -> _Slot:
        """Accept a request into the engine's inbox, or raise; atomic on the event loop.

        Check and enqueue happen with no await in between, so a burst of concurrent handlers can
        never overshoot --max-waiting, and a refusal happens before any response header is sent.
        """
        self.check_admission()
        self.engine.validate(prompt_token_ids, params)  # RequestRejected -> 400
        slot = _Slot(asyncio.get_running_loop())
        self._slots[request_id] = slot
        self._post("add", (request_id, prompt_token_ids, params, prompt, time.monotonic()))
        return slot

    async def results(self, request_id: str, slot: _Slot) -> AsyncIterator[RequestOutput]:
        """Yield an admitted request's cumulative output until it finishes.

        Leaving early (client gone, handler cancelled) aborts the request, which frees its KV
        blocks at the next step.
        """
        try:
            while True:
                await slot.event.wait()
                slot.event.clear()
                if slot.error is not None:
                    raise slot.error
                if slot.latest is not None:
                    yield slot.latest
                if slot.done:
                    return
        finally:
            self.release(request_id, slot)

    def release(self, request_id: str, slot: _Slot) -> None:
        """Forget a request's slot; abort it in the engine if it has not finished."""
        self._slots.pop(request_id, None)
        if not slot.done:
            slot.done = True
            self._post("abort", request_id)

    def _post(self, op: str, arg: object) -> None:
        with self._wake:
            self._inbox.append((op, arg))
            self._wake.notify()

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> DrainResult:
        """Stop admitting, then wait until every in-flight request finished or `timeout` passed."""
        if not self.draining:
            log.info("drain_started", in_flight=self.num_in_flight, timeout_s=timeout)
            get_notifier().status(f"draining: {self.num_in_flight} request(s) in flight")
        self.draining = True
        self.metrics.set_draining(True)
        start = time.monotonic()
        at_start = self.num_in_flight
        while self._slots and time.monotonic() - start < timeout:
            await asyncio.sleep(0.05)
        result = DrainResult(drained=not self._slots, in_flight_at_start=at_start,
                             in_flight=self.num_in_flight, waited_seconds=round(time.monotonic() - start, 3))
        log.info("drain_finished", **result.__dict__)
        return result

    def begin_handover(self) -> None:
        """Report draining (health, metric) while still admitting requests on open connections."""
        self.handing_over = True
        self.metrics.set_draining(True)
        get_notifier().status(f"handing over: {self.num_in_flight} request(s) in flight")
        log.info("handover_started", in_flight=self.num_in_flight)

    def abort_all(self, reason: str) -> int:
        """Refuse new requests and fail every admitted one with EngineStopping; returns how many."""
        self.stopping = True
        self.stop_reason = reason
        self.draining = True
        self.metrics.set_draining(True)
        count = self.num_in_flight
        self._post("abort_all", reason)
        log.warning("aborting_in_flight", requests=count, reason=reason)
        return count

    def resume(self) -> None:
        """Undo a drain (admit again)."""
        self.draining = False
        self.metrics.set_draining(False)
        get_notifier().status("serving (drain cancelled)")
        log.info("drain_cancelled")

    # -- health ---------------------------------------------------------------------------------

    def health(self) -> str:
        """'ok', 'draining' or 'stalled' (work is waiting and the loop has not advanced in time)."""
        if not self._thread.is_alive():
            return "stalled"
        if self.draining or self.handing_over:
            return "draining"
        with self._lock:
            has_work = bool(self._inbox) or self.engine.has_unfinished_requests()
        if has_work and time.monotonic() - self.heartbeat > self.health_stall_seconds:
            return "stalled"
        return "ok"

    def freeze(self, seconds: float) -> None:
        """Debug hook: make the step loop stop advancing for `seconds` (tests of hang detection)."""
        self._freeze_until = time.monotonic() + seconds
        log.warning("step_loop_frozen", seconds=seconds)

    # -- the step loop (its own thread) ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._inbox and not self.engine.has_unfinished_requests() and not self._stop:
                    self._wake.wait(timeout=_IDLE_WAKEUP_S)
                if self._stop:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
                self._apply(commands)
                self._num_waiting = self.engine.core.scheduler.num_waiting
            while time.monotonic() < self._freeze_until:
                time.sleep(0.05)
            self.heartbeat = time.monotonic()
            self.loop_iterations += 1
            if self.engine.has_unfinished_requests():
                self._step()
            with self._lock:
                self._num_waiting = self.engine.core.scheduler.num_waiting
            self.metrics.update(self._snapshot())
            for hook in self._on_step:
                hook()

    def _apply(self, commands: list[tuple[str, object]]) -> None:
        for op, arg in commands:
            if op == "abort_all":
                self._fail_everything(EngineStopping(str(arg)))
                continue
            if op == "abort":
                out = self.engine.abort_request(arg)  # type: ignore[arg-type]
                if out is not None:
                    self._finished(out)
                continue
            request_id, ids, params, prompt, arrival = arg  # type: ignore[misc]
            slot = self._slots.get(request_id)
            try:
                self.engine.add_request(request_id, {"prompt_token_ids": ids, "prompt": prompt}, params,
                                        arrival_time=arrival)
            except RequestRejected as e:
                self.metrics.request_failed("rejected")
                if slot is not None:
                    slot.publish(error=e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug, not an input: fail the batch, keep serving
            log.exception("step_failed")
            self._fail_everything(EngineStepError(f"the engine step failed: {e}"))
            return
        for out in outputs:
            slot = self._slots.get(out.request_id)
            if out.finished:
                self._finished(out)
            if slot is not None:
                slot.publish(out)

    def _finished(self, out: RequestOutput) -> None:
        t = out.metrics
        if t is not None:
            self.metrics.request_finished(
                out.outputs[0].finish_reason or "abort", t.arrival_time, t.first_scheduled_time,
                t.first_token_time, t.finished_time or time.monotonic(),
                num_output_tokens=len(out.outputs[0].token_ids),
            )

    def _fail_everything(self, error: Exception) -> None:
        for request_id in list(self.engine.request_ids()):
            self.engine.abort_request(request_id)
            self.metrics.request_failed("error")
            slot = self._slots.get(request_id)
            if slot is not None:
                slot.publish(error=error)

    def _snapshot(self) -> EngineSnapshot:
        snap = self.engine.core.snapshot()
        snap.steps = self.loop_iterations  # the loop's heartbeat, idle iterations included
        return snap
