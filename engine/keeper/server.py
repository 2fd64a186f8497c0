"""The keeper process: load the weights once per rank, then hand them to whichever engine asks, until told to go.

It loads every tensor-parallel rank's shard on that rank's GPU (one thread per rank), each into one arena
(engine/keeper/arena.py), while its socket already answers `state` ("loading", then "ready", or "failed" with the
reason).  `weights` hands a rank's views and handles to an engine whose key matches; `exit` ends it.  It runs no
model and allocates nothing after loading, so its memory is flat for as long as it lives.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.config import ConfigError, EngineConfig
from engine.keeper.arena import TensorView, export, materialize, share
from engine.keeper.protocol import MAX_FDS, peer_uid, send_reply, weights_key
from engine.model.interface import CausalLM
from engine.model.loader import ModelInfo, build_on_meta, check_checkpoint, fill_weights, inspect_model
from engine.parallel.group import TPGroup

log = structlog.get_logger("pagekeeper.keeper")


@dataclass
class RankWeights:
    views: list[TensorView]
    handles: list[Any]
    fds: list[int]
    device_bytes: int  # what this rank's weights take on its device
    keep: list[torch.Tensor] = field(default_factory=list)  # the storages: alive as long as the keeper


class Keeper:
    def __init__(self, config: EngineConfig, socket_path: Path) -> None:
        self.config = config
        self.socket_path = socket_path
        self.state = "loading"
        self.error: str | None = None
        self.key: str | None = None
        self.ranks: dict[int, RankWeights] = {}
        self.load_seconds: float | None = None
        self._exit = threading.Event()
        socket_path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(str(socket_path))
        finally:
            os.umask(old)
        self._sock.listen(16)
        threading.Thread(target=self._serve, name="keeper-socket", daemon=True).start()

    # -- loading ----------------------------------------------------------------------------------

    def load(self) -> None:
        """Load every rank (raises ConfigError for a checkpoint that cannot be loaded)."""
        from engine.parallel.launch import rank_device

        started = time.monotonic()
        info = inspect_model(self.config)
        if self.config.load_format != "dummy":
            check_checkpoint(info)  # every tensor there with its shape, before device memory is taken for them
        self.key = weights_key(self.config, str(info.dtype).removeprefix("torch."), _quant_name(info))
        size = self.config.tensor_parallel_size
        devices = [rank_device(self.config, r) for r in range(size)]
        # Built here, one after the other: building sets torch's default dtype, which is the process's, not the
        # thread's (built on the rank threads, one rank of a 70B shape once kept a float32 tensor among bf16 ones).
        models = [build_on_meta(info, 1, devices[r], TPGroup(r, size)) for r in range(size)]
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                self.ranks[rank] = _load_rank(self.config, info, devices[rank], models[rank])
            except BaseException as e:  # reported by the loading thread
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,), name=f"keeper-rank-{r}") for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.load_seconds = round(time.monotonic() - started, 3)
        self.state = "ready"
        log.info(
            "weights_kept",
            model=str(info.path),
            ranks=size,
            bytes_per_rank=[self.ranks[r].device_bytes for r in range(size)],
            seconds=self.load_seconds,
            socket=str(self.socket_path),
        )

    def fail(self, error: str) -> None:
        self.state, self.error = "failed", error

    def request_exit(self) -> None:
        self._exit.set()

    def wait_exit(self) -> None:
        self._exit.wait()

    def close(self) -> None:
        self._sock.close()
        self.socket_path.unlink(missing_ok=True)

    # -- the socket -------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(30)
                    self._handle(conn)
                except Exception as e:  # one bad client never stops the keeper
                    log.warning("keeper_request_failed", error=str(e))

    def _handle(self, conn: socket.socket) -> None:
        import json

        if peer_uid(conn) not in (os.geteuid(), 0):
            send_reply(conn, {"ok": False, "error": "not your keeper"})
            return
        request = json.loads(conn.makefile("rb").readline() or b"{}")
        cmd = request.get("cmd")
        base = {"pid": os.getpid(), "state": self.state, "key": self.key, "error": self.error}
        if cmd == "state":
            send_reply(conn, {"ok": True, **base, "load_seconds": self.load_seconds})
        elif cmd == "exit":
            send_reply(conn, {"ok": True, **base})
            log.info("keeper_exit_requested")
            self.request_exit()
        elif cmd == "weights":
            self._weights(conn, request, base)
        else:
            send_reply(conn, {"ok": False, **base, "error": f"unknown command {cmd!r}"})

    def _weights(self, conn: socket.socket, request: dict[str, Any], base: dict[str, Any]) -> None:
        if self.state != "ready":
            send_reply(conn, {"ok": False, **base})
            return
        if request.get("key") != self.key:
            send_reply(conn, {"ok": False, **base, "error": "the keeper holds other weights (the key differs)"})
            return
        rank = int(request.get("rank", 0))
        kept = self.ranks.get(rank)
        if kept is None:
            send_reply(conn, {"ok": False, **base, "error": f"no rank {rank} here"})
            return
        payload = pickle.dumps((kept.views, kept.handles), protocol=pickle.HIGHEST_PROTOCOL)
        send_reply(conn, {"ok": True, **base, "device_bytes": kept.device_bytes}, payload, kept.fds)
        log.info("weights_handed_out", rank=rank, tensors=len(kept.views), bytes=kept.device_bytes)


def _quant_name(info: ModelInfo) -> str | None:
    return info.quant.describe() if info.quant is not None else None


def _load_rank(config: EngineConfig, info: ModelInfo, device: torch.device, model: CausalLM) -> RankWeights:
    """Fill one rank's model, built on the meta device with max_model_len 1 (the rotary tables are each engine's
    own), into one arena on its device."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    arena = materialize(model, device, shared_cpu=True)
    fill_weights(model, info, config.load_format, device)
    views, storages = export(model, arena)
    handles, fds = share(storages)
    if len(fds) > MAX_FDS:
        raise ConfigError(f"the model's weights are in {len(fds)} shared storages; the keeper passes at most {MAX_FDS}")
    device_bytes = sum(s.numel() for s in storages)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return RankWeights(views, handles, fds, device_bytes, storages)
