"""A real multi-node Slurm cluster on one machine (tests, demos, rehearsals)."""

from ftslurm.localcluster.config import ClusterLayout
from ftslurm.localcluster.harness import (
    DEFAULT_ROOT,
    ClusterError,
    LocalCluster,
    wait_for,
)

__all__ = ["DEFAULT_ROOT", "ClusterError", "ClusterLayout", "LocalCluster", "wait_for"]
