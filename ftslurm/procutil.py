"""Processes by pid, as Linux's /proc shows them: whether one still runs (a zombie, exited
but not yet reaped, does not, though it still answers `kill(pid, 0)`)."""

from __future__ import annotations

import os

# The states of /proc/<pid>/stat of a process that no longer runs: a zombie, and dead.
NOT_RUNNING = ("Z", "X")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...), or
    None when the process is gone or /proc cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_alive(pid: int | None) -> bool:
    """Whether process `pid` runs: it exists and is neither a zombie nor dead. Another
    user's process refuses `kill(pid, 0)` but may run: /proc tells."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: running, or a zombie
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in NOT_RUNNING
