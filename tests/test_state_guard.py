"""State lost or damaged, full disks, unusable state folders: detected, one line, recoverable.

Every command runs in process through `ftslurm.cli.main.main` with its own FTSLURM_HOME; the
daemon's loop (`service.serve`) runs in a thread where a test needs it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockScheduler
from ftslurm.cli.main import main
from ftslurm.core.types import ClusterFacts, JobInfo, JobOptions, JobState
from ftslurm.daemon import service
from ftslurm.daemon.records import RunState, new_run_record
from ftslurm.daemon.store import (
    BACKUP_NAME,
    DB_NAME,
    MARK_NAME,
    DiskFull,
    StateDamaged,
    Store,
    read_mark,
)
from ftslurm.daemon.submission import make_spec, tag
from ftslurm.errors import ConfigError
from ftslurm.fsutil import folder_error, private_dir
from ftslurm.recipe import load_recipe

from .conftest import wait_for
from .test_daemon_store import make_run

PAGE = 4096


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FTSLURM_HOME", str(home))
    monkeypatch.delenv("FTSLURM_MOCK_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # status asks no real Slurm
    return home


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code != 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("Error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], err


def no_daemon(home: Path) -> bool:
    return service.running_pid(home) is None


# ------------------------------------------------------------------------ WAL deleted
def test_wal_deleted_while_the_daemon_is_down_is_refused_and_recover_brings_the_run_back(
    home, tmp_path, capsys, monkeypatch
):
    store = Store(home)
    store.add_run(make_run("r1"))
    store.append_event("r1", "created", {}, 1.0)
    store.backup()  # as the daemon does at start
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the main file holds r1 now
    # A reader's snapshot stops the daemon's checkpoint short: what follows stays in the WAL.
    reader = sqlite3.connect(home / DB_NAME, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM events").fetchone()
    store.add_run(make_run("r2"))
    for _ in range(3):
        store.append_event("r2", "running", {}, 2.0)
    older = tmp_path / "older.bak"
    shutil.copy2(home / BACKUP_NAME, older)  # the backup from before r2
    keeper = service.Keeper(store, backup_interval_s=3600)
    keeper.next_backup = float("inf")
    keeper.after_cycle()  # checkpoint (blocked by the reader), the mark, a backup (new run)
    assert read_mark(home) == 4
    assert runs_in(home / BACKUP_NAME) == 2  # a new run is backed up at once
    # The daemon is killed and the WAL deleted: the copy below is what remains on disk,
    # with a backup from before r2 (one taken before the run came).
    lost = tmp_path / "lost"
    lost.mkdir(mode=0o700)
    for name in (DB_NAME, MARK_NAME):
        shutil.copy2(home / name, lost / name)
    shutil.copy2(older, lost / BACKUP_NAME)
    reader.close()
    store.close()
    monkeypatch.setenv("FTSLURM_HOME", str(lost))

    code, out, err = cli(capsys, "status")
    assert_one_line_error(code, err, "lost committed changes", "daemon recover")
    assert out == ""
    code, _, err = cli(capsys, "daemon", "start")
    assert_one_line_error(code, err, "lost committed changes")
    assert no_daemon(lost)

    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert "restored 1 run(s) (1 active)" in out and "damaged-" in out
    kept = [p for p in lost.iterdir() if p.name.startswith("damaged-")]
    assert len(kept) == 1 and (kept[0] / DB_NAME).exists() and (kept[0] / MARK_NAME).exists()
    code, out, err = cli(capsys, "status", "--json")
    assert code == 0, err
    assert [s["run_id"] for s in json.loads(out)] == ["r1"]
    assert read_mark(lost) == 1  # the mark follows the restored database


def test_recover_is_refused_while_a_daemon_runs(home, capsys):
    with Store(home) as store:
        store.backup()
    lock = service.DaemonLock(home)
    lock.acquire()  # a daemon holds the state directory
    try:
        code, _, err = cli(capsys, "daemon", "recover")
        assert_one_line_error(code, err, "already running")
    finally:
        lock.release()
    assert not any(p.name.startswith("damaged-") for p in home.iterdir())


def test_recover_without_a_backup_is_one_line(home, capsys):
    Store(home).close()
    code, _, err = cli(capsys, "daemon", "recover")
    assert_one_line_error(code, err, "no backup")


# ------------------------------------------------------------------------ damaged file
def fill_runs(home: Path, count: int) -> None:
    """Runs whose rows fill many pages (each spec carries a marker and padding)."""
    with Store(home) as store:
        for i in range(count):
            store.add_run(make_run(f"run{i:03d}", spec={"marker": "MARKER-ROW", "pad": "x" * 900}))
        store.append_event(None, "filled", {}, 1.0)


def damage_a_middle_page_of_runs(db: Path) -> int:
    """Zero a page in the middle of the file that holds rows of the runs table."""
    data = bytearray(db.read_bytes())
    pages = [
        i for i in range(len(data) // PAGE) if b"MARKER-ROW" in data[i * PAGE : (i + 1) * PAGE]
    ]
    assert len(pages) > 10
    victim = pages[len(pages) // 2]
    data[victim * PAGE : (victim + 1) * PAGE] = bytes(PAGE)
    db.write_bytes(bytes(data))
    return victim


def test_a_database_damaged_mid_file_is_one_line_for_every_command_and_recover_works(
    home, tmp_path, capsys, monkeypatch
):
    fill_runs(home, 120)
    with Store(home) as store:
        store.backup()
    damage_a_middle_page_of_runs(home / DB_NAME)
    train = tmp_path / "train.py"
    train.write_text("print('hi')\n")
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    for argv in (
        ["status"],
        ["status", "--json"],
        ["daemon", "start"],
        ["submit", "--json", "--dry-run", str(train)],
    ):
        code, out, err = cli(capsys, *argv)
        assert_one_line_error(code, err, "is damaged", "daemon recover")
    assert no_daemon(home)
    assert not (tmp_path / "mock").exists()  # nothing was submitted
    monkeypatch.delenv("FTSLURM_MOCK_HOME")
    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0, err
    assert "restored 120 run(s)" in out
    code, out, err = cli(capsys, "status", "--json")
    assert code == 0 and len(json.loads(out)) == 120


def test_damage_is_refused_by_the_daemon_itself(home):
    fill_runs(home, 60)
    damage_a_middle_page_of_runs(home / DB_NAME)
    with pytest.raises(StateDamaged):
        service.serve(home, threading.Event())
    assert no_daemon(home)  # it let the lock go


def test_file_is_not_a_database_is_one_line_and_recoverable(home, capsys):
    with Store(home) as store:
        store.add_run(make_run("r1"))
        store.backup()
    with open(home / DB_NAME, "r+b") as f:
        f.write(b"this is not the header of an sqlite database at all" * 4)
    for argv in (["status"], ["daemon", "start"], ["nodes"], ["daemon", "status"]):
        code, _, err = cli(capsys, *argv)
        assert_one_line_error(code, err, "file is not a database", "daemon recover")
    code, out, err = cli(capsys, "daemon", "recover")
    assert code == 0 and "restored 1 run(s)" in out, err
    assert cli(capsys, "status", "r1", "--json")[0] == 0


# ------------------------------------------------------------------------ backups
def runs_in(path: Path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM runs").fetchone()[0])
    finally:
        db.close()


@pytest.fixture
def serving(home) -> Iterator[tuple[threading.Event, list[BaseException]]]:
    stop = threading.Event()
    errors: list[BaseException] = []
    yield stop, errors
    stop.set()


def start_serving(
    home: Path, stop: threading.Event, errors: list[BaseException], **kw: object
) -> threading.Thread:
    def target() -> None:
        try:
            service.serve(home, stop, **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    wait_for(lambda: service.running_pid(home) or errors, 10, "the daemon to take its lock")
    assert not errors, errors
    return thread


def test_backup_at_start_and_periodically_while_something_changed(home, serving):
    stop, errors = serving
    with Store(home) as store:
        store.add_run(make_run("r1"))
        store.append_event("r1", "created", {}, 1.0)
    thread = start_serving(home, stop, errors, backup_interval_s=0.3)
    backup = home / BACKUP_NAME
    wait_for(backup.exists, 10, "the backup at start")
    assert runs_in(backup) == 1
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    with Store(home) as store:  # a CLI records another run while the daemon serves
        store.add_run(make_run("r2"))
        store.append_event("r2", "created", {}, 2.0)
    wait_for(lambda: runs_in(backup) == 2, 10, "a periodic backup with the new run")
    wait_for(lambda: read_mark(home) == 2, 10, "the mark of the newest event")
    stop.set()
    thread.join(10)
    assert not errors, errors
    assert not [p for p in home.iterdir() if p.name.endswith(".tmp")]  # none left behind


# ------------------------------------------------------------------------ disk full
class FakeSlurm:
    """A scheduler with one running job past its checkpoint-signal time."""

    name = "fake"

    def __init__(self, job_id: str, start: float) -> None:
        self.job_id, self.start = job_id, start
        self.queries = 0
        self.signals: list[str] = []

    def query(self, ids):
        self.queries += 1
        return {
            j: JobInfo(
                job_id=j,
                state=JobState.RUNNING,
                observed_at=time.time(),
                nodes=("n1",),
                start_time=self.start,
                time_limit_s=60,
            )
            for j in ids
        }

    def signal(self, job_id, sig, target=None):
        self.signals.append(job_id)

    def cluster_facts(self):
        return ClusterFacts(min_job_age_s=300, accounting=True)


def pack_events(home: Path) -> int:
    """Fill the events table to the last byte its pages can hold, with SQLite's page limit
    at the database's current size: any further event needs a page the limit forbids."""
    db = sqlite3.connect(home / DB_NAME, isolation_level=None)
    try:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")
        for size in (2000, 500, 100, 20, 0):
            while True:
                try:
                    db.execute(
                        "INSERT INTO events (time, run_id, kind, data) VALUES "
                        "(0, NULL, 'filler', ?)",
                        (json.dumps("x" * size),),
                    )
                except sqlite3.OperationalError as exc:
                    assert "full" in str(exc)
                    break
        return pages
    finally:
        db.close()


