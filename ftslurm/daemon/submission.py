"""From a run's stored spec to the batch script and options of one attempt (pure).

The spec is plain JSON kept in the run's record, so the daemon can build attempt N after
any number of its own restarts. Every job carries its tag (`ftslurm:<run>:<attempt>`) in
its comment: after a crash between `sbatch` and recording the job id, the daemon finds the
job by that tag instead of submitting a duplicate.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftslurm.core.contract import (
    SHARING_MODES,
    Disambiguation,
    EnvName,
    HealthConfig,
    JobEnv,
    RunDir,
    attempt_setup_line,
    default_checkpoint_dir,
    launched_line,
)
from ftslurm.core.inject import Injection, env_value, parse_injections, still_to_fire
from ftslurm.core.settings import straggler_threshold
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.types import JobOptions
from ftslurm.daemon.records import tag
from ftslurm.recipe import Recipe
from ftslurm.templates import render_job_script


def make_spec(
    recipe: Recipe,
    *,
    run_dir: Path,
    backend: str,
    workdir: str,
    inject: tuple[str, ...] = (),
    mock_home: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What every attempt of a run is built from. `options.nodes` is what the job asks
    Slurm for: the training's nodes plus `spare_nodes` (hot spares, `ftslurm.core.recovery`),
    so whatever counts the job's nodes (exclusion planning, status) counts the spares too.
    Checkpoints go where the recipe says, else under the site's scratch space, else into
    the run directory (`default_checkpoint_dir`, from the submitter's `environ`;
    `checkpoint_dir_from` says which)."""
    if recipe.checkpoint_dir:
        checkpoint_dir, source = recipe.checkpoint_dir, "the recipe"
    else:
        default, source = default_checkpoint_dir(Path(run_dir), environ or {})
        checkpoint_dir = str(default)
    return {
        "backend": backend,
        "mock_home": str(mock_home) if mock_home is not None else None,
        # A `torchrun ...` command runs its script under ftslurm's launcher instead
        # (`ftslurm.core.torchrun`), with torchrun's one thread per rank by default.
        "command": recipe.job_command(),
        "run_dir": str(run_dir),
        "checkpoint_dir": str(Path(workdir, checkpoint_dir)),
        "checkpoint_dir_from": source,
        "workdir": workdir,
        "setup": [*_torchrun_setup(recipe), *recipe.setup],
        "env": dict(recipe.env),
        "inject": list(inject),
        "python": sys.executable,
        "options": {
            "name": recipe.name,
            "nodes": recipe.nodes + recipe.spare_nodes,
            "spare_nodes": recipe.spare_nodes,
            "ntasks_per_node": recipe.ranks_per_node(),
            "cpus_per_task": recipe.cpus_per_task,
            "gpus_per_node": recipe.gpus_per_node,
            "time_limit": recipe.time,
            "partition": recipe.partition,
            "account": recipe.account,
            "exclude": list(recipe.exclude),
            "extra": dict(recipe.sbatch_extra),
        },
    }


def _torchrun_setup(recipe: Recipe) -> list[str]:
    """What torchrun does to the ranks' environment that ftslurm's launcher does not: with
    several ranks per node, OMP_NUM_THREADS=1 unless the job has it already."""
    if recipe.torchrun() is None or recipe.ranks_per_node() < 2:
        return []
    return ['export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"']


BACKSTOP_MIN_SPARE_S = 300
# A run's setting -> the field of the job's environment (`JobEnv`) that carries it.
_SETTING_TO_ENV = {
    "checkpoint_signal": "checkpoint_signal",
    # Straggler scores (ftslurm.agent.straggler): ranks publish their step times each
    # interval; the launcher on node 0 scores them into the run's straggler report.
    "straggler_report_interval_s": "straggler_interval_s",
    "straggler_threshold": "straggler_threshold",
    "straggler_windows": "straggler_windows",
    "straggler_reference": "straggler_reference",
    "num_in_job_restarts": "in_job_restarts",
    "grace_s": "grace_s",
    "peer_timeout_s": "peer_timeout_s",
    # Hot spares: the launchers train on SLURM_NNODES - spare_nodes nodes, keep the rest idle.
    "spare_nodes": "spare_nodes",
    # Live recovery: the spares keep their ranks warm (ftslurm.agent.live).
    "live_recovery": "live_recovery",
    "checkpoint_sharing": "checkpoint_sharing",
}


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


