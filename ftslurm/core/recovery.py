"""Where a lost node's job recovers: inside the allocation on a spare, or by a new job (pure).

A run with `spare_nodes` K asks Slurm for N+K nodes with `--no-kill`; the launchers train
on N of them and keep K idle. When nodes are lost (a peer-loss report, or Slurm's verdict),
the job can carry on inside its allocation only while

- node rank 0 is not among them: it runs the batch script (Slurm's batch host, whose loss
  the job cannot survive) and hosts the launchers' rendezvous; and
- no more nodes are lost than there were spares: every lost node, active or idle, takes
  one node out of the pool of N+K, and N must remain.

Otherwise the job is ended and the run goes on in a new job without the lost nodes.
Both the daemon (`ftslurm.daemon.step`) and the launchers read this one rule.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum

BATCH_NODE_RANK = 0  # SLURM_NODEID of the batch host: the batch script and the rendezvous


class Source(str, Enum):
    """Who told of a lost node first."""

    PEER = "peer"  # the launchers' leases (ftslurm.agent.peers)
    SLURM = "slurm"  # Slurm's NODE_FAIL, after its SlurmdTimeout
    # the daemon's own watch of the batch host's lease, when no launcher reported its loss
    DAEMON = "daemon"


class Recovery(str, Enum):
    SPARE = "spare"  # the launchers restart the ranks on the survivors and a spare
    NEW_JOB = "new_job"  # end the job; the next attempt runs without the lost nodes


def recovery(lost_node_ranks: Collection[int], spare_nodes: int) -> Recovery:
    """How a job with `spare_nodes` spares recovers from losing these node ranks (every
    node lost in the attempt so far, not only the newest)."""
    lost = set(lost_node_ranks)
    if BATCH_NODE_RANK in lost or len(lost) > spare_nodes:
        return Recovery.NEW_JOB
    return Recovery.SPARE
