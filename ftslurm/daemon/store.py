"""The daemon's durable state: one SQLite database (WAL) in the state directory.

Tables (schema version in `PRAGMA user_version`, upgraded by `MIGRATIONS` in order):
    runs       one row per run: state, counters, and its spec/settings as JSON
    attempts   one row per (run, attempt): the scheduler job, how it ended, its cause
    events     append-only log of what the daemon saw, decided and did
    node_flags nodes kept out of later attempts, with reason and expiry

Several processes use it at once (the daemon, `ftslurm submit/status/cancel`): WAL lets
readers run beside the writer, every write is one `BEGIN IMMEDIATE` transaction, and a
busy timeout waits out the others. The folder is 0700 and the files 0600.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ftslurm.daemon.records import Attempt, Event, NodeFlag, Run, RunState
from ftslurm.errors import FtslurmError
from ftslurm.fsutil import private_dir

MIGRATIONS: list[tuple[int, list[str]]] = [
    (1, [
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL,
            created_at REAL NOT NULL, ended_at REAL, spec TEXT NOT NULL, settings TEXT NOT NULL,
            job_retries_used INTEGER NOT NULL, cause_counts TEXT NOT NULL,
            continuations INTEGER NOT NULL, stalled_continuations INTEGER NOT NULL,
            last_checkpoint_step INTEGER, reason TEXT, cancel_requested INTEGER NOT NULL)""",
        "CREATE INDEX runs_state ON runs(state)",
        """CREATE TABLE attempts (
            run_id TEXT NOT NULL REFERENCES runs(run_id), attempt INTEGER NOT NULL,
            state TEXT NOT NULL, job_id TEXT, tag TEXT NOT NULL, restart_count INTEGER NOT NULL,
            nodes TEXT NOT NULL, submitted_at REAL, start REAL, end_ REAL, exit_code INTEGER,
            signal INTEGER, reason TEXT, cause TEXT, in_job_restarts INTEGER NOT NULL,
            checkpoint_signal_at REAL, failure_seen_at REAL,
            PRIMARY KEY (run_id, attempt))""",
        "CREATE INDEX attempts_job ON attempts(job_id)",
        """CREATE TABLE events (
            event_id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, run_id TEXT,
            kind TEXT NOT NULL, data TEXT NOT NULL)""",
        "CREATE INDEX events_run ON events(run_id, event_id)",
        """CREATE TABLE node_flags (
            node TEXT PRIMARY KEY, reason TEXT NOT NULL, since REAL NOT NULL,
            expires_at REAL, run_id TEXT)""",
    ]),
]  # fmt: skip
SCHEMA_VERSION = MIGRATIONS[-1][0]

_RUN_COLS = ("run_id", "name", "state", "created_at", "ended_at", "spec", "settings",
             "job_retries_used", "cause_counts", "continuations", "stalled_continuations",
             "last_checkpoint_step", "reason", "cancel_requested")  # fmt: skip
_ATTEMPT_COLS = ("run_id", "attempt", "state", "job_id", "tag", "restart_count", "nodes",
                 "submitted_at", "start", "end_", "exit_code", "signal", "reason", "cause",
                 "in_job_restarts", "checkpoint_signal_at", "failure_seen_at")  # fmt: skip


class StateError(FtslurmError):
    """The state database cannot be used (e.g. written by a newer ftslurm)."""


class DaemonAlreadyRunning(FtslurmError):
    """Another daemon holds this state directory."""


