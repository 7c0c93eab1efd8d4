"""The daemon's durable state: one SQLite database (WAL) in the state directory.

Tables (schema version in `PRAGMA user_version`, upgraded by `MIGRATIONS` in order):
    runs       one row per run: name, state, times, retry counters and the last reason as
               columns (so they can be queried), spec/settings/cause_counts and the fault
               injections that fired as JSON text
    attempts   one row per (run_id, attempt): state, scheduler job id, tag, nodes (JSON),
               times, how it ended and its cause
    events     append-only log of what the daemon saw, decided and did; `event_id` only
               grows (AUTOINCREMENT: ids are never reused), `data` is JSON text
    node_flags one row per flagged node (kept out of later attempts), reason and expiry
    daemon_lease  one row: the daemon serving this directory (host, pid, a renewal counter)
    requests   what a command asked the daemon to do (add or remove node exclusions): kind,
               data (JSON), when asked, and when and how the daemon applied it

One writer of run state: the daemon performs every transition of runs, attempts and node
flags. Commands write only new runs (with their first submission intent), requests and
the cancel flag (`request_cancel`). Runs and attempts carry a `version`; `update_run` and
`update_attempt` are compare-and-set on the version the record was read at and raise
`StaleRecord` when the stored one moved on (a cancel request moves a run's version too):
the holder of the old copy reads again and decides again, it never overwrites.

Enums are stored as their `.value`, times as REAL (seconds since the epoch), booleans as
0/1. Several processes use the database at once (the daemon, `ftslurm submit/status/cancel`):
WAL lets readers run beside the one writer, every write is one `BEGIN IMMEDIATE`
transaction (so a writer takes the write lock up front instead of failing on upgrade), and a
busy timeout waits out the others. The folder is 0700 and the files 0600.

On a network filesystem (NFS, Lustre, GPFS, BeeGFS, ...: `fsutil.network_filesystem`, or
`FTSLURM_STATE_FS=network`) the database uses a rollback journal instead of WAL: WAL keeps
its index in shared memory (the `-shm` file mapped by every user), which processes on two
hosts cannot share, so a daemon on one host and a command on another would each see their
own index and could corrupt the file. A rollback journal needs only the filesystem's POSIX
locks, which NFSv3 (lockd), NFSv4, Lustre (mounted with `flock`), GPFS and BeeGFS provide
across hosts. The database stays in the shared state directory rather than moving to
node-local storage: the daemon may run on another host than the commands (a login node's
or a Slurm job's, `ftslurm daemon submit`), and all of them must see the same runs. Readers
then wait for a writer (the busy timeout covers it); writes are short.

One daemon per state directory: `DaemonLock`, an exclusive `flock` on
`daemon.<host>.lock` holding the pid, keeps one per host at once (and lets this host's
commands find and signal it); the `daemon_lease` row, renewed by the serving daemon and
taken over only when released or silent (`ftslurm.core.leases.daemon_lease_verdict`), keeps
one across the hosts that share the directory, whose flocks may not see each other.

Guarding against lost state (docs/daemon.md, "When the state is damaged"):
- every sqlite error becomes a one-line `StateError` (`StateDamaged` for a damaged file,
  `DiskFull` when there is no room); a constraint violation stays `sqlite3.IntegrityError`
  for the method that expects it;
- `state.db.mark` (JSON, written atomically by the daemon after a commit) holds the newest
  event id the daemon saw committed: a database whose newest event is older has lost
  committed changes (e.g. its `-wal` file was deleted) and is refused;
- `backup()` writes `state.db.bak` with SQLite's online backup API; `restore_backup()` puts
  it back, keeping the damaged files in `damaged-<time>/`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from ftslurm.core.cadence import DAY_S, FailureHistory
from ftslurm.core.leases import DaemonLease
from ftslurm.daemon.records import Attempt, AttemptState, Event, NodeFlag, Run, RunState
from ftslurm.daemon.records import tag as record_tag
from ftslurm.errors import FtslurmError, PermanentError
from ftslurm.fsutil import (
    STATE_FS_ENV,
    private_dir,
    read_json,
    replace_durably,
    shared_between_hosts,
    sqlite_journal_mode,
    temp_path,
    write_json_atomic,
)

DB_NAME = "state.db"
LOCK_NAME = "daemon.{host}.lock"  # one per host (`lock_name`)
BACKUP_NAME = "state.db.bak"
MARK_NAME = "state.db.mark"
DAMAGED_PREFIX = "damaged-"
DB_SUFFIXES = ("", "-wal", "-shm", "-journal")  # the database file and SQLite's companions
BUSY_TIMEOUT_S = 10.0
RECOVER_HINT = "stop the daemon and run `ftslurm daemon recover` to restore the last backup"
RUNS_DIR = "runs"  # $FTSLURM_HOME/runs/<run id>/: each run's folder (`RunDir`)
# In a run's folder: the run as `submit` recorded it (`mirror_run`), so that a run the
# database loses (a deleted WAL, an older backup put back) is noticed and rebuilt.
RUN_MIRROR = "run.json"
LOST_RUN = "lost with the state database and rebuilt from its folder"

MIGRATIONS: list[tuple[int, list[str]]] = [
    (1, [
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL,
            created_at REAL NOT NULL, ended_at REAL, spec TEXT NOT NULL, settings TEXT NOT NULL,
            job_retries_used INTEGER NOT NULL, cause_counts TEXT NOT NULL,
            continuations INTEGER NOT NULL, stalled_continuations INTEGER NOT NULL,
            last_checkpoint_step INTEGER, reason TEXT, cancel_requested INTEGER NOT NULL)""",
        "CREATE INDEX runs_state ON runs(state)",
        "CREATE INDEX runs_created ON runs(created_at)",
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
    (2, [
        "ALTER TABLE runs ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE attempts ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
        """CREATE TABLE requests (
            request_id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
            data TEXT NOT NULL, created_at REAL NOT NULL, applied_at REAL, result TEXT)""",
        "CREATE INDEX requests_pending ON requests(applied_at, request_id)",
    ]),
    (3, [
        # the lost nodes an attempt acted on (JSON list): survives a daemon restart
        "ALTER TABLE attempts ADD COLUMN lost_nodes TEXT NOT NULL DEFAULT '[]'",
    ]),
    (4, [
        # the daemon that serves this directory, whatever host it runs on (core.leases)
        """CREATE TABLE daemon_lease (
            id INTEGER PRIMARY KEY CHECK (id = 1), owner TEXT NOT NULL, host TEXT NOT NULL,
            pid INTEGER NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, ended TEXT,
            job_id TEXT)""",
    ]),
    (5, [
        # the fault injections that fired in the run (JSON list): each fires once per run
        "ALTER TABLE runs ADD COLUMN injected TEXT NOT NULL DEFAULT '[]'",
    ]),
]  # fmt: skip
SCHEMA_VERSION: int = MIGRATIONS[-1][0]