def build_attempt(
    run_id: str,
    spec: dict[str, Any],
    settings: dict[str, Any],
    attempt: int,
    exclude: tuple[str, ...],
    fired: Collection[str] = (),
    disambiguate: Disambiguation | None = None,
) -> tuple[str, JobOptions]:
    """The batch script and sbatch options for attempt `attempt` of a run. `fired`: the
    fault injections that fired in an earlier attempt (`Run.injected`): each fires once per
    run, so the new job carries only the others (a straggler always: its node stays slow).
    A requeued job runs the script it was submitted with, and its scheduler (the mock)
    remembers what fired in it; the ranks remember the crashes and hangs they carried out.
    `disambiguate`: the attempt re-runs elsewhere after exit 16 (`FTSLURM_DISAMBIGUATE`)."""
    run_dir = spec["run_dir"]
    injections = still_to_fire(parse_injections(tuple(spec.get("inject", ()))), fired)
    launcher = settings.get("use_launcher", True)
    spares = int(settings.get("spare_nodes", 0)) if launcher else 0
    job = _job_env(run_id, spec, settings, attempt, injections, launcher, spares)
    if disambiguate is not None:
        job = job.model_copy(update={"disambiguate": disambiguate})
    options = _job_options(run_id, spec, settings, attempt, exclude, job, injections, spares)
    env = {**spec["env"], **job.render()}
    setup = [
        attempt_setup_line(),
        'export MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"',
        *make_folders_lines(RunDir(run_dir).logs, settings.get("checkpoint_sharing", "private")),
        f'echo "=== ftslurm run ${EnvName.RUN_ID.value} attempt ${EnvName.ATTEMPT.value}: '
        'job $SLURM_JOB_ID on $SLURM_JOB_NODELIST ==="',
        *spec["setup"],
        launched_line(),  # the step starts now: the batch host's launcher is timed from here
    ]
    command, srun_args = _step(spec, job, launcher, spares)
    script = render_job_script(
        command, options, run_id=run_id, attempt=attempt, env=env, setup=setup, srun_args=srun_args
    )
    return script, options


def make_folders_lines(logs: Path, sharing: str) -> list[str]:
    """The batch script's lines that create the run's log folder and its checkpoint folder
    with every parent missing (`<scratch>/ftslurm/<run>/checkpoints`): the logs private, the
    checkpoints as `sharing` says (`SHARING_MODES`), whatever the job's umask is. A plain
    `mkdir -p` at the job's umask made them 0755 (0775 under umask 002), and
    `ftslurm.checkpoint` leaves a folder that exists as it is. Folders that exist already
    keep their mode: `mkdir -p` does not touch them."""
    folders = {
        _umask(SHARING_MODES["private"][0]): [shlex.quote(str(logs))],
    }
    folders.setdefault(_umask(SHARING_MODES[sharing][0]), []).append(
        f'"${EnvName.CHECKPOINT_DIR.value}"'
    )
    return [f"(umask {mask}; mkdir -p {' '.join(paths)})" for mask, paths in folders.items()]


def _umask(folder_mode: int) -> str:
    """The umask under which `mkdir` creates folders (and their parents) `folder_mode`."""
    return f"{0o777 & ~folder_mode:03o}"


def _job_env(
    run_id: str,
    spec: dict[str, Any],
    settings: dict[str, Any],
    attempt: int,
    injections: Sequence[Injection],
    launcher: bool,
    spares: int,
) -> JobEnv:
    """What travels to the compute side; a setting a stored run lacks gets JobEnv's default."""
    defaults = JobEnv()
    # peer_timeout_s: every job keeps a lease, with the launcher or without
    fields = [
        "checkpoint_signal",
        "straggler_interval_s",
        "straggler_threshold",
        "straggler_windows",
        "straggler_reference",
        "peer_timeout_s",
    ]
    if launcher:
        fields += ["in_job_restarts", "grace_s"]
    if spares:
        fields.append("spare_nodes")
    if launcher and settings.get("live_recovery"):
        fields.append("live_recovery")
    if settings.get("checkpoint_sharing", "private") != "private":
        fields.append("checkpoint_sharing")
    given: dict[str, Any] = {
        field: settings.get(key, getattr(defaults, field))
        for key, field in _SETTING_TO_ENV.items()
        if field in fields
    }
    if launcher:
        # Hang detection (ftslurm.agent.heartbeat); a timeout a stored run lacks gets its
        # default there, None (null) is off.
        given["section_timeouts"] = {
            **(settings.get("section_timeouts") or {}),
            **{
                key: settings[name]
                for key, name in (
                    ("out_of_section", "out_of_section_timeout"),
                    ("initial", "initial_timeout"),
                    ("warmup_steps", "hang_warmup_steps"),
                )
                if name in settings
            },
        }
    if any(i.kind.in_job for i in injections):
        given["inject"] = env_value(injections)
    if launcher:
        health = health_config(settings)
        if health != HealthConfig():  # the defaults apply where the launcher parses it
            given["health"] = health
    # None (the default): the threshold follows whether a straggler can step out to a warm
    # spare (`ftslurm.core.settings.straggler_threshold`, the one rule)
    given["straggler_threshold"] = straggler_threshold(
        settings.get("straggler_threshold"),
        live_recovery=launcher and bool(settings.get("live_recovery")),
        spare_nodes=spares,
    )
    return JobEnv(
        run_id=run_id,
        run_dir=spec["run_dir"],
        checkpoint_dir=spec["checkpoint_dir"],
        # A requeued job runs this same script again: the attempt number is the one it was
        # submitted as plus Slurm's restart count (the daemon numbers its attempts alike).
        attempt_base=attempt,
        **given,
    )