class Store:
    def __init__(self, home: Path | str) -> None:
        self.home = private_dir(home)
        self.path = self.home / "state.db"
        if not self.path.exists():
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                   check_same_thread=False)  # fmt: skip
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA busy_timeout = 30000")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.execute("PRAGMA foreign_keys = ON")
        self._depth = 0
        self._migrate()
        for suffix in ("-wal", "-shm"):
            extra = self.path.with_name(self.path.name + suffix)
            if extra.exists():
                os.chmod(extra, 0o600)

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------------ schema
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise StateError(f"{self.path} has schema version {version}; this ftslurm "
                             f"supports up to {SCHEMA_VERSION}: upgrade ftslurm")  # fmt: skip
        if version == SCHEMA_VERSION:
            return
        with self.transaction():
            version = self.schema_version()  # another process may have migrated meanwhile
            for target, statements in MIGRATIONS:
                if target > version:
                    for sql in statements:
                        self._db.execute(sql)
                    self._db.execute(f"PRAGMA user_version = {target}")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic unit; nested calls join the outer transaction."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")
        finally:
            self._depth = 0

    def _write(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Cursor:
        with self.transaction():
            return self._db.execute(sql, params)

    # ------------------------------------------------------------------ runs
    @staticmethod
    def _run_row(run: Run) -> tuple[Any, ...]:
        return (run.run_id, run.name, run.state.value, run.created_at, run.ended_at,
                json.dumps(run.spec), json.dumps(run.settings), run.job_retries_used,
                json.dumps(run.cause_counts), run.continuations, run.stalled_continuations,
                run.last_checkpoint_step, run.reason, int(run.cancel_requested))  # fmt: skip

    @staticmethod
    def _run(row: sqlite3.Row) -> Run:
        return Run(
            run_id=row["run_id"], name=row["name"], state=RunState(row["state"]),
            created_at=row["created_at"], spec=json.loads(row["spec"]),
            settings=json.loads(row["settings"]), job_retries_used=row["job_retries_used"],
            cause_counts=json.loads(row["cause_counts"]), continuations=row["continuations"],
            stalled_continuations=row["stalled_continuations"],
            last_checkpoint_step=row["last_checkpoint_step"], reason=row["reason"],
            cancel_requested=bool(row["cancel_requested"]), ended_at=row["ended_at"],
        )  # fmt: skip

    def add_run(self, run: Run) -> None:
        marks = ",".join("?" * len(_RUN_COLS))
        self._write(f"INSERT INTO runs ({','.join(_RUN_COLS)}) VALUES ({marks})",
                    self._run_row(run))  # fmt: skip

    def update_run(self, run: Run) -> None:
        sets = ",".join(f"{c} = ?" for c in _RUN_COLS[1:])
        row = self._run_row(run)
        self._write(f"UPDATE runs SET {sets} WHERE run_id = ?", (*row[1:], row[0]))

    def get_run(self, run_id: str) -> Run | None:
        row = self._db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return self._run(row) if row else None

    def list_runs(self, active_only: bool = False) -> list[Run]:
        sql = "SELECT * FROM runs"
        if active_only:
            ended = ",".join(f"'{s.value}'" for s in RunState if s.is_terminal)
            sql += f" WHERE state NOT IN ({ended})"
        return [self._run(r) for r in self._db.execute(sql + " ORDER BY created_at, run_id")]

    # ------------------------------------------------------------------ attempts
    @staticmethod
    def _attempt_row(a: Attempt) -> tuple[Any, ...]:
        return (a.run_id, a.attempt, a.state, a.job_id, a.tag, a.restart_count,
                json.dumps(a.nodes), a.submitted_at, a.start, a.end, a.exit_code, a.signal,
                a.reason, a.cause, a.in_job_restarts, a.checkpoint_signal_at,
                a.failure_seen_at)  # fmt: skip

    @staticmethod
    def _attempt(row: sqlite3.Row) -> Attempt:
        return Attempt(
            run_id=row["run_id"], attempt=row["attempt"], state=row["state"],
            job_id=row["job_id"], tag=row["tag"], restart_count=row["restart_count"],
            nodes=json.loads(row["nodes"]), submitted_at=row["submitted_at"],
            start=row["start"], end=row["end_"], exit_code=row["exit_code"],
            signal=row["signal"], reason=row["reason"], cause=row["cause"],
            in_job_restarts=row["in_job_restarts"],
            checkpoint_signal_at=row["checkpoint_signal_at"],
            failure_seen_at=row["failure_seen_at"],
        )  # fmt: skip

    def add_attempt(self, a: Attempt) -> None:
        marks = ",".join("?" * len(_ATTEMPT_COLS))
        self._write(f"INSERT INTO attempts ({','.join(_ATTEMPT_COLS)}) VALUES ({marks})",
                    self._attempt_row(a))  # fmt: skip

    def update_attempt(self, a: Attempt) -> None:
        sets = ",".join(f"{c} = ?" for c in _ATTEMPT_COLS[2:])
        row = self._attempt_row(a)
        self._write(f"UPDATE attempts SET {sets} WHERE run_id = ? AND attempt = ?",
                    (*row[2:], row[0], row[1]))  # fmt: skip

    def attempts(self, run_id: str) -> list[Attempt]:
        rows = self._db.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt",
                                (run_id,))  # fmt: skip
        return [self._attempt(r) for r in rows]

    def latest_attempt(self, run_id: str) -> Attempt | None:
        row = self._db.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt DESC "
                               "LIMIT 1", (run_id,)).fetchone()  # fmt: skip
        return self._attempt(row) if row else None

    def find_attempt_by_job(self, job_id: str) -> Attempt | None:
        row = self._db.execute("SELECT * FROM attempts WHERE job_id = ? ORDER BY attempt DESC "
                               "LIMIT 1", (job_id,)).fetchone()  # fmt: skip
        return self._attempt(row) if row else None

    # ------------------------------------------------------------------ events
    def append_event(self, run_id: str | None, kind: str, data: dict[str, Any],
                     time: float) -> int:  # fmt: skip
        cur = self._write("INSERT INTO events (time, run_id, kind, data) VALUES (?, ?, ?, ?)",
                          (time, run_id, kind, json.dumps(data)))  # fmt: skip
        return int(cur.lastrowid or 0)

    def events(self, run_id: str | None = None, since_id: int = 0,
               limit: int | None = None) -> list[Event]:  # fmt: skip
        sql, params = "SELECT * FROM events WHERE event_id > ?", [since_id]
        if run_id is not None:
            sql += " AND run_id = ?"
            params.append(run_id)
        sql += " ORDER BY event_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [Event(r["event_id"], r["time"], r["run_id"], r["kind"], json.loads(r["data"]))
                for r in self._db.execute(sql, params)]  # fmt: skip

    # ------------------------------------------------------------------ node flags
    def flag_node(self, flag: NodeFlag) -> None:
        self._write("INSERT OR REPLACE INTO node_flags (node, reason, since, expires_at, run_id) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (flag.node, flag.reason, flag.since, flag.expires_at, flag.run_id))

    def unflag_node(self, node: str) -> bool:
        return self._write("DELETE FROM node_flags WHERE node = ?", (node,)).rowcount > 0

    def node_flags(self, now: float | None = None) -> list[NodeFlag]:
        sql, params = "SELECT * FROM node_flags", ()
        if now is not None:
            sql, params = sql + " WHERE expires_at IS NULL OR expires_at > ?", (now,)
        return [NodeFlag(r["node"], r["reason"], r["since"], r["expires_at"], r["run_id"])
                for r in self._db.execute(sql + " ORDER BY node", params)]  # fmt: skip


class DaemonLock:
    """One daemon per state directory: an exclusive flock on `daemon.lock`, holding the pid."""

    def __init__(self, home: Path | str) -> None:
        self.home = Path(home)
        self.path = self.home / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        private_dir(self.home)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = self.holder_pid(self.home)
            raise DaemonAlreadyRunning(f"a daemon is already running for {self.home}"
                                       + (f" (pid {pid})" if pid else "")) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def holder_pid(home: Path | str) -> int | None:
        """The pid of the process holding the lock, or None when nobody holds it."""
        path = Path(home) / "daemon.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)
