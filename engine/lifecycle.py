"""The serving lifecycle of one engine process, as one state that every part reads and writes.

Before this, "is it draining?" was four flags on four objects (the async engine, the HTTP server, the control
socket, the metrics).  Now the state lives here; each part asks it or registers to hear about changes (the
control socket answers the supervisor from it, /health and the `vllm:engine_draining` gauge follow it, systemd
hears a status line).

    loading ──> standby ──> loading ──> serving <──> recycling
       │                                  │   └────> draining ──> serving (resume) / stopping
       └──────────────────────────────────┴───────> handing_over ──> stopping

- loading: the model is coming up (imports, weights, KV cache);
- standby: everything that needs no device memory is ready, and the engine waits for the one it replaces to
  exit and free the GPU (a restart that does not reload the model, engine/keeper/);
- serving: admitting and running requests;
- recycling: the KV pool and prefix cache are being rebuilt in place (requests in flight are requeued, none
  lost), admissions wait;
- draining: a load balancer's drain: new requests get 503 until resumed;
- handing_over: the listening socket belongs to the next engine; what reaches this one on its open
  connections is still served, then it exits;
- stopping: it leaves now; what is in flight is answered "restarting".
"""

from __future__ import annotations

import threading
from enum import Enum
from pathlib import Path
from typing import Callable


class Phase(str, Enum):
    LOADING = "loading"
    STANDBY = "standby"
    SERVING = "serving"
    RECYCLING = "recycling"
    DRAINING = "draining"
    HANDING_OVER = "handing_over"
    STOPPING = "stopping"

    @property
    def admits(self) -> bool:
        """New requests are taken (recycling queues them until the pool is back)."""
        return self in (Phase.SERVING, Phase.RECYCLING, Phase.HANDING_OVER)

    @property
    def leaving(self) -> bool:
        """The process is on its way out (drained requests do not come back)."""
        return self in (Phase.HANDING_OVER, Phase.STOPPING)


# Which phase may follow which; anything else is a bug (raised, not ignored).
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.LOADING: frozenset({Phase.STANDBY, Phase.SERVING, Phase.DRAINING, Phase.HANDING_OVER, Phase.STOPPING}),
    Phase.STANDBY: frozenset({Phase.LOADING, Phase.STOPPING}),
    Phase.SERVING: frozenset({Phase.RECYCLING, Phase.DRAINING, Phase.HANDING_OVER, Phase.STOPPING}),
    Phase.RECYCLING: frozenset({Phase.SERVING, Phase.HANDING_OVER, Phase.STOPPING, Phase.DRAINING}),
    Phase.DRAINING: frozenset({Phase.SERVING, Phase.HANDING_OVER, Phase.STOPPING}),
    Phase.HANDING_OVER: frozenset({Phase.STOPPING}),
    Phase.STOPPING: frozenset(),
}


class Lifecycle:
    """The process's phase; thread-safe.  Listeners run on the thread that changed it, after the change."""

    def __init__(self) -> None:
        self._phase = Phase.LOADING
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._listeners: list[Callable[[Phase, Phase], None]] = []

    @property
    def phase(self) -> Phase:
        return self._phase

    def listen(self, listener: Callable[[Phase, Phase], None]) -> None:
        """Call `listener(old, new)` on every change."""
        self._listeners.append(listener)

    def move(self, new: Phase) -> bool:
        """Change to `new`; False (no change) when already there.  A transition the diagram does not allow
        raises ValueError, except into STOPPING, which is always allowed (a second signal stops at once)."""
        with self._changed:
            old = self._phase
            if old == new:
                return False
            if new not in _NEXT[old] and new != Phase.STOPPING:
                raise ValueError(f"engine lifecycle: {old.value} -> {new.value} is not a transition")
            self._phase = new
            self._changed.notify_all()
        for listener in self._listeners:
            listener(old, new)
        return True

    def wait_until(self, predicate: Callable[[Phase], bool], timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self._phase), timeout)


LIFECYCLE = Lifecycle()  # this process's (an engine process serves one engine)


class _Exit:
    """How this process ends: `without_teardown` once a server leaves through os._exit after its exit functions
    (engine/server/__main__.py), so that those functions may skip what only an orderly interpreter exit needs (the
    tensor-parallel ranks' NCCL leave).  An offline script's interpreter exit stays orderly."""

    without_teardown = False


PROCESS_EXIT = _Exit()


STANDBY_LIMIT_S = 900.0  # a restart's successor waits this long at most for the engine it replaces


def descendants(pid: int) -> set[int]:
    """The processes under `pid` now (Linux /proc: every thread's children, recursively; empty elsewhere)."""
    import os

    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    children = {int(c) for c in f.read().split()}
            except OSError:
                continue
            todo.extend(children - found)
            found |= children
    return found


