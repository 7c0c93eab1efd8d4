"""Where ftslurm keeps its state on the submit side: the state directory (`FTSLURM_HOME`, or
the platform's user state dir) that holds the database, the runs' folders and the daemon's
lock."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from ftslurm.errors import ConfigError

HOME_ENV = "FTSLURM_HOME"


def state_dir() -> Path:
    """ftslurm's state directory: FTSLURM_HOME, or the platform's user state dir.
    `ConfigError` (one line) when something other than a folder is in its place."""
    chosen = os.environ.get(HOME_ENV)
    path = Path(chosen or platformdirs.user_state_dir("ftslurm"))
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), path)
    if existing.exists() and not existing.is_dir():
        where = f"{HOME_ENV}={path}" if chosen else str(path)
        what = "is not a folder" if existing == path else f"is under a file ({existing})"
        raise ConfigError(
            f"the state directory {where} {what}", hint=f"point {HOME_ENV} at a folder"
        )
    return path
