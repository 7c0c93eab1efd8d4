"""The daemon process: one per state directory, started on demand, stoppable, restartable.

`serve` is the foreground loop (`ftslurm daemon run`, e.g. under a systemd user unit);
`start` launches it detached and waits until it holds the lock; `stop` asks it to end.
Commands that change a run (`submit`, `cancel`) call `wake` so the loop looks at once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ftslurm.backends import create_backend
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.store import DaemonLock, Store
from ftslurm.errors import FtslurmError

log = logging.getLogger("ftslurm.daemon")
WAKE_FILE = "wake"
LOG_FILE = "daemon.log"


def wake(home: Path) -> None:
    """Ask a running daemon to run a cycle now (it watches this file's mtime)."""
    path = Path(home) / WAKE_FILE
    path.touch()
    os.utime(path)


def serve(home: Path, stop: threading.Event | None = None) -> None:
    """Run the reconcile loop until `stop` is set or SIGTERM/SIGINT arrives."""
    home = Path(home)
    lock = DaemonLock(home)
    lock.acquire()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    store = Store(home)
    cache: dict[str, SchedulerBackend] = {}

    def backends(key: str) -> SchedulerBackend:
        if key not in cache:
            kind, _, where = key.partition(":")
            cache[key] = create_backend(kind, where or None, abort=stop)
        return cache[key]

    reconciler = Reconciler(store, backends, stop=stop)
    log.info("daemon %d serving %s", os.getpid(), home)
    wake_path = home / WAKE_FILE
    try:
        while not stop.is_set():
            try:
                interval = reconciler.cycle()
            except FtslurmError as exc:
                log.warning("cycle failed: %s", exc.user_message())
                interval = 5.0
            except Exception:  # keep serving every other run; the log has the details
                log.exception("cycle failed")
                interval = 5.0
            seen = _mtime(wake_path)
            deadline = time.monotonic() + interval
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
    Store(home).close()  # creates the folder (0700) and the database
    logf = open(home / LOG_FILE, "ab")
    os.chmod(home / LOG_FILE, 0o600)
    env = dict(os.environ, FTSLURM_HOME=str(home))
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


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
