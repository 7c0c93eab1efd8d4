"""Scheduler backends behind one protocol: the Slurm CLI (default), pyslurm (optional).

`create_backend(kind)` returns a `SchedulerBackend` (`split_backend_key`: the kind and mock
home of a run's backend key):
- "slurm": the Slurm command-line clients (always available where Slurm is);
- "pyslurm": only when a pyslurm matching the controller's version imports;
- "auto": pyslurm when it can be used, otherwise the Slurm CLI;
- "mock": the mock scheduler in `FTSLURM_MOCK_HOME` (default: `<state dir>/mock`), with its
  controller started on demand.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.errors import BackendUnavailable, ConfigError
from ftslurm.paths import state_dir

BACKENDS = ("auto", "slurm", "pyslurm", "mock")
MOCK_HOME_ENV = "FTSLURM_MOCK_HOME"


def mock_home() -> Path:
    return Path(os.environ.get(MOCK_HOME_ENV) or state_dir() / "mock")


def split_backend_key(key: str) -> tuple[str, str | None]:
    """A run's backend key (`ftslurm.daemon.submission.backend_key`: "slurm", "auto",
    "pyslurm", "mock:<its mock cluster's folder>") as `create_backend`'s kind and home (None:
    the default mock cluster, or not a mock)."""
    kind, _, where = key.partition(":")
    return kind, where or None


def create_backend(
    kind: str = "slurm", home: Path | str | None = None, *, abort: threading.Event | None = None
) -> SchedulerBackend:
    """A backend by name; for "mock", the mock cluster in `home` (default `mock_home()`).
    Setting `abort` cuts short the retries of Slurm commands (the daemon is stopping)."""
    from ftslurm.backends.slurm_cli import SlurmCliBackend
    from ftslurm.backends.slurm_cli.runner import CommandRunner

    if kind not in BACKENDS:
        raise ConfigError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")
    if kind == "slurm":
        return SlurmCliBackend(CommandRunner(abort=abort))
    if kind == "mock":
        from ftslurm.backends.mock import MockScheduler
        from ftslurm.backends.mock.controller import ensure_controller

        home = Path(home) if home is not None else mock_home()
        scheduler = MockScheduler(home)
        ensure_controller(home)
        return scheduler
    from ftslurm.backends import pyslurm_backend

    cli = SlurmCliBackend(CommandRunner(abort=abort))
    usable, why = pyslurm_backend.pyslurm_status(cli.cluster_facts().version)
    if usable:
        return pyslurm_backend.PyslurmBackend()
    if kind == "pyslurm":
        raise BackendUnavailable(f"the pyslurm backend cannot be used here: {why}")
    return cli


__all__ = [
    "BACKENDS",
    "MOCK_HOME_ENV",
    "SchedulerBackend",
    "create_backend",
    "mock_home",
    "split_backend_key",
]