_RUN_COLS = ("run_id", "name", "state", "created_at", "ended_at", "spec", "settings",
             "job_retries_used", "cause_counts", "continuations", "stalled_continuations",
             "last_checkpoint_step", "reason", "cancel_requested", "injected")  # fmt: skip
_ATTEMPT_COLS = ("run_id", "attempt", "state", "job_id", "tag", "restart_count", "nodes",
                 "submitted_at", "start", "end_", "exit_code", "signal", "reason", "cause",
                 "in_job_restarts", "checkpoint_signal_at", "failure_seen_at",
                 "lost_nodes")  # fmt: skip
_TERMINAL = tuple(s.value for s in RunState if s.is_terminal)


def _chunks(items: list[str], size: int = 500) -> Iterator[list[str]]:
    """`items` in slices small enough for one statement's parameters."""
    for i in range(0, len(items), size):
        yield items[i:i + size]


class StateError(PermanentError):
    """The state database cannot be used as asked (newer schema, missing or duplicate record,
    or sqlite failed)."""


class StaleRecord(StateError):
    """A compare-and-set write found the record changed since the copy was read (another
    writer moved its version on): read it again and decide again, never overwrite."""


class StateDamaged(StateError):
    """The state database is damaged or has lost committed changes: recover from the backup."""


class DiskFull(StateError):
    """No room to write the state database; nothing already committed is lost."""


def state_error(exc: sqlite3.Error, path: Path) -> StateError:
    """sqlite's error as one line that says what happened to which file."""
    code = getattr(exc, "sqlite_errorcode", None)
    base = code & 0xFF if isinstance(code, int) else None
    if base in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return StateDamaged(f"the state database {path} is damaged ({exc})", hint=RECOVER_HINT)
    if base == sqlite3.SQLITE_FULL or (base == sqlite3.SQLITE_IOERR and _no_room(path)):
        return DiskFull(f"disk full: {path} ({exc})")
    return StateError(f"the state database {path} failed: {exc}")


