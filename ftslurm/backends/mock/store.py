"""Where a mock cluster's state lives: one SQLite file, shared by every process that uses it.

Each operation is one `BEGIN IMMEDIATE` transaction: read the state, change it, write it
back. SQLite's lock makes concurrent processes (a CLI, the daemon, the mock controller)
take turns; a crash mid-operation leaves the previous state intact.

What keeps an operation cheap on a cluster with many jobs:

- The state is written back only when the operation changed it (`model.changes()`): a
  query, a node listing or a tick in which nothing happened writes nothing.
- Every write gives the state a new `generation` (a random number, so that a cluster
  destroyed and created again cannot repeat one). A store keeps the state it parsed last
  with its generation and parses the stored JSON again only when another process (or
  another store) wrote since.
- Batch scripts and submission environments are kept apart, one row per job in the
  `launch` table, written in the transaction that submitted the job and read only when the
  job is launched; the state itself holds neither.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import sqlite3
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockJob, MockState
from ftslurm.errors import ConfigError
from ftslurm.fsutil import (
    replace_durably,
    shared_between_hosts,
    sqlite_journal_mode,
    temp_path,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: scripts and environments in `launch`, `generation` on the state
DB_FILE = "mock.sqlite"  # the mock cluster's state, in its folder
_APART = {"script", "env"}  # the job fields kept in `launch`, not in the state's JSON
_EXCLUDE = {"jobs": {"__all__": _APART}, "accounting": {"__all__": _APART}}


def _new_generation() -> int:
    return secrets.randbits(62)


FIRST_JOB_IDS = (100, 60000)  # a new cluster's first job id: 1000 x a number in this range
ID_BLOCK = 1000  # the job ids a new cluster has to itself before another's block
ID_COUNTER = "ftslurm-mock-job-ids"  # the machine's counter folder, in the system temp dir
_COUNTER_FILE, _LOCK_FILE = "next.json", "lock"
_LOCK_WAIT_S = 5.0  # a counter locked longer (a stuck process, a hostile user): random


def id_counter_dir() -> Path:
    """The folder of the machine-wide counter that numbers the mock clusters' blocks."""
    return Path(tempfile.gettempdir()) / ID_COUNTER


def _random_block() -> int:
    low, high = FIRST_JOB_IDS
    return low + secrets.randbelow(high - low + 1)


def _counter_folder(folder: Path) -> Path:
    """The counter's folder, made writable by every user of the machine (not sticky, so
    that each can replace the counter another wrote); OSError when it cannot be used."""
    try:
        folder.mkdir(mode=0o777)
        os.chmod(folder, 0o777)  # mkdir's mode went through the umask
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{folder} is not a folder this user can write in")
    return folder


def _readable_by_all(fd: int) -> None:
    """Every user reads the counter and locks its lock file, whatever this one's umask."""
    if os.fstat(fd).st_uid == os.getuid():
        os.fchmod(fd, 0o644)


