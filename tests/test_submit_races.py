"""`ftslurm submit` leaves the submission to the daemon: one job per attempt, whatever
happens to the `submit` process; a refused submission says so in one line.

The worst moment is forced: `submit` stops itself (SIGSTOP) right after recording the run
(`PAUSE_ENV`), so the daemon sees the recorded intent while `submit` cannot act.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockScheduler
from ftslurm.cli.submit import PAUSE_ENV
from ftslurm.daemon import service
from ftslurm.daemon.reconcile import NEVER_SUBMITTED
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import tag

from .conftest import wait_for
from .daemon_scenarios import Cli, write_train


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    c = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    c("mock", "up", "--min-job-age", "60")
    yield c
    c.stop_daemon()
    c("mock", "destroy", check=False)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _paused_submit(cli: Cli, train: Path) -> tuple[subprocess.Popen, str]:
    """`submit --dry-run` held (SIGSTOP) right after it recorded the run; its run id."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ftslurm",
            "submit",
            "--dry-run",
            "--json",
            str(train),
            "--",
            "100",
            "0.1",
            "10",
        ],
        env=dict(cli.env, **{PAUSE_ENV: "1"}),
        cwd=cli.cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: proc.poll() is not None or _stopped(proc.pid), 60, "submit to pause")
    assert proc.poll() is None, proc.communicate()
    runs = Store(cli.home).list_runs()
    assert len(runs) == 1
    return proc, runs[0].run_id


def _jobs_of(tmp_path: Path, run_id: str) -> list:
    return MockScheduler(tmp_path / "mock").find_jobs(tag(run_id, 0))


def _recorded_job(cli: Cli, run_id: str) -> str | None:
    a = Store(cli.home).latest_attempt(run_id)
    return a.job_id if a else None


def test_a_submit_paused_after_recording_leads_to_exactly_one_job(cli, tmp_path):
    cli("daemon", "start")
    train = write_train(tmp_path)
    proc, run_id = _paused_submit(cli, train)
    try:
        service.wake(cli.home)  # the daemon looks now, while `submit` is held
        job = wait_for(lambda: _recorded_job(cli, run_id), 60, "the daemon to submit")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0, errs
    said = json.loads(out)
    assert (said["run_id"], said["job_id"]) == (run_id, job)
    assert [j.job_id for j in _jobs_of(tmp_path, run_id)] == [job]
    cli("cancel", run_id)


def test_a_submit_killed_after_recording_leaves_the_run_to_the_daemon(cli, tmp_path):
    train = write_train(tmp_path)
    proc, run_id = _paused_submit(cli, train)
    proc.kill()
    proc.communicate()
    assert _jobs_of(tmp_path, run_id) == []  # `submit` itself never submits
    cli("daemon", "start")
    job = wait_for(lambda: _recorded_job(cli, run_id), 60, "the daemon to submit")
    assert [j.job_id for j in _jobs_of(tmp_path, run_id)] == [job]
    cli("cancel", run_id)


def test_a_refused_submission_is_one_line_and_a_run_marked_never_submitted(cli, tmp_path):
    train = write_train(tmp_path)
    proc = cli("submit", "--dry-run", "-N", "99", "-t", "5", str(train), check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: the scheduler refused the job: ")
    assert "node configuration is not available" in lines[0]
    (run,) = Store(cli.home).list_runs()
    s = cli.status(run.run_id)
    assert s["state"] == "FAILED" and s["reason"].startswith("never submitted: ")
    assert [a["state"] for a in s["attempts"]] == [NEVER_SUBMITTED]
    assert s["attempts"][0]["job_id"] is None
    assert "FAILED: never submitted: sbatch: " in cli("status", run.run_id).stdout
    assert _jobs_of(tmp_path, run.run_id) == []


def test_a_dry_run_submit_prints_one_line_with_where_to_look(cli, tmp_path):
    train = write_train(tmp_path)
    proc = cli("submit", "--dry-run", "-t", "5", str(train), "--", "5", "0.01", "5")
    (line,) = proc.stdout.strip().splitlines()
    (run,) = Store(cli.home).list_runs()
    job = Store(cli.home).latest_attempt(run.run_id).job_id
    assert run.run_id in line and f"job {job}" in line and f"ftslurm status {run.run_id}" in line
    assert proc.stderr.strip() == ""  # not the script
    script = cli("submit", "--dry-run", "--print-script", str(train)).stdout
    assert script.startswith("#!/bin/bash") and len(Store(cli.home).list_runs()) == 1


# ------------------------------------------------- a stale write right after a submission
def test_a_stale_write_of_a_new_job_id_never_leads_to_a_second_submission(tmp_path):
    """The daemon submits attempt 1 (its own intent, trusted: no search by tag) and the
    write of the new job id is refused as stale (another writer moved the record on). The
    pass ends without the id; the next one must find the job by its tag, not submit again."""
    from ftslurm.core.types import JobState
    from ftslurm.daemon.store import StaleRecord

    from .test_reconcile_property import running_on_the_model

    backend, store, rec = running_on_the_model(tmp_path, nodes=1)
    (a,) = store.attempts("r0")
    assert a.state == JobState.RUNNING.value
    backend.exited[a.job_id or ""] = (1, None)  # it fails, and the daemon looks only once
    backend.query([a.job_id or ""])  # the controller sees it end
    backend.now += 120  # and forgets it (MinJobAge): the next attempt is a fresh submission

    real_update = store.update_attempt
    refused: list[str] = []

    def update_attempt(x):  # type: ignore[no-untyped-def]
        if x.attempt == 1 and x.job_id and not refused:
            refused.append(x.job_id)
            raise StaleRecord("attempt 1 of run 'r0' changed since it was read")
        return real_update(x)

    store.update_attempt = update_attempt  # type: ignore[method-assign]
    for _ in range(5):
        rec.cycle()
        backend.now += 1
    assert len(refused) == 1  # the job was submitted and its id's write refused
    latest = store.latest_attempt("r0")
    assert latest.attempt == 1 and latest.job_id == refused[0]  # found by its tag
    assert backend.submitted[tag("r0", 1)] == 1
    assert [e.kind for e in store.events("r0") if e.data.get("attempt") == 1][:1] == ["adopted"]
