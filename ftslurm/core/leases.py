"""A launcher's lease and the rule that judges it (pure; the compute side's
`ftslurm.agent.peers` writes and watches leases, the daemon watches the batch host's).

A lease (`RunDir.peer_lease`) is rewritten every `poll_interval` by its node's launcher with
a counter that grows; a watcher judges a node lost when the counter has not changed for a
timeout measured on the watcher's own clock, from the read that saw the change (clocks of
two machines are never compared). See `ftslurm.agent.peers` for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Lease:
    """What a launcher's lease file says."""

    node_rank: int
    node: str
    pid: int
    seq: int
    time: float  # the writer's wall clock
    ended: str | None = None  # why its launcher left (its outcome); None while it runs
    # With hot spares (`ftslurm.agent.spares`): "active" once its launcher started ranks,
    # "spare" while it waits to replace a lost node; None without spares.
    role: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "node": self.node, "pid": self.pid,
                "seq": self.seq, "time": self.time, "ended": self.ended,
                "role": self.role}  # fmt: skip

    @staticmethod
    def from_json(data: Any) -> Lease | None:
        """The lease, or None for a file that is not one (torn, foreign, missing)."""
        try:
            return Lease(int(data["node_rank"]), str(data["node"]), int(data["pid"]),
                         int(data["seq"]), float(data["time"]),
                         None if data.get("ended") is None else str(data["ended"]),
                         None if data.get("role") is None else str(data["role"]))
        except (TypeError, KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Seen:
    """What a watcher knows of one peer: the latest lease it read and when (on its own
    clocks) it last saw that lease change."""

    node_rank: int
    # the watcher's own clock (a launcher's monotonic one, the daemon's wall clock): the
    # last change, or the watch's start
    changed_at: float
    lease: Lease | None = None  # None: never read
    heard_at: float | None = None  # watcher's wall clock at the last change
    changed_before: float | None = None  # the change before the last one (monotonic)


def observe(seen: Seen, lease: Lease | None, now: float, wall: float) -> Seen:
    """`seen` after reading `lease` at `now` (monotonic) and `wall`: a lease that changed
    (another counter, another writer, or ended) is news; an unreadable one is none."""
    if lease is None or lease == seen.lease:
        return seen
    return replace(seen, lease=lease, changed_at=now, heard_at=wall,
                   changed_before=seen.changed_at if seen.lease is not None else None)


def is_lost(seen: Seen, now: float, timeout: float, start_timeout: float) -> bool:
    """Whether the peer is lost: silent for `timeout` since its lease last changed, or for
    `start_timeout` since the watch began when it never wrote one; an ended lease never."""
    if seen.lease is None:
        return now - seen.changed_at > start_timeout
    return seen.lease.ended is None and now - seen.changed_at > timeout


def poll_interval(timeout: float) -> float:
    """How often a launcher rewrites its lease and reads its peers'."""
    return min(5.0, max(0.5, timeout / 6))


def daemon_timeout(timeout: float) -> float:
    """How long the daemon lets the batch host's lease stay silent before it judges that
    node lost itself: `timeout` plus two of the launchers' polls, the longest a live
    survivor takes to report it (`PeerWatch.wait_settled`). The daemon is the watcher of
    last resort: the survivors may be gone with it (their rendezvous lived there)."""
    return timeout + 2 * poll_interval(timeout)
