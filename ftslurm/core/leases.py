"""Leases and the rule that judges them (pure): a launcher's (the compute side's
`ftslurm.agent.peers` writes and watches them, the daemon watches the batch host's) and the
daemon's own (one daemon per state directory across hosts, `ftslurm.daemon.service`).

A lease (`RunDir.peer_lease`) is rewritten every `poll_interval` by its node's launcher with
a counter that grows; a watcher judges a node lost when the counter has not changed for a
timeout measured on the watcher's own clock, from the read that saw the change (clocks of
two machines are never compared). A watcher also holds a TCP connection to each node it
watches (the address in the lease, `addr`): a connection that closes without the node's
goodbye means its launcher died, and the node is lost at once (`Seen.dropped`); the lease's
timeout bounds only a silent death (a frozen or cut-off node). See `ftslurm.agent.peers`.

The daemon's lease is a row of the state database that the serving daemon renews the same
way (`DaemonLease`); a daemon starting on another host takes it only when it is free,
released, or silent for `DAEMON_LEASE_TIMEOUT_S` on its own clock (`daemon_lease_verdict`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ftslurm.core.contract.reports import NodeRole


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
    # "host:port" of the launcher's listening socket (a free port it chose): its watchers
    # connect there, and its death closes their connections; None: none (lease only)
    addr: str | None = None
    # a spare whose ranks wait warm (live recovery: `ftslurm.agent.live`); False once they
    # failed (it waits as an idle spare) and for every other node
    warm: bool = False

    def node_role(self) -> str | None:
        """The node's role as a loss report gives it (`NodeRole`): a training node, an idle
        spare or a warm one; None without spares (every node trains)."""
        if self.role == NodeRole.SPARE.value and self.warm:
            return NodeRole.WARM_SPARE.value
        return self.role

    def to_json(self) -> dict[str, Any]:
        return {
            "node_rank": self.node_rank,
            "node": self.node,
            "pid": self.pid,
            "seq": self.seq,
            "time": self.time,
            "ended": self.ended,
            "role": self.role,
            "addr": self.addr,
            "warm": self.warm,
        }

    @staticmethod
    def from_json(data: Any) -> Lease | None:
        """The lease, or None for a file that is not one (torn, foreign, missing)."""
        try:
            return Lease(
                int(data["node_rank"]),
                str(data["node"]),
                int(data["pid"]),
                int(data["seq"]),
                float(data["time"]),
                None if data.get("ended") is None else str(data["ended"]),
                None if data.get("role") is None else str(data["role"]),
                None if data.get("addr") is None else str(data["addr"]),
                data.get("warm") is True,
            )
        except (TypeError, KeyError, ValueError):
            return None


DAEMON_LEASE_TIMEOUT_S = 60.0  # a daemon's lease silent this long may be taken over


@dataclass(frozen=True)
class DaemonLease:
    """Who serves a state directory: the daemon's row in its state database."""

    owner: str  # "<host>:<pid>:<token>", unique to one daemon process
    host: str
    pid: int
    seq: int  # grows with every renewal
    time: float  # the writer's wall clock (shown; never compared with another host's)
    ended: str | None = None  # why the daemon released it; None while it serves
    job_id: str | None = None  # the Slurm job it runs in (`ftslurm daemon submit`)


@dataclass(frozen=True)
class Seen:
    """What a watcher knows of one peer: the latest lease it read and when (on its own
    clocks) it last saw that lease change."""

    node_rank: int
    # the watcher's own clock (a launcher's monotonic one, the daemon's wall clock): the
    # last change, or the watch's start
    changed_at: float
    lease: Lease | DaemonLease | None = None  # None: never read
    heard_at: float | None = None  # watcher's wall clock at the last change
    changed_before: float | None = None  # the change before the last one (monotonic)
    # the watcher's connection to it closed without a goodbye (its launcher died): lost at
    # once unless its lease says it ended; None: not dropped
    dropped_at: float | None = None


def observe(seen: Seen, lease: Lease | DaemonLease | None, now: float, wall: float) -> Seen:
    """`seen` after reading `lease` at `now` (monotonic) and `wall`: a lease that changed
    (another counter, another writer, or ended) is news; an unreadable one is none."""
    if lease is None or lease == seen.lease:
        return seen
    return replace(
        seen,
        lease=lease,
        changed_at=now,
        heard_at=wall,
        changed_before=seen.changed_at if seen.lease is not None else None,
    )


def is_lost(seen: Seen, now: float, timeout: float, start_timeout: float) -> bool:
    """Whether the peer is lost: its connection dropped without a goodbye, or silent for
    `timeout` since its lease last changed, or for `start_timeout` since the watch began
    when it never wrote one; an ended lease never."""
    if seen.lease is not None and seen.lease.ended is not None:
        return False
    if seen.dropped_at is not None:
        return True
    if seen.lease is None:
        return now - seen.changed_at > start_timeout
    return seen.lease.ended is None and now - seen.changed_at > timeout


def never_started(
    seen: Seen | None, launched_at: float | None, now: float, start_timeout: float
) -> bool:
    """Whether the batch host's launcher never started: its job's step started at
    `launched_at` (the watcher's clock, when it first saw the batch script's mark) and no
    lease of it was read within `start_timeout` since. A lease read once, ended or not, is
    a start; no mark seen (the setup lines still run, an older batch script) or no watch
    (`seen` None), no verdict."""
    return (
        launched_at is not None
        and seen is not None
        and seen.lease is None
        and now - launched_at > start_timeout
    )


def never_started_at(
    seen: Seen | None, launched_at: float | None, start_timeout: float
) -> float | None:
    """When `never_started` would say so if nothing changes; None: no verdict to come."""
    if launched_at is None or seen is None or seen.lease is not None:
        return None
    return launched_at + start_timeout


def poll_interval(timeout: float) -> float:
    """How often a launcher rewrites its lease and reads its peers'."""
    return min(5.0, max(0.5, timeout / 6))


def daemon_timeout(timeout: float, nnodes: int = 2) -> float:
    """How long the daemon lets the batch host's lease stay silent before it judges that
    node lost itself: `timeout` plus two of the launchers' polls, the longest a live
    survivor takes to report it (`PeerWatch.wait_settled`). The daemon is the watcher of
    last resort: the survivors may be gone with it (their rendezvous lived there). A job of
    one node has no survivor to wait for: `timeout` alone."""
    return timeout if nnodes < 2 else timeout + 2 * poll_interval(timeout)


def daemon_lease_verdict(
    current: DaemonLease | None,
    seen: Seen,
    *,
    host: str,
    now: float,
    timeout: float = DAEMON_LEASE_TIMEOUT_S,
) -> str:
    """What a daemon starting on `host` does about the lease it read (`current`), having
    watched it since `seen.changed_at` (its own monotonic clock, `now`):

    "take"  free, released, held on this very host (its lock is the caller's, so that
            holder is gone), or silent for `timeout`;
    "held"  it changed while watched: another daemon serves, do not start;
    "wait"  not known yet: read again after `poll_interval(timeout)`.
    """
    if current is None or current.ended is not None or current.host == host:
        return "take"
    if seen.changed_before is not None:
        return "held"
    return "take" if is_lost(seen, now, timeout, timeout) else "wait"
