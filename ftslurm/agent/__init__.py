"""The compute side: the per-task wrapper (`agent.task`, run under srun for every rank) and
the API a training script calls to tell the daemon how far it got (`agent.progress`)."""

from __future__ import annotations

from ftslurm.agent import progress

__all__ = ["progress"]
