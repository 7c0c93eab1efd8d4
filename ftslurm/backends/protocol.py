"""The one small interface every scheduler backend implements (Slurm CLI, pyslurm, mock)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ftslurm.core.types import ClusterFacts, JobInfo, JobOptions, NodeInfo, SignalTarget
from ftslurm.errors import FtslurmError


@runtime_checkable
class SchedulerBackend(Protocol):
    """What ftslurm needs from a scheduler, and nothing more.

    Rules every implementation keeps:
    - `query` answers for every id it is given, using a constant number of scheduler
      commands (one in the common case) whatever the number of ids; an id it could not
      observe is `JobState.UNKNOWN`, never a terminal state;
    - transient failures are retried inside the backend with a bounded budget, then raised
      as `SchedulerUnavailable` (actions) or reported as UNKNOWN (`query`);
    - permanent refusals raise a `SchedulerRejected` subclass with a one-line message;
    - the `*_many` actions act on all their jobs in one scheduler command where the
      scheduler takes a list of jobs (one command per job otherwise: `backends.batch`), and
      return the jobs refused, each with the error its single-job action would have raised
      (`JobStateConflict`, `InvalidJobId`, ...); the others were acted on. A scheduler that
      cannot be reached raises `SchedulerUnavailable` for the whole batch; an empty list
      runs no command.
    """

    name: str

    def submit(self, script: str, options: JobOptions) -> str:
        """Submit a batch script (its text); return the job id."""
        ...

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """One observation per id, keyed by id."""
        ...

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        """The jobs whose comment is exactly `comment`: how the daemon finds a job it
        submitted but had not recorded. The controller is asked first (one command); when it
        holds none and `since` is given (the earliest the job can have been submitted), the
        accounting database is asked for jobs it has already forgotten (one more)."""
        ...

    def active_jobs(self) -> list[JobInfo]:
        """The current user's jobs that have not ended (pending, running, ...), with their
        comments, in one command: how `status` finds jobs ftslurm tagged for runs the state
        database no longer has."""
        ...

    def cancel(self, job_id: str) -> None:
        """Cancel the job; cancelling a job that already ended is not an error."""
        ...

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        """Put a running or finished job back in the queue (held if `hold`)."""
        ...

    def release(self, job_id: str) -> None:
        """Release a held job."""
        ...

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        """Replace the excluded-node list of a pending job (an empty list clears it)."""
        ...

    def start_now(self, job_id: str) -> None:
        """Make a pending job eligible at once (drops the requeue BeginTime delay)."""
        ...

    def requeue_many(
        self, job_ids: Sequence[str], *, hold: bool = False
    ) -> dict[str, FtslurmError]:
        """`requeue` for every job of the list; returns the jobs refused."""
        ...

    def release_many(self, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
        """`release` for every job of the list; returns the jobs refused."""
        ...

    def start_now_many(self, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
        """`start_now` for every job of the list; returns the jobs refused."""
        ...

    def update_excluded_nodes_many(
        self, job_ids: Sequence[str], nodes: Sequence[str]
    ) -> dict[str, FtslurmError]:
        """`update_excluded_nodes` (the same nodes) for every job of the list; returns the
        jobs refused."""
        ...

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        """Send `sig` (e.g. "USR1") to the job's steps, its batch shell, or both."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """Every node with its state and reason."""
        ...

    def cluster_facts(self) -> ClusterFacts:
        """MinJobAge, whether accounting is on, and other settings decisions need."""
        ...
