"""ftslurm: Slurm-native fault tolerance for long distributed PyTorch training runs."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Recipe", "SubmititExecutor", "Training", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Recipe":  # imported on use: compute-side code does not pay for it
        from ftslurm.recipe import Recipe

        return Recipe
    if name == "SubmititExecutor":  # submitit's executor plugin (submitit is imported on use)
        from ftslurm.integrations.submitit import FtslurmExecutor

        return FtslurmExecutor
    if name == "Training":  # the rank's training loop (torch is imported on use)
        from ftslurm.agent.loop import Training

        return Training
    raise AttributeError(f"module 'ftslurm' has no attribute {name!r}")
