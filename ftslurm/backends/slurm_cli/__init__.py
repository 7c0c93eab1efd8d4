"""The Slurm command-line backend."""

from ftslurm.backends.slurm_cli.backend import SlurmCliBackend
from ftslurm.backends.slurm_cli.runner import CommandRunner, classify

__all__ = ["CommandRunner", "SlurmCliBackend", "classify"]
