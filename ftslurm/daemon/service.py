"""The daemon process: one per state directory, started on demand, stoppable, restartable.

`serve` is the foreground loop (`ftslurm daemon run`, e.g. under a systemd user unit);
`start` launches it detached and waits until it holds the lock; `stop` asks it to end.
Commands that change a run (`submit`, `cancel`) call `wake` so the loop looks at once.

Guarding the state (docs/daemon.md): the daemon refuses a damaged database at start
(`quick_check`) or one that lost committed changes (the mark); after a cycle that wrote,
it checkpoints the WAL into the database file and records the newest event id in the mark;
it backs the database up at start and every `BACKUP_INTERVAL_S` while something changed.
A full disk is logged once per episode and the loop keeps its cadence.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from ftslurm.backends import HOME_ENV, create_backend
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.store import (
    DaemonLock,
    DiskFull,
    Restored,
    StateError,
    Store,
    marked_backends,
    os_state_error,
    restore_backup,
    write_mark,
)
from ftslurm.errors import FtslurmError

log = logging.getLogger("ftslurm.daemon")
WAKE_FILE = "wake"
LOG_FILE = "daemon.log"
BACKUP_INTERVAL_S = 300.0  # a backup at most this often, and only when something changed


def wake(home: Path) -> None:
    """Ask a running daemon to run a cycle now (it watches this file's mtime)."""
    path = Path(home) / WAKE_FILE
    path.touch()
    os.utime(path)


class Keeper:
    """The daemon's care of its database between cycles: WAL checkpoint and mark after a
    cycle that wrote, a backup every `backup_interval_s` when something changed."""

    def __init__(self, store: Store, backup_interval_s: float) -> None:
        self.store = store
        self.backends = set(marked_backends(store.home))  # keys of the backends used
        self.backup_interval_s = backup_interval_s
        self._marked = (-1, -1)  # (connection changes, newest event id) last recorded
        self._backed_up: tuple[int, int] | None = None
        self.next_backup = time.monotonic()

    def after_cycle(self, backends: Iterable[str] = ()) -> None:
        """Raises `StateError` (e.g. `DiskFull`) when a step could not be done."""
        newest = self.store.newest_event_id()
        seen = (self.store.changes(), newest)
        if seen != self._marked or not self.backends.issuperset(backends):
            self.store.checkpoint()
            self.backends.update(backends)
            try:
                write_mark(self.store.home, newest, self.backends)
            except OSError as exc:
                raise os_state_error(exc, self.store.home) from None
            self._marked = seen
        if time.monotonic() >= self.next_backup:
            if seen != self._backed_up:
                self.store.backup()
                self._backed_up = seen
                log.info("backed up %s (newest event %d)", self.store.path, newest)
            self.next_backup = time.monotonic() + self.backup_interval_s


def serve(home: Path, stop: threading.Event | None = None,
          backup_interval_s: float = BACKUP_INTERVAL_S) -> None:  # fmt: skip
    """Run the reconcile loop until `stop` is set or SIGTERM/SIGINT arrives."""
    home = Path(home)
    lock = DaemonLock(home)
    lock.acquire()
    try:
        store = Store(home)
        try:
            store.check_integrity()
            keeper = Keeper(store, backup_interval_s)
            try:
                keeper.after_cycle()  # the backup at start, once the database passed the check
            except DiskFull as exc:  # serve all the same; the loop logs the episode
                log.error("%s; no backup at start", exc.message)
        except BaseException:
            store.close()
            raise
    except BaseException:
        lock.release()
        raise
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    cache: dict[str, SchedulerBackend] = {}

    def backends(key: str) -> SchedulerBackend:
        if key not in cache:
            kind, _, where = key.partition(":")
            cache[key] = create_backend(kind, where or None, abort=stop)
        return cache[key]

    reconciler = Reconciler(store, backends, stop=stop)
    log.info("daemon %d serving %s", os.getpid(), home)
    wake_path = home / WAKE_FILE
    disk_full = False  # an episode of a full disk is logged once, at its start and end
    try:
        while not stop.is_set():
            full_now = False
            try:
                interval = reconciler.cycle()
            except DiskFull:
                full_now, interval = True, reconciler.interval  # the usual cadence
            except FtslurmError as exc:
                log.warning("cycle failed: %s", exc.user_message())
                interval = 5.0
            except Exception:  # keep serving every other run; the log has the details
                log.exception("cycle failed")
                interval = 5.0
            try:
                keeper.after_cycle(cache)
            except DiskFull:
                full_now = True
            except StateError as exc:
                log.warning("could not checkpoint or back up: %s", exc.user_message())
            if full_now and not disk_full:
                log.error("disk full: %s; nothing recorded is lost, polling goes on and "
                          "recording resumes when there is room", store.path)  # fmt: skip
            elif disk_full and not full_now:
                log.warning("disk no longer full: %s; recording again", store.path)
            disk_full = full_now
            seen = _mtime(wake_path)
            deadline = min(time.monotonic() + interval, keeper.next_backup)
            while not stop.is_set() and time.monotonic() < deadline:
                if _mtime(wake_path) != seen:
                    break
                stop.wait(min(0.1, max(0.0, deadline - time.monotonic())))
    finally:
        store.close()
        lock.release()
        log.info("daemon %d stopped", os.getpid())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0.0


def running_pid(home: Path) -> int | None:
    """The daemon's pid, or None when none holds the lock."""
    for _ in range(40):  # a daemon that just took the lock writes its pid at once
        pid = DaemonLock.holder_pid(home)
        if pid is None or pid > 0:
            return pid
        time.sleep(0.05)
    return None


def start(home: Path, timeout_s: float = 15.0) -> int:
    """Start the daemon for `home` unless one runs; return its pid."""
    home = Path(home)
    pid = running_pid(home)
    if pid is not None:
        return pid
    with Store(home) as store:  # creates the folder (0700) and the database
        store.check_integrity()  # refuse here, in one line, what the daemon would refuse
    logf = open(home / LOG_FILE, "ab")
    os.chmod(home / LOG_FILE, 0o600)
    env = dict(os.environ, **{HOME_ENV: str(home)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftslurm", "daemon", "run"], stdin=subprocess.DEVNULL,
        stdout=logf, stderr=logf, start_new_session=True, close_fds=True, env=env,
    )  # fmt: skip
    logf.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = running_pid(home)
        if pid is not None:
            threading.Thread(target=proc.wait, daemon=True).start()
            return pid
        code = proc.poll()
        if code is not None:
            pid = running_pid(home)  # another start won the race
            if pid is not None:
                return pid
            raise FtslurmError(f"the daemon exited at once (code {code}); "
                               f"see {home / LOG_FILE}")  # fmt: skip
        time.sleep(0.05)
    raise FtslurmError(f"the daemon did not start within {timeout_s:.0f}s; "
                       f"see {home / LOG_FILE}")  # fmt: skip


def stop(home: Path, timeout_s: float = 30.0) -> int | None:
    """Stop the daemon for `home`; return the pid it had (None if none ran)."""
    pid = running_pid(home)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if running_pid(home) is None:
            return pid
        time.sleep(0.05)
    raise FtslurmError(f"the daemon (pid {pid}) did not stop within {timeout_s:.0f}s")


def recover(home: Path) -> Restored:
    """Put the last backup back (see `store.restore_backup`); refused while a daemon runs
    (the daemon lock is held throughout, so none can start meanwhile)."""
    lock = DaemonLock(home)
    lock.acquire()
    try:
        return restore_backup(home)
    finally:
        lock.release()


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
