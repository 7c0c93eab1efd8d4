"""Putting the state back: `restore_backup` puts `state.db.bak` back (keeping the damaged
files in `damaged-<time>/`), `rebuild_runs` adds back the runs the database lost from their
folders' mirrors, `recover_state` (`ftslurm daemon recover`) does what a state needs."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftslurm.daemon.records import Attempt, AttemptState, Run, RunState
from ftslurm.daemon.records import tag as record_tag
from ftslurm.daemon.store.connection import (
    DB_NAME,
    DB_SUFFIXES,
    StateDamaged,
    StateError,
    os_state_error,
    sqlite_errors,
)
from ftslurm.daemon.store.db import Store
from ftslurm.daemon.store.guard import BACKUP_NAME, MARK_NAME, marked_backends, write_mark
from ftslurm.daemon.store.schema import TERMINAL
from ftslurm.fsutil import private_dir, replace_durably, temp_path

DAMAGED_PREFIX = "damaged-"
LOST_RUN = "lost with the state database and rebuilt from its folder"


@dataclass(frozen=True)
class Restored:
    """What `restore_backup` put back."""

    runs: int
    active_runs: int
    taken_at: float | None  # when the backup was written (None: none was put back)
    kept_in: Path | None  # where the replaced files went (None: there were none)
    rebuilt: list[str] = field(default_factory=list)  # a line per run rebuilt from its folder


def restore_backup(
    home: Path | str, now: float | None = None, active: dict[str, tuple[int, str]] | None = None
) -> Restored:
    """Put `home/state.db.bak` back as the state database, after checking it; the files it
    replaces (database, WAL, shared memory, mark) move to `home/damaged-<time>/`. Runs the
    backup lacks but whose folders hold their mirror (`mirror_run`) are rebuilt
    (`rebuild_runs`); `active` says which runs still have a job at the scheduler (run id ->
    (attempt, job id); none without it). The caller makes sure no daemon runs (it holds
    the `DaemonLock`)."""
    home = private_dir(home)
    backup = home / BACKUP_NAME
    if not backup.is_file():
        raise StateError(
            f"no backup to restore: {backup} does not exist",
            hint="the daemon writes one when it starts",
        )
    taken_at = backup.stat().st_mtime
    staging = temp_path(home / DB_NAME)
    try:
        shutil.copyfile(backup, staging)
        os.chmod(staging, 0o600)
        with sqlite_errors(backup):
            db = sqlite3.connect(staging, isolation_level=None)
            try:
                rows = [str(r[0]) for r in db.execute("PRAGMA quick_check(5)").fetchall()]
                if rows != ["ok"]:
                    raise StateDamaged(f"the backup {backup} is damaged too ({rows[0]})")
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
                runs = active_runs = newest = 0
                if {"runs", "events"} <= tables:
                    marks = ",".join("?" * len(TERMINAL))
                    runs, active_runs = db.execute(
                        f"SELECT count(*), count(*) FILTER (WHERE state NOT IN ({marks})) "
                        "FROM runs",
                        TERMINAL,
                    ).fetchone()
                    newest = int(db.execute("SELECT max(event_id) FROM events").fetchone()[0] or 0)
            finally:
                db.close()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
        kept: Path | None = home / f"{DAMAGED_PREFIX}{stamp}"
        n = 1
        while kept.exists():  # type: ignore[union-attr]
            n += 1
            kept = home / f"{DAMAGED_PREFIX}{stamp}-{n}"
        names = [DB_NAME + suffix for suffix in DB_SUFFIXES] + [MARK_NAME]
        present = [name for name in names if (home / name).exists()]
        for name in present:
            private_dir(kept)
            os.replace(home / name, kept / name)  # type: ignore[operator]
        if not present:
            kept = None
        replace_durably(staging, home / DB_NAME)
    except OSError as exc:
        raise os_state_error(exc, home / DB_NAME) from None
    finally:
        for suffix in DB_SUFFIXES:
            staging.with_name(staging.name + suffix).unlink(missing_ok=True)
    # The backends used stay known (orphan jobs are looked for there), also when the backup
    # holds no event yet.
    write_mark(home, newest, marked_backends(kept) if kept else ())
    with Store(home, check_runs=False) as store:
        store.check_integrity()
        missing = store.missing_runs()
        when = time.time() if now is None else now
        rebuilt = rebuild_runs(store, missing, active or {}, when)
        write_mark(home, store.newest_event_id(), marked_backends(home))
    return Restored(
        runs=int(runs),
        active_runs=int(active_runs),
        taken_at=taken_at,
        kept_in=kept,
        rebuilt=rebuilt,
    )


def recover_state(
    home: Path | str, now: float | None = None, active: dict[str, tuple[int, str]] | None = None
) -> Restored:
    """`ftslurm daemon recover`: a database that is sound but lacks runs their folders
    mirror (its WAL deleted after `submit` committed) gets them rebuilt in place, keeping
    everything newer than the backup; any other (damaged, or lost committed events) gets
    the last backup put back (`restore_backup`), then the same rebuilding."""
    try:
        with Store(home, check_runs=False) as store:
            store.check_integrity()
            missing = store.missing_runs()
            if missing:
                when = time.time() if now is None else now
                rebuilt = rebuild_runs(store, missing, active or {}, when)
                runs = store.list_runs()
                write_mark(store.home, store.newest_event_id(), marked_backends(store.home))
                return Restored(
                    runs=len(runs),
                    taken_at=None,
                    kept_in=None,
                    rebuilt=rebuilt,
                    active_runs=sum(not r.state.is_terminal for r in runs),
                )
    except StateError:
        pass  # not sound: the backup, below
    return restore_backup(home, now, active)


def rebuild_runs(
    store: Store, mirrors: dict[str, dict[str, Any]], active: dict[str, tuple[int, str]], now: float
) -> list[str]:
    """Add the runs of `mirrors` (lost by the database: `Store.missing_runs`) back, one line
    each for the user. `active`: run id -> (attempt, job id) of the newest job the scheduler
    still holds for it (by the attempt's tag): such a run comes back as that attempt about to
    be submitted, which the daemon adopts by its tag instead of submitting again. Otherwise
    the mirror says how far the daemon took it (`update_mirror`): ended (it comes back so),
    never submitted (it is submitted now), or submitted and gone from the scheduler: then
    how it ended is not known, and it comes back FAILED, since submitting it again unasked
    could run it twice."""
    lines = []
    for run_id, m in sorted(mirrors.items()):
        found = active.get(run_id)
        ended = m.get("state") in TERMINAL
        run = Run(
            run_id=run_id,
            name=str(m.get("name") or run_id),
            state=RunState.PENDING,
            created_at=float(m.get("created_at") or now),
            spec=m["spec"],
            settings=m["settings"],
        )
        attempt = Attempt(
            run_id,
            int(m.get("attempt") or 0),
            AttemptState.SUBMITTING,
            tag=record_tag(run_id, int(m.get("attempt") or 0)),
        )
        if found:  # adopted by its tag instead of submitted again
            attempt = replace(attempt, attempt=found[0], tag=record_tag(run_id, found[0]))
            line = (
                f"run {run_id}: rebuilt from its folder; its job {found[1]} (attempt "
                f"{found[0]}) is still at the scheduler, and the daemon adopts it"
            )
        elif ended:
            run = replace(
                run,
                state=RunState(m["state"]),
                reason=m.get("reason"),
                ended_at=float(m.get("ended_at") or now),
            )
            attempt = replace(attempt, state=AttemptState.UNKNOWN, job_id=m.get("job_id"))
            line = f"run {run_id}: rebuilt from its folder as {m['state']} (it had ended)"
        elif m.get("job_id") is None:  # never submitted: the daemon submits it now
            line = f"run {run_id}: rebuilt from its folder; it had not been submitted yet"
        else:
            run = replace(
                run,
                state=RunState.FAILED,
                ended_at=now,
                reason=(
                    f"{LOST_RUN}: its job {m['job_id']} is no longer at the scheduler and how it "
                    "ended is not known; its checkpoints are kept: submit it again to continue"
                ),
            )
            attempt = replace(
                attempt, state=AttemptState.UNKNOWN, job_id=m.get("job_id"), reason=run.reason
            )
            line = f"run {run_id}: rebuilt from its folder as FAILED ({run.reason})"
        with store.transaction():
            store.add_run(run)
            store.add_attempt(attempt)
            store.append_event(run_id, "rebuilt", {"job_id": found[1] if found else None}, now)
        lines.append(line)
    return lines
