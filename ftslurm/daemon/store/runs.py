"""Runs, their attempts and the event log of the state database.

One writer of run state: the daemon performs every transition of runs, attempts and node
flags. Commands write only new runs (with their first submission intent), requests and
the cancel flag (`request_cancel`). Runs and attempts carry a `version`; `update_run` and
`update_attempt` are compare-and-set on the version the record was read at and raise
`StaleRecord` when the stored one moved on (a cancel request moves a run's version too):
the holder of the old copy reads again and decides again, it never overwrites.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ftslurm.core.cadence import DAY_S, FailureHistory
from ftslurm.daemon.records import Attempt, Event, Run
from ftslurm.daemon.store.connection import Connection, StaleRecord, StateError, sqlite_errors
from ftslurm.daemon.store.schema import (
    ATTEMPT_COLS,
    RUN_COLS,
    TERMINAL,
    attempt_record,
    attempt_row,
    event_record,
    run_record,
    run_row,
)


def _chunks(items: list[str], size: int = 500) -> Iterator[list[str]]:
    """`items` in slices small enough for one statement's parameters."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


class RunsMixin(Connection):
    """`Store`'s runs, attempts and events."""

    # ------------------------------------------------------------------ runs
    def add_run(self, run: Run) -> None:
        """Insert a new run (stored at version 0, which `run` then carries); `StateError` if
        `run.run_id` exists."""
        marks = ",".join("?" * len(RUN_COLS))
        try:
            self._write(f"INSERT INTO runs ({','.join(RUN_COLS)}) VALUES ({marks})", run_row(run))
        except sqlite3.IntegrityError:
            raise StateError(f"run {run.run_id!r} already exists in {self.path}") from None
        run.version = 0

    def _stale(
        self, table: str, where: str, key: tuple[Any, ...], what: str, read_at: int
    ) -> StateError:
        """Why a compare-and-set update changed no row: the record is gone, or it moved on."""
        rows = self._read(f"SELECT version FROM {table} WHERE {where}", key)
        if not rows:
            return StateError(f"no {what} in {self.path}")
        return StaleRecord(
            f"{what} changed since it was read (version {read_at}, now {rows[0][0]}): read it again"
        )

    def update_run(self, run: Run) -> None:
        """Replace the stored record of `run.run_id` except its cancel request (only
        `request_cancel` sets that), if it is still at `run.version` (compare-and-set);
        then the version moves on by one, in the store and in `run`. `StaleRecord` when
        another writer changed it since `run` was read, `StateError` if there is none.

        Inside a transaction that rolls back, `run` keeps the new version all the same: a
        later write from it then fails as stale (read again), it never overwrites."""
        cols = [i for i, c in enumerate(RUN_COLS) if c not in ("run_id", "cancel_requested")]
        sets = ",".join(f"{RUN_COLS[i]} = ?" for i in cols)
        row = run_row(run)
        cur = self._write(
            f"UPDATE runs SET {sets}, version = version + 1 WHERE run_id = ? AND version = ?",
            (*(row[i] for i in cols), row[0], run.version),
        )
        if cur.rowcount == 0:
            raise self._stale(
                "runs", "run_id = ?", (run.run_id,), f"run {run.run_id!r}", run.version
            )
        run.version += 1

    def request_cancel(self, run_id: str, now: float) -> tuple[bool, Attempt | None]:
        """Ask for a run's cancellation: set that one column (and log the event) unless the
        run has ended, and read its latest attempt in the same transaction. Returns whether
        the request was recorded, and that attempt. The first request moves the run's
        version on, so a copy read before it can no longer be written back."""
        with self.transaction():
            cur = self._write(
                "UPDATE runs SET version = version + (cancel_requested = 0), "
                "cancel_requested = 1 WHERE run_id = ? AND "
                f"state NOT IN ({','.join('?' * len(TERMINAL))})",
                (run_id, *TERMINAL),
            )
            if cur.rowcount:
                self.append_event(run_id, "cancel_requested", {}, now)
            return cur.rowcount > 0, self.latest_attempt(run_id)

    def get_run(self, run_id: str) -> Run | None:
        rows = self._read("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return run_record(rows[0]) if rows else None

    def find_runs(self, prefix: str) -> list[Run]:
        """The runs whose id is `prefix` or starts with it (an exact id wins)."""
        run = self.get_run(prefix)
        if run is not None:
            return [run]
        rows = self._read(
            "SELECT * FROM runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id",
            (len(prefix), prefix),
        )
        return [run_record(r) for r in rows]

    def newest_run(self) -> int:
        """A number that grows with every run added (the newest row's id; 0: none)."""
        return int(self._read("SELECT coalesce(max(rowid), 0) FROM runs")[0][0])

    def active_heads(self) -> list[tuple[str, int, int | None, int | None]]:
        """For every run not in a terminal state, oldest first: (run id, its version, the
        number and version of its latest attempt, or None, None). One query that decodes
        nothing: a reader that keeps the records it read can tell which ones changed."""
        with self._lock, sqlite_errors(self.path):
            cur = self._db.execute(
                "SELECT r.run_id, r.version, a.attempt, a.version FROM runs r "
                "LEFT JOIN attempts a ON a.run_id = r.run_id AND a.attempt = "
                "(SELECT max(attempt) FROM attempts WHERE run_id = r.run_id) "
                f"WHERE r.state NOT IN ({','.join('?' * len(TERMINAL))}) "
                "ORDER BY r.created_at, r.run_id",
                TERMINAL,
            )
            cur.row_factory = None  # plain tuples: this is read often and in bulk
            return cur.fetchall()

    def runs_by_id(
        self, run_ids: Iterable[str], shared: dict[str, Any] | None = None
    ) -> dict[str, Run]:
        """The runs of these ids (those that exist), read in a few queries. `shared`: JSON
        text of settings -> its decoded dict, filled as it goes: runs whose settings are
        the same text get the same dict (the caller changes none in place)."""
        out: dict[str, Run] = {}
        for chunk in _chunks(list(run_ids)):
            rows = self._read(
                f"SELECT * FROM runs WHERE run_id IN ({','.join('?' * len(chunk))})", tuple(chunk)
            )
            out.update((r["run_id"], run_record(r, shared)) for r in rows)
        return out

    def latest_attempts(self, run_ids: Iterable[str]) -> dict[str, Attempt]:
        """The latest attempt of each of these runs (those that have one), in a few queries."""
        out: dict[str, Attempt] = {}
        for chunk in _chunks(list(run_ids)):
            rows = self._read(
                "SELECT a.* FROM attempts a WHERE a.run_id IN "
                f"({','.join('?' * len(chunk))}) AND a.attempt = "
                "(SELECT max(attempt) FROM attempts WHERE run_id = a.run_id)",
                tuple(chunk),
            )
            out.update((r["run_id"], attempt_record(r)) for r in rows)
        return out

    def list_runs(self, active_only: bool = False) -> list[Run]:
        """All runs (or those not yet in a terminal state), oldest first."""
        sql, params = "SELECT * FROM runs", ()
        if active_only:
            sql += f" WHERE state NOT IN ({','.join('?' * len(TERMINAL))})"
            params = TERMINAL
        return [run_record(r) for r in self._read(sql + " ORDER BY created_at, run_id", params)]

    # ------------------------------------------------------------------ attempts
    def add_attempt(self, a: Attempt) -> None:
        """Insert a new attempt of an existing run (stored at version 0, which `a` then
        carries); `StateError` if it exists already."""
        marks = ",".join("?" * len(ATTEMPT_COLS))
        try:
            self._write(
                f"INSERT INTO attempts ({','.join(ATTEMPT_COLS)}) VALUES ({marks})", attempt_row(a)
            )
        except sqlite3.IntegrityError as exc:
            if "FOREIGN KEY" in str(exc):
                raise StateError(f"attempt {a.attempt} names unknown run {a.run_id!r}") from None
            raise StateError(f"attempt {a.attempt} of run {a.run_id!r} already exists") from None
        a.version = 0

    def update_attempt(self, a: Attempt) -> None:
        """Replace the whole stored record of (`a.run_id`, `a.attempt`) if it is still at
        `a.version` (compare-and-set, as `update_run`); `StaleRecord` when it moved on."""
        sets = ",".join(f"{c} = ?" for c in ATTEMPT_COLS[2:])
        row = attempt_row(a)
        cur = self._write(
            f"UPDATE attempts SET {sets}, version = version + 1 "
            "WHERE run_id = ? AND attempt = ? AND version = ?",
            (*row[2:], row[0], row[1], a.version),
        )
        if cur.rowcount == 0:
            raise self._stale(
                "attempts",
                "run_id = ? AND attempt = ?",
                (a.run_id, a.attempt),
                f"attempt {a.attempt} of run {a.run_id!r}",
                a.version,
            )
        a.version += 1

    def attempts(self, run_id: str) -> list[Attempt]:
        rows = self._read("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt", (run_id,))
        return [attempt_record(r) for r in rows]

    def attempt_before(self, run_id: str, attempt: int) -> Attempt | None:
        """The run's attempt just before attempt `attempt` (one row: a run continued many
        times has many attempts, each with its node list)."""
        rows = self._read(
            "SELECT * FROM attempts WHERE run_id = ? AND attempt < ? ORDER BY attempt DESC LIMIT 1",
            (run_id, attempt),
        )
        return attempt_record(rows[0]) if rows else None

    def latest_attempt(self, run_id: str) -> Attempt | None:
        rows = self._read(
            "SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt DESC LIMIT 1", (run_id,)
        )
        return attempt_record(rows[0]) if rows else None

    # ------------------------------------------------------------------ events
    def append_event(self, run_id: str | None, kind: str, data: dict[str, Any], time: float) -> int:
        """Append one event; returns its id (larger than every id before it)."""
        cur = self._write(
            "INSERT INTO events (time, run_id, kind, data) VALUES (?, ?, ?, ?)",
            (time, run_id, kind, json.dumps(data)),
        )
        return int(cur.lastrowid or 0)

    def events(
        self, run_id: str | None = None, since_id: int = 0, limit: int | None = None
    ) -> list[Event]:
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
        return [event_record(r) for r in self._read(sql, tuple(params))]

    def failure_history(
        self, now: float, cluster_of: Callable[[dict[str, Any]], str]
    ) -> dict[str, FailureHistory]:
        """Per cluster (`cluster_of` a run's spec), the node failures this store saw
        (`node_lost` events, from peers, the daemon or Slurm) and the node-days its attempts
        ran (nodes times run time, up to `now` for one still running): the cluster's node
        failure rate as seen here. A mock's injected failures stay with that mock."""
        clusters = {
            r["run_id"]: cluster_of(json.loads(r["spec"]))
            for r in self._read("SELECT run_id, spec FROM runs")
        }
        lost = self._read(
            "SELECT run_id, COUNT(*) AS n FROM events WHERE kind = 'node_lost' GROUP BY run_id"
        )
        ran = self._read(
            "SELECT run_id, SUM(json_array_length(nodes) * MAX(0, COALESCE(end_, ?) - start))"
            " AS s FROM attempts WHERE start IS NOT NULL GROUP BY run_id",
            (now,),
        )
        failures: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for r in lost:
            c = clusters.get(r["run_id"], "")
            failures[c] = failures.get(c, 0) + int(r["n"])
        for r in ran:
            c = clusters.get(r["run_id"], "")
            seconds[c] = seconds.get(c, 0.0) + float(r["s"] or 0.0)
        return {
            c: FailureHistory(failures.get(c, 0), seconds.get(c, 0.0) / DAY_S)
            for c in set(failures) | set(seconds)
        }

    def latest_event(self, run_id: str, kind: str) -> Event | None:
        """The run's newest event of `kind`, or None."""
        rows = self._read(
            "SELECT * FROM events WHERE run_id = ? AND kind = ? ORDER BY event_id DESC LIMIT 1",
            (run_id, kind),
        )
        return event_record(rows[0]) if rows else None
