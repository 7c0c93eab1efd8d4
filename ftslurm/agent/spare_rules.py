"""The hot spares' rules (pure): who trains, what a loss or a bench record means, whether
a node may step out, and the records' contents. The launcher's decision core
(`ftslurm.agent.launch_core`) uses them; `ftslurm.agent.spares` re-exports them with what
the launchers read ([agent.md](agent.md#hot-spares))."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import Enum
from typing import Any

from ftslurm.core.contract.reports import (
    Benched,
    HangClaim,
    HangEvidence,
    NodeRole,
    Outcome,
    PeerLost,
    RoundRecord,
    StragglerReport,
    parse,
)
from ftslurm.core.leases import Lease
from ftslurm.core.recovery import Recovery, recovery

ACTIVE, SPARE = NodeRole.ACTIVE.value, NodeRole.SPARE.value  # a spare's outcome too
# With spares, the rendezvous drops a participant whose keep-alive stopped after
# KEEP_ALIVE_S x KEEP_ALIVE_MISSES seconds (torch's defaults: 5 x 3): the round that brings
# in a spare waits on that.
KEEP_ALIVE_S, KEEP_ALIVE_MISSES = 1, 3
# Why a node stepped out (`RunDir.benched`), and the outcome of its node report.
HANG, STRAGGLER = "hang", "straggler"
UNHEALTHY = Outcome.UNHEALTHY.value  # it failed its pre-flight health check (before training)
BENCHED = Outcome.BENCHED.value
# A node that finds its ranks hung but may not step out waits this long for a peer to step
# out before it restarts its ranks in place (its ranks may be blocked on the peer's).
BENCH_WAIT_S = 5.0
# A node that finds a rank hung says so (`RunDir.hang_claim`) and waits this long for the
# claims of the other nodes that judge the same hang (a hung rank blocks its peers in their
# next collective, and their launchers judge a hang about as soon) before one steps out.
HANG_CLAIM_WAIT_S = 2.0
# Claims further apart than this (on the writers' wall clocks) are not of the same hang.
HANG_CLAIM_WINDOW_S = 2 * HANG_CLAIM_WAIT_S + 1.0
# How strongly a claim's evidence says its rank is the hang the others wait on.
_EVIDENCE = {HangEvidence.FROZEN.value: 1, HangEvidence.RUNNING.value: 0}


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


def spare_ranks(nnodes: int, spare_nodes: int) -> range:
    """The node ranks that start as spares."""
    return range(active_nodes(nnodes, spare_nodes), nnodes)


def takeovers(
    gone: Sequence[tuple[int, str | None]], nnodes: int, spare_nodes: int
) -> dict[int, int]:
    """Which spare takes over which node with live recovery (pure): `gone`, the attempt's
    lost or stepped-out nodes in the order they went (node rank, the role its lease said).
    Each active node that went is taken over by the lowest-ranked spare still waiting; a
    spare that went while waiting is no longer one; a spare that took over and went is an
    active node like the others. Lost node rank -> the spare's node rank, for those a
    spare was left for (every launcher reads the same records: they agree)."""
    waiting = list(spare_ranks(nnodes, spare_nodes))
    taken: dict[int, int] = {}
    for node_rank, role in gone:
        if node_rank in waiting:
            waiting.remove(node_rank)
        elif (role == ACTIVE or node_rank in taken.values()) and waiting:
            taken[node_rank] = waiting.pop(0)
    return taken


def may_step_out(node_rank: int, gone: Collection[int], spare_nodes: int) -> bool:
    """Whether node `node_rank` may take itself out of the training so that a spare takes
    its place (pure): `ftslurm.core.recovery.recovery` of every node lost or benched in the
    attempt so far (`gone`) plus this one says SPARE. Never the batch host, never without a
    spare left."""
    return recovery({*gone, node_rank}, spare_nodes) is Recovery.SPARE


def same_hang(claims: Mapping[int, HangClaim], mine: HangClaim) -> dict[int, HangClaim]:
    """The claims of the hang `mine` claims (pure): node rank -> claim, for those written
    within HANG_CLAIM_WINDOW_S of it (a node's file holds its latest claim; an older one is
    an earlier hang's); this node's own claim among them."""
    at = mine.time or 0.0
    out = {
        r: c
        for r, c in claims.items()
        if c.time is not None and abs(c.time - at) <= HANG_CLAIM_WINDOW_S
    }
    if mine.node_rank is not None:
        out[mine.node_rank] = mine
    return out


def hang_culprit(
    claims: Mapping[int, HangClaim], gone: Collection[int], spare_nodes: int
) -> int | None:
    """Which node steps out for a hang several launchers judged at once (pure). `claims`:
    node rank -> its claim of this hang (`same_hang`). The strongest evidence points at
    the hang the others wait on (a frozen rank waits on no peer; a running one may be
    blocked in a collective on it); among those alike, the ranks at the lowest step when
    the steps differ (the others went on to a later step's collective and wait there); of
    those, the nodes that may step out (`may_step_out`: never the batch host, a spare
    left). Exactly one: that node. None: none may (the batch host's rank is the one: every
    node restarts its ranks in place, which clears it), or several remain alike (nothing
    tells the hung node from the ones blocked on it: rather than a healthy node stepping
    out, each restarts in place). Nodes already gone are left out."""
    shown = {r: c for r, c in claims.items() if r not in gone}
    if not shown:
        return None
    strength = {r: _EVIDENCE.get(str(c.evidence), 0) for r, c in shown.items()}
    top = max(strength.values())
    first = [r for r in sorted(shown) if strength[r] == top]
    steps = [shown[r].step for r in first]
    if all(s is not None for s in steps) and len(set(steps)) > 1:
        low = min(s for s in steps if s is not None)
        first = [r for r in first if shown[r].step == low]
    may = [r for r in first if may_step_out(r, gone, spare_nodes)]
    return may[0] if len(may) == 1 else None


def hang_claim(
    *,
    node_rank: int,
    node: str,
    local_rank: int,
    reason: str,
    step: int | None,
    frozen: bool,
    time: float,
    job_id: str,
    attempt: int,
) -> HangClaim:
    """The content of `hang-claim-<n>.json` (pure)."""
    evidence = HangEvidence.FROZEN if frozen else HangEvidence.RUNNING
    return HangClaim(
        node_rank=node_rank,
        node=node,
        local_rank=local_rank,
        reason=reason,
        step=step,
        evidence=evidence.value,
        time=time,
        job_id=job_id,
        attempt=attempt,
    )


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
) -> Benched:
    """The content of `recovery/benched-<n>.json` (pure)."""
    return Benched(
        node_rank=node_rank,
        node=node,
        why=why,
        reason=reason,
        time=time,
        job_id=job_id,
        attempt=attempt,
    )


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
) -> RoundRecord:
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
    )