def _no_room(path: Path) -> bool:
    """Whether the filesystem of `path` has no block left for us (an ENOSPC that SQLite
    reported as a plain I/O error, e.g. from fsync)."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail == 0


def os_state_error(exc: OSError, path: Path) -> StateError:
    if exc.errno == errno.ENOSPC:
        return DiskFull(f"disk full: {path}")
    return StateError(f"the state database {path} cannot be used: {exc.strerror or exc}")


@contextmanager
def sqlite_errors(path: Path) -> Iterator[None]:
    """Turn sqlite's errors (but a constraint violation, which callers expect) into
    `StateError`s of one line."""
    try:
        yield
    except sqlite3.IntegrityError:
        raise
    except sqlite3.Error as exc:
        raise state_error(exc, path) from None


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
    data = {"run_id": run.run_id, "name": run.name, "created_at": run.created_at,
            "spec": run.spec, "settings": run.settings}  # fmt: skip
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
        if (isinstance(data, dict) and data.get("run_id") == name
                and isinstance(data.get("spec"), dict)
                and isinstance(data.get("settings"), dict)):  # fmt: skip
            found[name] = data
    return found


class DaemonAlreadyRunning(FtslurmError):
    """Another daemon holds this state directory."""


def this_host() -> str:
    """This host's name, as the daemon lock and lease record it: in a Slurm job, the
    node's name (`SLURMD_NODENAME`), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class Store:
    """The state database of one state directory (`home/state.db`).

    One connection per instance; an instance may be shared by threads (calls are serialized),
    and any number of processes may open the same directory at once.
    """

    def __init__(self, home: Path | str, network: bool | None = None,
                 check_runs: bool = True) -> None:  # fmt: skip
        self.home = private_dir(home)
        self.path = self.home / DB_NAME
        # WAL on a local filesystem, a rollback journal on a shared one (module doc)
        self.network = shared_between_hosts(self.home) if network is None else network
        self.journal = sqlite_journal_mode(self.network)
        try:
            if not self.path.exists():
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as exc:
            raise os_state_error(exc, self.path) from None
        self._lock = threading.RLock()
        self._depth = 0
        with sqlite_errors(self.path):
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)  # fmt: skip
        try:
            with sqlite_errors(self.path):
                self._db.row_factory = sqlite3.Row
                self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
                self._check_version()  # before anything that could change the file
                self._check_mark()  # likewise: a database that lost changes is not touched
                self._set_journal()
                self._db.execute("PRAGMA synchronous = FULL")
                self._db.execute("PRAGMA foreign_keys = ON")
                self._migrate()
                if check_runs:
                    self._check_runs()  # a run `submit` recorded that the database lost
        except BaseException:
            self._db.close()
            raise
        for suffix in DB_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.path.with_name(self.path.name + suffix), 0o600)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()

    def _check_mark(self) -> None:
        mark = read_mark(self.home)
        newest = self.newest_event_id() if mark else 0
        if newest < mark:
            raise StateDamaged(
                f"the state database {self.path} has lost committed changes: its newest event "
                f"is {newest}, but events up to {mark} were committed (was {DB_NAME}-wal "
                "deleted or an older copy put back?)", hint=RECOVER_HINT)  # fmt: skip

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
                hint="stop the daemon and run `ftslurm daemon recover`: it rebuilds them")

    def _set_journal(self) -> None:
        """Switch to this filesystem's journal mode (WAL persists in the file; a switch
        needs every other connection closed). SQLite does not apply the busy timeout to
        this switch, so processes that create the database at the same moment wait here."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.005
        while True:
            try:
                mode = self._db.execute("PRAGMA journal_mode").fetchone()[0]
                if str(mode).lower() != self.journal:
                    mode = self._db.execute(
                        f"PRAGMA journal_mode = {self.journal.upper()}").fetchone()[0]
                if str(mode).lower() == self.journal:
                    return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                raise StateError(
                    f"{self.path} could not be switched to {self.journal.upper()} journal mode "
                    "(another process keeps it open in the other mode)",
                    hint=f"stop the daemon, or set {STATE_FS_ENV} alike on every host")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    # ------------------------------------------------------------------ schema
    def schema_version(self) -> int:
        with self._lock, sqlite_errors(self.path):
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _check_version(self) -> None:
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise StateError(f"{self.path} has schema version {version}, but this ftslurm "
                             f"supports up to version {SCHEMA_VERSION}",
                             hint="upgrade ftslurm, or use another state directory")  # fmt: skip

    # ------------------------------------------------------------ daemon lease
    def daemon_lease(self) -> DaemonLease | None:
        """The daemon lease row, or None when no daemon ever took one."""
        with self._lock, sqlite_errors(self.path):
            row = self._db.execute("SELECT owner, host, pid, seq, time, ended, job_id FROM "
                                   "daemon_lease WHERE id = 1").fetchone()  # fmt: skip
        return None if row is None else DaemonLease(*row)

    def swap_daemon_lease(self, new: DaemonLease, expect: DaemonLease | None) -> bool:
        """Write `new` if the row is still `expect` (its owner and counter; None: no row),
        in one transaction: two daemons that read the same lease cannot both take it."""
        with self.transaction():
            current = self.daemon_lease()
            if (current and (current.owner, current.seq)) != (expect and (expect.owner,
                                                                          expect.seq)):
                return False
            self._db.execute(
                "INSERT OR REPLACE INTO daemon_lease (id, owner, host, pid, seq, time, ended, "
                "job_id) VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
                (new.owner, new.host, new.pid, new.seq, new.time, new.ended,
                 new.job_id))  # fmt: skip
        return True

    def newest_event_id(self) -> int:
        """The id of the newest committed event (0 in a database without events)."""
        with self._lock, sqlite_errors(self.path):
            if int(self._db.execute("PRAGMA user_version").fetchone()[0]) < 1:
                return 0  # no tables yet
            row = self._db.execute("SELECT max(event_id) FROM events").fetchone()
            return int(row[0] or 0)

    def changes(self) -> int:
        """How many rows this connection has written since it opened (grows with each)."""
        with self._lock:
            return int(self._db.total_changes)

    def check_integrity(self) -> None:
        """`PRAGMA quick_check` (reads every page: for a daemon's start, not the hot path);
        `StateDamaged` with one line when it finds damage."""
        with self._lock, sqlite_errors(self.path):
            rows = [str(r[0]) for r in self._db.execute("PRAGMA quick_check(5)").fetchall()]
        if rows != ["ok"]:
            raise StateDamaged(f"the state database {self.path} is damaged ({rows[0]})",
                               hint=RECOVER_HINT)  # fmt: skip

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

    def _migrate(self) -> None:
        if self.schema_version() == SCHEMA_VERSION:
            return
        with self.transaction():
            self._check_version()  # another process may have migrated meanwhile
            version = self.schema_version()
            for target, statements in MIGRATIONS:
                if target > version:
                    for sql in statements:
                        self._db.execute(sql)
                    self._db.execute(f"PRAGMA user_version = {int(target)}")

    # ------------------------------------------------------------------ transactions
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic unit (`BEGIN IMMEDIATE` ... `COMMIT`, `ROLLBACK` on any exception).

        A nested call joins the outer transaction as a savepoint: an exception that leaves
        it undoes its own writes; the outer transaction decides whether anything commits.
        """
        with self._lock, sqlite_errors(self.path):
            if self._depth:
                name = f"ftslurm_sp{self._depth}"
                self._db.execute(f"SAVEPOINT {name}")
                self._depth += 1
                try:
                    yield
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute(f"ROLLBACK TO {name}")
                        self._db.execute(f"RELEASE {name}")
                    raise
                else:
                    self._db.execute(f"RELEASE {name}")
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0

    def _write(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Cursor:
        """One statement, atomically: its own transaction unless inside `transaction()`."""
        with self._lock, sqlite_errors(self.path):
            if self._depth:
                return self._db.execute(sql, params)
            with self.transaction():
                return self._db.execute(sql, params)

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock, sqlite_errors(self.path):
            return self._db.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ runs
    @staticmethod
    def _run_row(run: Run) -> tuple[Any, ...]:
        return (run.run_id, run.name, RunState(run.state).value, run.created_at, run.ended_at,
                json.dumps(run.spec), json.dumps(run.settings), run.job_retries_used,
                json.dumps(run.cause_counts), run.continuations, run.stalled_continuations,
                run.last_checkpoint_step, run.reason, int(run.cancel_requested),
                json.dumps(run.injected))  # fmt: skip

    @staticmethod
    def _run(row: sqlite3.Row, shared: dict[str, Any] | None = None) -> Run:
        text = row["settings"]
        if shared is None:
            settings = json.loads(text)
        elif (settings := shared.get(text)) is None:
            settings = shared[text] = json.loads(text)
        return Run(
            run_id=row["run_id"], name=row["name"], state=RunState(row["state"]),
            created_at=row["created_at"], spec=json.loads(row["spec"]),
            settings=settings, job_retries_used=row["job_retries_used"],
            cause_counts=json.loads(row["cause_counts"]), continuations=row["continuations"],
            stalled_continuations=row["stalled_continuations"],
            last_checkpoint_step=row["last_checkpoint_step"], reason=row["reason"],
            cancel_requested=bool(row["cancel_requested"]), ended_at=row["ended_at"],
            injected=json.loads(row["injected"]), version=row["version"],
        )  # fmt: skip

    def add_run(self, run: Run) -> None:
        """Insert a new run (stored at version 0, which `run` then carries); `StateError` if
        `run.run_id` exists."""
        marks = ",".join("?" * len(_RUN_COLS))
        try:
            self._write(f"INSERT INTO runs ({','.join(_RUN_COLS)}) VALUES ({marks})",
                        self._run_row(run))  # fmt: skip
        except sqlite3.IntegrityError:
            raise StateError(f"run {run.run_id!r} already exists in {self.path}") from None
        run.version = 0

    def _stale(self, table: str, where: str, key: tuple[Any, ...], what: str,
               read_at: int) -> StateError:  # fmt: skip
        """Why a compare-and-set update changed no row: the record is gone, or it moved on."""
        rows = self._read(f"SELECT version FROM {table} WHERE {where}", key)
        if not rows:
            return StateError(f"no {what} in {self.path}")
        return StaleRecord(f"{what} changed since it was read (version {read_at}, now "
                           f"{rows[0][0]}): read it again")  # fmt: skip

    def update_run(self, run: Run) -> None:
        """Replace the stored record of `run.run_id` except its cancel request (only
        `request_cancel` sets that), if it is still at `run.version` (compare-and-set);
        then the version moves on by one, in the store and in `run`. `StaleRecord` when
        another writer changed it since `run` was read, `StateError` if there is none.

        Inside a transaction that rolls back, `run` keeps the new version all the same: a
        later write from it then fails as stale (read again), it never overwrites."""
        cols = [i for i, c in enumerate(_RUN_COLS) if c not in ("run_id", "cancel_requested")]
        sets = ",".join(f"{_RUN_COLS[i]} = ?" for i in cols)
        row = self._run_row(run)
        cur = self._write(f"UPDATE runs SET {sets}, version = version + 1 "
                          "WHERE run_id = ? AND version = ?",
                          (*(row[i] for i in cols), row[0], run.version))  # fmt: skip
        if cur.rowcount == 0:
            raise self._stale("runs", "run_id = ?", (run.run_id,), f"run {run.run_id!r}",
                              run.version)  # fmt: skip
        run.version += 1

    def request_cancel(self, run_id: str, now: float) -> tuple[bool, Attempt | None]:
        """Ask for a run's cancellation: set that one column (and log the event) unless the
        run has ended, and read its latest attempt in the same transaction. Returns whether
        the request was recorded, and that attempt. The first request moves the run's
        version on, so a copy read before it can no longer be written back."""
        with self.transaction():
            cur = self._write("UPDATE runs SET version = version + (cancel_requested = 0), "
                              "cancel_requested = 1 WHERE run_id = ? AND "
                              f"state NOT IN ({','.join('?' * len(_TERMINAL))})",
                              (run_id, *_TERMINAL))  # fmt: skip
            if cur.rowcount:
                self.append_event(run_id, "cancel_requested", {}, now)
            return cur.rowcount > 0, self.latest_attempt(run_id)

    def get_run(self, run_id: str) -> Run | None:
        rows = self._read("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return self._run(rows[0]) if rows else None

    def find_runs(self, prefix: str) -> list[Run]:
        """The runs whose id is `prefix` or starts with it (an exact id wins)."""
        run = self.get_run(prefix)
        if run is not None:
            return [run]
        rows = self._read("SELECT * FROM runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id",
                          (len(prefix), prefix))
        return [self._run(r) for r in rows]

    def newest_run(self) -> int:
        """A number that grows with every run added (the newest row's id; 0: none)."""
        return int(self._read("SELECT coalesce(max(rowid), 0) FROM runs")[0][0])

    def stamp(self) -> tuple[int, int]:
        """What changes whenever anything is committed to the database: SQLite's
        `data_version` (moves on a commit by any other connection, of this process or
        another) and the rows this connection has written. Two equal stamps: nothing was
        written between them, so what was read at the first still stands."""
        with self._lock, sqlite_errors(self.path):
            version = int(self._db.execute("PRAGMA data_version").fetchone()[0])
            return version, int(self._db.total_changes)

    def active_heads(self) -> list[tuple[str, int, int | None, int | None]]:
        """For every run not in a terminal state, oldest first: (run id, its version, the
        number and version of its latest attempt, or None, None). One query that decodes
        nothing: a reader that keeps the records it read can tell which ones changed."""
        with self._lock, sqlite_errors(self.path):
            cur = self._db.execute(
                "SELECT r.run_id, r.version, a.attempt, a.version FROM runs r "
                "LEFT JOIN attempts a ON a.run_id = r.run_id AND a.attempt = "
                "(SELECT max(attempt) FROM attempts WHERE run_id = r.run_id) "
                f"WHERE r.state NOT IN ({','.join('?' * len(_TERMINAL))}) "
                "ORDER BY r.created_at, r.run_id", _TERMINAL)  # fmt: skip
            cur.row_factory = None  # plain tuples: this is read often and in bulk
            return cur.fetchall()

    def runs_by_id(self, run_ids: Iterable[str],
                   shared: dict[str, Any] | None = None) -> dict[str, Run]:  # fmt: skip
        """The runs of these ids (those that exist), read in a few queries. `shared`: JSON
        text of settings -> its decoded dict, filled as it goes: runs whose settings are
        the same text get the same dict (the caller changes none in place)."""
        out: dict[str, Run] = {}
        for chunk in _chunks(list(run_ids)):
            rows = self._read(f"SELECT * FROM runs WHERE run_id IN ({','.join('?' * len(chunk))})",
                              tuple(chunk))  # fmt: skip
            out.update((r["run_id"], self._run(r, shared)) for r in rows)
        return out

    def latest_attempts(self, run_ids: Iterable[str]) -> dict[str, Attempt]:
        """The latest attempt of each of these runs (those that have one), in a few queries."""
        out: dict[str, Attempt] = {}
        for chunk in _chunks(list(run_ids)):
            rows = self._read(
                "SELECT a.* FROM attempts a WHERE a.run_id IN "
                f"({','.join('?' * len(chunk))}) AND a.attempt = "
                "(SELECT max(attempt) FROM attempts WHERE run_id = a.run_id)",
                tuple(chunk))  # fmt: skip
            out.update((r["run_id"], self._attempt(r)) for r in rows)
        return out

    def list_runs(self, active_only: bool = False) -> list[Run]:
        """All runs (or those not yet in a terminal state), oldest first."""
        sql, params = "SELECT * FROM runs", ()
        if active_only:
            sql += f" WHERE state NOT IN ({','.join('?' * len(_TERMINAL))})"
            params = _TERMINAL
        return [self._run(r) for r in self._read(sql + " ORDER BY created_at, run_id", params)]

    # ------------------------------------------------------------------ attempts
    @staticmethod
    def _attempt_row(a: Attempt) -> tuple[Any, ...]:
        return (a.run_id, a.attempt, a.state, a.job_id, a.tag, a.restart_count,
                json.dumps(a.nodes), a.submitted_at, a.start, a.end, a.exit_code, a.signal,
                a.reason, a.cause, a.in_job_restarts, a.checkpoint_signal_at,
                a.failure_seen_at, json.dumps(a.lost_nodes))  # fmt: skip

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
            failure_seen_at=row["failure_seen_at"], lost_nodes=json.loads(row["lost_nodes"]),
            version=row["version"],
        )  # fmt: skip

    def add_attempt(self, a: Attempt) -> None:
        """Insert a new attempt of an existing run (stored at version 0, which `a` then
        carries); `StateError` if it exists already."""
        marks = ",".join("?" * len(_ATTEMPT_COLS))
        try:
            self._write(f"INSERT INTO attempts ({','.join(_ATTEMPT_COLS)}) VALUES ({marks})",
                        self._attempt_row(a))  # fmt: skip
        except sqlite3.IntegrityError as exc:
            if "FOREIGN KEY" in str(exc):
                raise StateError(f"attempt {a.attempt} names unknown run {a.run_id!r}") from None
            raise StateError(f"attempt {a.attempt} of run {a.run_id!r} already exists") from None
        a.version = 0

    def update_attempt(self, a: Attempt) -> None:
        """Replace the whole stored record of (`a.run_id`, `a.attempt`) if it is still at
        `a.version` (compare-and-set, as `update_run`); `StaleRecord` when it moved on."""
        sets = ",".join(f"{c} = ?" for c in _ATTEMPT_COLS[2:])
        row = self._attempt_row(a)
        cur = self._write(f"UPDATE attempts SET {sets}, version = version + 1 "
                          "WHERE run_id = ? AND attempt = ? AND version = ?",
                          (*row[2:], row[0], row[1], a.version))  # fmt: skip
        if cur.rowcount == 0:
            raise self._stale("attempts", "run_id = ? AND attempt = ?", (a.run_id, a.attempt),
                              f"attempt {a.attempt} of run {a.run_id!r}", a.version)
        a.version += 1

    def attempts(self, run_id: str) -> list[Attempt]:
        rows = self._read("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt", (run_id,))
        return [self._attempt(r) for r in rows]

    def attempt_before(self, run_id: str, attempt: int) -> Attempt | None:
        """The run's attempt just before attempt `attempt` (one row: a run continued many
        times has many attempts, each with its node list)."""
        rows = self._read("SELECT * FROM attempts WHERE run_id = ? AND attempt < ? "
                          "ORDER BY attempt DESC LIMIT 1", (run_id, attempt))  # fmt: skip
        return self._attempt(rows[0]) if rows else None

    def latest_attempt(self, run_id: str) -> Attempt | None:
        rows = self._read("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt DESC "
                          "LIMIT 1", (run_id,))  # fmt: skip
        return self._attempt(rows[0]) if rows else None

    def find_attempt_by_job(self, job_id: str) -> Attempt | None:
        """The latest attempt that ran as `job_id` (a requeued job keeps its id)."""
        rows = self._read("SELECT a.* FROM attempts a JOIN runs r USING (run_id) "
                          "WHERE a.job_id = ? ORDER BY r.created_at DESC, a.attempt DESC "
                          "LIMIT 1", (job_id,))  # fmt: skip
        return self._attempt(rows[0]) if rows else None

    # ------------------------------------------------------------------ events
    def append_event(self, run_id: str | None, kind: str, data: dict[str, Any],
                     time: float) -> int:  # fmt: skip
        """Append one event; returns its id (larger than every id before it)."""
        cur = self._write("INSERT INTO events (time, run_id, kind, data) VALUES (?, ?, ?, ?)",
                          (time, run_id, kind, json.dumps(data)))  # fmt: skip
        return int(cur.lastrowid or 0)

    def events(self, run_id: str | None = None, since_id: int = 0,
               limit: int | None = None) -> list[Event]:  # fmt: skip
        """Events with id > `since_id` (of one run, or of all when `run_id` is None),
        in ascending id order, at most `limit` of them."""
        sql, params = "SELECT * FROM events WHERE event_id > ?", [since_id]
        if run_id is not None:
            sql += " AND run_id = ?"
            params.append(run_id)
        sql += " ORDER BY event_id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(max(0, int(limit)))
        return [self._event(r) for r in self._read(sql, tuple(params))]

    @staticmethod
    def _event(row: sqlite3.Row) -> Event:
        return Event(row["event_id"], row["time"], row["run_id"], row["kind"],
                     json.loads(row["data"]))  # fmt: skip

    def failure_history(self, now: float, cluster_of: Callable[[dict[str, Any]], str]
                        ) -> dict[str, FailureHistory]:  # fmt: skip
        """Per cluster (`cluster_of` a run's spec), the node failures this store saw
        (`node_lost` events, from peers, the daemon or Slurm) and the node-days its attempts
        ran (nodes times run time, up to `now` for one still running): the cluster's node
        failure rate as seen here. A mock's injected failures stay with that mock."""
        clusters = {r["run_id"]: cluster_of(json.loads(r["spec"]))
                    for r in self._read("SELECT run_id, spec FROM runs")}  # fmt: skip
        lost = self._read("SELECT run_id, COUNT(*) AS n FROM events WHERE kind = 'node_lost' "
                          "GROUP BY run_id")  # fmt: skip
        ran = self._read(
            "SELECT run_id, SUM(json_array_length(nodes) * MAX(0, COALESCE(end_, ?) - start))"
            " AS s FROM attempts WHERE start IS NOT NULL GROUP BY run_id", (now,))  # fmt: skip
        failures: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for r in lost:
            c = clusters.get(r["run_id"], "")
            failures[c] = failures.get(c, 0) + int(r["n"])
        for r in ran:
            c = clusters.get(r["run_id"], "")
            seconds[c] = seconds.get(c, 0.0) + float(r["s"] or 0.0)
        return {c: FailureHistory(failures.get(c, 0), seconds.get(c, 0.0) / DAY_S)
                for c in set(failures) | set(seconds)}  # fmt: skip

    def latest_event(self, run_id: str, kind: str) -> Event | None:
        """The run's newest event of `kind`, or None."""
        rows = self._read("SELECT * FROM events WHERE run_id = ? AND kind = ? "
                          "ORDER BY event_id DESC LIMIT 1", (run_id, kind))  # fmt: skip
        return self._event(rows[0]) if rows else None

    # ------------------------------------------------------------------ requests
    def add_request(self, kind: str, data: dict[str, Any], now: float) -> int:
        """Record what a command asks the daemon to do; returns the request's id."""
        cur = self._write("INSERT INTO requests (kind, data, created_at) VALUES (?, ?, ?)",
                          (kind, json.dumps(data), now))  # fmt: skip
        return int(cur.lastrowid or 0)

    @staticmethod
    def _request(row: sqlite3.Row) -> Request:
        result = row["result"]
        return Request(row["request_id"], row["kind"], json.loads(row["data"]),
                       row["created_at"], row["applied_at"],
                       None if result is None else json.loads(result))  # fmt: skip

    def pending_requests(self) -> list[Request]:
        """Requests not applied yet, oldest first."""
        rows = self._read("SELECT * FROM requests WHERE applied_at IS NULL ORDER BY request_id")
        return [self._request(r) for r in rows]

    def get_request(self, request_id: int) -> Request | None:
        rows = self._read("SELECT * FROM requests WHERE request_id = ?", (request_id,))
        return self._request(rows[0]) if rows else None

    def finish_request(self, request_id: int, result: dict[str, Any], now: float) -> bool:
        """Record that the daemon applied a request, and how; whether it was still pending
        (a request is applied once)."""
        cur = self._write("UPDATE requests SET applied_at = ?, result = ? "
                          "WHERE request_id = ? AND applied_at IS NULL",
                          (now, json.dumps(result), request_id))  # fmt: skip
        return cur.rowcount > 0

    # ------------------------------------------------------------------ node flags
    def flag_node(self, flag: NodeFlag) -> None:
        """Flag a node (replacing any flag it had)."""
        self._write(
            "INSERT OR REPLACE INTO node_flags (node, reason, since, expires_at, run_id) "
            "VALUES (?, ?, ?, ?, ?)",
            (flag.node, flag.reason, flag.since, flag.expires_at, flag.run_id),
        )

    def unflag_node(self, node: str) -> bool:
        """Remove a node's flag; whether it had one."""
        return self._write("DELETE FROM node_flags WHERE node = ?", (node,)).rowcount > 0

    def node_flags(self, now: float | None = None) -> list[NodeFlag]:
        """All flags by node name; with `now`, only those not expired at `now`."""
        sql, params = "SELECT * FROM node_flags", ()
        if now is not None:
            sql, params = sql + " WHERE expires_at IS NULL OR expires_at > ?", (now,)
        return [NodeFlag(r["node"], r["reason"], r["since"], r["expires_at"], r["run_id"])
                for r in self._read(sql + " ORDER BY node", params)]  # fmt: skip


@dataclass(frozen=True)
class Request:
    """What a command asked the daemon to do (`requests` table)."""

    request_id: int
    kind: str
    data: dict[str, Any]
    created_at: float
    applied_at: float | None = None  # None: not applied yet
    result: dict[str, Any] | None = None  # what applying it did, for the command that asked


@dataclass(frozen=True)
class Restored:
    """What `restore_backup` put back."""

    runs: int
    active_runs: int
    taken_at: float | None  # when the backup was written (None: none was put back)
    kept_in: Path | None  # where the replaced files went (None: there were none)
    rebuilt: list[str] = field(default_factory=list)  # a line per run rebuilt from its folder


def restore_backup(home: Path | str, now: float | None = None,
                   active: dict[str, tuple[int, str]] | None = None) -> Restored:
    """Put `home/state.db.bak` back as the state database, after checking it; the files it
    replaces (database, WAL, shared memory, mark) move to `home/damaged-<time>/`. Runs the
    backup lacks but whose folders hold their mirror (`mirror_run`) are rebuilt
    (`rebuild_runs`); `active` says which runs still have a job at the scheduler (run id ->
    (attempt, job id); none without it). The caller makes sure no daemon runs (it holds
    the `DaemonLock`)."""
    home = private_dir(home)
    backup = home / BACKUP_NAME
    if not backup.is_file():
        raise StateError(f"no backup to restore: {backup} does not exist",
                         hint="the daemon writes one when it starts")  # fmt: skip
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
                    marks = ",".join("?" * len(_TERMINAL))
                    runs, active_runs = db.execute(
                        f"SELECT count(*), count(*) FILTER (WHERE state NOT IN ({marks})) "
                        "FROM runs", _TERMINAL).fetchone()  # fmt: skip
                    newest = int(db.execute("SELECT max(event_id) FROM events").fetchone()[0]
                                 or 0)  # fmt: skip
            finally:
                db.close()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None
                                                               else now))  # fmt: skip
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
    return Restored(runs=int(runs), active_runs=int(active_runs), taken_at=taken_at,
                    kept_in=kept, rebuilt=rebuilt)  # fmt: skip


