"""What the keeper and an engine say to each other, and the key that tells whether kept weights are the ones wanted.

One request per connection on a unix socket (0600, in the supervisor's private runtime dir; a peer of another
uid is refused): a JSON line in, a JSON line back, and for `weights` a pickled payload after it (the views and
handles of engine/keeper/arena.py, whose CPU file descriptors ride on the JSON line as SCM_RIGHTS).  Pickle
because torch's own IPC arguments are Python objects; both ends are this package, run by one user.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, ResolvedConfig

MAX_FDS = 250  # SCM_RIGHTS carries at most 253 descriptors in one message


def weights_key(config: EngineConfig | ResolvedConfig, dtype: str, quantization: str | None) -> str:
    """What makes two loads give the same weights: the checkpoint's files (path, sizes, modification times), the
    dtype and quantization they were loaded as, the load format, the tensor-parallel split and the GPUs
    visible.  max_model_len is not in it: the rotary tables that depend on it belong to each engine."""
    root = Path(config.model_path()).expanduser().resolve()
    files = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.suffix in (".json", ".safetensors") and path.is_file():
            st = path.stat()
            files.append((path.name, st.st_size, st.st_mtime_ns))
    parts = {
        "model": str(root),
        "files": files,
        "dtype": dtype,
        "quantization": quantization,
        "load_format": config.load_format,
        "tensor_parallel_size": config.tensor_parallel_size,
        "device": config.device,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def send_reply(conn: socket.socket, reply: dict[str, Any], payload: bytes = b"", fds: list[int] | None = None) -> None:
    """The JSON line (with `payload_bytes` and any fds), then the payload."""
    line = json.dumps({**reply, "payload_bytes": len(payload), "fds": len(fds or [])}).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [line], fds)
    else:
        conn.sendall(line)
    if payload:
        conn.sendall(payload)


def request(
    path: str | os.PathLike[str], cmd: str, timeout: float, **args: Any
) -> tuple[dict[str, Any], bytes, list[int]]:
    """Send one command; (the JSON reply, the payload, the file descriptors received).  OSError/ValueError when
    the keeper does not answer as it should."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        buf, fds, _flags, _addr = socket.recv_fds(s, 1 << 16, MAX_FDS)
        while b"\n" not in buf:
            more = s.recv(1 << 16)
            if not more:
                raise ValueError("the keeper closed the connection mid-reply")
            buf += more
        line, rest = buf.split(b"\n", 1)
        reply = json.loads(line)
        need = int(reply.get("payload_bytes", 0))
        chunks, have = [rest], len(rest)
        while have < need:
            more = s.recv(min(1 << 20, need - have))
            if not more:
                raise ValueError(f"the keeper's reply stopped after {have} of {need} bytes")
            chunks.append(more)
            have += len(more)
    return reply, b"".join(chunks), list(fds)
