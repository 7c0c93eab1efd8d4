"""From a run's stored spec to the batch script and options of one attempt (pure).

The spec is plain JSON kept in the run's record, so the daemon can build attempt N after
any number of its own restarts. Every job carries its tag (`ftslurm:<run>:<attempt>`) in
its comment: after a crash between `sbatch` and recording the job id, the daemon finds the
job by that tag instead of submitting a duplicate.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from ftslurm.core.inject import env_value, parse_injections
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.types import JobOptions
from ftslurm.daemon.records import tag
from ftslurm.recipe import Recipe
from ftslurm.templates import render_job_script


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
            "ntasks_per_node": recipe.ranks_per_node(), "cpus_per_task": recipe.cpus_per_task,
            "gpus_per_node": recipe.gpus_per_node, "time_limit": recipe.time,
            "partition": recipe.partition, "account": recipe.account,
            "exclude": list(recipe.exclude), "extra": dict(recipe.sbatch_extra),
        },
    }  # fmt: skip


BACKSTOP_MIN_SPARE_S = 300


def _backstop(time_limit: str | None, preempt_time: int, settings: dict[str, Any]) -> bool:
    """Whether to render Slurm's own `--signal` too. Slurm may deliver it up to a minute
    early, so on a job barely longer than the lead it can arrive while the ranks are still
    starting and cannot catch it: only for limits of at least the lead plus 5 minutes."""
    if not (time_limit and preempt_time and settings.get("signal_backstop", True)):
        return False
    limit = parse_time_limit(time_limit)  # None: no limit, nothing to signal before
    return limit is not None and limit >= preempt_time + BACKSTOP_MIN_SPARE_S


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
    injections = parse_injections(tuple(spec.get("inject", ())))
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
        signal=f"{signal}@{preempt_time}" if _backstop(o["time_limit"], preempt_time, settings)
        else None,
        # The scheduler carries out what happens to the cluster (node_fail, preempt,
        # timeout); what a job can do to itself travels to every rank's wrapper, on the
        # mock and on a real cluster alike.
        extra=extra, inject=tuple(i.spec() for i in injections if not i.kind.in_job),
    )  # fmt: skip
    env = {
        **spec["env"],
        "FTSLURM_RUN_ID": run_id, "FTSLURM_RUN_DIR": run_dir,
        "FTSLURM_CHECKPOINT_DIR": spec["checkpoint_dir"],
        # A requeued job runs this same script again: the attempt number is the one it was
        # submitted as plus Slurm's restart count (the daemon numbers its attempts alike).
        "FTSLURM_ATTEMPT_BASE": str(attempt),
        "FTSLURM_CHECKPOINT_SIGNAL": signal,
        # Straggler scores (ftslurm.agent.straggler): ranks publish their step times each
        # interval; the launcher on node 0 scores them into stragglers/report.json.
        "FTSLURM_STRAGGLER_INTERVAL_S": str(settings.get("straggler_report_interval_s", 60)),
        "FTSLURM_STRAGGLER_THRESHOLD": str(settings.get("straggler_threshold", 0.75)),
        "FTSLURM_STRAGGLER_WINDOWS": str(settings.get("straggler_windows", 3)),
        "FTSLURM_STRAGGLER_REFERENCE": str(settings.get("straggler_reference", "best")),
    }  # fmt: skip
    if any(i.kind.in_job for i in injections):
        env["FTSLURM_INJECT"] = env_value(injections)
    setup = [
        'export FTSLURM_ATTEMPT=$((FTSLURM_ATTEMPT_BASE + ${SLURM_RESTART_COUNT:-0}))',
        'export MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"',
        f'mkdir -p {shlex.quote(run_dir + "/logs")} "$FTSLURM_CHECKPOINT_DIR"',
        'echo "=== ftslurm run $FTSLURM_RUN_ID attempt $FTSLURM_ATTEMPT: job $SLURM_JOB_ID'
        ' on $SLURM_JOB_NODELIST ==="',
        *spec["setup"],
    ]  # fmt: skip
    if settings.get("use_launcher", True):
        # One launcher per node starts the node's ranks, restarts them in-job and forwards
        # signals; srun waits for the others after the first launcher ends (no kill on
        # "continue me", which is a non-zero code), then ends the step.
        # Hang detection (ftslurm.agent.heartbeat); a setting a stored run lacks gets its
        # default there, None (null) is off.
        timeouts = {**(settings.get("section_timeouts") or {}),
                    **{key: settings[name] for key, name in (
                        ("out_of_section", "out_of_section_timeout"),
                        ("initial", "initial_timeout"),
                        ("warmup_steps", "hang_warmup_steps")) if name in settings}}
        env.update({"FTSLURM_IN_JOB_RESTARTS": str(settings.get("num_in_job_restarts", 0)),
                    "FTSLURM_SECTION_TIMEOUTS": json.dumps(timeouts, sort_keys=True),
                    "FTSLURM_GRACE_S": str(settings.get("grace_s", 120))})  # fmt: skip
        command = [spec["python"], "-m", "ftslurm.agent.launch",
                   f"--nproc-per-node={o['ntasks_per_node']}", "--", *spec["command"]]
        grace = int(float(settings.get("grace_s", 120)))
        srun_args: tuple[str, ...] = (
            "--nodes=${SLURM_NNODES:-1}", "--ntasks=${SLURM_NNODES:-1}",
            "--ntasks-per-node=1", "--cpus-per-task=${SLURM_CPUS_ON_NODE:-1}",
            "--kill-on-bad-exit=0", f"--wait={grace + 60}")  # fmt: skip
    else:
        command = [spec["python"], "-m", "ftslurm.agent.task", "--", *spec["command"]]
        srun_args = ("--kill-on-bad-exit=1",)
    script = render_job_script(command, options, run_id=run_id, attempt=attempt, env=env,
                               setup=setup, srun_args=srun_args)  # fmt: skip
    return script, options

