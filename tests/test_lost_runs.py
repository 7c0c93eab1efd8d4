"""Runs the database lost are noticed and rebuilt, never silently gone.

`submit` mirrors each run it records into the run's folder (`store.mirror_run`) and the
daemon notes there how far it took the run (`update_mirror`). A database that lacks a
mirrored run (its WAL deleted after `submit` committed, an older backup put back) is
refused; `ftslurm daemon recover` rebuilds such runs, adopting a job the scheduler still
holds by its tag, and names what it could not rebuild.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockScheduler
from ftslurm.cli.main import main
from ftslurm.core.types import JobOptions
from ftslurm.daemon import service
from ftslurm.daemon.records import AttemptState, RunState, tag
from ftslurm.daemon.store import (
    BACKUP_NAME,
    DB_NAME,
    MARK_NAME,
    RUN_MIRROR,
    Store,
    mirror_run,
    mirrored_runs,
    rebuild_runs,
    update_mirror,
)

from .conftest import wait_for
from .test_daemon_store import make_run
from .test_state_guard import damage_a_middle_page_of_runs, fill_runs

SLEEPER = "#!/bin/bash\n#SBATCH -N 1\nsleep 600\n"


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FTSLURM_HOME", str(home))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sleeper.sh").write_text(SLEEPER)
    yield home
    service.stop(home)
    MockScheduler(tmp_path / "mock")  # the mock's jobs end with the test
    for line in subprocess.run(
        ["pgrep", "-f", str(tmp_path)], capture_output=True, text=True
    ).stdout.split():
        if int(line) != os.getpid():
            os.kill(int(line), signal.SIGKILL)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stop_outside_a_write(pid: int, db: Path) -> None:
    """SIGSTOP `pid` at a moment it holds no write lock on `db` (a stop inside its lease
    renewal would block every writer): stopped, then checked, continued and tried again."""
    for _ in range(100):
        os.kill(pid, signal.SIGSTOP)
        probe = sqlite3.connect(db, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # locked: let it finish its write
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
        finally:
            probe.close()
    raise AssertionError(f"pid {pid} held the write lock of {db} at every try")


def mirrored(home: Path, run: str, **fields: object) -> Store:
    store = Store(home)
    r = make_run(
        run,
        spec={"run_dir": str(home / "runs" / run), "backend": "mock"},
        state=RunState.PENDING,
        cancel_requested=False,
    )
    store.add_run(r)
    (home / "runs" / run).mkdir(parents=True)
    mirror_run(r)
    if fields:
        update_mirror(r, **fields)
    return store


def test_a_mirrored_run_the_database_lacks_is_refused_in_one_line(home, capsys):
    store = mirrored(home, "r1")
    store._db.execute("DELETE FROM runs")  # as if the commit had been in a deleted WAL
    store.close()
    code, out, err = cli(capsys, "status")
    assert code != 0 and out == ""
    assert err.startswith("Error: ") and len(err.strip().splitlines()) == 1
    assert "lost run(s) r1" in err and "daemon recover" in err


def test_rebuild_follows_what_the_mirror_and_the_scheduler_say(home):
    for run, fields in [
        ("fresh", {}),
        ("gone", {"attempt": 2, "job_id": "77"}),
        (
            "done",
            {
                "attempt": 1,
                "job_id": "5",
                "state": "COMPLETED",
                "reason": "finished",
                "ended_at": 9.0,
            },
        ),
        ("alive", {"attempt": 1, "job_id": "8"}),
    ]:
        mirrored(home, run, **fields).close()
    store = Store(home, check_runs=False)
    store._db.execute("DELETE FROM runs")
    lines = rebuild_runs(store, store.missing_runs(), {"alive": (3, "12")}, now=50.0)
    assert len(lines) == 4 and not store.missing_runs()
    runs = {r.run_id: r for r in store.list_runs()}
    latest = store.latest_attempts(list(runs))
    # never submitted: submitted now (attempt 0, by its tag)
    assert runs["fresh"].state is RunState.PENDING
    assert latest["fresh"].state is AttemptState.SUBMITTING and latest["fresh"].attempt == 0
    # a job at the scheduler under a newer attempt's tag: that attempt, adopted by its tag
    assert latest["alive"].state is AttemptState.SUBMITTING and latest["alive"].attempt == 3
    assert latest["alive"].tag == tag("alive", 3)
    # ended before the loss: as it ended
    assert runs["done"].state is RunState.COMPLETED and runs["done"].reason == "finished"
    # submitted, and its job gone: not submitted again unasked, and the reason says why
    assert runs["gone"].state is RunState.FAILED and "77" in runs["gone"].reason
    assert "not known" in runs["gone"].reason


def test_the_wal_deleted_after_submit_committed_loses_no_run(home, tmp_path, capsys):
    """The issue's sequence: the daemon stopped (SIGSTOP), `submit` records a run, the
    daemon is killed and the WAL deleted. The run is refused as lost, rebuilt by
    `recover`, and submitted by the next daemon."""
    code, out, err = cli(capsys, "daemon", "start")
    assert code == 0, err
    wait_for((home / BACKUP_NAME).exists, 60, "the daemon serving (its first backup)")
    daemon = service.running_pid(home)
    stop_outside_a_write(daemon, home / DB_NAME)
    try:
        submit = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ftslurm",
                "submit",
                "--dry-run",
                "-t",
                "10",
                "--name",
                "walrun",
                "sleeper.sh",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        mirror = wait_for(lambda: mirrored_runs(home), 60, "the run's mirror")
        (run_id,) = mirror
        submit.kill()
        submit.wait()
    finally:
        os.kill(daemon, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.kill(daemon, signal.SIGCONT)
    wait_for(lambda: service.running_pid(home) is None, 15, "the killed daemon gone")
    (home / f"{DB_NAME}-wal").unlink()

    code, out, err = cli(capsys, "status")
    assert code != 0 and f"lost run(s) {run_id}" in err, err
    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert f"run {run_id}: rebuilt from its folder; it had not been submitted yet" in out
    code, out, err = cli(capsys, "daemon", "start")
    assert code == 0, err
    with Store(home) as store:
        job = wait_for(
            lambda: (store.latest_attempt(run_id) or None) and store.latest_attempt(run_id).job_id,
            60,
            "the run submitted",
        )
    assert job


def test_recover_rebuilds_a_run_the_backup_lacks_and_adopts_its_job(home, tmp_path, capsys):
    """The backup was taken before the run was submitted; the database is then damaged.
    `recover` brings the run back from its folder, and the daemon adopts the job that
    carries its tag (one job, not a second submission)."""
    with Store(home) as store:
        store.backup()  # as the daemon does at start, before the run
    mock = MockScheduler(tmp_path / "mock")
    store = mirrored(home, "late")
    job = mock.submit(SLEEPER, JobOptions(comment=tag("late", 0)))
    update_mirror(store.get_run("late"), attempt=0, job_id=job)
    store.close()
    with open(home / DB_NAME, "r+b") as f:  # damage the header
        f.write(b"\0" * 100)
    code, out, err = cli(capsys, "status")
    assert code != 0 and "damaged" in err

    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert "restored 0 run(s)" in out
    assert f"run late: rebuilt from its folder; its job {job} (attempt 0) is still" in out
    with Store(home) as store:
        assert store.latest_attempt("late").state is AttemptState.SUBMITTING
    code, out, err = cli(capsys, "daemon", "start")
    assert code == 0, err
    with Store(home) as store:
        adopted = wait_for(lambda: store.latest_attempt("late").job_id, 60, "the adoption")
    assert adopted == job
    assert [j.job_id for j in mock.active_jobs() if j.comment == tag("late", 0)] == [job]


def test_recover_names_tagged_jobs_it_could_not_rebuild(home, tmp_path, capsys):
    with Store(home) as store:
        store.backup()
    mock = MockScheduler(tmp_path / "mock")
    job = mock.submit(SLEEPER, JobOptions(comment=tag("nofolder", 1)))
    from ftslurm.daemon.store import mark_backend

    mark_backend(home, f"mock:{tmp_path / 'mock'}")
    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert f"job {job} carries the tag of run nofolder" in out


def test_submit_mirrors_the_run_and_the_daemon_notes_its_job(home, capsys):
    code, out, err = cli(capsys, "submit", "--dry-run", "-t", "10", "--json", "sleeper.sh")
    assert code == 0, err
    run_id = json.loads(out)["run_id"]
    mirror = json.loads((home / "runs" / run_id / RUN_MIRROR).read_text())
    assert mirror["run_id"] == run_id and mirror["spec"]["backend"] == "mock"
    wait_for(
        lambda: json.loads((home / "runs" / run_id / RUN_MIRROR).read_text()).get("job_id"),
        30,
        "the job noted in the mirror",
    )
    assert oct((home / "runs" / run_id / RUN_MIRROR).stat().st_mode & 0o777) == "0o600"


def served(home: Path, tmp_path: Path, run: str) -> Store:
    """The daemon's first cycle with `run` (mirrored) recorded: the mark (naming the mock
    as a backend used) and the backup, as `service.Keeper` leaves them."""
    store = mirrored(home, run)
    store.append_event(run, "created", {}, 1.0)
    service.Keeper(store, backup_interval_s=3600).after_cycle([f"mock:{tmp_path / 'mock'}"])
    assert (home / BACKUP_NAME).exists() and (home / MARK_NAME).exists()
    return store


def submitted_after_the_backup(store: Store, mock: MockScheduler, run: str) -> str:
    """A run `submit` records and the daemon submits, both after the last backup: only the
    run's folder and the scheduler's job (by its tag) know it besides the database."""
    store.add_run(
        make_run(
            run,
            spec={"run_dir": str(store.home / "runs" / run), "backend": "mock"},
            state=RunState.PENDING,
            cancel_requested=False,
        )
    )
    (store.home / "runs" / run).mkdir(parents=True)
    mirror_run(store.get_run(run))
    job = mock.submit(SLEEPER, JobOptions(comment=tag(run, 0)))
    update_mirror(store.get_run(run), attempt=0, job_id=job)
    store.append_event(run, "submitted", {"job_id": job}, 2.0)
    store.checkpoint()  # the WAL is in the main file: the damage below hits it all
    store.close()
    assert not (store.home / f"{DB_NAME}-wal").exists()
    return job


def assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code != 0 and out == "", (out, err)
    assert err.startswith("Error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("size", ["empty", "half"])
def test_a_database_truncated_after_a_submit_is_one_line_and_recover_brings_every_run_back(
    home, tmp_path, capsys, size
):
    """The issue's truncation: state.db cut to 0 bytes or to half after a run was submitted
    (and before a backup held it). Every command says so in one line; `recover` puts the
    backup back (the run it holds) and rebuilds the newer run from its folder, adopting
    its job."""
    mock = MockScheduler(tmp_path / "mock")
    job = submitted_after_the_backup(served(home, tmp_path, "early"), mock, "late")
    db = home / DB_NAME
    with open(db, "r+b") as f:
        f.truncate(0 if size == "empty" else db.stat().st_size // 2)
    for argv in (["status"], ["status", "--json"], ["daemon", "start"]):
        code, out, err = cli(capsys, *argv)
        assert_one_line_error(code, out, err, "daemon recover")
    assert service.running_pid(home) is None

    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert "restored 1 run(s)" in out
    assert f"run late: rebuilt from its folder; its job {job} (attempt 0) is still" in out
    code, out, err = cli(capsys, "status", "--json")
    assert code == 0, err
    assert sorted(s["run_id"] for s in json.loads(out)) == ["early", "late"]
    with Store(home) as store:
        late = store.latest_attempt("late")
    assert (late.state, late.tag) == (AttemptState.SUBMITTING, tag("late", 0))  # adopted


def test_a_middle_page_damaged_loses_no_run_the_backup_lacks(home, tmp_path, capsys):
    """A page of the runs table zeroed in the middle of the file, with a run submitted
    after the last backup: the backup's runs come back, and the newer one from its folder."""
    fill_runs(home, 120)
    mock = MockScheduler(tmp_path / "mock")
    job = submitted_after_the_backup(served(home, tmp_path, "early"), mock, "late")
    damage_a_middle_page_of_runs(home / DB_NAME)
    code, out, err = cli(capsys, "status")
    assert_one_line_error(code, out, err, "is damaged", "daemon recover")

    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert "restored 121 run(s)" in out
    assert f"run late: rebuilt from its folder; its job {job} (attempt 0) is still" in out
    code, out, err = cli(capsys, "status", "--json")
    assert code == 0, err
    ids = {s["run_id"] for s in json.loads(out)}
    assert len(ids) == 122 and {"early", "late", "run060"} <= ids


def test_status_after_recover_still_warns_about_a_tagged_job_no_run_claims(
    home, tmp_path, capsys, monkeypatch
):
    """Only the mark names the mock the daemon used (no run left uses it, and
    FTSLURM_MOCK_HOME is not set): `recover` moves the damaged mark aside but carries its
    backends over, so `status` still asks that scheduler and warns about the job."""
    mock = MockScheduler(tmp_path / "mock")
    served(home, tmp_path, "early").close()
    job = mock.submit(SLEEPER, JobOptions(comment=tag("nofolder", 1)))
    with open(home / DB_NAME, "r+b") as f:  # damage the header
        f.write(b"\0" * 100)
    monkeypatch.delenv("FTSLURM_MOCK_HOME")
    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert f"job {job} carries the tag of run nofolder" in out
    code, out, err = cli(capsys, "status")
    assert code == 0, err
    warning = [line for line in err.splitlines() if "carry ftslurm tags" in line]
    assert len(warning) == 1 and f"job(s) {job} " in warning[0], err
    assert "run(s) nofolder " in warning[0]
