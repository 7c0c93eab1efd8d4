"""The state database's connection: journal mode, schema version, transactions, errors.

Several processes use the database at once (the daemon, `ftslurm submit/status/cancel`):
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

Every sqlite error becomes a one-line `StateError` (`StateDamaged` for a damaged file,
`DiskFull` when there is no room); a constraint violation stays `sqlite3.IntegrityError`
for the method that expects it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ftslurm.daemon.store import schema
from ftslurm.errors import PermanentError
from ftslurm.fsutil import STATE_FS_ENV, private_dir, shared_between_hosts, sqlite_journal_mode

DB_NAME = "state.db"
DB_SUFFIXES = ("", "-wal", "-shm", "-journal")  # the database file and SQLite's companions
BUSY_TIMEOUT_S = 10.0
RECOVER_HINT = "stop the daemon and run `ftslurm daemon recover` to restore the last backup"


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


class Connection:
    """The base of `Store` (db.py): one connection to the state database of `home`
    (`home/state.db`, created 0600), statements, transactions, the schema version and its
    migration. `Store` adds the reads and writes of the tables and opens it in order.

    An instance may be shared by threads (calls are serialized).
    """

    def __init__(self, home: Path | str, network: bool | None = None) -> None:
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
            self._db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
                        f"PRAGMA journal_mode = {self.journal.upper()}"
                    ).fetchone()[0]
                if str(mode).lower() == self.journal:
                    return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                raise StateError(
                    f"{self.path} could not be switched to {self.journal.upper()} journal mode "
                    "(another process keeps it open in the other mode)",
                    hint=f"stop the daemon, or set {STATE_FS_ENV} alike on every host",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    # ------------------------------------------------------------------ schema
    def schema_version(self) -> int:
        with self._lock, sqlite_errors(self.path):
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    # MIGRATIONS and SCHEMA_VERSION are read through their module, where a test can put a
    # newer or an older schema in their place.
    def _check_version(self) -> None:
        version = self.schema_version()
        if version > schema.SCHEMA_VERSION:
            raise StateError(
                f"{self.path} has schema version {version}, but this ftslurm "
                f"supports up to version {schema.SCHEMA_VERSION}",
                hint="upgrade ftslurm, or use another state directory",
            )

    def _migrate(self) -> None:
        if self.schema_version() == schema.SCHEMA_VERSION:
            return
        with self.transaction():
            self._check_version()  # another process may have migrated meanwhile
            version = self.schema_version()
            for target, statements in schema.MIGRATIONS:
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

    def changes(self) -> int:
        """How many rows this connection has written since it opened (grows with each)."""
        with self._lock:
            return int(self._db.total_changes)

    def stamp(self) -> tuple[int, int]:
        """What changes whenever anything is committed to the database: SQLite's
        `data_version` (moves on a commit by any other connection, of this process or
        another) and the rows this connection has written. Two equal stamps: nothing was
        written between them, so what was read at the first still stands."""
        with self._lock, sqlite_errors(self.path):
            version = int(self._db.execute("PRAGMA data_version").fetchone()[0])
            return version, int(self._db.total_changes)
