"""The batch actions of the protocol for a scheduler that takes one job per command.

`each(action, job_ids)` calls a single-job action for every job (once per id) and collects
the refusals: the error the single-job action raised, keyed by job id. A scheduler that
cannot be reached (`SchedulerUnavailable`, or any `TransientError`) ends the batch at once
and is raised: what it would say of the remaining jobs is not known. `OneJobPerCommand`
gives a backend the four `*_many` methods of the protocol over its single-job ones (the
mock scheduler and pyslurm use these; the Slurm CLI sends one command for a list).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ftslurm.errors import FtslurmError, TransientError


def unique(job_ids: Sequence[str]) -> list[str]:
    """The ids as strings, each once, in their first order."""
    return list(dict.fromkeys(str(j) for j in job_ids))


def each(action: Callable[[str], None], job_ids: Sequence[str]) -> dict[str, FtslurmError]:
    """Call `action` on every job; returns the jobs refused with the error each raised."""
    refused: dict[str, FtslurmError] = {}
    for job in unique(job_ids):
        try:
            action(job)
        except TransientError:
            raise  # the scheduler cannot be reached: the whole batch is retried later
        except FtslurmError as exc:
            refused[job] = exc
    return refused


class _SingleJobActions(Protocol):
    def requeue(self, job_id: str, *, hold: bool = False) -> None: ...
    def release(self, job_id: str) -> None: ...
    def start_now(self, job_id: str) -> None: ...
    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None: ...


def requeue_each(
    backend: _SingleJobActions, job_ids: Sequence[str], *, hold: bool = False
) -> dict[str, FtslurmError]:
    return each(lambda job: backend.requeue(job, hold=hold), job_ids)


def release_each(backend: _SingleJobActions, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
    return each(backend.release, job_ids)


def start_now_each(backend: _SingleJobActions, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
    return each(backend.start_now, job_ids)


def update_excluded_nodes_each(
    backend: _SingleJobActions, job_ids: Sequence[str], nodes: Sequence[str]
) -> dict[str, FtslurmError]:
    return each(lambda job: backend.update_excluded_nodes(job, nodes), job_ids)


class OneJobPerCommand:
    """The protocol's batch actions as one single-job action per job (a mixin)."""

    def requeue_many(
        self: _SingleJobActions, job_ids: Sequence[str], *, hold: bool = False
    ) -> dict[str, FtslurmError]:
        return requeue_each(self, job_ids, hold=hold)

    def release_many(self: _SingleJobActions, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
        return release_each(self, job_ids)

    def start_now_many(self: _SingleJobActions, job_ids: Sequence[str]) -> dict[str, FtslurmError]:
        return start_now_each(self, job_ids)

    def update_excluded_nodes_many(
        self: _SingleJobActions, job_ids: Sequence[str], nodes: Sequence[str]
    ) -> dict[str, FtslurmError]:
        return update_excluded_nodes_each(self, job_ids, nodes)
