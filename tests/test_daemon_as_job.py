"""The daemon as a Slurm job, without a cluster: its script and options, the handover to a
successor, and how commands find a queued daemon job instead of starting a daemon here
(the real cluster's scenarios: tests/test_daemon_job_slurm.py)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ftslurm.core.sbatch import sbatch_args
from ftslurm.core.types import JobInfo, JobOptions, JobState
from ftslurm.daemon import as_job, service
from ftslurm.errors import FtslurmError

from .conftest import wait_for


@dataclass
class FakeSlurm:
    """Just enough of a scheduler: what was submitted, and the states it answers."""

    states: dict[str, JobState] = field(default_factory=dict)
    submitted: list[tuple[str, JobOptions]] = field(default_factory=list)

    def submit(self, script: str, options: JobOptions) -> str:
        self.submitted.append((script, options))
        job = str(100 + len(self.submitted))
        self.states[job] = JobState.PENDING
        return job

    def query(self, job_ids: list[str]) -> dict[str, JobInfo]:
        return {
            j: JobInfo(job_id=j, state=self.states[j], observed_at=0.0)
            for j in job_ids
            if j in self.states
        }


def spec(home: Path, **kw: object) -> as_job.DaemonJob:
    return as_job.DaemonJob(home, "/opt/my env/bin/python", **kw)  # type: ignore[arg-type]


def test_the_daemon_job_is_one_cpu_requeued_and_signalled_before_its_limit(tmp_path):
    job = spec(
        tmp_path / "it's home",
        time="2-00:00:00",
        handover_s=900,
        lease_timeout_s=30,
        partition="long",
        extra={"qos": "daemon"},
    )
    args = sbatch_args(job.options())
    for flag in (
        "--job-name=ftslurm-daemon",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--time=2-00:00:00",
        "--partition=long",
        "--requeue",
        "--signal=B:USR1@900",
        "--qos=daemon",
    ):
        assert flag in args, args
    lines = job.script().splitlines()
    assert lines[0] == "#!/bin/bash"
    # every value that reaches the shell is quoted: the odd home and interpreter survive
    assert shlex.split(lines[2].removeprefix("export ")) == [f"FTSLURM_HOME={job.home}"]
    assert shlex.split(lines[3]) == [
        "exec",
        "/opt/my env/bin/python",
        "-m",
        "ftslurm",
        "daemon",
        "run",
        "--job",
        "--lease-timeout",
        "30",
    ]
    assert "--successor" in job.script(successor=True)
    assert as_job.DaemonJob.from_json(job.to_json()) == job
    assert as_job.DaemonJob.from_json({"home": 1}) is None


def test_the_handover_submits_the_successor_and_stops_once_it_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(as_job, "SUCCESSOR_POLL_S", 0.0)
    slurm = FakeSlurm()
    first = as_job.submit(slurm, spec(tmp_path))  # type: ignore[arg-type]
    assert as_job.recorded(tmp_path) == (first, spec(tmp_path))
    handover = as_job.Handover(tmp_path, lambda: slurm)  # type: ignore[arg-type, return-value]
    assert not handover.due()  # no signal yet: nothing happens
    handover.requested.set()
    assert not handover.due() and handover.successor == "102"
    script, _ = slurm.submitted[-1]
    assert "--successor" in script and as_job.recorded(tmp_path)[0] == "102"  # type: ignore[index]
    assert not handover.due()  # still queued: serve on
    slurm.states["102"] = JobState.FAILED  # it died before it ran: another one
    assert not handover.due() and handover.successor is None
    assert not handover.due() and handover.successor == "103"
    slurm.states["103"] = JobState.RUNNING
    assert handover.due()  # it runs (and waits for the lease): release it and go


def test_a_queued_daemon_job_serves_and_an_ended_one_is_reported_not_replaced(
    tmp_path, monkeypatch
):
    slurm = FakeSlurm()
    monkeypatch.setattr(service, "create_backend", lambda kind="slurm", *a, **k: slurm)
    home = tmp_path / "home"
    home.mkdir()
    job = as_job.submit(slurm, spec(home))  # type: ignore[arg-type]
    found = service.start(home)  # a command that needs a daemon: none is started here
    assert found.pending and found.job_id == job and found.describe() == f"Slurm job {job}, pending"
    assert service.running_pid(home) is None
    slurm.states[job] = JobState.TIMEOUT
    with pytest.raises(FtslurmError, match=f"the daemon job {job} has ended"):
        service.start(home)
    assert service.running_pid(home) is None
    # `ftslurm daemon start` says: serve from this host from now on
    found = service.start(home, auto=False)
    try:
        assert found.here and found.pid == service.running_pid(home)
        assert as_job.recorded(home) is None
    finally:
        service.stop(home)


def test_a_successor_on_its_predecessors_node_waits_for_it_to_leave(tmp_path):
    """Both on one node: the successor does not refuse the node's lock, it waits for it."""
    import threading

    from ftslurm.daemon.store import DaemonLock, Store

    home = tmp_path / "home"
    predecessor = DaemonLock(home, service.this_host())
    predecessor.acquire()
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            service.serve(home, stop=stop, job=True, successor=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        thread.join(timeout=1.5)
        assert thread.is_alive() and not errors  # waiting, not refused
        with Store(home) as s:
            assert s.daemon_lease() is None
        predecessor.release()

        def serving() -> bool:  # its lease taken, not only the node's lock (then a stop
            with Store(home) as s:  # would end its wait for the lease, an error here)
                return s.daemon_lease() is not None

        wait_for(lambda: serving() or errors, 30, "the successor serving")
        assert not errors
    finally:
        stop.set()
        thread.join(timeout=30)
        predecessor.release()
    assert not errors
