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
`reported_by_node_rank`), with the report's `time`, `job_id` and `attempt`, and the lost
node's `role` as its last lease said (a training node, an idle or a warm spare). The first
launcher to judge a node lost writes it (atomically); a second one finds it there and
leaves it. A launcher whose ranks failed waits before it exits until every node it
watches has ended, been heard since (two new leases), or been judged lost (`settled`; at most
`peer_timeout_s` plus two polls), so a node lost under a failing job is still reported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from ftslurm.core.contract import JobEnv, RunDir
from ftslurm.core.contract.reports import PeerLost
from ftslurm.core.leases import Lease, Seen, is_lost, observe, poll_interval
from ftslurm.fsutil import read_json, temp_path
from ftslurm.runfiles import write_report

log = logging.getLogger("ftslurm.launch")

WATCHED = 2  # how many nodes after its own (in ring order) each launcher watches
BACKLOG = 16  # connections a launcher's listener keeps (its watchers: two)
CONNECT_TIMEOUT_S = 1.0  # a connect to a peer's listener that takes longer is tried again
BYE = b"bye\n"  # what a launcher on its way out sends its watchers before it closes
TASK_START_TIMEOUT_S = 300.0  # without the launcher: a node never heard from, lost after


def watched(node_rank: int, nnodes: int, count: int = WATCHED) -> list[int]:
    """The node ranks node `node_rank` watches: the `count` after it in ring order."""
    return sorted({(node_rank + k) % nnodes for k in range(1, count + 1)} - {node_rank})


def lost_peers(
    seen: Mapping[int, Seen], now: float, timeout: float, start_timeout: float
) -> list[int]:
    """The node ranks judged lost (pure): leases seen + now + timeouts -> lost nodes."""
    return sorted(r for r, s in seen.items() if is_lost(s, now, timeout, start_timeout))


def settled(
    seen: Mapping[int, Seen], since: float, now: float, timeout: float, start_timeout: float
) -> bool:
    """Whether every peer has a verdict after `since`: ended, heard from since, or lost.
    Heard from since means two changes read after `since`: the first may be a lease written
    before `since` (by a node lost since) and read only after it."""
    return all(
        (
            s.lease is not None
            and (
                s.lease.ended is not None
                or (s.changed_before is not None and s.changed_before > since)
            )
        )
        or is_lost(s, now, timeout, start_timeout)
        for s in seen.values()
    )


def loss_report(
    seen: Seen,
    *,
    now: float,
    wall: float,
    timeout: float,
    me: int,
    node: str,
    job_id: str,
    attempt: int,
) -> PeerLost:
    """The content of `recovery/lost-<n>.json` (pure)."""
    return PeerLost(
        lost_node_rank=seen.node_rank,
        lost_node=seen.lease.node if seen.lease else None,
        last_heard=seen.heard_at,
        lease_time=seen.lease.time if seen.lease else None,
        silent_s=round(now - seen.changed_at, 3),
        peer_timeout_s=timeout,
        how="dropped" if seen.dropped_at is not None else "silent",
        reported_by=node,
        reported_by_node_rank=me,
        time=wall,
        job_id=job_id,
        attempt=attempt,
        role=seen.lease.node_role() if isinstance(seen.lease, Lease) else None,
    )


