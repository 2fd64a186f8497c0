"""`opsctl top`'s terminal: rich draws the figures (opsctl/top.py) on the alternate screen every interval; keys are
read in cbreak mode (q quits, as does Ctrl-C) and the terminal's modes are put back however it ends.

rich is imported here only: this module is loaded by the `top` command alone, so no other command pays for it
(tests/opsctl/test_start_imports.py).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import termios
import time
import tty
from types import FrameType
from typing import Any

from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from opsctl.state import EXIT_NOT_RUNNING, EngineState
from opsctl.top import Figures, Latency, Watcher

QUIT_KEYS = (b"q", b"Q", b"\x03")  # \x03: Ctrl-C where the terminal does not turn it into SIGINT
NONE = "-"
COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("instance", "left"),
    ("state", "left"),
    ("running", "right"),
    ("waiting", "right"),
    ("KV cache", "right"),
    ("tok/s", "right"),  # generated
    ("req/s", "right"),  # finished
    ("TTFT ms\np50/p90/p99", "right"),
    ("TPOT ms\np50/p90/p99", "right"),
    ("model", "left"),
)


def _number(value: float | None, digits: int = 1) -> str:
    return NONE if value is None else f"{value:.{digits}f}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return NONE
    ms = seconds * 1000
    return f"{ms:.1f}" if ms < 10 else f"{ms:.0f}"


def _latency(lat: Latency) -> str:
    return NONE if not lat.count else "/".join(_ms(v) for v in (lat.p50, lat.p90, lat.p99))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def render(figures: list[Figures], interval: float) -> RenderableType:
    """One frame: the engines (one row per instance), their GPUs, the supervisors' recent decisions."""
    header = Text.assemble(
        ("opsctl top", "bold"),
        f"   every {interval:g} s   {time.strftime('%H:%M:%S')}   ",
        ("q quits", "dim"),
    )
    window = next((f.window_s for f in figures if f.window_s), None)
    engines = Table(
        box=box.ROUNDED,
        caption=f"rates and percentiles over the last {window:.1f} s" if window else "rates after the next refresh",
        caption_justify="left",
    )
    for name, justify in COLUMNS:
        engines.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    gpus = Table(
        "instance", "gpu", "memory GiB", "util", "temp", box=box.SIMPLE_HEAD, title="GPUs", title_justify="left"
    )
    decisions = Table(
        "instance", "time", "decision", box=box.SIMPLE_HEAD, title="recent decisions", title_justify="left"
    )
    no_gpus, problems = [], []
    for f in figures:
        state_style = "green" if f.state == EngineState.SERVING else "yellow"
        engines.add_row(
            f.instance,
            Text(f.state, style=state_style),
            NONE if f.running is None else str(f.running),
            NONE if f.waiting is None else str(f.waiting),
            NONE if f.kv_cache_usage is None else percent(f.kv_cache_usage),
            _number(f.generation_tokens_per_s),
            _number(f.requests_per_s, 2),
            _latency(f.ttft),
            _latency(f.tpot),
            f.model or NONE,
        )
        for g in f.gpus:
            gpus.add_row(
                f.instance,
                str(g.index) + (f" {g.name}" if g.name else ""),
                f"{_gib(g.memory_used_bytes)} / {_gib(g.memory_total_bytes)}",
                NONE if g.utilization_ratio is None else f"{g.utilization_ratio * 100:.0f}%",
                NONE if g.temperature_celsius is None else f"{g.temperature_celsius:.0f} C",
            )
        if not f.gpus and f.gpu_detail:
            no_gpus.append(Text(f"GPUs of {f.instance}: {f.gpu_detail}"))
        for d in f.decisions:
            decisions.add_row(f.instance, time.strftime("%H:%M:%S", time.localtime(d.time)), d.text)
        if f.error:
            problems.append(Text(f"{f.instance}: {f.error}", style="red"))
    tables = [t for t in (gpus, decisions) if t.row_count]
    return Group(header, engines, *no_gpus, *tables, *problems)


def document(figures: list[Figures], interval: float) -> dict[str, Any]:
    """What --json prints: the figures of every instance at one moment."""
    return {"time": time.time(), "interval_s": interval, "instances": [f.to_json() for f in figures]}


def run(watchers: list[Watcher], interval: float, once: bool, as_json: bool) -> int:
    """The exit code: 0, or with --once 3 when an instance's supervisor is not running."""
    try:
        if once:
            return _once(watchers, interval, as_json)
        if as_json:
            return _json_lines(watchers, interval)
        return _live(watchers, interval)
    finally:
        for w in watchers:
            w.close()


def _step(watchers: list[Watcher]) -> list[Figures]:
    return [w.step() for w in watchers]


def _once(watchers: list[Watcher], interval: float, as_json: bool) -> int:
    """Two scrapes `interval` apart (rates need two), one frame or one JSON document."""
    first = _step(watchers)
    if any(f.state != EngineState.NOT_RUNNING for f in first):
        time.sleep(interval)
    figures = _step(watchers)
    if as_json:
        print(json.dumps(document(figures, interval)), flush=True)
    else:  # a pipe gets a table as wide as its figures rather than 80 columns
        Console(width=None if sys.stdout.isatty() else 200).print(render(figures, interval))
    return EXIT_NOT_RUNNING if any(f.state == EngineState.NOT_RUNNING for f in figures) else 0


def _json_lines(watchers: list[Watcher], interval: float) -> int:
    """One JSON document a line per refresh, until interrupted (or the reader goes away)."""
    try:
        while True:
            print(json.dumps(document(_step(watchers), interval)), flush=True)
            time.sleep(interval)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0


_stop: list[int] = []  # the exit code a signal asked for (Ctrl-C: 0, SIGTERM/SIGHUP: 128 + its number)


def _note_stop(signum: int, frame: FrameType | None) -> None:
    """Noted, not raised: an exception raised wherever the signal lands (inside rich's console lock, in the middle of
    an HTTP scrape) could leave a lock held that the terminal's restoration then waits on forever; the loop sees the
    note within one refresh."""
    _stop.append(0 if signum == signal.SIGINT else 128 + signum)


def _live(watchers: list[Watcher], interval: float) -> int:
    keys = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(keys) if keys is not None else None
    _stop.clear()
    handlers = {sig: signal.signal(sig, _note_stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if keys is not None:
            tty.setcbreak(keys)
        live = Live(
            render(_step(watchers), interval),
            console=Console(),
            screen=True,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        with live:
            while not _stop and not _quit_within(keys, interval):
                live.update(render(_step(watchers), interval), refresh=True)
        return _stop[0] if _stop else 0
    except KeyboardInterrupt:
        return 0
    finally:
        if keys is not None and saved is not None:
            termios.tcsetattr(keys, termios.TCSADRAIN, saved)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _quit_within(fd: int | None, seconds: float) -> bool:
    """Wait `seconds` for a quit key on `fd`; True when one came."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not _stop:
        if fd is None:
            time.sleep(left)
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        data = os.read(fd, 64)
        if not data:  # the terminal went away: no more keys, keep drawing until a signal
            fd = None
            continue
        if any(k in data for k in QUIT_KEYS):
            return True
    return False


def percent(ratio: float) -> str:
    """A share as a percentage, with a second decimal below 1 %: a few requests in a large pool hold a few
    hundredths of a percent, which "0.0%" would hide."""
    value = ratio * 100
    return f"{value:.1f}%" if value >= 1 or value == 0 else f"{value:.2f}%"
