"""Peer-loss detection: the launchers of a multi-node job watch each other.

**Why a lease file per node, not keys in the rendezvous store.** torch elastic's c10d
store lives inside node 0's launcher, on the batch host: the store dies with the very node
whose loss matters most, and a launcher blocked on it learns nothing. So every launcher
keeps a lease of its own in the attempt's folder of the run directory
(`RunDir.peer_lease`), on the shared file system every node of the job already mounts
(rank reports, progress and checkpoints live there). No node hosts anything the others
depend on: any survivor can tell that any other node fell silent, the batch host included.

**The watch** runs in a thread of the launcher (never in the ranks, so the training is not
slowed, and a plain script that knows nothing of ftslurm is watched all the same). Every
`interval` (`peer_timeout_s / 6`, between 0.5 s and 5 s) it rewrites its own lease
(node rank, node name, pid, a counter `seq`, the wall time; written to a temporary file
and renamed, no fsync: a lease only needs to be fresh) and reads the leases of the (at
most) two nodes after its own in ring order (node r watches r+1 and r+2 modulo the node
count, so every node is watched by two others and each launcher does three small file
operations per poll, whatever the job's size).

**The rule** (`lost_peers`, pure): a lease is fresh while its counter changed within
`peer_timeout_s`, measured on the watcher's own monotonic clock from the read that saw the
change; clocks of two machines are never compared, and file times (which a network file
system caches) are never read. The watcher reads before it decides, so a watcher that was
itself paused sees the news before it judges. A lease marked `ended` (its launcher left on
its own, whatever the outcome) is never lost. A node whose lease was never read is given
`start_timeout` (the rendezvous timeout) from the start of the watch. A node merely slow,
with every core busy, still rewrites its lease several times per timeout: its launcher
sleeps between polls, and a sleeping thread is woken ahead of busy ones.

**The report** (`RunDir.peer_lost`, `attempts/<k>/recovery/lost-<n>.json`, `n` the lost
node's rank) names the lost node (`lost_node_rank`, `lost_node`), when it was last heard
(`last_heard`: the reporter's wall time of the read that last saw its counter change,
null if never; `lease_time`: the wall time the lost node wrote in that lease), how long it
has been silent (`silent_s`), the `peer_timeout_s`, and by whom (`reported_by`,
`reported_by_node_rank`), with the report's `time`, `job_id` and `attempt`. The first
launcher to judge a node lost writes it (atomically); a second one finds it there and
leaves it. A launcher whose ranks failed waits before it exits until every node it
watches has ended, been heard since (two new leases), or been judged lost (`settled`; at most
`peer_timeout_s` plus two polls), so a node lost under a failing job is still reported.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ftslurm.core.contract import RunDir
from ftslurm.core.leases import Lease, Seen, is_lost, observe, poll_interval
from ftslurm.fsutil import read_json, temp_path, write_json_atomic

log = logging.getLogger("ftslurm.launch")

WATCHED = 2  # how many nodes after its own (in ring order) each launcher watches


def watched(node_rank: int, nnodes: int, count: int = WATCHED) -> list[int]:
    """The node ranks node `node_rank` watches: the `count` after it in ring order."""
    return sorted({(node_rank + k) % nnodes for k in range(1, count + 1)} - {node_rank})


def lost_peers(seen: Mapping[int, Seen], now: float, timeout: float,
               start_timeout: float) -> list[int]:  # fmt: skip
    """The node ranks judged lost (pure): leases seen + now + timeouts -> lost nodes."""
    return sorted(r for r, s in seen.items() if is_lost(s, now, timeout, start_timeout))


def settled(seen: Mapping[int, Seen], since: float, now: float, timeout: float,
            start_timeout: float) -> bool:  # fmt: skip
    """Whether every peer has a verdict after `since`: ended, heard from since, or lost.
    Heard from since means two changes read after `since`: the first may be a lease written
    before `since` (by a node lost since) and read only after it."""
    return all((s.lease is not None and (s.lease.ended is not None or (
        s.changed_before is not None and s.changed_before > since)))
        or is_lost(s, now, timeout, start_timeout) for s in seen.values())


def loss_report(seen: Seen, *, now: float, wall: float, timeout: float, me: int, node: str,
                job_id: str, attempt: int) -> dict[str, Any]:  # fmt: skip
    """The content of `recovery/lost-<n>.json` (pure)."""
    return {"lost_node_rank": seen.node_rank,
            "lost_node": seen.lease.node if seen.lease else None,
            "last_heard": seen.heard_at,
            "lease_time": seen.lease.time if seen.lease else None,
            "silent_s": round(now - seen.changed_at, 3), "peer_timeout_s": timeout,
            "reported_by": node, "reported_by_node_rank": me, "time": wall,
            "job_id": job_id, "attempt": attempt}  # fmt: skip


class PeerWatch:
    """The launcher's watch thread (the shell around the rule above)."""

    def __init__(self, run: RunDir, *, attempt: int, node_rank: int, nnodes: int, node: str,
                 job_id: str, timeout: float, start_timeout: float, role: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.run, self.attempt, self.node_rank, self.node = run, attempt, node_rank, node
        self.job_id, self.timeout, self.start_timeout = job_id, timeout, start_timeout
        self.interval = poll_interval(timeout)
        self.clock, self.wall = clock, wall
        start = clock()
        self.seen = {r: Seen(r, start) for r in watched(node_rank, nnodes)}
        self.lost: list[int] = []  # the peers this launcher judged lost, in order
        self.seq = 0
        self.role = role
        self._writing = threading.Lock()  # the watch thread and set_role both write
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticked = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="ftslurm-peers", daemon=True)

    def start(self) -> PeerWatch:
        self.run.attempt(self.attempt).mkdir(parents=True, exist_ok=True)
        self._write_lease(None)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # never let the watch stop the training
                log.warning("peer watch: %s", exc)

    def tick(self) -> None:
        """One poll: renew the lease, read the peers', report the newly lost."""
        self._write_lease(None)
        leases = {r: Lease.from_json(read_json(self.run.peer_lease(self.attempt, r)))
                  for r in self.seen}  # fmt: skip
        now, wall = self.clock(), self.wall()
        with self._lock:
            self.seen = {r: observe(s, leases[r], now, wall) for r, s in self.seen.items()}
            new = [r for r in lost_peers(self.seen, now, self.timeout, self.start_timeout)
                   if r not in self.lost]  # fmt: skip
            self.lost.extend(new)
            seen = dict(self.seen)
            self._ticked.notify_all()
        for r in new:
            self._report(seen[r], now, wall)

    def _report(self, seen: Seen, now: float, wall: float) -> None:
        name = seen.lease.node if seen.lease else f"node rank {seen.node_rank}"
        log.warning("node %s (node rank %d) silent for %.1fs: reporting it lost", name,
                    seen.node_rank, now - seen.changed_at)  # fmt: skip
        path = self.run.peer_lost(self.attempt, seen.node_rank)
        if path.exists():  # another launcher saw it first
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, loss_report(
            seen, now=now, wall=wall, timeout=self.timeout, me=self.node_rank, node=self.node,
            job_id=self.job_id, attempt=self.attempt))  # fmt: skip

    def set_role(self, role: str) -> None:
        """Say the node's role in its lease at once (not only at the next poll)."""
        if role != self.role:
            self.role = role
            self._write_lease(None)

    def _write_lease(self, ended: str | None) -> None:
        with self._writing:
            self.seq += 1
            lease = Lease(self.node_rank, self.node, os.getpid(), self.seq, self.wall(), ended,
                          self.role)  # fmt: skip
            path = self.run.peer_lease(self.attempt, self.node_rank)
            tmp = temp_path(path)
            tmp.write_text(json.dumps(lease.to_json()))
            os.replace(tmp, path)

    def wait_settled(self) -> None:
        """Wait until every watched node has a verdict given after now (see `settled`),
        for at most `peer_timeout_s` plus two polls."""
        since = self.clock()
        deadline = since + self.timeout + 2 * self.interval
        with self._lock:
            while not settled(self.seen, since, self.clock(), self.timeout, self.start_timeout):
                left = deadline - self.clock()
                if left <= 0 or not self._thread.is_alive():
                    return
                self._ticked.wait(left)

    def stop(self, ended: str) -> None:
        """End the watch and mark the lease ended (`ended`: the launcher's outcome)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)
        try:
            self._write_lease(ended)
        except OSError as exc:
            log.warning("peer watch: could not mark the lease ended: %s", exc)