def test_disk_full_keeps_the_daemon_serving_logs_once_and_loses_nothing(
    home, tmp_path, serving, monkeypatch, caplog
):
    stop, errors = serving
    train = tmp_path / "train.py"
    train.write_text("print('hi')\n")
    recipe = load_recipe(train, []).with_overrides(preempt_time=30)
    spec = make_spec(
        recipe, run_dir=home / "runs" / "full1", backend="slurm", workdir=str(tmp_path)
    )
    run, attempt = new_run_record("full1", "full", spec, recipe.settings(), time.time())
    backend = FakeSlurm("77", start=time.time() - 50)  # 10 s left of 60: the signal is due
    attempt = replace(attempt, state="RUNNING", job_id="77", nodes=["n1"], start=backend.start)
    with Store(home) as store:
        store.add_run(replace(run, state=RunState.RUNNING))
        store.add_attempt(attempt)
        store.append_event("full1", "running", {"attempt": 0}, time.time())
    pages = pack_events(home)
    with Store(home) as store:
        before = [(e.event_id, e.kind) for e in store.events()]
        store.backup()  # an earlier backup: the daemon's first does not change the size
    opened: list[Store] = []

    def limited_store(where: Path) -> Store:
        s = Store(where)
        s._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full for the daemon
        opened.append(s)
        return s

    monkeypatch.setattr(service, "Store", limited_store)
    monkeypatch.setattr(service, "create_backend", lambda kind, where=None, abort=None: backend)
    caplog.set_level(logging.INFO, logger="ftslurm.daemon")
    thread = start_serving(home, stop, errors, backup_interval_s=3600)
    wait_for(lambda: backend.queries >= 4, 30, "the daemon to keep polling with a full disk")
    full = [r for r in caplog.records if r.getMessage().startswith("disk full: ")]
    assert len(full) == 1 and str(home / DB_NAME) in full[0].getMessage()
    assert not [r for r in caplog.records if "cycle failed" in r.getMessage()]
    assert backend.signals == []  # the signal's intent could not be recorded: not sent
    with Store(home) as store:
        assert [(e.event_id, e.kind) for e in store.events()] == before
    with opened[0]._lock:
        opened[0]._db.execute(f"PRAGMA max_page_count = {pages + 1000}")  # room again
    wait_for(lambda: backend.signals, 30, "the checkpoint signal once there is room")
    stop.set()
    thread.join(10)
    assert not errors, errors
    with Store(home) as store:
        after = [(e.event_id, e.kind) for e in store.events()]
    assert after[: len(before)] == before
    assert [k for _, k in after[len(before) :]] == ["checkpoint_signal"]
    assert backend.signals == ["77"]
    assert len([r for r in caplog.records if r.getMessage().startswith("disk full")]) == 1
    assert [r for r in caplog.records if "no longer full" in r.getMessage()]


