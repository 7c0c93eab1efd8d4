"""Guarding against lost state (docs/daemon.md, "When the state is damaged").

- every sqlite error becomes a one-line `StateError` (connection.py);
- `state.db.mark` (JSON, written atomically by the daemon after a commit) holds the newest
  event id the daemon saw committed: a database whose newest event is older has lost
  committed changes (e.g. its `-wal` file was deleted) and is refused;
- `backup()` writes `state.db.bak` with SQLite's online backup API; `restore_backup()`
  (recover.py) puts it back, keeping the damaged files in `damaged-<time>/`;
- each run's folder holds the run as `submit` recorded it (`mirror_run`): a database that
  lacks a mirrored run is refused, and `ftslurm daemon recover` rebuilds it (recover.py).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ftslurm.daemon.records import Run
from ftslurm.daemon.store.connection import (
    DB_NAME,
    DB_SUFFIXES,
    RECOVER_HINT,
    Connection,
    StateDamaged,
    os_state_error,
    sqlite_errors,
)
from ftslurm.fsutil import read_json, replace_durably, temp_path, write_json_atomic

BACKUP_NAME = "state.db.bak"
MARK_NAME = "state.db.mark"
RUNS_DIR = "runs"  # $FTSLURM_HOME/runs/<run id>/: each run's folder (`RunDir`)
# In a run's folder: the run as `submit` recorded it (`mirror_run`), so that a run the
# database loses (a deleted WAL, an older backup put back) is noticed and rebuilt.
RUN_MIRROR = "run.json"


def read_mark(home: Path) -> int:
    """The newest event id the daemon saw committed (0 when none was recorded)."""
    data = read_json(Path(home) / MARK_NAME)
    value = data.get("event_id") if isinstance(data, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else 0


def marked_backends(home: Path) -> list[str]:
    """The scheduler backends (`submission.backend_key`) the daemon has used here."""
    data = read_json(Path(home) / MARK_NAME)
    value = data.get("backends") if isinstance(data, dict) else None
    return [str(b) for b in value] if isinstance(value, list) else []


def write_mark(home: Path, event_id: int, backends: Iterable[str] = ()) -> None:
    """Record (atomically, 0600) that events up to `event_id` are committed, and which
    backends the daemon used (kept when the database is lost, so `status` knows where to
    look for jobs of lost runs)."""
    data = {"event_id": int(event_id), "time": time.time(), "backends": sorted(set(backends))}
    write_json_atomic(Path(home) / MARK_NAME, data, mode=0o600)


def mark_backend(home: Path, key: str) -> None:
    """Add backend `key` to those the mark names (`write_mark`), before the daemon has
    seen a run of it."""
    if key not in marked_backends(home):
        write_mark(home, read_mark(home), [*marked_backends(home), key])


def mirror_run(run: Run) -> None:
    """Write what `submit` recorded of `run` into its folder (atomically, 0600): the store
    refuses a database that lacks a mirrored run, and `restore_backup` rebuilds it."""
    data = {
        "run_id": run.run_id,
        "name": run.name,
        "created_at": run.created_at,
        "spec": run.spec,
        "settings": run.settings,
    }
    write_json_atomic(Path(run.spec["run_dir"]) / RUN_MIRROR, data, mode=0o600)


def update_mirror(run: Run, **fields: Any) -> None:
    """Note in the run's mirror (`mirror_run`) how far the daemon took it: the attempt it
    submitted and its job (`attempt`, `job_id`), or how it ended (`state`, `reason`); a run
    without a mirror gets none (one recorded before mirrors existed, or by a test)."""
    path = Path(run.spec.get("run_dir") or "") / RUN_MIRROR
    data = read_json(path) if run.spec.get("run_dir") else None
    if isinstance(data, dict) and data.get("run_id") == run.run_id:
        write_json_atomic(path, {**data, **fields}, mode=0o600)


def mirrored_runs(home: Path | str, skip: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Run id -> the mirror (`mirror_run`) of each run folder under `home` whose id is not
    in `skip`; folders without a readable mirror are not runs `submit` recorded."""
    skip = set(skip)
    try:
        names = sorted(os.listdir(Path(home) / RUNS_DIR))
    except OSError:
        return {}
    found = {}
    for name in names:
        if name in skip:
            continue
        data = read_json(Path(home) / RUNS_DIR / name / RUN_MIRROR)
        if (
            isinstance(data, dict)
            and data.get("run_id") == name
            and isinstance(data.get("spec"), dict)
            and isinstance(data.get("settings"), dict)
        ):
            found[name] = data
    return found