def recover_state(home: Path | str, now: float | None = None,
                  active: dict[str, tuple[int, str]] | None = None) -> Restored:
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
                return Restored(runs=len(runs), taken_at=None, kept_in=None, rebuilt=rebuilt,
                                active_runs=sum(not r.state.is_terminal for r in runs))
    except StateError:
        pass  # not sound: the backup, below
    return restore_backup(home, now, active)


def rebuild_runs(store: Store, mirrors: dict[str, dict[str, Any]],
                 active: dict[str, tuple[int, str]], now: float) -> list[str]:
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
        ended = m.get("state") in _TERMINAL
        run = Run(run_id=run_id, name=str(m.get("name") or run_id), state=RunState.PENDING,
                  created_at=float(m.get("created_at") or now), spec=m["spec"],
                  settings=m["settings"])  # fmt: skip
        attempt = Attempt(run_id, int(m.get("attempt") or 0), AttemptState.SUBMITTING,
                          tag=record_tag(run_id, int(m.get("attempt") or 0)))  # fmt: skip
        if found:  # adopted by its tag instead of submitted again
            attempt = replace(attempt, attempt=found[0], tag=record_tag(run_id, found[0]))
            line = (f"run {run_id}: rebuilt from its folder; its job {found[1]} (attempt "
                    f"{found[0]}) is still at the scheduler, and the daemon adopts it")
        elif ended:
            run = replace(run, state=RunState(m["state"]), reason=m.get("reason"),
                          ended_at=float(m.get("ended_at") or now))  # fmt: skip
            attempt = replace(attempt, state=AttemptState.UNKNOWN, job_id=m.get("job_id"))
            line = f"run {run_id}: rebuilt from its folder as {m['state']} (it had ended)"
        elif m.get("job_id") is None:  # never submitted: the daemon submits it now
            line = f"run {run_id}: rebuilt from its folder; it had not been submitted yet"
        else:
            run = replace(run, state=RunState.FAILED, ended_at=now, reason=(
                f"{LOST_RUN}: its job {m['job_id']} is no longer at the scheduler and how it "
                "ended is not known; its checkpoints are kept: submit it again to continue"))
            attempt = replace(attempt, state=AttemptState.UNKNOWN, job_id=m.get("job_id"),
                              reason=run.reason)  # fmt: skip
            line = f"run {run_id}: rebuilt from its folder as FAILED ({run.reason})"
        with store.transaction():
            store.add_run(run)
            store.add_attempt(attempt)
            store.append_event(run_id, "rebuilt", {"job_id": found[1] if found else None}, now)
        lines.append(line)
    return lines


