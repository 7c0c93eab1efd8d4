"""Scheduler backends behind one protocol: the Slurm CLI (default), pyslurm (optional).

`create_backend(kind)` returns a `SchedulerBackend`:
- "slurm": the Slurm command-line clients (always available where Slurm is);
- "pyslurm": only when a pyslurm matching the controller's version imports;
- "auto": pyslurm when it can be used, otherwise the Slurm CLI.
"""

from __future__ import annotations

from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.errors import BackendUnavailable, ConfigError

BACKENDS = ("auto", "slurm", "pyslurm")


def create_backend(kind: str = "slurm") -> SchedulerBackend:
    from ftslurm.backends.slurm_cli import SlurmCliBackend

    if kind not in BACKENDS:
        raise ConfigError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")
    if kind == "slurm":
        return SlurmCliBackend()
    from ftslurm.backends import pyslurm_backend

    cli = SlurmCliBackend()
    usable, why = pyslurm_backend.pyslurm_status(cli.cluster_facts().version)
    if usable:
        return pyslurm_backend.PyslurmBackend()
    if kind == "pyslurm":
        raise BackendUnavailable(f"the pyslurm backend cannot be used here: {why}")
    return cli


__all__ = ["BACKENDS", "SchedulerBackend", "create_backend"]
