"""`Store`: the state database of one state directory, made of its parts (connection.py,
runs.py, requests.py, lock.py's lease row, guard.py)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from types import TracebackType

from ftslurm.daemon.store.connection import BUSY_TIMEOUT_S, DB_SUFFIXES, sqlite_errors
from ftslurm.daemon.store.guard import GuardMixin
from ftslurm.daemon.store.lock import LeaseMixin
from ftslurm.daemon.store.requests import RequestsMixin
from ftslurm.daemon.store.runs import RunsMixin


class Store(RunsMixin, RequestsMixin, LeaseMixin, GuardMixin):
    """The state database of one state directory (`home/state.db`).

    One connection per instance; an instance may be shared by threads (calls are serialized),
    and any number of processes may open the same directory at once.
    """

    def __init__(
        self, home: Path | str, network: bool | None = None, check_runs: bool = True
    ) -> None:
        super().__init__(home, network)  # the file and the connection (connection.py)
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

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
