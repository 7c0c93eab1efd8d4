"""What the daemon remembers: runs, their attempts, node flags and events (inert data).

These records are what `store` persists and what `policy` decides on. A run is one
training campaign; each attempt is one scheduler job execution (a fresh submission, or
the same job id requeued: Slurm counts those in `restart_count`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RunState(str, Enum):
    PENDING = "PENDING"  # no attempt has started running yet
    RUNNING = "RUNNING"  # an attempt is queued or running after the first one started
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


# Attempt.state holds a core.types.JobState value, or SUBMITTING: the intent to submit was
# recorded but the scheduler's job id is not known yet (adopted by tag after a crash).
SUBMITTING = "SUBMITTING"


@dataclass
class Run:
    run_id: str
    name: str
    state: RunState
    created_at: float
    # What to submit: the rendered-script inputs, as plain JSON (see daemon.submission).
    spec: dict[str, Any]
    # Fault-tolerance settings (daemon.policy.FtSettings as a dict).
    settings: dict[str, Any]
    job_retries_used: int = 0
    cause_counts: dict[str, int] = field(default_factory=dict)  # retries spent per cause
    continuations: int = 0
    stalled_continuations: int = 0  # consecutive continuations without checkpoint progress
    last_checkpoint_step: int | None = None
    reason: str | None = None  # why the run ended (or the last decision), for `status`
    cancel_requested: bool = False
    ended_at: float | None = None


@dataclass
class Attempt:
    run_id: str
    attempt: int  # 0, 1, 2, ... within the run
    state: str  # a JobState value or SUBMITTING
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
