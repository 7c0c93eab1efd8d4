"""The Slurm command-line backend."""

from ftslurm.backends.slurm_cli.backend import SlurmCliBackend, sbatch_args
from ftslurm.backends.slurm_cli.runner import CommandRunner, classify

__all__ = ["CommandRunner", "SlurmCliBackend", "classify", "sbatch_args"]
