"""The mock cluster's controller: the process that moves simulated time forward.

Clients change the state only when they call; the controller calls `tick` on its own, at
the next timed event (time limit, warning signal, BeginTime, node-failure detection,
MinJobAge) or every `interval` seconds to notice processes that ended. One controller per
mock cluster: it holds an exclusive lock on `controller.lock` in the cluster's folder.

    python -m ftslurm.backends.mock.controller HOME [--interval 0.2]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ftslurm.backends.mock.backend import MockScheduler
from ftslurm.errors import FtslurmError


def _try_lock(home: Path) -> int | None:
    fd = os.open(home / "controller.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def run(home: Path, interval: float = 0.2, stop: threading.Event | None = None) -> None:
    """Tick until `stop` is set (forever when None). Returns at once if another runs."""
    fd = _try_lock(home)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        scheduler = MockScheduler(home)
        stop = stop or threading.Event()
        while not stop.is_set():
            due = scheduler.tick()
            wait = interval if due is None else max(0.0, min(interval, due - time.time()))
            stop.wait(wait)
    finally:
        os.close(fd)


def controller_running(home: Path) -> bool:
    home.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(home)
    if fd is None:
        return True
    os.close(fd)
    return False


def controller_pid(home: Path) -> int | None:
    """The running controller's pid, or None when none holds the lock."""
    if not controller_running(home):
        return None
    try:
        return int((home / "controller.lock").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def ensure_controller(home: Path, timeout: float = 15.0) -> None:
    """Start a detached controller for the mock cluster in `home` unless one runs."""
    if controller_running(home):
        return
    with open(home / "controller.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftslurm.backends.mock.controller", str(home)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + timeout
    while not controller_running(home):  # it has started once it holds the lock
        if proc.poll() is not None and not controller_running(home):
            raise FtslurmError(f"the mock controller exited at start; see {home}/controller.log")
        if time.monotonic() > deadline:
            raise FtslurmError(f"the mock controller did not start within {timeout:.0f}s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run a mock cluster's controller")
    parser.add_argument("home", type=Path)
    parser.add_argument("--interval", type=float, default=0.2)
    args = parser.parse_args(argv)
    run(args.home, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
