"""opsctl: start, supervise, drain and restart the pagekeeper engine."""

from engine.lean_imports import import_structlog_without_rich

import_structlog_without_rich()  # first, before any module of ours imports structlog (engine/lean_imports.py says why)
