"""structlog set-up: JSON lines when stderr is not a terminal, readable key=value when it is.

Logs go to stderr so that programs using the offline API keep stdout for their own output.
Applications that configure structlog themselves are left alone.

Each line leaves in one `write` call.  The process launcher points two engines at one engine.log during a
handover, and runs them with PYTHONUNBUFFERED=1: structlog's PrintLogger writes the message and its newline as
two writes there, so the other engine's line could land between them and two JSON objects shared a line.
A single write on a file opened O_APPEND lands whole.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(level: str = "info", force: bool = False, stream: TextIO | None = None) -> None:
    """`stream` (default stderr): a container's supervisor logs to stdout, where the runtime collects its log."""
    if structlog.is_configured() and not force:
        return
    stream = stream or sys.stderr
    tty = stream.isatty()
    renderer = structlog.dev.ConsoleRenderer(colors=tty) if tty else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
