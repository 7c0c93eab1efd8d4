"""What the daemon remembers: runs, their attempts, node flags and events (inert data).

These records are what `store` persists and what `policy` decides on. A run is one
training campaign; each attempt is one scheduler job execution (a fresh submission, or
the same job id requeued: Slurm counts those in `restart_count`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ftslurm.core.settings import FtSettings
from ftslurm.core.types import JobState


class RunState(str, Enum):
    PENDING = "PENDING"  # no attempt has started running yet
    RUNNING = "RUNNING"  # an attempt is queued or running after the first one started
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


class _AttemptStateValue(str):
    """What every `AttemptState` member is besides an Enum member: its plain string."""

    @classmethod
    def of(cls, state: JobState) -> AttemptState:
        return AttemptState(state.value)


# Where one attempt stands: the scheduler's state of its job (every `JobState` value, taken
# from there), or one of the daemon's own:
# - SUBMITTING: the intent to submit was recorded but the scheduler's job id is not known
#   yet (adopted by its tag after a crash);
# - REQUEUING: the intent to bring `job_id` back for this attempt (requeue held,
#   exclusions, release, start now) was recorded;
# - NEVER_SUBMITTED: the scheduler refused the attempt's submission.
# Stored and printed as the plain string (the value): a `str` Enum whose str() is its
# value, as `enum.StrEnum` (Python 3.11) would be; Python 3.10 is supported.
AttemptState = Enum(  # type: ignore[misc]
    "AttemptState",
    [
        *((s.name, s.value) for s in JobState),
        ("SUBMITTING", "SUBMITTING"),
        ("REQUEUING", "REQUEUING"),
        ("NEVER_SUBMITTED", "NEVER_SUBMITTED"),
    ],
    type=_AttemptStateValue,
    module=__name__,
)
AttemptState.__str__ = lambda self: str(self.value)  # type: ignore[method-assign]


SUBMITTING = AttemptState.SUBMITTING
REQUEUING = AttemptState.REQUEUING
NEVER_SUBMITTED = AttemptState.NEVER_SUBMITTED


def tag(run_id: str, attempt: int) -> str:
    """What the job of an attempt carries (its comment), so a restarted daemon finds it."""
    return f"ftslurm:{run_id}:{attempt}"


def parse_tag(comment: str | None) -> tuple[str, int] | None:
    """(run id, attempt) of a job's ftslurm tag (`tag`), or None for any other comment."""
    parts = (comment or "").split(":")
    if len(parts) == 3 and parts[2].isdigit() and tag(parts[1], int(parts[2])) == comment:
        return parts[1], int(parts[2])
    return None


@dataclass
class Run:
    run_id: str
    name: str
    state: RunState
    created_at: float
    # What to submit: the rendered-script inputs, as plain JSON (see daemon.submission).
    spec: dict[str, Any]
    # Fault-tolerance settings (core.settings.FtSettings as a dict).
    settings: dict[str, Any]
    job_retries_used: int = 0
    cause_counts: dict[str, int] = field(default_factory=dict)  # retries spent per cause
    continuations: int = 0
    stalled_continuations: int = 0  # consecutive continuations without checkpoint progress
    last_checkpoint_step: int | None = None
    reason: str | None = None  # why the run ended (or the last decision), for `status`
    cancel_requested: bool = False
    ended_at: float | None = None
    # the fault injections (specs, `ftslurm.core.inject`) that fired in an attempt so far:
    # each fires once per run, so a later job of the run leaves them out
    injected: list[str] = field(default_factory=list)
    # The stored version this copy was read at (`Store.update_run` is compare-and-set on it);
    # bookkeeping, not content: two copies of the same run compare equal across versions.
    version: int = field(default=0, compare=False)


@dataclass
class Attempt:
    run_id: str
    attempt: int  # 0, 1, 2, ... within the run
    state: AttemptState  # a plain string is accepted and converted
    job_id: str | None = None
    tag: str = ""  # carried by the job (its comment): names run and attempt, for adoption
    restart_count: int = 0  # Slurm's restart count of job_id when this attempt began
    nodes: list[str] = field(default_factory=list)
    submitted_at: float | None = None
    start: float | None = None
    end: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    cause: str | None = None  # the policy's classification of how it ended
    in_job_restarts: int = 0
    checkpoint_signal_at: float | None = None  # when the daemon sent the checkpoint signal
    failure_seen_at: float | None = None  # when the daemon observed the previous ending
    # the nodes lost (a peer-loss report) or benched inside this attempt that the daemon
    # has acted on: flagged, recorded, recovered (`step`); the next attempt of one that
    # ended for them cancels its job before submitting
    lost_nodes: list[str] = field(default_factory=list)
    version: int = field(default=0, compare=False)  # as stored when read (compare-and-set)

    def __post_init__(self) -> None:
        if not isinstance(self.state, AttemptState):
            self.state = AttemptState(self.state)


def new_run_record(
    run_id: str, name: str, spec: dict[str, Any], settings: FtSettings, now: float
) -> tuple[Run, Attempt]:
    """A new run and its first attempt, to be submitted by the daemon (`SUBMITTING`)."""
    run = Run(
        run_id=run_id,
        name=name,
        state=RunState.PENDING,
        created_at=now,
        spec=spec,
        settings=settings.model_dump(mode="json"),
    )
    return run, Attempt(run_id, 0, SUBMITTING, tag=tag(run_id, 0))


@dataclass
class NodeFlag:
    node: str
    reason: str
    since: float
    expires_at: float | None  # None: until removed
    run_id: str | None = None


@dataclass
class Event:
    event_id: int
    time: float
    run_id: str | None
    kind: str
    data: dict[str, Any]