def lock_name(host: str) -> str:
    """The file of a host's daemon lock (a host name is letters, digits, '.', '-'; anything
    else is replaced, so no name can leave the folder)."""
    return LOCK_NAME.format(host=re.sub(r"[^A-Za-z0-9.-]", "_", host) or "_")


class DaemonLock:
    """One daemon per state directory on this host: an exclusive flock on
    home/"daemon.<host>.lock" holding the pid (the lease in the database covers the other
    hosts, module doc).

    The lock belongs to the open file, so it ends with the process however that ends.
    """

    def __init__(self, home: Path | str, host: str | None = None) -> None:
        self.home = Path(home)
        self.path = self.home / lock_name(host or this_host())
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; `DaemonAlreadyRunning` if another holder has it."""
        if self._fd is not None:
            return
        private_dir(self.home)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = self.holder_pid(self.home)
            held = f" (pid {pid})" if pid is not None and pid > 0 else ""
            raise DaemonAlreadyRunning(f"a daemon is already running for {self.home}{held}",
                                       hint="stop it first") from None  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> DaemonLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.release()

    @staticmethod
    def holder_pid(home: Path | str, host: str | None = None) -> int | None:
        """The pid of the live holder of this host's lock, or None when nobody holds it.

        Probes with a non-blocking shared flock on a separate descriptor. A holder that has
        just taken the lock may not have written its pid yet: then -1 (ask again).
        """
        try:
            fd = os.open(Path(home) / lock_name(host or this_host()), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() and int(text) > 0 else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)
