"""ftslurm's own vocabulary for what a scheduler reports: frozen values, explicit unknowns.

Everything here is inert data: no I/O, no clock reads. A backend turns a scheduler's
answer into these types; the daemon's decisions take them as input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ftslurm.core.validate import check_line, check_sbatch_flag


class JobState(str, Enum):
    """The state of one scheduler job, as ftslurm understands it.

    PENDING -> RUNNING -> COMPLETING -> (a terminal state), or back to PENDING after a
    requeue. REQUEUED is the short window (or held state) between a requeue and PENDING.
    UNKNOWN means "could not observe": never treat it as terminal.
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    CANCELLED = "CANCELLED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    REQUEUED = "REQUEUED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        """Queued or holding an allocation (the job may still run or is running)."""
        return self in (JobState.PENDING, JobState.RUNNING, JobState.COMPLETING, JobState.REQUEUED)

    @classmethod
    def from_slurm(cls, raw: str) -> JobState:
        """Map a Slurm state string (`squeue %T`, `sacct State`, `scontrol JobState`)."""
        word = raw.strip().split(" ", 1)[0].upper()  # "CANCELLED by 0" -> CANCELLED
        word = word.rstrip("+")  # sacct abbreviates "CANCELLED+"
        return _SLURM_STATES.get(word, cls.UNKNOWN)


_TERMINAL = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.CANCELLED,
        JobState.OUT_OF_MEMORY,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
    }
)

_SLURM_STATES: Mapping[str, JobState] = {
    **{s.value: s for s in JobState},
    # Slurm's other states, folded onto ours (JobInfo.raw_state keeps the original).
    "CONFIGURING": JobState.RUNNING,  # allocated, nodes being readied
    "RESIZING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,  # still holds its allocation
    "STOPPED": JobState.RUNNING,
    "STAGE_OUT": JobState.COMPLETING,
    "REQUEUE_FED": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "SPECIAL_EXIT": JobState.REQUEUED,  # requeued and held
    "RESV_DEL_HOLD": JobState.PENDING,
    "REVOKED": JobState.CANCELLED,
    "OOM": JobState.OUT_OF_MEMORY,
}


class SignalTarget(str, Enum):
    """Which processes of a job a signal is sent to."""

    STEPS = "steps"  # every task of every job step (srun), on all nodes
    BATCH = "batch"  # only the batch shell
    ALL = "all"  # both


class NodeState(str, Enum):
    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    COMPLETING = "COMPLETING"
    DOWN = "DOWN"
    DRAINED = "DRAINED"
    DRAINING = "DRAINING"
    FAIL = "FAIL"
    UNKNOWN = "UNKNOWN"

    @property
    def usable(self) -> bool:
        return self in (NodeState.IDLE, NodeState.ALLOCATED, NodeState.MIXED, NodeState.COMPLETING)

    @classmethod
    def from_slurm(cls, raw: str) -> NodeState:
        word = raw.strip().lower().rstrip("*~#!%$@^-+")
        return _NODE_STATES.get(word, cls.UNKNOWN)


_NODE_STATES: Mapping[str, NodeState] = {
    "idle": NodeState.IDLE,
    "alloc": NodeState.ALLOCATED,
    "allocated": NodeState.ALLOCATED,
    "mix": NodeState.MIXED,
    "mixed": NodeState.MIXED,
    "comp": NodeState.COMPLETING,
    "completing": NodeState.COMPLETING,
    "down": NodeState.DOWN,
    "drain": NodeState.DRAINED,
    "drained": NodeState.DRAINED,
    "drng": NodeState.DRAINING,
    "draining": NodeState.DRAINING,
    "fail": NodeState.FAIL,
    "failing": NodeState.FAIL,
}


@dataclass(frozen=True)
class JobInfo:
    """One observation of one job. `state=UNKNOWN` means the source could not tell."""

    job_id: str
    state: JobState
    observed_at: float
    raw_state: str = ""
    exit_code: int | None = None
    signal: int | None = None
    nodes: tuple[str, ...] = ()
    submit_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    time_limit_s: int | None = None  # None: unlimited or not known
    restart_count: int = 0
    reason: str | None = None
    name: str | None = None
    comment: str | None = None
    # True when the job came from the accounting records (sacct): the controller has
    # forgotten it (ended more than MinJobAge ago), so it can no longer be requeued.
    from_accounting: bool = False

    @classmethod
    def unknown(cls, job_id: str, observed_at: float, reason: str) -> JobInfo:
        return cls(job_id=job_id, state=JobState.UNKNOWN, observed_at=observed_at, reason=reason)


@dataclass(frozen=True)
class NodeInfo:
    """One node as the scheduler sees it. Slurm marks a node whose slurmd stopped answering
    with a `*` after its state (`idle*`, `alloc*`) until SlurmdTimeout has passed and it is
    declared DOWN; `not_responding_since` is when it stopped answering, where the scheduler
    says (the mock does; Slurm's sinfo does not)."""

    name: str
    state: NodeState
    raw_state: str = ""
    reason: str | None = None
    not_responding_since: float | None = None

    @property
    def responding(self) -> bool:
        """False for sinfo's `idle*` and for the flag's name (`IDLE+NOT_RESPONDING`)."""
        raw = self.raw_state.strip()
        return not (raw.endswith("*") or "NOT_RESPONDING" in raw.upper())


@dataclass(frozen=True)
class ClusterFacts:
    """Settings of the cluster that decisions depend on."""

    min_job_age_s: int
    accounting: bool
    kill_wait_s: int = 30
    job_requeue: bool = True
    version: str = ""
    cluster_name: str = ""
    slurmd_timeout_s: int = 300  # SlurmdTimeout: a node silent this long is declared DOWN


@dataclass(frozen=True)
class JobOptions:
    """What to ask of the scheduler for one batch job (generic names; Slurm flags in `extra`)."""

    name: str | None = None
    nodes: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    time_limit: str | None = None  # Slurm syntax, validated by parse_time_limit
    partition: str | None = None
    account: str | None = None
    exclude: tuple[str, ...] = ()
    comment: str | None = None
    output: str | None = None
    error: str | None = None
    workdir: str | None = None
    requeue: bool | None = None  # None: the cluster's JobRequeue default
    signal: str | None = None  # e.g. "B:USR1@90"
    hold: bool = False
    no_kill: bool = False  # --no-kill: the job lives on when one of its nodes fails
    env: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, str | None] = field(default_factory=dict)  # raw `--key=value` flags
    inject: tuple[str, ...] = ()  # fault injections, `KIND@TIME[:TARGET]` (core.inject)

    def __post_init__(self) -> None:
        # Every value here can reach an `#SBATCH` line: one line of printable text each.
        for attr, flag in _FLAG_OF.items():
            check_line(flag, getattr(self, attr))
        for node in self.exclude:
            check_line("--exclude", node)
        for key, value in self.extra.items():
            check_sbatch_flag(key, value, owned_ok=True)


_FLAG_OF = {
    "name": "--job-name",
    "partition": "--partition",
    "account": "--account",
    "time_limit": "--time",
    "comment": "--comment",
    "output": "--output",
    "error": "--error",
    "workdir": "--chdir",
    "signal": "--signal",
}
