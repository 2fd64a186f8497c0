"""A real systemd 252 as PID 1 of its own namespaces: a throw-away "box" for testing the units.

Never boot systemd on this machine's own file system: its tmpfiles set-up empties /tmp and it changes
host settings.  A box is:

    cgroup      a new cgroup2 directory on the host; the box is moved into it before `unshare --cgroup`,
                so systemd sees it as the root of its own hierarchy and `cgroup.kill` ends everything in it
    namespaces  `setpriv --pdeathsig KILL unshare --pid --mount --uts --ipc --cgroup --fork --kill-child`:
                if the test process dies, the box dies with it; the network namespace is the host's, so
                the engine's socket is reachable on 127.0.0.1 (a free port per box)
    file system tests/systemd/boxinit.py (PID 1 of the box) mounts an overlay of / with a tmpfs upper,
                private /run, /tmp and /dev, read-only /proc/sys and /sys, then pivot_root()s into it
                and execs /lib/systemd/systemd --system --unit=pagekeeper-box.target

Control it from outside with `nsenter -t PID -m -p` (`Box.ctl`, `Box.run`).  `Box.stop()` powers it off
(`systemctl poweroff`), then kills whatever is left (`cgroup.kill`, SIGKILL of PID 1) and removes the
cgroup: the fixture calls it even when the test failed.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SYSTEMD = Path("/lib/systemd/systemd")
BOX_TARGET = "pagekeeper-box.target"
BOX_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
    "PYTHONUNBUFFERED": "1",
}

# Units the host's configuration would pull into sysinit.target & co. that have no business in a box
# sharing the host's network and kernel.  Everything wanted by the host's targets is masked as well
# (see _masks); these are masked even if nothing wants them.
ALWAYS_MASKED = [
    "systemd-timesyncd.service",
    "systemd-networkd.service",
    "systemd-networkd.socket",
    "systemd-resolved.service",
    "systemd-modules-load.service",
    "systemd-sysctl.service",
    "systemd-binfmt.service",
    "systemd-udevd.service",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-hwdb-update.service",
    "systemd-pstore.service",
    "systemd-firstboot.service",
    "systemd-repart.service",
    "kmod-static-nodes.service",
    "proc-sys-fs-binfmt_misc.automount",
    "systemd-pcrphase.service",
    "systemd-pcrphase-sysinit.service",
    "systemd-random-seed.service",
    "systemd-machine-id-commit.service",
    "systemd-update-utmp.service",
    "systemd-journald-audit.socket",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-kernel-config.mount",
    "sys-fs-fuse-connections.mount",
    "dev-hugepages.mount",
    "dev-mqueue.mount",
    "getty.target",
    "console-getty.service",
    "systemd-logind.service",
    "dbus.socket",
    "dbus.service",
]
KEEP = {
    "systemd-journald.service",
    "systemd-journald.socket",
    "systemd-journald-dev-log.socket",
    "systemd-journal-flush.service",
    "systemd-tmpfiles-setup.service",
    "systemd-tmpfiles-setup-dev.service",
    "systemd-sysusers.service",
}

TARGET_UNIT = """\
[Unit]
Description=pagekeeper test box
Wants=sysinit.target systemd-journald.socket systemd-journald-dev-log.socket
After=sysinit.target systemd-journald.socket
AllowIsolate=yes
"""

_counter = itertools.count()


class BoxUnavailable(Exception):
    """Namespaces, cgroup2 or systemd are not available here (the tests skip with this reason)."""


def cgroup2_root() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            return Path(fields[4])
    return None


def check_available() -> None:
    """Raise BoxUnavailable with the reason when a box cannot start on this machine."""
    if os.geteuid() != 0:
        raise BoxUnavailable("needs root (namespaces, mounts, cgroups)")
    if not SYSTEMD.exists():
        raise BoxUnavailable(f"no {SYSTEMD} (apt-get install systemd; scripts/setup.sh --test does)")
    for tool in ("unshare", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            raise BoxUnavailable(f"no {tool} (util-linux)")
    filesystems = Path("/proc/filesystems").read_text()
    if "overlay" not in filesystems:
        raise BoxUnavailable("no overlay file system in this kernel")
    if cgroup2_root() is None:
        raise BoxUnavailable("no cgroup2 hierarchy mounted on the host")
    r = subprocess.run(
        ["unshare", "--pid", "--mount", "--uts", "--ipc", "--cgroup", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        raise BoxUnavailable(f"unshare of pid/mount/uts/ipc/cgroup namespaces fails: {r.stderr.strip()}")


def _masks() -> list[str]:
    """Everything the host's own targets want (its enabled services, timers, sockets), and ALWAYS_MASKED."""
    names = set(ALWAYS_MASKED)
    for base in (Path("/etc/systemd/system"), Path("/lib/systemd/system"), Path("/usr/lib/systemd/system")):
        for wants in base.glob("*.target.wants"):
            names.update(p.name for p in wants.iterdir())
    names -= KEEP
    return sorted(n for n in names if "@" not in n or not n.endswith("@.service"))


