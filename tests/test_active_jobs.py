"""`active_jobs()`: the user's jobs that have not ended, with their comments, in one command,
on every backend (Slurm CLI on recorded output, the mock's model, pyslurm on stand-ins)."""

from __future__ import annotations

import os
import types
from pathlib import Path

from ftslurm.backends import pyslurm_backend as pb
from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockState
from ftslurm.backends.slurm_cli import SlurmCliBackend
from ftslurm.core.types import JobOptions, JobState

DATA = Path(__file__).parent / "data"
NOW = 1_800_000_000.0


class RecordingRunner:
    """Stands in for `CommandRunner`: answers with recorded squeue output, keeps the argv."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.calls: list[list[str]] = []

    def run(self, argv, **kw) -> str:
        self.calls.append(list(argv))
        return self.out


def test_slurm_cli_lists_the_users_unended_jobs_with_one_squeue():
    runner = RecordingRunner((DATA / "squeue_22.05.txt").read_text())
    backend = SlurmCliBackend(runner, clock=lambda: NOW)  # type: ignore[arg-type]
    jobs = backend.active_jobs()
    assert len(runner.calls) == 1
    argv = runner.calls[0]
    assert argv[0] == "squeue" and "--me" in argv and "--states=all" not in argv
    assert jobs and all(not j.state.is_terminal for j in jobs)
    by_id = {j.job_id: j for j in jobs}
    assert by_id["67"].comment == "ftslurm:run=abc:attempt=1"  # free text kept whole
    assert by_id["68"].state is JobState.PENDING
    assert "6" not in by_id  # CANCELLED rows (squeue shows them briefly) are left out


def test_mock_model_lists_jobs_until_they_end():
    st = MockState.create(MockConfig())
    running = model.submit(st, "#!/bin/bash\ntrue\n", JobOptions(comment="a"), 1000.0)
    held = model.submit(st, "#!/bin/bash\ntrue\n", JobOptions(comment="b", hold=True), 1000.0)
    model.advance(st, 1000.0, {})
    listed = {j.job_id: j.comment for j in model.active_jobs(st, 1000.0)}
    assert listed == {running: "a", held: "b"}
    model.advance(st, 1001.0, {running: (0, None)})  # it exits
    assert [j.job_id for j in model.active_jobs(st, 1001.0)] == [held]


def test_pyslurm_lists_only_this_users_unended_jobs():
    def job(id, user_id, state):
        return types.SimpleNamespace(
            id=id,
            user_id=user_id,
            state=state,
            comment=f"c{id}",
            allocated_nodes=None,
            time_limit=None,
        )

    loaded = {
        1: job(1, os.getuid(), "RUNNING"),
        2: job(2, os.getuid() + 1, "RUNNING"),
        3: job(3, os.getuid(), "COMPLETED"),
        4: job(4, os.getuid(), "PENDING"),
    }
    backend = object.__new__(pb.PyslurmBackend)
    backend.pyslurm = types.SimpleNamespace(Jobs=types.SimpleNamespace(load=lambda: loaded))
    backend.query_budget_s, backend.clock = 1.0, lambda: NOW
    assert [(j.job_id, j.comment) for j in backend.active_jobs()] == [("1", "c1"), ("4", "c4")]


def test_live_slurm_cli_lists_a_held_job_with_its_comment_until_cancelled(backend, jobs):
    job = backend.submit(
        "#!/bin/bash\nsleep 600\n", JobOptions(name="listing", comment="ftslurm:lost:0", hold=True)
    )
    jobs.append(job)
    listed = {j.job_id: j for j in backend.active_jobs()}
    assert listed[job].comment == "ftslurm:lost:0" and listed[job].state is JobState.PENDING
    backend.cancel(job)
    assert job not in {j.job_id for j in backend.active_jobs()}
