"""`python -m engine.keeper --socket PATH [--config FILE] [engine flags]`: run the weights keeper
(engine/keeper/__init__.py).

Takes the engine's command line (the [engine] section of `--config`, then the engine's flags; the server's keys
and flags are the server's), so the keeper and the engines it serves agree on the checkpoint, dtype, quantization
and tensor-parallel split by construction.  A checkpoint that cannot be loaded is one line on stderr and exit 2,
as for the engine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from engine.config import ConfigError, EngineConfig
from engine.logs import configure_logging
from engine.ops_contract.config_file import read_config_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.keeper", description="pagekeeper weights keeper")
    parser.add_argument("--socket", required=True, help="Unix socket to serve the weights on.")
    parser.add_argument("--config", default=None, help="The engine's TOML file: its [engine] section's engine keys.")
    EngineConfig.add_cli_args(parser.add_argument_group("engine"), defaults=False)
    args, _server_flags = parser.parse_known_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("socket", "config")}
    configure_logging()
    try:
        section = read_config_file(Path(args.config))["engine"] if args.config else {}
        config = EngineConfig(**{**{k: v for k, v in section.items() if k in EngineConfig.field_names()}, **flags})
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
