"""The compute side: the per-task wrapper (`agent.task`, run under srun for every rank) and
the API a training script calls to tell the daemon how far it got (`agent.progress`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["progress"]


def __getattr__(name: str) -> Any:
    # Imported on use: the launcher's first lines (`agent.boot`) run before anything heavy.
    if name == "progress":
        return importlib.import_module("ftslurm.agent.progress")
    raise AttributeError(f"module 'ftslurm.agent' has no attribute {name!r}")
