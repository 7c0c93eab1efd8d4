"""Which processes catch a signal: Linux's caught-signal mask (`SigCgt` in /proc/<pid>/status).

The checkpoint signal (USR2 by default) and USR1 end a process that has no handler for
them, so ftslurm delivers them only to the processes of a rank that catch them
(`ftslurm.agent.task`): a plain script that never installs a handler is left to its wall
limit, never killed by ftslurm's signal. Where the mask cannot be read (no /proc, another
system) the answer is None, "unknown", and the caller falls back on its own rule.
"""

from __future__ import annotations

import os


def readable() -> bool:
    """Whether this system shows signal masks at all (Linux's /proc)."""
    return os.path.exists("/proc/self/status")


def caught_signals(pid: int) -> frozenset[int] | None:
    """The signals `pid` has a handler for (its `SigCgt` mask), or None when that cannot be
    read (the process is gone, or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return mask_signals(int(line.split()[1], 16))
    except (OSError, ValueError, IndexError):
        return None
    return None


def mask_signals(mask: int) -> frozenset[int]:
    """The signal numbers of a /proc signal mask (bit n-1 stands for signal n)."""
    return frozenset(n + 1 for n in range(mask.bit_length()) if mask >> n & 1)


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[2])  # state, ppid, pgrp
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            pass
    return kids


def group_processes(leader: int) -> list[int] | None:
    """`leader` and its descendants that are in its process group (those a signal to the
    group reaches, short of any that left the tree), or None when the leader is gone or
    /proc cannot be read."""
    group = _pgid(leader)
    if group is None:
        return None
    found, todo, seen = [leader], [leader], {leader}
    while todo:
        for kid in _children(todo.pop()):
            if kid not in seen:
                seen.add(kid)
                todo.append(kid)
                if _pgid(kid) == group:
                    found.append(kid)
    return found


def catchers(leader: int, sig: int) -> list[int] | None:
    """The processes of `leader`'s group (`group_processes`) that catch `sig`; None when
    that cannot be known (then the caller decides without the mask)."""
    members = group_processes(leader)
    if members is None:
        return None
    found = []
    for pid in members:
        caught = caught_signals(pid)
        if caught is None and pid == leader:
            return None
        if caught is not None and sig in caught:
            found.append(pid)
    return found
