"""`python -m engine.keeper --socket PATH [engine flags]`: run the weights keeper (engine/keeper/__init__.py).

Takes the engine's own flags (server-only flags the supervisor passes along are ignored), so the keeper and the
engines it serves agree on the checkpoint, dtype, quantization and tensor-parallel split by construction.  A
checkpoint that cannot be loaded is one line on stderr and exit 2, as for the engine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from engine.config import ConfigError, EngineConfig
from engine.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.keeper", description="pagekeeper weights keeper")
    parser.add_argument("--socket", required=True, help="Unix socket to serve the weights on.")
    EngineConfig.add_cli_args(parser.add_argument_group("engine"))
    args, _server_flags = parser.parse_known_args(argv)
    configure_logging()
    try:
        config = EngineConfig.from_cli_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.resolved_device().startswith("cuda"):
        # one allocation per device, shared over IPC: the expandable segments the engine prefers cannot be
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    from engine.keeper.server import Keeper

    keeper = Keeper(config, Path(args.socket))
    signal.signal(signal.SIGTERM, lambda *_: keeper.request_exit())
    try:
        keeper.load()
    except ConfigError as e:
        keeper.fail(str(e))
        keeper.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        keeper.wait_exit()
    finally:
        keeper.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown of torch and the kept memory: the kernel and the driver free it
