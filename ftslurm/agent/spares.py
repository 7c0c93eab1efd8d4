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
from typing import Any

from ftslurm.agent.peers import Lease
from ftslurm.agent.spare_rules import (  # the rules, pure; re-exported here
    ACTIVE,
    BENCH_WAIT_S,
    BENCHED,
    HANG,
    KEEP_ALIVE_MISSES,
    KEEP_ALIVE_S,
    SPARE,
    STRAGGLER,
    UNHEALTHY,
    Action,
    active_nodes,
    alive_since,
    benched_record,
    gone_name,
    hang_claim,
    loss_action,
    may_join,
    may_step_out,
    round_record,
    same_hang,
    spares_left,
    starts_as_spare,
    straggler_reason,
    swap_why,
)
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Benched, Kind, PeerLost, RoundRecord
from ftslurm.fsutil import read_json
from ftslurm.runfiles import read_reports

log = logging.getLogger("ftslurm.launch")

__all__ = [  # the rules (`ftslurm.agent.spare_rules`) and what the launchers read
    "ACTIVE",
    "SPARE",
    "KEEP_ALIVE_S",
    "KEEP_ALIVE_MISSES",
    "HANG",
    "STRAGGLER",
    "UNHEALTHY",
    "BENCHED",
    "BENCH_WAIT_S",
    "Action",
    "active_nodes",
    "starts_as_spare",
    "loss_action",
    "may_join",
    "alive_since",
    "may_step_out",
    "straggler_reason",
    "benched_record",
    "hang_claim",
    "same_hang",
    "gone_name",
    "swap_why",
    "spares_left",
    "round_record",
    "lost_reports",
    "benched_reports",
    "gone_reports",
    "leave_rendezvous",
    "read_lease",
    "named_in_rounds",
    "rendezvous_round",
]


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
