"""The protocol's batch actions (`requeue_many`, `release_many`, `start_now_many`,
`update_excluded_nodes_many`): one scontrol command for a list, its refusals read from
output recorded on the local cluster; the one-job-per-command fallback (mock, pyslurm)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from ftslurm.backends import batch
from ftslurm.backends.mock import MockScheduler
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend, parse
from ftslurm.core.types import JobOptions
from ftslurm.errors import (
    FtslurmError,
    InvalidJobId,
    JobStateConflict,
    SchedulerRejected,
    SchedulerUnavailable,
)

DATA = Path(__file__).parent / "data"


def recorded() -> dict[str, tuple[int, str]]:
    """Command line -> (exit status, what it printed), from the recorded 22.05 session."""
    cases: dict[str, tuple[int, str]] = {}
    command = ""
    for line in (DATA / "scontrol_lists_22.05.txt").read_text().splitlines():
        if line.startswith("# "):
            continue
        if line.startswith("$ "):
            command = line[2:]
            cases[command] = (0, "")
        elif line.startswith("rc="):
            cases[command] = (int(line[3:]), "")
        else:
            rc, text = cases[command]
            cases[command] = (rc, text + line + "\n")
    return cases


RECORDED = recorded()


def test_the_recorded_refusals_name_each_refused_job():
    assert RECORDED["scontrol requeuehold 11,12,13"] == (
        1,
        "Requested operation is presently disabled for job 13\n",
    )
    assert parse.parse_refusals(
        RECORDED["scontrol requeuehold 11,12,13"][1], ["11", "12", "13"]
    ) == {"13": "Requested operation is presently disabled for job 13"}
    both = parse.parse_refusals(RECORDED["scontrol requeuehold 11,12"][1], ["11", "12"])
    assert both == {
        "11": "Job is pending execution for job 11",
        "12": "Job is pending execution for job 12",
    }
    for command in (
        "scontrol update jobid=11,12,14 ExcNodeList=n[3-4]",
        "scontrol update jobid=11,12,14 StartTime=now",
        "scontrol release 11,12,14",
    ):  # release repeats the message: still job 14
        rc, text = RECORDED[command]
        assert rc == 1
        assert parse.parse_refusals(text, ["11", "12", "14"]) == {
            "14": "Job has already finished for job 14"
        }, command


@pytest.mark.parametrize(
    "text",
    [
        RECORDED["scontrol requeue 11,abc"][1],  # a malformed list is refused as a whole
        "Job is pending execution for job 77\n",  # a job not in the list
        "Job has already finished for job 14\nscontrol: error: something else\n",
        "exit status 1",
    ],
)
def test_output_that_names_no_job_of_the_list_cannot_be_attributed(text):
    assert parse.parse_refusals(text, ["11", "12", "14"]) is None


class ReplayRunner:
    """Stands in for `CommandRunner`: answers list commands as the cluster did, logs argv."""

    def __init__(self, single: dict[str, FtslurmError] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.single = single or {}  # job id -> what its single-job command raises

    def run_refusals(self, argv: Sequence[str], *, budget_s: float) -> str:
        self.calls.append(list(argv))
        rc, text = RECORDED[" ".join(argv)]
        return text.strip() if rc else ""

    def run(self, argv: Sequence[str], *, budget_s: float, **_: object) -> str:
        self.calls.append(list(argv))
        job = argv[2].removeprefix("jobid=")  # scontrol requeue 7, scontrol update jobid=7
        if job in self.single:
            raise self.single[job]
        return ""


def test_each_batch_action_is_one_command_and_returns_the_refused_job_typed():
    runner = ReplayRunner()
    backend = SlurmCliBackend(runner)  # type: ignore[arg-type]
    refused = backend.requeue_many(["11", "12", "13"], hold=True)
    assert runner.calls == [["scontrol", "requeuehold", "11,12,13"]]
    assert list(refused) == ["13"] and isinstance(refused["13"], JobStateConflict)
    assert "job 13" in refused["13"].message
    for act, argv in [
        (lambda ids: backend.release_many(ids), ["scontrol", "release", "11,12,14"]),
        (
            lambda ids: backend.start_now_many(ids),
            ["scontrol", "update", "jobid=11,12,14", "StartTime=now"],
        ),
        (
            lambda ids: backend.update_excluded_nodes_many(ids, ["n4", "n3"]),
            ["scontrol", "update", "jobid=11,12,14", "ExcNodeList=n[3-4]"],
        ),
    ]:
        runner.calls.clear()
        refused = act(["11", "12", "14", "11"])  # an id given twice is acted on once
        assert runner.calls == [argv]
        assert list(refused) == ["14"] and isinstance(refused["14"], JobStateConflict), argv
    runner.calls.clear()
    assert backend.release_many([]) == {} and runner.calls == []  # nothing to do: no command


def test_an_invalid_id_in_a_list_is_refused_as_invalid():
    backend = SlurmCliBackend(ReplayRunner())  # type: ignore[arg-type]
    refused = backend.release_many(["99999"])
    assert list(refused) == ["99999"] and isinstance(refused["99999"], InvalidJobId)


def test_output_naming_no_job_falls_back_to_one_command_per_job():
    runner = ReplayRunner(single={"abc": InvalidJobId("scontrol: Invalid job id specified")})
    backend = SlurmCliBackend(runner)  # type: ignore[arg-type]
    refused = backend.requeue_many(["11", "abc"])
    assert runner.calls == [
        ["scontrol", "requeue", "11,abc"],
        ["scontrol", "requeue", "11"],
        ["scontrol", "requeue", "abc"],
    ]
    assert list(refused) == ["abc"] and isinstance(refused["abc"], InvalidJobId)


def test_a_list_longer_than_one_argument_allows_is_cut_in_parts():
    runner = ReplayRunner()
    runner.run_refusals = lambda argv, budget_s: runner.calls.append(list(argv)) or ""  # type: ignore[method-assign]
    backend = SlurmCliBackend(runner, max_jobs_arg_chars=12)  # type: ignore[arg-type]
    assert backend.start_now_many(["1001", "1002", "1003", "1004", "1005"]) == {}
    assert [c[2] for c in runner.calls] == ["jobid=1001,1002", "jobid=1003,1004", "jobid=1005"]


def test_the_runner_returns_refusals_and_raises_an_unreachable_controller():
    runner = CommandRunner(max_wait_s=0.01)
    say = [sys.executable, "-c"]
    assert runner.run_refusals([*say, "pass"], budget_s=1) == ""
    refusal = "import sys; sys.stderr.write('Job has already finished for job 3\\n'); sys.exit(1)"
    assert runner.run_refusals([*say, refusal], budget_s=1) == "Job has already finished for job 3"
    down = "import sys; sys.stderr.write('Unable to contact slurm controller\\n'); sys.exit(1)"
    before = runner.commands
    with pytest.raises(SchedulerUnavailable):
        runner.run_refusals([*say, down], budget_s=0.3)
    assert runner.commands - before >= 2  # retried within its budget first


def test_a_finished_job_is_a_state_conflict():
    from ftslurm.backends.slurm_cli.runner import classify

    err = classify(
        ["scontrol"],
        1,
        "Job has already finished for job 6\nslurm_suspend error: Job has already finished\n",
    )
    assert isinstance(err, JobStateConflict)


# ------------------------------------------------------------------ the fallback
class OneByOne(batch.OneJobPerCommand):
    def __init__(self, refuse: dict[str, FtslurmError]) -> None:
        self.refuse = refuse
        self.done: list[tuple[str, str]] = []

    def _act(self, what: str, job_id: str) -> None:
        self.done.append((what, job_id))
        if job_id in self.refuse:
            raise self.refuse[job_id]

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        self._act("requeuehold" if hold else "requeue", job_id)

    def release(self, job_id: str) -> None:
        self._act("release", job_id)

    def start_now(self, job_id: str) -> None:
        self._act("start_now", job_id)

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._act("exclude " + ",".join(nodes), job_id)


def test_the_fallback_acts_on_every_job_and_collects_the_refusals():
    ended = JobStateConflict("Job has already finished for job 2")
    other = SchedulerRejected("scontrol: Access/permission denied for job 3")
    b = OneByOne({"2": ended, "3": other})
    assert b.requeue_many(["1", "2", "3", "4", "1"], hold=True) == {"2": ended, "3": other}
    assert b.done == [("requeuehold", j) for j in "1234"]
    b.done.clear()
    assert b.update_excluded_nodes_many(["4", "2"], ["n1"]) == {"2": ended}
    assert b.done == [("exclude n1", "4"), ("exclude n1", "2")]
    assert b.release_many([]) == {} and b.start_now_many([]) == {}
    assert len(b.done) == 2


def test_an_unreachable_scheduler_ends_the_fallbacks_batch():
    b = OneByOne({"2": SchedulerUnavailable("controller not responding")})
    with pytest.raises(SchedulerUnavailable):
        b.release_many(["1", "2", "3"])
    assert b.done == [("release", "1"), ("release", "2")]


def test_the_mock_refuses_the_ended_job_of_a_batch_and_acts_on_the_others(tmp_path):
    mock = MockScheduler(tmp_path / "mock")
    assert isinstance(mock, SchedulerBackend)
    script = "#!/bin/bash\nsleep 600\n"
    a, b, ended = (
        mock.submit(script, JobOptions(hold=True, workdir=str(tmp_path))) for _ in range(3)
    )
    mock.cancel(ended)
    refused = mock.update_excluded_nodes_many([a, b, ended], ["n3", "n4"])
    assert list(refused) == [ended] and isinstance(refused[ended], JobStateConflict)
    refused = mock.start_now_many([a, b, ended])
    assert list(refused) == [ended] and isinstance(refused[ended], JobStateConflict)
    refused = mock.requeue_many([a, b, "999"], hold=True)  # pending: nothing to requeue
    assert set(refused) == {a, b, "999"} and isinstance(refused["999"], InvalidJobId)
    with mock.store.transaction() as st:
        assert st.jobs[a].exclude == st.jobs[b].exclude == ["n3", "n4"]
        assert st.jobs[a].held and st.jobs[b].held
