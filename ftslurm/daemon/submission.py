"""From a run's stored spec to the batch script and options of one attempt (pure).

The spec is plain JSON kept in the run's record, so the daemon can build attempt N after
any number of its own restarts. Every job carries its tag (`ftslurm:<run>:<attempt>`) in
its comment: after a crash between `sbatch` and recording the job id, the daemon finds the
job by that tag instead of submitting a duplicate.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ftslurm.core.types import JobOptions
from ftslurm.recipe import Recipe
from ftslurm.templates import render_job_script


def tag(run_id: str, attempt: int) -> str:
    return f"ftslurm:{run_id}:{attempt}"


def make_spec(recipe: Recipe, *, run_dir: Path, backend: str, workdir: str,
              inject: tuple[str, ...] = (), mock_home: Path | None = None,
              ) -> dict[str, Any]:  # fmt: skip
    """What every attempt of a run is built from."""
    checkpoint_dir = recipe.checkpoint_dir or str(run_dir / "checkpoints")
    return {
        "backend": backend,
        "mock_home": str(mock_home) if mock_home is not None else None,
        "command": list(recipe.command or []),
        "run_dir": str(run_dir),
        "checkpoint_dir": str(Path(workdir, checkpoint_dir)),
        "workdir": workdir,
        "setup": list(recipe.setup),
        "env": dict(recipe.env),
        "inject": list(inject),
        "python": sys.executable,
        "options": {
            "name": recipe.name, "nodes": recipe.nodes,
            "ntasks_per_node": recipe.ntasks_per_node, "cpus_per_task": recipe.cpus_per_task,
            "gpus_per_node": recipe.gpus_per_node, "time_limit": recipe.time,
            "partition": recipe.partition, "account": recipe.account,
            "exclude": list(recipe.exclude), "extra": dict(recipe.sbatch_extra),
        },
    }  # fmt: skip


def backend_key(spec: dict[str, Any]) -> str:
    """Which scheduler a run lives on: "slurm", or "mock:<its mock cluster's folder>"."""
    if spec["backend"] == "mock":
        return f"mock:{spec.get('mock_home') or ''}"
    return str(spec["backend"])


def build_attempt(run_id: str, spec: dict[str, Any], settings: dict[str, Any], attempt: int,
                  exclude: tuple[str, ...]) -> tuple[str, JobOptions]:  # fmt: skip
    """The batch script and sbatch options for attempt `attempt` of a run."""
    o = spec["options"]
    run_dir = spec["run_dir"]
    signal = settings.get("checkpoint_signal", "USR2")
    preempt_time = int(settings.get("preempt_time", 60))
    extra = {"open-mode": "append", **o["extra"]}
    options = JobOptions(
        name=o["name"] or f"ftslurm-{run_id}", nodes=o["nodes"],
        ntasks_per_node=o["ntasks_per_node"], cpus_per_task=o["cpus_per_task"],
        gpus_per_node=o["gpus_per_node"], time_limit=o["time_limit"],
        partition=o["partition"], account=o["account"],
        exclude=tuple(sorted(set(o["exclude"]) | set(exclude))), comment=tag(run_id, attempt),
        output=f"{run_dir}/logs/job-%j.out", workdir=spec["workdir"], requeue=True,
        # A backstop: if the daemon is down, Slurm itself still asks for the checkpoint.
        signal=f"{signal}@{preempt_time}" if o["time_limit"] and preempt_time
        and settings.get("signal_backstop", True) else None,
        extra=extra, inject=tuple(spec.get("inject", ())),
    )  # fmt: skip
    env = {
        **spec["env"],
        "FTSLURM_RUN_ID": run_id, "FTSLURM_RUN_DIR": run_dir,
        "FTSLURM_CHECKPOINT_DIR": spec["checkpoint_dir"],
        # A requeued job runs this same script again: the attempt number is the one it was
        # submitted as plus Slurm's restart count (the daemon numbers its attempts alike).
        "FTSLURM_ATTEMPT_BASE": str(attempt),
        "FTSLURM_CHECKPOINT_SIGNAL": signal,
    }  # fmt: skip
    setup = [
        'export FTSLURM_ATTEMPT=$((FTSLURM_ATTEMPT_BASE + ${SLURM_RESTART_COUNT:-0}))',
        'export MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"',
        f'mkdir -p {run_dir}/logs "$FTSLURM_CHECKPOINT_DIR"',
        'echo "=== ftslurm run $FTSLURM_RUN_ID attempt $FTSLURM_ATTEMPT: job $SLURM_JOB_ID'
        ' on $SLURM_JOB_NODELIST ==="',
        *spec["setup"],
    ]  # fmt: skip
    command = [spec["python"], "-m", "ftslurm.agent.task", "--", *spec["command"]]
    script = render_job_script(command, options, run_id=run_id, attempt=attempt, env=env,
                               setup=setup)  # fmt: skip
    return script, options

