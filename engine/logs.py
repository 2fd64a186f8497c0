"""structlog set-up: JSON lines when stderr is not a terminal, readable key=value when it is.

Logs go to stderr so that programs using the offline API keep stdout for their own output.
Applications that configure structlog themselves are left alone.

Each line leaves in one `write` call.  The process launcher points two engines at one engine.log during a
handover, and runs them with PYTHONUNBUFFERED=1: structlog's PrintLogger writes the message and its newline as
two writes there, so the other engine's line could land between them and two JSON objects shared a line.
A single write on a file opened O_APPEND lands whole.

Libraries that log through the standard `logging` (transformers, torch, uvicorn's warnings) and Python's
`warnings` go through the same renderer once our logging is configured, so that a log collector reading JSON
lines never meets a plain one (transformers wrote `[transformers] Token indices sequence length is longer ...`
into engine.log).  transformers keeps a handler of its own: `route_library_logger` hands its records to ours.

Start-up details (`engine_ready`'s ~1,000 characters, the memory plan, each kernel choice) are `info` in a server's
log, which operators read; the offline API logs them at `debug` and one short line instead (engine/llm.py), since
its callers read stderr beside their own output.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")

# the level of the start-up details logged in this context (startup_detail): info unless startup_details_at says
_startup_level: ContextVar[int] = ContextVar("startup_detail_level", default=logging.INFO)


def startup_detail(logger: Any, event: str, **fields: Any) -> None:
    """Log one start-up detail at this context's level: info in a server, debug while the offline API starts."""
    logger.log(_startup_level.get(), event, **fields)


@contextmanager
def startup_details_at(level: int) -> Iterator[None]:
    """Start-up details logged inside this block (in this thread) go out at `level`."""
    token = _startup_level.set(level)
    try:
        yield
    finally:
        _startup_level.reset(token)


class _LibraryHandler(logging.StreamHandler[TextIO]):
    """The root logger's handler: a library's record rendered as one of our lines (one write, as ours)."""


def routing_library_logs() -> bool:
    """configure_logging() has put library records through our renderer in this process."""
    return any(isinstance(h, _LibraryHandler) for h in logging.getLogger().handlers)


def route_library_logger(name: str) -> None:
    """A library logger with a handler of its own (transformers' writes plain lines to stderr) sends its records to
    ours instead, when this process configured ours; a program that uses the offline API keeps its own set-up."""
    if not routing_library_logs():
        return
    library = logging.getLogger(name)
    for handler in list(library.handlers):
        library.removeHandler(handler)
    library.propagate = True


def configure_logging(level: str = "info", force: bool = False, stream: TextIO | None = None) -> None:
    """`stream` (default stderr): a container's supervisor logs to stdout, where the runtime collects its log."""
    if structlog.is_configured() and not force:
        return
    stream = stream or sys.stderr
    tty = stream.isatty()
    renderer = structlog.dev.ConsoleRenderer(colors=tty) if tty else structlog.processors.JSONRenderer()
    stamp: list[structlog.types.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    handler = _LibraryHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamp],
        )
    )
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, _LibraryHandler)] + [handler]
    root.setLevel(logging.WARNING)  # libraries' warnings and errors; their info stays out
    logging.captureWarnings(True)  # warnings.warn(...) too, as logger py.warnings
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