class GuardMixin(Connection):
    """`Store`'s guards: the checks when it opens, the integrity check and the backup."""

    def _check_mark(self) -> None:
        mark = read_mark(self.home)
        newest = self.newest_event_id() if mark else 0
        if newest < mark:
            raise StateDamaged(
                f"the state database {self.path} has lost committed changes: its newest event "
                f"is {newest}, but events up to {mark} were committed (was {DB_NAME}-wal "
                "deleted or an older copy put back?)",
                hint=RECOVER_HINT,
            )

    def missing_runs(self) -> dict[str, dict[str, Any]]:
        """The mirrors (`mirror_run`) of runs that are not in the database."""
        known = [row["run_id"] for row in self._read("SELECT run_id FROM runs")]
        return mirrored_runs(self.home, known)

    def _check_runs(self) -> None:
        lost = sorted(self.missing_runs())
        if lost:
            more = " ..." if len(lost) > 5 else ""
            raise StateDamaged(
                f"the state database {self.path} has lost run(s) {', '.join(lost[:5])}{more}: "
                f"their folders say `submit` recorded them (was {DB_NAME}-wal deleted or an "
                "older copy put back?)",
                hint="stop the daemon and run `ftslurm daemon recover`: it rebuilds them",
            )

    def newest_event_id(self) -> int:
        """The id of the newest committed event (0 in a database without events)."""
        with self._lock, sqlite_errors(self.path):
            if int(self._db.execute("PRAGMA user_version").fetchone()[0]) < 1:
                return 0  # no tables yet
            row = self._db.execute("SELECT max(event_id) FROM events").fetchone()
            return int(row[0] or 0)

    def check_integrity(self) -> None:
        """`PRAGMA quick_check` (reads every page: for a daemon's start, not the hot path);
        `StateDamaged` with one line when it finds damage."""
        with self._lock, sqlite_errors(self.path):
            rows = [str(r[0]) for r in self._db.execute("PRAGMA quick_check(5)").fetchall()]
        if rows != ["ok"]:
            raise StateDamaged(
                f"the state database {self.path} is damaged ({rows[0]})", hint=RECOVER_HINT
            )

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database file as far as readers allow
        (`wal_checkpoint(PASSIVE)`: never waits), so the main file is rarely behind."""
        with self._lock, sqlite_errors(self.path):
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def backup(self) -> Path:
        """A consistent copy of the database (SQLite's online backup API) as
        `home/state.db.bak` (0600, one self-contained file, replaced atomically)."""
        dest = self.home / BACKUP_NAME
        tmp = temp_path(dest)
        try:
            tmp.unlink(missing_ok=True)
            os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
            with sqlite_errors(dest):
                copy = sqlite3.connect(tmp, isolation_level=None)
                try:
                    with self._lock:
                        self._db.backup(copy)
                    copy.execute("PRAGMA journal_mode = DELETE").fetchall()  # no -wal beside
                finally:
                    copy.close()
            replace_durably(tmp, dest)
        except OSError as exc:
            raise os_state_error(exc, dest) from None
        finally:
            for suffix in DB_SUFFIXES:
                tmp.with_name(tmp.name + suffix).unlink(missing_ok=True)
        return dest
