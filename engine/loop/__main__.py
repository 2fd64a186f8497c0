from engine.lean_imports import import_structlog_without_rich

import_structlog_without_rich()  # before any module of ours imports structlog (engine/lean_imports.py)

from engine.loop.core_main import leave, main  # noqa: E402

leave(main())