STANDBY_POLL_S = 0.2  # how often a standby looks again at the processes under the one it waits for


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22): with the pid, a name no
    later process has.  None: no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def process_age_s(pid: int | None = None) -> float | None:
    """Seconds since process `pid` (this one by default) started, from /proc/uptime and its start time in clock
    ticks, both counted from boot (None without /proc).  psutil's create_time adds the boot time, which /proc/stat
    gives in whole seconds: its ages were up to a second too long, and start-up timelines began before the process."""
    import os

    ticks = _start_ticks(os.getpid() if pid is None else pid)
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    return None if ticks is None else max(0.0, uptime - int(ticks) / os.sysconf("SC_CLK_TCK"))


def released_marker(pid: int) -> Path | None:
    """Where process `pid` says it has freed its device memory (engine/runner/release.py); None: no such process.
    Under the cache folder, which an engine and its successor share (engine/cache_dir.py)."""
    from engine.cache_dir import cache_root

    ticks = _start_ticks(pid)
    return None if ticks is None else cache_root() / "released" / f"{pid}-{ticks}"


def announce_released(held_bytes: int) -> bool:
    """Tell a standby successor that this process, which is exiting, holds no more device memory than
    `held_bytes` (its allocator's; the context's come on top): it stops waiting for this process.  False when the
    marker cannot be written (the successor then waits for the exit)."""
    import json
    import os

    marker = released_marker(os.getpid())
    if marker is None:
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        for old in marker.parent.iterdir():  # markers of processes that are gone
            pid = old.name.split("-")[0]
            if pid.isdigit() and released_marker(int(pid)) != old:
                old.unlink(missing_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"held_bytes": held_bytes}))
        tmp.rename(marker)
    except OSError:
        return False
    return True


def retract_released() -> None:
    """This process takes device memory again (a standby that is promoted): it no longer counts as gone."""
    import os

    marker = released_marker(os.getpid())
    if marker is not None:
        marker.unlink(missing_ok=True)


def _released(pid: int) -> bool:
    marker = released_marker(pid)
    return marker is not None and marker.exists()


def standby_until_exit(
    pid: int, limit_s: float | None = STANDBY_LIMIT_S, timings: dict[str, float] | None = None
) -> float:
    """In STANDBY, wait for process `pid` and every process under it to exit (the engine this one replaces frees
    the GPU: its engine core or tensor-parallel ranks hold device memory too, and a killed engine's children die a
    moment after it); the seconds waited.  A process that announced it has freed its device memory
    (`announce_released`) counts as gone: its exit's teardown is not waited for.

    A spare engine the supervisor keeps ready waits without a limit (`limit_s` None); every standby also ends if
    this process's parent (its supervisor) exits first: a successor nobody supervises must not wake up and serve
    beside whatever a new supervisor starts.  TimeoutError past `limit_s`, SystemExit when the parent is gone.
    `timings` receives `after_pid_s`: how long the wait went on after `pid` itself exited or announced its release
    (its engine core's and ranks' exits or releases), and `released`: 1.0 if `pid` announced, 0.0 if it exited."""
    import os
    import select
    import time

    started = time.monotonic()
    deadline = None if limit_s is None else started + limit_s
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 0.0
    parent = os.getppid()
    try:
        parent_fd: int | None = os.pidfd_open(parent) if parent > 1 else None
    except ProcessLookupError:
        parent_fd = None
    moved = LIFECYCLE.phase == Phase.LOADING and LIFECYCLE.move(Phase.STANDBY)
    under: set[int] = set()
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if parent_fd is not None:
            poller.register(parent_fd, select.POLLIN)
        while True:
            under |= descendants(pid)  # seen while it lives: they may outlive it by a moment
            wait = STANDBY_POLL_S if deadline is None else min(STANDBY_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"process {pid} (the engine this one replaces) did not exit within {limit_s:.0f} s")
            ready = poller.poll(wait * 1000)
            if not ready:
                if _released(pid):
                    break
                continue
            if parent_fd is not None and any(f == parent_fd for f, _ in ready) and not any(f == fd for f, _ in ready):
                raise SystemExit(
                    f"the process that started this one (pid {parent}: the supervisor, or rank 0 for a tensor-parallel "
                    "rank) is gone: a standby engine does not start on its own"
                )
            break
        pid_done = time.monotonic()
        if timings is not None:
            timings["released"] = 1.0 if _released(pid) else 0.0
        wait_gone_or_released(under, deadline)
        if timings is not None:
            timings["after_pid_s"] = round(time.monotonic() - pid_done, 3)
    finally:
        os.close(fd)
        if parent_fd is not None:
            os.close(parent_fd)
        if moved and LIFECYCLE.phase == Phase.STANDBY:
            LIFECYCLE.move(Phase.LOADING)
    return time.monotonic() - started


def wait_gone_or_released(pids: set[int], deadline: float | None) -> None:
    """Until every one of `pids` has exited or announced its device memory free (TimeoutError at `deadline`, a
    time.monotonic() value; None: no limit)."""
    import os
    import select
    import time

    for pid in sorted(pids):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not _released(pid):
                wait = STANDBY_POLL_S if deadline is None else min(STANDBY_POLL_S, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"process {pid}, under the engine this one replaces, did not exit in time")
                if poller.poll(wait * 1000):
                    break
        finally:
            os.close(fd)