# The run's settings -> the health check's (`HealthConfig`), the settings' names beside
_HEALTH_SETTINGS = {
    "health_check": "enabled",
    "health_timeout_s": "timeout_s",
    "health_min_write_mb_s": "min_write_mb_s",
    "health_min_free_memory_mb": "min_free_memory_mb",
    "health_min_free_disk_mb": "min_free_disk_mb",
    "health_min_gpu_free_mb": "min_gpu_free_mb",
    "health_min_bandwidth_ratio": "min_bandwidth_ratio",
    "health_dirs": "dirs",
    "health_command": "command",
}


def health_config(settings: dict[str, Any]) -> HealthConfig:
    """The pre-flight health check's settings the job gets (a setting a stored run lacks:
    its default)."""
    return HealthConfig(
        **{
            field: settings[name]
            for name, field in _HEALTH_SETTINGS.items()
            if settings.get(name) is not None
        }
    )


def _job_options(
    run_id: str,
    spec: dict[str, Any],
    settings: dict[str, Any],
    attempt: int,
    exclude: tuple[str, ...],
    job: JobEnv,
    injections: Sequence[Injection],
    spares: int,
) -> JobOptions:
    """The attempt's sbatch options."""
    o = spec["options"]
    preempt_time = int(settings.get("preempt_time", 60))
    return JobOptions(
        name=o["name"] or f"ftslurm-{run_id}",
        nodes=o["nodes"],
        ntasks_per_node=o["ntasks_per_node"],
        cpus_per_task=o["cpus_per_task"],
        gpus_per_node=o["gpus_per_node"],
        time_limit=o["time_limit"],
        partition=o["partition"],
        account=o["account"],
        exclude=tuple(sorted(set(o["exclude"]) | set(exclude))),
        comment=tag(run_id, attempt),
        output=RunDir(spec["run_dir"]).job_output,
        workdir=spec["workdir"],
        requeue=True,
        # A backstop: if the daemon is down, Slurm itself still asks for the checkpoint.
        signal=f"{job.checkpoint_signal}@{preempt_time}"
        if _backstop(o["time_limit"], preempt_time, settings)
        else None,
        # The scheduler carries out what happens to the cluster (node_fail, preempt,
        # timeout); what a job can do to itself travels to every rank's wrapper, on the
        # mock and on a real cluster alike.
        extra={"open-mode": "append", **o["extra"]},
        inject=tuple(i.spec() for i in injections if not i.kind.in_job),
        # With spares the job must outlive a lost node: Slurm shrinks it instead of ending it.
        no_kill=spares > 0,
    )


def _step(
    spec: dict[str, Any], job: JobEnv, launcher: bool, spares: int
) -> tuple[list[str], tuple[str, ...]]:
    """The job step's command and its srun flags."""
    if not launcher:
        command = [spec["python"], "-m", "ftslurm.agent.task", "--", *spec["command"]]
        return command, ("--kill-on-bad-exit=1",)
    # One launcher per node starts the node's ranks, restarts them in-job and forwards
    # signals; srun waits for the others after the first launcher ends (no kill on
    # "continue me", which is a non-zero code), then ends the step.
    command = [
        spec["python"],
        "-m",
        "ftslurm.agent.launch",
        f"--nproc-per-node={spec['options']['ntasks_per_node']}",
        "--",
        *spec["command"],
    ]
    srun_args: tuple[str, ...] = (
        "--nodes=${SLURM_NNODES:-1}",
        "--ntasks=${SLURM_NNODES:-1}",
        "--ntasks-per-node=1",
        "--cpus-per-task=${SLURM_CPUS_ON_NODE:-1}",
        "--kill-on-bad-exit=0",
    )
    if spares:
        # The step outlives a lost node too (the others train on with a spare); no
        # --wait, whose clock a task lost with its node could start: the spares leave
        # when the rendezvous closes.
        return command, (*srun_args, "--no-kill")
    return command, (*srun_args, f"--wait={int(job.grace_s) + 60}")