def test_disk_full_is_a_typed_error_of_the_store_and_keeps_what_was_written(tmp_path):
    with Store(tmp_path / "home") as store:
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(DiskFull) as info:
            for i in range(10_000):
                store.append_event(None, "x", {"pad": "y" * 500}, float(i))
        assert info.value.message.startswith("disk full: ")
        assert len(store.events()) == i  # every event written before is still there


# ------------------------------------------------------------------------ state folder
def test_ftslurm_home_that_is_a_file_is_one_line(home, capsys):
    home.parent.mkdir(parents=True, exist_ok=True)
    home.write_text("not a folder")
    for argv in (["status"], ["daemon", "status"], ["daemon", "start"], ["nodes"]):
        code, _, err = cli(capsys, *argv)
        assert_one_line_error(code, err, "FTSLURM_HOME", "not a folder")


def test_ftslurm_home_under_a_file_is_one_line(home, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "afile" / "home"))
    for argv in (["status"], ["daemon", "status"], ["daemon", "stop"], ["nodes"]):
        code, _, err = cli(capsys, *argv)
        assert_one_line_error(code, err, "FTSLURM_HOME", "is under a file")
    with pytest.raises(ConfigError, match="a part of that path is a file"):
        Store(tmp_path / "afile" / "home")


def test_unwritable_folder_errors_are_one_line(tmp_path, monkeypatch):
    def refuse(path, mode):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "chmod", refuse)
    with pytest.raises(ConfigError) as info:
        private_dir(tmp_path / "home")
    assert "permission denied" in info.value.user_message()
    error = folder_error(tmp_path, OSError(28, "No space left on device"))
    assert "No space left on device" in error.message and "\n" not in error.message