class PeerWatch:
    """The launcher's watch thread (the shell around the rule above)."""

    def __init__(
        self,
        run: RunDir,
        *,
        attempt: int,
        node_rank: int,
        nnodes: int,
        node: str,
        job_id: str,
        timeout: float,
        start_timeout: float,
        role: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        listen: bool = True,
    ) -> None:
        self.run, self.attempt, self.node_rank, self.node = run, attempt, node_rank, node
        self.job_id, self.timeout, self.start_timeout = job_id, timeout, start_timeout
        self.interval = poll_interval(timeout)
        self.clock, self.wall = clock, wall
        start = clock()
        self.seen = {r: Seen(r, start) for r in watched(node_rank, nnodes)}
        self.lost: list[int] = []  # the peers this launcher judged lost, in order
        self.seq = 0
        self.role = role
        self.warm = False  # a spare whose ranks wait warm (its lease says so)
        self.addr: str | None = None  # "host:port" of the listener, once it listens
        self._listen = listen
        self._listener: socket.socket | None = None
        self._accepted: list[socket.socket] = []  # the watchers' connections to this node
        self._links: dict[int, socket.socket] = {}  # this node's connections to its peers
        self._bye_from: set[int] = set()  # peers that said goodbye (their close is no death)
        self._leaving = threading.Event()  # this launcher is on its way out: no more reports
        self._said_bye = False
        self._conns = threading.RLock()  # `leaving` may come from a signal handler
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._writing = threading.Lock()  # the watch thread and set_role both write
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticked = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="ftslurm-peers", daemon=True)

    def start(self) -> PeerWatch:
        self.run.attempt(self.attempt).mkdir(parents=True, exist_ok=True)
        if self._listen:
            try:  # a free port of the kernel's choice, on every interface
                self._listener = socket.create_server(("", 0), backlog=BACKLOG)
                self._listener.setblocking(False)
                self.addr = f"{advertised_host()}:{self._listener.getsockname()[1]}"
            except OSError as exc:  # the lease alone still tells
                log.warning("peer watch: no listening socket (%s): leases only", exc)
        self._write_lease(None)
        atexit.register(self.leaving)  # an interpreter that exits is no dead node
        self._thread.start()
        return self

    def _loop(self) -> None:
        due = self.clock()  # the peers' leases read (and their listeners dialled) at once
        while not self._stop.is_set():
            try:
                self._wait_io(max(0.0, due - self.clock()))
                if self._stop.is_set():
                    return
                if self.clock() >= due:
                    self.tick()
                    self._connect()
                    due = self.clock() + self.interval
            except Exception as exc:  # never let the watch stop the training
                log.warning("peer watch: %s", exc)
                self._stop.wait(self.interval)
                due = self.clock()

    def _wait_io(self, timeout: float) -> None:
        """Wait up to `timeout` for a connection to accept, a peer's goodbye or its
        connection's close (a death: judged at once, `Seen.dropped_at`)."""
        with self._conns:
            socks = [self._wake_r, *self._accepted, *self._links.values()]
            if self._listener is not None:
                socks.append(self._listener)
        ready, _, _ = select.select(socks, [], [], timeout)
        dropped = False
        for sock in ready:
            if sock is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif sock is self._listener:
                self._accept()
            elif sock in self._accepted:  # a watcher wrote (nothing is asked) or left
                if not _read(sock):
                    self._drop_accepted(sock)
            else:
                r = next(r for r, link in self._links.items() if link is sock)
                data = _read(sock)
                if data and BYE in data:
                    self._bye_from.add(r)
                if data:
                    continue
                del self._links[r]
                sock.close()
                if r in self._bye_from or self._leaving.is_set():
                    continue
                log.warning("node rank %d: its connection closed without a goodbye", r)
                with self._lock:
                    s = self.seen[r]
                    if s.dropped_at is None:
                        self.seen[r] = replace(s, dropped_at=self.clock())
                dropped = True
        if dropped:
            self.tick()  # its lease read again first: one that ended is no loss

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with self._conns:
            if len(self._accepted) >= BACKLOG:
                conn.close()  # watchers are two; more are not ours
                return
            conn.setblocking(False)
            self._accepted.append(conn)
            if self._said_bye:
                _send(conn, BYE)

    def _drop_accepted(self, sock: socket.socket) -> None:
        with self._conns:
            if sock in self._accepted:
                self._accepted.remove(sock)
        sock.close()

    def _connect(self) -> None:
        """Connect to each watched peer whose lease names its listener (once per poll
        until it succeeds; a refused or slow connect leaves the lease's timeout alone)."""
        with self._lock:
            seen = dict(self.seen)
        for r, s in seen.items():
            lease = s.lease
            if (
                r in self._links
                or r in self._bye_from
                or s.dropped_at is not None
                or not isinstance(lease, Lease)
                or lease.addr is None
                or lease.ended is not None
                or r in self.lost
            ):
                continue
            host, _, port = lease.addr.rpartition(":")
            try:
                link = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            except (OSError, ValueError):
                continue
            link.setblocking(False)
            self._links[r] = link

    def tick(self) -> None:
        """One poll: renew the lease, read the peers', report the newly lost."""
        self._write_lease(None)
        leases = {
            r: Lease.from_json(read_json(self.run.peer_lease(self.attempt, r))) for r in self.seen
        }
        now, wall = self.clock(), self.wall()
        with self._lock:
            self.seen = {r: observe(s, leases[r], now, wall) for r, s in self.seen.items()}
            new = (
                []
                if self._leaving.is_set()
                else [
                    r
                    for r in lost_peers(self.seen, now, self.timeout, self.start_timeout)
                    if r not in self.lost
                ]
            )
            self.lost.extend(new)
            seen = dict(self.seen)
            self._ticked.notify_all()
        for r in new:
            self._report(seen[r], now, wall)

    def _report(self, seen: Seen, now: float, wall: float) -> None:
        name = seen.lease.node if seen.lease else f"node rank {seen.node_rank}"
        if seen.dropped_at is not None:
            log.warning(
                "node %s (node rank %d): its launcher died (connection closed): reporting it lost",
                name,
                seen.node_rank,
            )
        else:
            log.warning(
                "node %s (node rank %d) silent for %.1fs: reporting it lost",
                name,
                seen.node_rank,
                now - seen.changed_at,
            )
        path = self.run.peer_lost(self.attempt, seen.node_rank)
        if path.exists():  # another launcher saw it first
            return
        write_report(
            path,
            loss_report(
                seen,
                now=now,
                wall=wall,
                timeout=self.timeout,
                me=self.node_rank,
                node=self.node,
                job_id=self.job_id,
                attempt=self.attempt,
            ),
        )

    def set_role(self, role: str) -> None:
        """Say the node's role in its lease at once (not only at the next poll)."""
        if role != self.role:
            self.role = role
            self._write_lease(None)

    def set_warm(self, warm: bool) -> None:
        """Say in the lease whether this spare's ranks wait warm (at once), so that a loss
        report tells a warm spare from an idle one."""
        if warm != self.warm:
            self.warm = warm
            self._write_lease(None)

    def _write_lease(self, ended: str | None) -> None:
        with self._writing:
            self.seq += 1
            lease = Lease(
                self.node_rank,
                self.node,
                os.getpid(),
                self.seq,
                self.wall(),
                ended,
                self.role,
                self.addr,
                self.warm,
            )
            path = self.run.peer_lease(self.attempt, self.node_rank)
            tmp = temp_path(path)
            tmp.write_text(json.dumps(lease.to_json()))
            os.replace(tmp, path)

    def leaving(self) -> None:
        """This launcher is on its way out (a termination signal, its end, the interpreter's
        exit): say goodbye to its watchers, so that its connections' close is no death, and
        report no one from now on (its peers are going down with it, in any order). Safe in
        a signal handler."""
        self._leaving.set()
        with self._conns:
            if not self._said_bye:
                self._said_bye = True
                for conn in self._accepted:
                    _send(conn, BYE)
        _send(self._wake_w, b"!")

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
        """End the watch and mark the lease ended (`ended`: the launcher's outcome), then
        say goodbye and close the connections."""
        self._stop.set()
        _send(self._wake_w, b"!")
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)
        try:
            self._write_lease(ended)
        except OSError as exc:
            log.warning("peer watch: could not mark the lease ended: %s", exc)
        self.leaving()
        atexit.unregister(self.leaving)
        with self._conns:
            for sock in [*self._accepted, *self._links.values()]:
                sock.close()
            self._accepted, self._links = [], {}
            if self._listener is not None:
                self._listener.close()
                self._listener = None


