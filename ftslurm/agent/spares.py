"""Hot spares on the compute side: the rules the launchers follow (pure), and what they read.

A job with `spare_nodes` K runs one launcher on each of its N+K nodes. The rendezvous asks
for exactly N nodes (min = max = N). Node ranks 0..N-1 train first: the K others (the
spares) hold back from the first rendezvous until every one of those N launchers started
its ranks (its lease says "active"), so the batch host always trains; then they join and
torch elastic's rendezvous keeps them on its redundancy list, where they wait, keep their
keep-alive, and restart no one.

When an active node is lost (a peer-loss report, `recovery/lost-<n>.json`, for a node whose
lease said "active"), or the ranks fail and a report of such a loss comes within the peer
timeout, the survivors kill their ranks and join the next round of the rendezvous; the dead
node's keep-alive runs out (in about 3 s: the keep-alive is tuned down with spares), a
spare leaves the redundancy list and takes its place, and the ranks start again from the
last checkpoint on N nodes: the same WORLD_SIZE, ranks 0..WORLD_SIZE-1. Which launcher gets
which group rank is torch's choice (sorted by address); ranks stay contiguous.

A swap is an in-job restart (the node reports count it in `in_job_restarts`, and say how
many were swaps in `spare_swaps`), but it does not use up `num_in_job_restarts`, which
caps the restarts after a failure of the training itself: the spares are their own budget,
so a spare takes over even with `num_in_job_restarts` 0. When a loss leaves no spare, or the
batch host is lost (`ftslurm.core.recovery.recovery`), the launchers stop their ranks and
leave; the daemon ends the job and the run goes on in a new one.

A node that is not lost but bad steps out the same way (`may_step_out`): its launcher finds
one of its ranks hung, or the straggler report names it as a persistent straggler
(`straggler_reason`), while a spare can take its place and it is not the batch host. It
writes `recovery/benched-<n>.json` (`benched_record`), kills its ranks, leaves the
rendezvous without closing it, and exits 0 with outcome "benched" (like a spare never
needed, it leaves the job's verdict to the nodes that train). The other launchers treat the
record of an active node like a loss report: their ranks, failed or blocked on the missing
peer, restart with a spare within a second or two. A node that finds a hang but may not
step out (the batch host, say) first waits up to `BENCH_WAIT_S` for a peer to step out
(its ranks may only be blocked on a peer's hung rank), then restarts its ranks in place
as without spares.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from enum import Enum
from typing import Any

from ftslurm.agent.peers import Lease
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import (
    Benched,
    Kind,
    Outcome,
    PeerLost,
    RoundRecord,
    StragglerReport,
    parse,
)
from ftslurm.core.recovery import Recovery, recovery
from ftslurm.fsutil import read_json
from ftslurm.runfiles import read_reports

log = logging.getLogger("ftslurm.launch")

ACTIVE, SPARE = "active", Outcome.SPARE.value  # a node's role; a spare's outcome too
# With spares, the rendezvous drops a participant whose keep-alive stopped after
# KEEP_ALIVE_S x KEEP_ALIVE_MISSES seconds (torch's defaults: 5 x 3): the round that brings
# in a spare waits on that.
KEEP_ALIVE_S, KEEP_ALIVE_MISSES = 1, 3
# Why a node stepped out (`RunDir.benched`), and the outcome of its node report.
HANG, STRAGGLER = "hang", "straggler"
BENCHED = Outcome.BENCHED.value
# A node that finds its ranks hung but may not step out waits this long for a peer to step
# out before it restarts its ranks in place (its ranks may be blocked on the peer's).
BENCH_WAIT_S = 5.0


class Action(str, Enum):
    NONE = "none"  # nothing to do: no node that trained is among the newly lost
    SWAP = "swap"  # restart the ranks on the survivors and a spare
    NEW_JOB = "new_job"  # no spare can help: stop, the daemon moves the run to a new job


def active_nodes(nnodes: int, spare_nodes: int) -> int:
    """How many nodes train: N of the job's N+K."""
    return nnodes - spare_nodes


def starts_as_spare(node_rank: int, nnodes: int, spare_nodes: int) -> bool:
    """Node ranks N..N+K-1 start as spares; 0..N-1 (the batch host among them) train."""
    return node_rank >= active_nodes(nnodes, spare_nodes)


def loss_action(
    lost: Collection[int], newly_lost_roles: Mapping[int, str | None], spare_nodes: int
) -> Action:
    """What the launchers do on news of lost nodes (pure). `lost`: every node rank lost in
    the attempt so far; `newly_lost_roles`: the roles the newly lost nodes' leases said.
    A lost spare changes nothing now (it takes a spare away); an active one is replaced
    while `ftslurm.core.recovery.recovery` says a spare can do it."""
    if not any(role == ACTIVE for role in newly_lost_roles.values()):
        return Action.NONE
    if recovery(lost, spare_nodes) is Recovery.SPARE:
        return Action.SWAP
    return Action.NEW_JOB


def may_join(
    leases: Mapping[int, Lease | None], nnodes: int, spare_nodes: int, lost: Collection[int]
) -> bool:
    """Whether a spare may join the rendezvous (pure): once every node that trains first
    started its ranks, or when one of them is lost or left (then a spare is needed now)."""
    if lost:
        return True
    firsts = [leases.get(r) for r in range(active_nodes(nnodes, spare_nodes))]
    return all(
        lease is not None and (lease.role == ACTIVE or lease.ended is not None) for lease in firsts
    )


