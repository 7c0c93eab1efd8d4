"""Where a mock cluster's state lives: one SQLite file, shared by every process that uses it.

Each operation is one `BEGIN IMMEDIATE` transaction: read the state, change it, write it
back. SQLite's lock makes concurrent processes (a CLI, the daemon, the mock controller)
take turns; a crash mid-operation leaves the previous state intact.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ftslurm.backends.mock.model import MockConfig, MockState

SCHEMA_VERSION = 1
DB_FILE = "mock.sqlite"  # the mock cluster's state, in its folder


class MockStore:
    def __init__(self, home: Path | str) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.home / DB_FILE
        self.jobs_dir = self.home / "jobs"
        self.jobs_dir.mkdir(exist_ok=True)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS state "
                     "(id INTEGER PRIMARY KEY CHECK (id = 1), schema INTEGER, body TEXT)")
        try:
            os.chmod(self.path, 0o600)
        except OSError:
            pass
        return conn

    def initialise(self, config: MockConfig | None) -> None:
        """Create the cluster if it does not exist yet; a given config replaces nothing."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT body FROM state WHERE id = 1").fetchone()
            if row is None:
                body = MockState.create(config).model_dump_json()
                conn.execute("INSERT INTO state VALUES (1, ?, ?)", (SCHEMA_VERSION, body))
            conn.execute("COMMIT")
        finally:
            conn.close()

    @contextmanager
    def transaction(self) -> Iterator[MockState]:
        """Yield the state; whatever the block changed is saved when it exits cleanly."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT body FROM state WHERE id = 1").fetchone()
            state = MockState.model_validate_json(row[0]) if row else MockState.create()
            try:
                yield state
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            body = state.model_dump_json()
            if row is None:
                conn.execute("INSERT INTO state VALUES (1, ?, ?)", (SCHEMA_VERSION, body))
            else:
                conn.execute("UPDATE state SET body = ? WHERE id = 1", (body,))
            conn.execute("COMMIT")
        finally:
            conn.close()

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / str(job_id)