# ------------------------------------------------------------------------ orphan jobs
def test_status_warns_about_tagged_jobs_whose_runs_are_not_in_the_database(
    home, tmp_path, capsys, monkeypatch
):
    mock = tmp_path / "mock"
    scheduler = MockScheduler(mock)
    script = "#!/bin/bash\nsleep 600\n"
    lost = scheduler.submit(script, JobOptions(comment=tag("lost1", 2), hold=True))
    known = scheduler.submit(script, JobOptions(comment=tag("r1", 0), hold=True))
    other = scheduler.submit(script, JobOptions(comment="not ours", hold=True))
    try:
        with Store(home) as store:
            store.add_run(make_run("r1"))
        monkeypatch.setenv("FTSLURM_MOCK_HOME", str(mock))
        code, out, err = cli(capsys, "status")
        assert code == 0, err
        warning = [
            line
            for line in err.splitlines()  # (beside: no daemon serves r1)
            if line.startswith("warning:") and "carry ftslurm tags" in line
        ]
        assert len(warning) == 1, err
        jobs = warning[0].split("job(s) ", 1)[1].split(" carry", 1)[0]
        runs = warning[0].split("run(s) ", 1)[1].split(" that", 1)[0]
        assert (jobs, runs) == (lost, "lost1")
        code, out, err = cli(capsys, "status", "--json")  # stdout stays JSON
        assert code == 0 and json.loads(out)[0]["run_id"] == "r1" and "lost1" in err
    finally:
        for job in (lost, known, other):
            scheduler.cancel(job)


def test_the_mark_names_the_backends_the_daemon_used(tmp_path):
    home = tmp_path / "home"
    with Store(home) as store:
        keeper = service.Keeper(store, backup_interval_s=3600)
        keeper.after_cycle(["mock:/somewhere"])
    assert json.loads((home / MARK_NAME).read_text())["backends"] == ["mock:/somewhere"]
    assert stat.S_IMODE((home / MARK_NAME).stat().st_mode) == 0o600