def alive_since(first: Mapping[int, int], leases: Mapping[int, Lease | None]) -> bool:
    """Whether every peer in `first` (node rank -> the lease counter read when the ranks
    failed) has renewed its lease twice since, or ended: its launcher lives (pure)."""
    for r, seq in first.items():
        lease = leases.get(r)
        if lease is None or (lease.ended is None and lease.seq < seq + 2):
            return False
    return True


def may_step_out(node_rank: int, gone: Collection[int], spare_nodes: int) -> bool:
    """Whether node `node_rank` may take itself out of the training so that a spare takes
    its place (pure): `ftslurm.core.recovery.recovery` of every node lost or benched in the
    attempt so far (`gone`) plus this one says SPARE. Never the batch host, never without a
    spare left."""
    return recovery({*gone, node_rank}, spare_nodes) is Recovery.SPARE


def straggler_reason(
    report: StragglerReport | Mapping[str, Any] | None, attempt: int, node: str
) -> str | None:
    """The words for node `node` when the attempt's straggler report (`RunDir.
    straggler_report`) names it a persistent straggler; None when it does not (pure)."""
    report = parse(StragglerReport, report)
    if report is None or report.attempt != attempt or node not in report.persistent_nodes:
        return None
    scores = [min(s.relative, s.individual) for s in report.scores if s.node == node]
    score = f"score {min(scores):.2f} " if scores else ""
    return f"persistent straggler: {score}below {report.threshold}"


def benched_record(
    *, node_rank: int, node: str, why: str, reason: str, time: float, job_id: str, attempt: int
) -> dict[str, Any]:
    """The content of `recovery/benched-<n>.json` (pure)."""
    return Benched(
        node_rank=node_rank,
        node=node,
        why=why,
        reason=reason,
        time=time,
        job_id=job_id,
        attempt=attempt,
    ).to_json()


def gone_name(node_rank: int, report: PeerLost | Benched) -> str:
    """The node a loss report or a bench record names."""
    named = report.lost_node if isinstance(report, PeerLost) else report.node
    return str(named or f"node rank {node_rank}")


def swap_why(gone: Mapping[int, PeerLost | Benched]) -> str:
    """The round record's `why` for a swap after these losses and benches (pure)."""
    words = []
    for r, rep in sorted(gone.items()):
        if isinstance(rep, PeerLost):
            words.append(f"node {gone_name(r, rep)} lost")
        else:
            reason = f": {rep.reason}" if rep.reason else ""
            words.append(f"node {gone_name(r, rep)} stepped out ({rep.why}{reason})")
    return f"{'; '.join(words)}: a spare takes its place"


def spares_left(lost: Collection[int], spare_nodes: int) -> int:
    return max(0, spare_nodes - len(set(lost)))


def round_record(
    *,
    round_: int,
    started_at: float,
    world_size: int,
    nnodes_active: int,
    spares_left: int,
    why: str,
    lost: list[str],
    job_id: str,
    attempt: int,
) -> dict[str, Any]:
    """The content of `recovery/round-<r>.json` when the round's ranks start (pure)."""
    return RoundRecord(
        round=round_,
        started_at=started_at,
        first_step_at=None,
        step=None,
        world_size=world_size,
        nnodes_active=nnodes_active,
        spares_left=spares_left,
        why=why,
        lost=lost,
        job_id=job_id,
        attempt=attempt,
    ).to_json()


# ---------------------------------------------------------------------------- reading
def lost_reports(run: RunDir, attempt: int) -> dict[int, PeerLost]:
    """The attempt's peer-loss reports: node rank -> report."""
    found: list[PeerLost] = read_reports(run, Kind.PEER_LOST, attempt)
    return {r.lost_node_rank: r for r in found if r.lost_node_rank is not None}


def benched_reports(run: RunDir, attempt: int) -> dict[int, Benched]:
    """The attempt's bench records: node rank -> record."""
    found: list[Benched] = read_reports(run, Kind.BENCHED, attempt)
    return {r.node_rank: r for r in found if r.node_rank is not None}


def gone_reports(run: RunDir, attempt: int) -> dict[int, PeerLost | Benched]:
    """Every node of the attempt lost or benched: node rank -> its report (the loss report
    when there are both)."""
    return {**benched_reports(run, attempt), **lost_reports(run, attempt)}


def leave_rendezvous(handler: Any) -> None:
    """Leave torch's rendezvous without closing it (a benched node): stop the keep-alive
    and take this node out of the participants, so the next round forms without waiting
    for its keep-alive to run out (which it would do anyway if this fails)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10)
    except Exception as exc:
        log.info("left the rendezvous by silence: %s", exc)


def read_lease(run: RunDir, attempt: int, node_rank: int) -> Lease | None:
    return Lease.from_json(read_json(run.peer_lease(attempt, node_rank)))


def named_in_rounds(run: RunDir, attempt: int) -> set[str]:
    """The lost nodes the attempt's round records named already."""
    rounds: list[RoundRecord] = read_reports(run, Kind.ROUND, attempt)
    return {n for r in rounds for n in r.lost}


def rendezvous_round(handler: Any) -> int | None:
    """The round of torch's dynamic rendezvous (0: the first), or None when unknown."""
    try:
        return int(handler._state_holder.state.round)
    except Exception:
        return None
