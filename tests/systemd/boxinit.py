"""Stage 2 of a systemd box: runs as PID 1 of fresh pid/mount/uts/ipc/cgroup namespaces and execs systemd.

Started by tests/systemd/box.py as `unshare --pid --mount --uts --ipc --cgroup --fork -- python boxinit.py SPEC`
(network is shared with the host: the box's sockets are reachable on 127.0.0.1).  It builds the root
file system the box's systemd will see, pivots into it and execs `/lib/systemd/systemd`:

    /              overlay: lower = the host's root file system (read-only to the box), upper = tmpfs
    /proc          a new procfs; /proc/sys, /proc/sysrq-trigger, /proc/irq, /proc/bus bound read-only
    /sys           a new sysfs, read-only; /sys/fs/cgroup = cgroup2 rooted at the box's cgroup (namespace)
    /dev           tmpfs with null, zero, full, random, urandom, tty (+ NVIDIA nodes if the host has
                   them), a private devpts, /dev/shm, and /dev/console = a pty the test reads
    /run, /tmp     private tmpfs: systemd-tmpfiles in the box can never touch the host's /tmp
    /run/systemd/system   the box's own units (SPEC["run_units"]) and masks

Nothing the box writes reaches the host's disk.  Capabilities that reach beyond the namespaces
(network configuration, kernel modules, the clock, the kernel log, ...) are dropped from the bounding
set before systemd starts.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import socket
import sys
import uuid
from pathlib import Path

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_CAPBSET_DROP = 24
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

# Dropped from the bounding set: what would let the box change the host (it shares the host's network).
DROP_CAPS = {
    "CAP_NET_ADMIN": 12,
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_RAWIO": 17,
    "CAP_SYS_PACCT": 20,
    "CAP_SYS_TIME": 25,
    "CAP_SYS_TTY_CONFIG": 26,
    "CAP_AUDIT_CONTROL": 30,
    "CAP_MAC_OVERRIDE": 32,
    "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34,
    "CAP_WAKE_ALARM": 35,
    "CAP_BLOCK_SUSPEND": 36,
}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str | Path, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    enc = lambda v: None if v is None else str(v).encode()  # noqa: E731
    _check(
        libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
        f"mount {source} on {target} ({fstype}, {data})",
    )


def bind(source: str | Path, target: Path, readonly: bool = False, extra: int = 0) -> None:
    if not target.exists() and not target.is_symlink():
        if Path(source).is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
    mount(str(source), target, None, MS_BIND | MS_REC)
    if readonly:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | extra)


def build_root(spec: dict) -> Path:
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    stage = Path("/run")  # a tmpfs over /run of *this* mount namespace only
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    for d in ("upper", "work", "root"):
        (stage / d).mkdir()
    root = stage / "root"
    mount("overlay", root, "overlay", 0, f"lowerdir=/,upperdir={stage}/upper,workdir={stage}/work")

    for path in spec.get("ro_binds", []):  # host paths on other file systems than / (e.g. the repo)
        bind(path, root / path.lstrip("/"), readonly=True)

    mount("proc", root / "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        p = root / "proc" / sub
        if p.exists():
            bind(p, p, readonly=True, extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)

    mount("sysfs", root / "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("cgroup2", root / "sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    dev = root / "dev"
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=4m")
    for node in ("null", "zero", "full", "random", "urandom", "tty"):
        bind(f"/dev/{node}", dev / node)
    for node in sorted(Path("/dev").glob("nvidia*")):  # a GPU host: the engine can use it in the box
        bind(node, dev / node.name)
    (dev / "pts").mkdir()
    mount("devpts", dev / "pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")
    os.symlink("pts/ptmx", dev / "ptmx")
    (dev / "shm").mkdir()
    mount("tmpfs", dev / "shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, dev / name)
    bind(spec["console"], dev / "console")

    mount("tmpfs", root / "run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    mount("tmpfs", root / "tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for path in spec.get("tmp_binds", []):  # needed host paths under /tmp, which the tmpfs just hid
        bind(path, root / path.lstrip("/"), readonly=True)
    units = root / "run/systemd/system"
    units.mkdir(parents=True)
    for name, text in spec.get("run_units", {}).items():
        (units / name).parent.mkdir(parents=True, exist_ok=True)
        (units / name).write_text(text)
    for name in spec.get("masks", []):
        os.symlink("/dev/null", units / name)

    if spec.get("files_from"):  # e.g. the tree `opsctl install --prefix` wrote
        shutil.copytree(spec["files_from"], root, symlinks=True, dirs_exist_ok=True)
    (root / "etc/machine-id").unlink(missing_ok=True)
    (root / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
    return root


def pivot(root: Path) -> None:
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(root)
    _check(libc.syscall(number, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    assert os.getpid() == 1, "boxinit must run as PID 1 of a new pid namespace"
    root = build_root(spec)
    socket.sethostname(spec.get("hostname", "pagekeeper-box"))
    for cap in DROP_CAPS.values():
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # unknown caps on old kernels: EINVAL, ignored
    pivot(root)
    env = {
        "container": "pagekeeper-box",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }
    os.execve(
        "/lib/systemd/systemd",
        ["/lib/systemd/systemd", "--system", f"--unit={spec['target']}", "--show-status=no", "--log-color=no"],
        env,
    )


if __name__ == "__main__":
    main()