def task_watch(
    job: JobEnv, environ: Mapping[str, str], attempt: int, node: str
) -> PeerWatch | None:
    """Without the launcher (`use_launcher=False`), the lease of the node, kept by the task
    wrapper (`ftslurm.agent.task`) of its first task: the daemon watches the batch host's
    (the only watcher of a job of one node), and the nodes of a larger job watch each
    other's as launchers do, by the lease alone (no connections: srun's kill of a failed
    step's other tasks would read as deaths). None: not this task's to keep (another local
    task, under the launcher, or no run directory)."""
    if job.run is None or job.heartbeat_dir or (environ.get("SLURM_LOCALID") or "0") != "0":
        return None
    try:
        nnodes = int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or 1)
        node_rank = int(environ.get("SLURM_NODEID") or 0)
    except ValueError:
        return None
    return PeerWatch(
        job.run,
        attempt=attempt,
        node_rank=node_rank,
        nnodes=nnodes,
        node=node,
        job_id=environ.get("SLURM_JOB_ID", "local"),
        timeout=job.peer_timeout_s,
        start_timeout=TASK_START_TIMEOUT_S,
        listen=False,
    ).start()


def advertised_host() -> str:
    """The name the watchers connect to: this host's name, as the batch script's
    MASTER_ADDR (`hostname`)."""
    return socket.gethostname()


def _read(sock: socket.socket) -> bytes:
    """What a connection says; b"" once it closed (or was reset)."""
    try:
        return sock.recv(4096)
    except BlockingIOError:
        return b"?"  # nothing after all: not a close
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.send(data)
