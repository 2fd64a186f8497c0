"""The test run's peak memory, and the tests that set it, printed at the end of every run.

The suite must fit a 2-core, 24 GiB machine shared with other work: no test over 2 GB.  The kernel keeps two peaks
per process, its own (`RUSAGE_SELF`: pytest and every model a test loads in it) and that of its largest finished
child (`RUSAGE_CHILDREN`: servers, supervisors and benchmarks the tests start and wait for).  Read after each test,
a peak that rose was set by that test, so the summary names them.

Under pytest-xdist each worker is a pytest process of its own: each keeps its peaks and hands them to the controller
at its end (`workeroutput`), and the controller's summary names the largest of them all, per kind of process.
"""

from __future__ import annotations

import resource

import pytest

GB = 1e9
LIMIT_BYTES = 2 * GB
SHOWN = 3


class PeakRecorder:
    def __init__(self) -> None:
        self.peaks: dict[str, list[tuple[int, str]]] = {"pytest process": [], "largest child process": []}
        self._last = {name: 0 for name in self.peaks}

    @staticmethod
    def read() -> dict[str, int]:
        """Bytes (Linux reports KiB)."""
        return {
            "pytest process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "largest child process": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        }

    def after(self, nodeid: str) -> None:
        for name, peak in self.read().items():
            if peak > self._last[name]:
                self.peaks[name].append((peak, nodeid))
                self._last[name] = peak

    def lines(self) -> list[str]:
        out = []
        for name, peaks in self.peaks.items():
            if not peaks:
                continue
            top = sorted(peaks, reverse=True)[:SHOWN]
            over = " (over the 2 GB a test may use)" if top[0][0] > LIMIT_BYTES else ""
            setters = "; ".join(f"{peak / GB:.2f} GB after {nodeid}" for peak, nodeid in top)
            out.append(f"peak RSS, {name}: {top[0][0] / GB:.2f} GB{over} (raised by: {setters})")
        return out

    def merge(self, peaks: dict[str, list[tuple[int, str]]], process: str) -> None:
        """Another process's peaks (an xdist worker's), each named with the process."""
        for name, found in peaks.items():
            self.peaks.setdefault(name, []).extend((int(peak), f"{nodeid} [{process}]") for peak, nodeid in found)


_recorder = PeakRecorder()
_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def _is_controller() -> bool:
    """xdist's controller runs no test: its own rusage says nothing about them (its children are the workers)."""
    return _config is not None and _config.pluginmanager.hasplugin("dsession")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if not _is_controller():
        _recorder.after(nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: to the controller
        _recorder.after("(session end)")
        workeroutput["memory_peaks"] = {name: [list(p) for p in peaks] for name, peaks in _recorder.peaks.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    peaks = getattr(node, "workeroutput", {}).get("memory_peaks")
    if peaks:
        _recorder.merge(peaks, node.gateway.id)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _is_controller():
        _recorder.after("(session end)")
    terminalreporter.section("memory")
    for line in _recorder.lines():
        terminalreporter.write_line(line)