class Box:
    def __init__(
        self, workdir: Path, run_units: dict[str, str] | None = None, files_from: Path | None = None, name: str = "box"
    ) -> None:
        self.workdir = workdir
        self.name = name
        self.run_units = {BOX_TARGET: TARGET_UNIT, **(run_units or {})}
        self.files_from = files_from
        self.console_log = workdir / f"{name}-console.log"
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # host PID of the box's PID 1 (systemd)
        self.cgroup: Path | None = None
        self._master: int | None = None
        self._reader: threading.Thread | None = None
        self.boot_seconds: float | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> Box:
        check_available()
        _remove_stale_cgroups()
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cgroup = cgroup2_root() / f"pagekeeper-box-{os.getpid()}-{next(_counter)}"  # type: ignore[operator]
        self.cgroup.mkdir()
        master, slave = os.openpty()
        self._master = master
        spec = {
            "console": os.ttyname(slave),
            "target": BOX_TARGET,
            "run_units": self.run_units,
            "masks": [m for m in _masks() if m not in self.run_units],
            "hostname": f"pagekeeper-{self.name}",
            "files_from": str(self.files_from) if self.files_from else None,
            "ro_binds": _other_mounts(),
            "tmp_binds": _under_private_tmp(),
        }
        spec_file = self.workdir / f"{self.name}-spec.json"
        spec_file.write_text(json.dumps(spec, indent=1))
        inner = [
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",
            "unshare",
            "--pid",
            "--mount",
            "--uts",
            "--ipc",
            "--cgroup",
            "--fork",
            "--kill-child",
            "--",
            sys.executable,
            "-S",
            str(HERE / "boxinit.py"),
            str(spec_file),
        ]
        # Enter the box's cgroup first, so that `unshare --cgroup` makes it the root of the box's view.
        cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.cgroup), *inner]
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self._reader = threading.Thread(target=self._pump_console, name=f"{self.name}-console", daemon=True)
        self._reader.start()
        try:
            self.pid = self._find_pid1(started + 15)
            self._wait_booted(started + timeout)
        except BaseException:
            self.stop()
            raise
        self.boot_seconds = time.monotonic() - started
        return self

    def _pump_console(self) -> None:
        with open(self.console_log, "ab") as log:
            while True:
                try:
                    data = os.read(self._master, 65536)  # type: ignore[arg-type]
                except OSError as e:  # EIO: every slave end is closed (the box is gone)
                    if e.errno in (errno.EIO, errno.EBADF):
                        return
                    raise
                if not data:
                    return
                log.write(data)
                log.flush()

    def _find_pid1(self, deadline: float) -> int:
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the box exited with {self.proc.returncode} before booting:\n{self.console()}")
            try:
                pids = children.read_text().split()
            except OSError:
                pids = []
            if pids:
                return int(pids[0])
            time.sleep(0.01)
        raise TimeoutError(f"the box's PID 1 did not appear:\n{self.console()}")

    def _wait_booted(self, deadline: float) -> None:
        state = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the box exited with {self.proc.returncode} while booting:\n{self.console()}")
            r = self.ctl("is-system-running", timeout=10)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"the box did not finish booting (state {state!r}):\n{self.console()}\n{self.ctl('list-jobs').stdout}"
        )

    def stop(self, timeout: float = 20.0) -> None:
        """Power the box off; kill what is left; remove its cgroup.  Safe to call twice, and after failures."""
        if self.proc is not None and self.proc.poll() is None and self.pid is not None:
            self.ctl("poweroff", "--no-block", timeout=10)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.cgroup is not None and self.cgroup.exists():
            try:
                (self.cgroup / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for pid in (self.pid, self.proc.pid if self.proc else None):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self._reader is not None:
            self._reader.join(5)
        if self._master is not None:
            os.close(self._master)
            self._master = None
        if self.cgroup is not None:
            _remove_cgroup(self.cgroup)
            self.cgroup = None

    def __enter__(self) -> Box:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- control --------------------------------------------------------------------------------------

    def run(
        self, *cmd: str, timeout: float = 120, env: dict[str, str] | None = None, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run a command inside the box (its mount and pid namespaces)."""
        assert self.pid is not None
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-i", "--", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**BOX_ENV, **(env or {})},
            input=input,
        )

    def ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run("systemctl", "--no-pager", *args, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.ctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *units: str, lines: int = 200) -> str:
        args = [f"--unit={u}" for u in units]
        return self.run("journalctl", "--no-pager", "-o", "short-monotonic", "-n", str(lines), *args).stdout

    def console(self) -> str:
        return self.console_log.read_text(errors="replace")[-4000:] if self.console_log.exists() else ""

    def read(self, path: str) -> str:
        return self.run("cat", path).stdout


def _needed_paths() -> list[Path]:
    """What the units run: the repo and the interpreter."""
    return [
        Path(os.path.abspath(p))
        for p in (REPO, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent)
    ]


def _under_private_tmp() -> list[str]:
    """Needed paths under /tmp (a checkout cloned there, say): the box mounts its own empty /tmp over
    them, so boxinit binds them back, read-only, at the same paths."""
    out: list[str] = []
    for path in _needed_paths():
        if path.is_relative_to("/tmp") and str(path) not in out:
            out.append(str(path))
    return out


def _other_mounts() -> list[str]:
    """Paths the box needs (the repo, the interpreter) that live on another file system than / (the
    overlay only shows the root file system); bound read-only into the box.  Paths under /tmp are
    bound after the box's own /tmp instead (`_under_private_tmp`)."""
    root_dev = os.stat("/").st_dev
    out: list[str] = []
    for path in _needed_paths():
        top = path
        if os.stat(top).st_dev == root_dev or path.is_relative_to("/tmp"):
            continue
        while top.parent != top and os.stat(top.parent).st_dev == os.stat(path).st_dev:
            top = top.parent  # the mount point holding it
        if str(top) not in out:
            out.append(str(top))
    return out


def _remove_stale_cgroups() -> None:
    """Cgroups of boxes whose test process died without tearing them down (killed with SIGKILL: its
    boxes died with it through --pdeathsig/--kill-child, only their empty cgroups remain)."""
    root = cgroup2_root()
    for path in root.glob("pagekeeper-box-*-*") if root else []:
        owner = path.name.split("-")[2]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            try:
                (path / "cgroup.kill").write_text("1")
                _remove_cgroup(path, timeout=5)
            except OSError:
                pass


def _remove_cgroup(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            for dirpath, _dirs, _files in os.walk(path, topdown=False):
                os.rmdir(dirpath)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: processes still exiting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
