"""One daemon per state directory.

One daemon per state directory: `DaemonLock`, an exclusive `flock` on
`daemon.<host>.lock` holding the pid, keeps one per host at once (and lets this host's
commands find and signal it); the `daemon_lease` row, renewed by the serving daemon and
taken over only when released or silent (`ftslurm.core.leases.daemon_lease_verdict`), keeps
one across the hosts that share the directory, whose flocks may not see each other.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from pathlib import Path
from types import TracebackType

from ftslurm.core.leases import DaemonLease
from ftslurm.daemon.store.connection import Connection, sqlite_errors
from ftslurm.errors import FtslurmError
from ftslurm.fsutil import private_dir

LOCK_NAME = "daemon.{host}.lock"  # one per host (`lock_name`)


class DaemonAlreadyRunning(FtslurmError):
    """Another daemon holds this state directory."""


def this_host() -> str:
    """This host's name, as the daemon lock and lease record it: in a Slurm job, the
    node's name (`SLURMD_NODENAME`), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def lock_name(host: str) -> str:
    """The file of a host's daemon lock (a host name is letters, digits, '.', '-'; anything
    else is replaced, so no name can leave the folder)."""
    return LOCK_NAME.format(host=re.sub(r"[^A-Za-z0-9.-]", "_", host) or "_")


class DaemonLock:
    """One daemon per state directory on this host: an exclusive flock on
    home/"daemon.<host>.lock" holding the pid (the lease in the database covers the other
    hosts, module doc).

    The lock belongs to the open file, so it ends with the process however that ends.
    """

    def __init__(self, home: Path | str, host: str | None = None) -> None:
        self.home = Path(home)
        self.path = self.home / lock_name(host or this_host())
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; `DaemonAlreadyRunning` if another holder has it."""
        if self._fd is not None:
            return
        private_dir(self.home)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = self.holder_pid(self.home)
            held = f" (pid {pid})" if pid is not None and pid > 0 else ""
            raise DaemonAlreadyRunning(
                f"a daemon is already running for {self.home}{held}", hint="stop it first"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> DaemonLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    @staticmethod
    def holder_pid(home: Path | str, host: str | None = None) -> int | None:
        """The pid of the live holder of this host's lock, or None when nobody holds it.

        Probes with a non-blocking shared flock on a separate descriptor. A holder that has
        just taken the lock may not have written its pid yet: then -1 (ask again).
        """
        try:
            fd = os.open(Path(home) / lock_name(host or this_host()), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() and int(text) > 0 else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


class LeaseMixin(Connection):
    """`Store`'s daemon lease row (`ftslurm.core.leases`)."""

    # ------------------------------------------------------------ daemon lease
    def daemon_lease(self) -> DaemonLease | None:
        """The daemon lease row, or None when no daemon ever took one."""
        with self._lock, sqlite_errors(self.path):
            row = self._db.execute(
                "SELECT owner, host, pid, seq, time, ended, job_id FROM daemon_lease WHERE id = 1"
            ).fetchone()
        return None if row is None else DaemonLease(*row)

    def swap_daemon_lease(self, new: DaemonLease, expect: DaemonLease | None) -> bool:
        """Write `new` if the row is still `expect` (its owner and counter; None: no row),
        in one transaction: two daemons that read the same lease cannot both take it."""
        with self.transaction():
            current = self.daemon_lease()
            if (current and (current.owner, current.seq)) != (
                expect and (expect.owner, expect.seq)
            ):
                return False
            self._db.execute(
                "INSERT OR REPLACE INTO daemon_lease (id, owner, host, pid, seq, time, ended, "
                "job_id) VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
                (new.owner, new.host, new.pid, new.seq, new.time, new.ended, new.job_id),
            )
        return True
