"""Debug-level log lines captured in a test, whatever level an earlier test configured structlog to filter at."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import structlog
from structlog.testing import capture_logs


@contextlib.contextmanager
def debug_logs() -> Iterator[list[dict[str, Any]]]:
    """structlog's capture_logs with debug lines let through (configure_logging filters below info), then the
    configuration as it was."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)
