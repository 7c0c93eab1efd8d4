"""A run's fault-tolerance settings and the vocabulary they speak (pure: no I/O, no clock).

`FtSettings` comes from the recipe (overridden by the command line), is stored with the run
and read by the daemon's decisions (`ftslurm.daemon.policy`, `ftslurm.daemon.step`) and by
the compute side (the hang-detection defaults below are the launcher's). `Cause` names how
an attempt ended; `cause_budgets` are keyed by it. The exit codes the job uses to speak to
the daemon live in `ftslurm.core.contract` (the settings refuse them as user-error codes).
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ftslurm.core.contract import (
    DEFAULT_CHECKPOINT_SIGNAL,
    DEFAULT_GRACE_S,
    DEFAULT_HEALTH_BANDWIDTH_RATIO,
    DEFAULT_HEALTH_FREE_DISK_MB,
    DEFAULT_HEALTH_FREE_MEMORY_MB,
    DEFAULT_HEALTH_GPU_FREE_MB,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_HEALTH_WRITE_MB_S,
    DEFAULT_PEER_TIMEOUT_S,
    DEFAULT_STRAGGLER_INTERVAL_S,
    DEFAULT_STRAGGLER_REFERENCE,
    DEFAULT_STRAGGLER_THRESHOLD,
    DEFAULT_STRAGGLER_WINDOWS,
    RESERVED_EXITS,
    checked_signal_name,
)

# Hang detection is on by default (seconds): a rank gets DEFAULT_INITIAL_S from its start to
# its first heartbeat or section, then at most DEFAULT_RUNNING_S without a sign of life (a
# heartbeat, a section entered or left) unless the open section has its own limit; "setup",
# "checkpointing" and "recovery" keep their own, looser ones. After DEFAULT_WARMUP_STEPS steps of a
# round the running limit is tightened (ftslurm.agent.heartbeat `learned`).
DEFAULT_INITIAL_S = 1800.0
DEFAULT_RUNNING_S = 300.0
# A live recovery (ftslurm.agent.live) runs in this section: the group re-forms and the state
# is handed over while no step can advance (a rank restarted alone may take minutes to
# start); the live group bounds it itself, this is a backstop.
RECOVERY_SECTION = "recovery"
DEFAULT_SECTION_S: dict[str, float | None] = {
    "setup": 1800.0,
    "checkpointing": 1800.0,
    RECOVERY_SECTION: 1800.0,
}
DEFAULT_WARMUP_STEPS = 20


class Cause(str, Enum):
    FINISHED = "finished"  # the training says it is done
    CHECKPOINTED = "checkpointed"  # it saved a checkpoint and exited: continue it
    NODE_FAIL = "node_fail"
    BOOT_FAIL = "boot_fail"
    PREEMPTED = "preempted"  # preempted without a checkpoint at the end
    TIMEOUT = "timeout"  # wall limit without a checkpoint at the end
    HANG = "hang"  # a rank hung: until the wall limit, or through the in-job restarts
    CRASH = "crash"  # a rank failed
    OOM = "oom"
    RESUME_ELSEWHERE = "resume_elsewhere"  # exit 16: resume on other hardware
    USER_ERROR = "user_error"  # will fail again the same way: do not retry
    FAILED_VALIDATION = "failed_validation"  # exit 17
    DO_NOT_RETRY = "do_not_retry"  # exit 93
    DISK_FULL = "disk_full"  # a rank died of ENOSPC: retrying would fill the disk again
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    # Not an ending: the daemon moved a running job off a persistent straggler node
    # (`stop_if_straggler`). Counted per cause, capped by cause_budgets; not a failure.
    STRAGGLER = "straggler"
    # A node failed its pre-flight health check (ftslurm.agent.health) and no spare took its
    # place: the attempt ends before training, the run goes on in a job without the node.
    # Spends no failure budget while the node can be kept out (docs/policy.md).
    UNHEALTHY = "unhealthy"


RETRYABLE = frozenset(
    {
        Cause.NODE_FAIL,
        Cause.BOOT_FAIL,
        Cause.PREEMPTED,
        Cause.TIMEOUT,
        Cause.HANG,
        Cause.CRASH,
        Cause.OOM,
        Cause.RESUME_ELSEWHERE,
    }
)
# the causes `cause_budgets` may cap
BUDGETED = RETRYABLE | frozenset({Cause.STRAGGLER, Cause.UNHEALTHY})


DEFAULT_LAUNCHER_START_TIMEOUT_S = 180.0  # `FtSettings.launcher_start_timeout_s`


class FtSettings(BaseModel):
    """A run's fault-tolerance settings (from the recipe, overridden by the command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_job_retries_on_failure: int = Field(2, ge=0)
    num_in_job_restarts: int = Field(0, ge=0)
    preempt_time: int = Field(60, ge=0)  # seconds before the wall limit to ask for a checkpoint
    checkpoint_signal: str = DEFAULT_CHECKPOINT_SIGNAL
    # Also ask Slurm itself (`--signal`) for the checkpoint signal, in case the daemon is
    # down. Slurm may deliver it up to a minute early; the daemon's is within ~1 s.
    signal_backstop: bool = True
    cause_budgets: dict[Cause, int] = Field(default_factory=dict)  # per-cause retry caps
    max_stalled_continuations: int = Field(3, ge=1)
    user_error_exit_codes: tuple[int, ...] = ()
    exclude_failed_nodes: bool = True
    # Result validation (ftslurm.agent.validation): a node on which the ranks' re-runs in
    # place found this many transient result faults in one run (a re-run that differed: the
    # node computed wrong, then right) is flagged when an attempt ends and kept out of later
    # jobs, as a node that failed is; one fault is chance, a second on the same node is a
    # flaky part. 0: never (with `exclude_failed_nodes` off, never either).
    transient_faults_to_flag: int = Field(2, ge=0)
    node_exclusion_ttl_s: float = Field(24 * 3600, gt=0)
    # A node flagged again within this long after its flag ran out (a "lemon") is kept out
    # twice as long as the last time, up to this long.
    node_exclusion_max_ttl_s: float = Field(7 * 24 * 3600, gt=0)
    # The compute side (ftslurm.agent.launch): one launcher per node restarts ranks in-job
    # and watches these timeouts (seconds; None = infinite; on by default; tightened from
    # what earlier attempts observed): `initial_timeout` from a rank's start to its first
    # heartbeat or section; `out_of_section_timeout`, the running timeout, the longest time
    # without a sign of life unless the open section has its own limit in
    # `section_timeouts` ("setup" and "checkpointing" always have one, 30 min unless set);
    # after `hang_warmup_steps` steps (None: never) the running timeout is learned from the
    # pace (3 x the longest step, at least 30 s). `grace_s` is how long ranks get to
    # checkpoint after SIGTERM.
    use_launcher: bool = True
    section_timeouts: dict[str, float | None] = Field(
        default_factory=lambda: dict(DEFAULT_SECTION_S)
    )
    out_of_section_timeout: float | None = Field(DEFAULT_RUNNING_S, gt=0)
    initial_timeout: float | None = Field(DEFAULT_INITIAL_S, gt=0)
    hang_warmup_steps: int | None = Field(DEFAULT_WARMUP_STEPS, ge=1)
    grace_s: float = Field(DEFAULT_GRACE_S, gt=0)
    # Peer-loss detection (ftslurm.agent.peers): the launchers of a multi-node job watch
    # each other's leases in the run directory; a node silent this long is reported lost
    # (`attempts/<k>/recovery/lost-<n>.json`), well before Slurm's SlurmdTimeout.
    peer_timeout_s: float = Field(DEFAULT_PEER_TIMEOUT_S, gt=0)
    # A launcher that never started: from when the daemon sees the batch script start the
    # job's step (after the setup lines: `RunDir.launched`), node rank 0's launcher (or, without
    # the launcher, its first task wrapper) has this long to write its lease; silent, the
    # attempt ends at once ("the launcher never started on node X") and is retried, rather
    # than waiting for the other nodes' rendezvous timeout or srun's --wait. Generous: a
    # cold `import torch` from a busy shared filesystem on a loaded node takes a minute or two.
    launcher_start_timeout_s: float = Field(DEFAULT_LAUNCHER_START_TIMEOUT_S, gt=0)
    # Hot spares (ftslurm.core.recovery): the job asks for `nodes` + `spare_nodes` nodes
    # with --no-kill and trains on `nodes`; a lost, hung or straggling node is replaced by
    # a spare inside the same job (an in-job restart), until the spares are used up.
    spare_nodes: int = Field(0, ge=0)
    # Live recovery (ftslurm.agent.live; the script opts in with `live.init_process_group`):
    # the spares' launchers start their ranks ahead of time, and a lost or stepped-out
    # node's ranks are taken over by them while the other ranks keep running; each
    # training node keeps a warm standby process that takes a crashed rank's place.
    live_recovery: bool = False
    # Straggler detection (ftslurm.agent.straggler): each rank's step times are published
    # every `straggler_report_interval_s`; a node whose ranks score below
    # `straggler_threshold` in `straggler_windows` consecutive windows is persistent: it is
    # kept out of later attempts (`exclude_stragglers`), and with `stop_if_straggler` the
    # running job is moved off it at once (requeue held, exclude, release). With hot spares
    # its launcher steps out and a spare takes its place inside the job. The threshold's
    # default (None) depends on that: `straggler_threshold(...)` below, the one rule.
    straggler_report_interval_s: float = Field(DEFAULT_STRAGGLER_INTERVAL_S, gt=0)
    straggler_threshold: float | None = Field(None, gt=0, le=1)
    straggler_windows: int = Field(DEFAULT_STRAGGLER_WINDOWS, ge=1)
    straggler_reference: Literal["best", "median"] = DEFAULT_STRAGGLER_REFERENCE
    exclude_stragglers: bool = True
    stop_if_straggler: bool = False
    # Periodic checkpoints (ftslurm.core.cadence): the rank agent's `should_checkpoint()`
    # also answers True every `checkpoint_interval` seconds; "auto" tunes it (Daly's
    # optimum) from the run's measured save time (`checkpoint_save_prior_s` until it has
    # saved once) and the node failure rate the daemon has seen on this cluster, blended
    # with a prior of `failure_rate_prior` failures per 1000 node-days worth
    # `failure_prior_node_days` node-days; "off": only the checkpoint signal asks. A run
    # that also saves to the memory tier gets a second, longer interval for the disk: the
    # optimum for the failures memory cannot serve, a share 1 - `memory_tier_coverage`.
    checkpoint_interval: float | Literal["auto", "off"] = "auto"
    checkpoint_save_prior_s: float = Field(60.0, gt=0)
    failure_rate_prior: float = Field(5.0, gt=0)
    failure_prior_node_days: float = Field(1000.0, gt=0)
    memory_tier_coverage: float = Field(0.5, ge=0, lt=1)
    # Who may read the run's checkpoints (`ftslurm.checkpoint`): "private" (folders 0700,
    # files 0600: weights are the owner's alone) or "group" (0750 / 0640, for a folder a
    # team shares). Folders that exist already keep their mode.
    checkpoint_sharing: Literal["private", "group"] = "private"
    # Pre-flight health check (ftslurm.agent.health): each node's launcher checks, before
    # it joins the rendezvous and within `health_timeout_s` for all checks together, that the
    # checkpoint directory (and each of `health_dirs`, `{node}` replaced by the node's name:
    # node-local scratch) takes a small write + fsync at `health_min_write_mb_s` MB/s, that
    # free memory and the checkpoint directory's free disk are above their floors (MB), that
    # the GPUs the job asked for are there, run a small kernel and have
    # `health_min_gpu_free_mb` free, that on a job of 4 nodes or more its transfer rate to
    # node rank 0 is at least `health_min_bandwidth_ratio` x the median node's, and that the
    # site's `health_command` (a shell command, as Slurm's HealthCheckProgram) exits 0. A
    # node that fails is flagged and leaves: a spare takes its place, or the run goes on in
    # a job without it. On by default; the floors catch broken nodes, not slow ones.
    health_check: bool = True
    health_timeout_s: float = Field(DEFAULT_HEALTH_TIMEOUT_S, gt=0, le=600)
    health_min_write_mb_s: float = Field(DEFAULT_HEALTH_WRITE_MB_S, ge=0)
    health_min_free_memory_mb: float = Field(DEFAULT_HEALTH_FREE_MEMORY_MB, ge=0)
    health_min_free_disk_mb: float = Field(DEFAULT_HEALTH_FREE_DISK_MB, ge=0)
    health_min_gpu_free_mb: float = Field(DEFAULT_HEALTH_GPU_FREE_MB, ge=0)
    health_min_bandwidth_ratio: float = Field(DEFAULT_HEALTH_BANDWIDTH_RATIO, ge=0, le=1)
    health_dirs: tuple[str, ...] = ()
    health_command: str | None = None

    @field_validator("checkpoint_signal")
    @classmethod
    def _signal_name(cls, value: str) -> str:
        return checked_signal_name(value)

    @field_validator("health_command")
    @classmethod
    def _health_command(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "\n" in value or "\x00" in value):
            raise ValueError("health_command must be one non-empty line of shell")
        return value

    @field_validator("health_dirs")
    @classmethod
    def _health_dirs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for folder in value:
            if not folder.strip() or "\n" in folder or "\x00" in folder:
                raise ValueError(f"health_dirs: {folder!r} is not a folder's path")
        return value

    @field_validator("checkpoint_interval")
    @classmethod
    def _interval(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and not value > 0:
            raise ValueError("checkpoint_interval must be > 0 seconds, 'auto' or 'off'")
        return value

    @field_validator("section_timeouts")
    @classmethod
    def _sections(cls, value: dict[str, float | None]) -> dict[str, float | None]:
        for name, limit in value.items():
            if limit is not None and not limit > 0:
                raise ValueError(f"timeout of section {name!r} must be > 0 or None (off)")
        return {**DEFAULT_SECTION_S, **value}  # setup and checkpointing keep their own

    @field_validator("user_error_exit_codes")
    @classmethod
    def _user_codes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        reserved = sorted(int(c) for c in set(value) & RESERVED_EXITS)
        if reserved:
            raise ValueError(f"exit codes {reserved} have their own meaning")
        return value

    @field_validator("cause_budgets")
    @classmethod
    def _budgets(cls, value: dict[Cause, int]) -> dict[Cause, int]:
        for cause, n in value.items():
            if cause not in BUDGETED:
                raise ValueError(f"{cause.value} is never retried; it takes no budget")
            if n < 0:
                raise ValueError(f"budget for {cause.value} must be >= 0")
        return value


# The straggler threshold a run gets when it sets none follows what acting on a straggler
# costs. Without live recovery, a restart of every rank from the last checkpoint (a spare
# taking its place in the job, or with `stop_if_straggler` a move of the whole job):
# minutes of the whole job, so only a clear slowdown counts, a score below 0.75 (a node
# about 33% slower than the best). With live recovery and a hot spare waiting warm, the
# straggler's launcher steps out and the spare's ranks take its place while the other
# ranks keep their processes: about a second on a real cluster (1.16 s measured,
# tests/test_live_slurm.py; docs/policy.md) plus the node's state received, against
# (1 - score) of the whole job's speed for as long as the slowdown lasts (fail-slow
# episodes last minutes to hours). So a milder slowdown is worth acting on: a score below
# 0.9 (a node about 11% slower). The price: a node that is only noisy, its window medians
# 10% or more behind the best rank's for `straggler_windows` windows in a row, steps out
# too (one spare used, the node kept out of later attempts for `node_exclusion_ttl_s`); on
# a cluster whose healthy nodes spread that much, set `straggler_threshold` (0.75 is the
# old default).
LIVE_STRAGGLER_THRESHOLD = 0.9


def straggler_threshold(threshold: float | None, *, live_recovery: bool, spare_nodes: int) -> float:
    """The straggler score threshold a run's launchers use: the run's `straggler_threshold`
    when it sets one; otherwise LIVE_STRAGGLER_THRESHOLD (0.9) for a run that recovers live
    (`live_recovery`) with hot spares (`spare_nodes` > 0): a straggler then steps out to a
    warm spare for about a second; DEFAULT_STRAGGLER_THRESHOLD (0.75) for any other run
    (acting costs a restart of every rank or a move of the job). Pure; the daemon passes
    the result to the job (`FTSLURM_STRAGGLER_THRESHOLD`) at every submission."""
    if threshold is not None:
        return threshold
    if live_recovery and spare_nodes > 0:
        return LIVE_STRAGGLER_THRESHOLD
    return DEFAULT_STRAGGLER_THRESHOLD


def straggler_move_threshold(threshold: float | None) -> float:
    """The score a flagged straggler must be below for `stop_if_straggler` to move the
    whole job off it (no spare can take its place): the run's `straggler_threshold` when it
    sets one, else DEFAULT_STRAGGLER_THRESHOLD (0.75), also where live recovery's default
    flags milder slowdowns: a move restarts every rank from the last checkpoint in a new
    allocation, the cost the 0.75 default is set for. A milder straggler is still flagged:
    the job's next allocation leaves it out."""
    return DEFAULT_STRAGGLER_THRESHOLD if threshold is None else threshold