def _claim_block(folder: Path) -> int:
    """The next block of job ids, taken from the counter under its lock; the counter moves
    on by one, written atomically. A missing or damaged counter starts at a random block."""
    folder = _counter_folder(folder)
    # no link followed: anyone may put one in the folder
    fd = os.open(folder / _LOCK_FILE, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        _readable_by_all(fd)
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{folder / _LOCK_FILE} stayed locked") from None
                time.sleep(0.01)
        low, high = FIRST_JOB_IDS
        path = folder / _COUNTER_FILE
        try:
            block = json.loads(path.read_text())["next_block"]
            if not isinstance(block, int) or not low <= block <= high:
                raise ValueError(f"block {block!r} out of range")
        except FileNotFoundError:
            block = _random_block()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("mock job id counter %s damaged (%s): started again", path, exc)
            block = _random_block()
        following = block + 1 if block < high else low
        tmp = temp_path(path)
        tmp.unlink(missing_ok=True)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            try:
                _readable_by_all(out)
                os.write(out, json.dumps({"next_block": following}).encode())
            finally:
                os.close(out)
            replace_durably(tmp, path)  # readers see the old counter or the new one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return block
    finally:
        os.close(fd)  # releases the lock


def first_job_id(counter: Path | None = None) -> int:
    """A new mock cluster's first job id when its config names none: the next block of
    1000 ids (from 100000, under Slurm's MaxJobId) from a machine-wide counter in the system
    temp dir, shared by every user, so two mock clusters on one machine (two users' homes,
    a dry run beside the test suite) never start in one block. Where the counter cannot be
    used (a temp dir not writable), one log line and a random block, as Slurm's clusters
    each number their own jobs. A cluster's ids after its first 1000 run into the next
    block; nothing depends on ids being unique across clusters (a launcher publishes the
    port it bound), an id shared with another cluster's job only makes logs ambiguous."""
    folder = counter if counter is not None else id_counter_dir()
    try:
        block = _claim_block(folder)
    except OSError as exc:
        log.warning(
            "mock job ids: no machine-wide counter in %s (%s): a random first id", folder, exc
        )
        block = _random_block()
    return ID_BLOCK * block


def new_state(config: MockConfig | None) -> MockState:
    """A new cluster's state, its first job id chosen when the config left it open."""
    config = config or MockConfig()
    if config.first_job_id is None:
        config = config.model_copy(update={"first_job_id": first_job_id()})
    return MockState.create(config)


class MockStore:
    def __init__(self, home: Path | str) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.home / DB_FILE
        self.jobs_dir = self.home / "jobs"
        self.jobs_dir.mkdir(exist_ok=True)
        # WAL on a local filesystem, a rollback journal on one shared between hosts
        self.journal = sqlite_journal_mode(shared_between_hosts(self.home))
        # (generation, state) after the last transaction that ended well; a transaction
        # takes it, so a failed one leaves nothing behind that it may have half changed
        self._cache: tuple[int, MockState] | None = None
        self._local = threading.local()  # the connection of this thread's transaction

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute(f"PRAGMA journal_mode={self.journal.upper()}")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS state (id INTEGER PRIMARY KEY CHECK (id = 1), "
            "schema INTEGER, body TEXT, generation INTEGER)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS launch (job_id TEXT PRIMARY KEY, "
            "script TEXT NOT NULL, env TEXT NOT NULL)"
        )
        try:
            os.chmod(self.path, 0o600)
        except OSError:
            pass
        return conn

    def initialise(self, config: MockConfig | None) -> None:
        """Create the cluster if it does not exist yet; a given config replaces nothing.
        A cluster stored by an earlier version is brought to this schema."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            columns = {r[1] for r in conn.execute("PRAGMA table_info(state)")}
            if "generation" not in columns:
                conn.execute("ALTER TABLE state ADD COLUMN generation INTEGER")
            row = conn.execute("SELECT schema FROM state WHERE id = 1").fetchone()
            if row is None:
                state = new_state(config)
                self._write(conn, state, first_new=state.next_job_id, insert=True)
            elif row[0] < SCHEMA_VERSION:  # scripts and environments were in the state
                body = conn.execute("SELECT body FROM state WHERE id = 1").fetchone()[0]
                self._write(conn, MockState.model_validate_json(body), first_new=1)
            conn.execute("COMMIT")
        finally:
            conn.close()

    @contextmanager
    def transaction(self) -> Iterator[MockState]:
        """Yield the state; whatever the block changed is saved when it exits cleanly."""
        cached, self._cache = self._cache, None
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT generation FROM state WHERE id = 1").fetchone()
            if row is None:
                state, generation = new_state(None), None
            elif cached is not None and cached[0] == row[0]:
                state, generation = cached[1], row[0]
            else:
                body = conn.execute("SELECT body FROM state WHERE id = 1").fetchone()[0]
                state, generation = MockState.model_validate_json(body), row[0]
            first_new, counted = state.next_job_id, model.changes()
            self._local.conn = conn
            try:
                yield state
                if generation is None or model.changes() != counted:
                    generation = self._write(conn, state, first_new, insert=row is None)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            finally:
                self._local.conn = None
            self._cache = (generation, state)
        finally:
            conn.close()

    def _write(
        self, conn: sqlite3.Connection, state: MockState, first_new: int, insert: bool = False
    ) -> int:
        """Store the state with a new generation, and the scripts of the jobs numbered from
        `first_new` on (those submitted since it was read) in `launch`; return the generation."""
        new = [
            job
            for job in (*state.jobs.values(), *state.accounting.values())
            if int(job.job_id) >= first_new and (job.script or job.env)
        ]
        conn.executemany(
            "INSERT OR REPLACE INTO launch VALUES (?, ?, ?)",
            [(j.job_id, j.script, json.dumps(j.env)) for j in new],
        )
        for job in new:  # kept in `launch` now: the state in memory stays small
            job.script, job.env = "", {}
        body, generation = state.model_dump_json(exclude=_EXCLUDE), _new_generation()
        if insert:
            conn.execute(
                "INSERT INTO state VALUES (1, ?, ?, ?)", (SCHEMA_VERSION, body, generation)
            )
        else:
            conn.execute(
                "UPDATE state SET schema = ?, body = ?, generation = ? WHERE id = 1",
                (SCHEMA_VERSION, body, generation),
            )
        return generation

    def launch_spec(self, job: MockJob) -> tuple[str, dict[str, str]]:
        """The batch script and submission environment of `job`, inside a transaction.
        `ConfigError` (one line) when they are missing or damaged."""
        if job.script:  # submitted in this transaction: not stored apart yet
            return job.script, dict(job.env)
        conn = getattr(self._local, "conn", None)
        if conn is None:
            raise RuntimeError("launch_spec is for use inside a transaction")
        row = conn.execute(
            "SELECT script, env FROM launch WHERE job_id = ?", (job.job_id,)
        ).fetchone()
        if row is None:
            raise ConfigError(
                f"mock job {job.job_id}: its batch script is missing from {self.path}"
            )
        script, env_text = row
        try:
            env = json.loads(env_text)
        except ValueError:
            env = None
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError(
                f"mock job {job.job_id}: its stored environment is damaged in {self.path}"
            )
        if not isinstance(script, str) or not script.startswith("#!"):
            raise ConfigError(
                f"mock job {job.job_id}: its stored batch script is damaged "
                f"(no '#!' line) in {self.path}"
            )
        return script, env

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / str(job_id)
