"""The state database's tables, their migrations and the row <-> record converters.

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

Enums are stored as their `.value`, times as REAL (seconds since the epoch), booleans as
0/1.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ftslurm.daemon.records import Attempt, Event, Run, RunState

MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
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
        ],
    ),
    (
        2,
        [
            "ALTER TABLE runs ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE attempts ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
            """CREATE TABLE requests (
            request_id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
            data TEXT NOT NULL, created_at REAL NOT NULL, applied_at REAL, result TEXT)""",
            "CREATE INDEX requests_pending ON requests(applied_at, request_id)",
        ],
    ),
    (
        3,
        [
            # the lost nodes an attempt acted on (JSON list): survives a daemon restart
            "ALTER TABLE attempts ADD COLUMN lost_nodes TEXT NOT NULL DEFAULT '[]'",
        ],
    ),
    (
        4,
        [
            # the daemon that serves this directory, whatever host it runs on (core.leases)
            """CREATE TABLE daemon_lease (
            id INTEGER PRIMARY KEY CHECK (id = 1), owner TEXT NOT NULL, host TEXT NOT NULL,
            pid INTEGER NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, ended TEXT,
            job_id TEXT)""",
        ],
    ),
    (
        5,
        [
            # the fault injections that fired in the run (JSON list): each fires once per run
            "ALTER TABLE runs ADD COLUMN injected TEXT NOT NULL DEFAULT '[]'",
        ],
    ),
]
SCHEMA_VERSION: int = MIGRATIONS[-1][0]

RUN_COLS = (
    "run_id",
    "name",
    "state",
    "created_at",
    "ended_at",
    "spec",
    "settings",
    "job_retries_used",
    "cause_counts",
    "continuations",
    "stalled_continuations",
    "last_checkpoint_step",
    "reason",
    "cancel_requested",
    "injected",
)
ATTEMPT_COLS = (
    "run_id",
    "attempt",
    "state",
    "job_id",
    "tag",
    "restart_count",
    "nodes",
    "submitted_at",
    "start",
    "end_",
    "exit_code",
    "signal",
    "reason",
    "cause",
    "in_job_restarts",
    "checkpoint_signal_at",
    "failure_seen_at",
    "lost_nodes",
)
TERMINAL = tuple(s.value for s in RunState if s.is_terminal)  # the `state` of an ended run


def run_row(run: Run) -> tuple[Any, ...]:
    """`run` as the values of `RUN_COLS`."""
    return (
        run.run_id,
        run.name,
        RunState(run.state).value,
        run.created_at,
        run.ended_at,
        json.dumps(run.spec),
        json.dumps(run.settings),
        run.job_retries_used,
        json.dumps(run.cause_counts),
        run.continuations,
        run.stalled_continuations,
        run.last_checkpoint_step,
        run.reason,
        int(run.cancel_requested),
        json.dumps(run.injected),
    )


def run_record(row: sqlite3.Row, shared: dict[str, Any] | None = None) -> Run:
    """The run of a `runs` row (`shared`: as `Store.runs_by_id`)."""
    text = row["settings"]
    if shared is None:
        settings = json.loads(text)
    elif (settings := shared.get(text)) is None:
        settings = shared[text] = json.loads(text)
    return Run(
        run_id=row["run_id"],
        name=row["name"],
        state=RunState(row["state"]),
        created_at=row["created_at"],
        spec=json.loads(row["spec"]),
        settings=settings,
        job_retries_used=row["job_retries_used"],
        cause_counts=json.loads(row["cause_counts"]),
        continuations=row["continuations"],
        stalled_continuations=row["stalled_continuations"],
        last_checkpoint_step=row["last_checkpoint_step"],
        reason=row["reason"],
        cancel_requested=bool(row["cancel_requested"]),
        ended_at=row["ended_at"],
        injected=json.loads(row["injected"]),
        version=row["version"],
    )


def attempt_row(a: Attempt) -> tuple[Any, ...]:
    """`a` as the values of `ATTEMPT_COLS`."""
    return (
        a.run_id,
        a.attempt,
        a.state,
        a.job_id,
        a.tag,
        a.restart_count,
        json.dumps(a.nodes),
        a.submitted_at,
        a.start,
        a.end,
        a.exit_code,
        a.signal,
        a.reason,
        a.cause,
        a.in_job_restarts,
        a.checkpoint_signal_at,
        a.failure_seen_at,
        json.dumps(a.lost_nodes),
    )


def attempt_record(row: sqlite3.Row) -> Attempt:
    """The attempt of an `attempts` row."""
    return Attempt(
        run_id=row["run_id"],
        attempt=row["attempt"],
        state=row["state"],
        job_id=row["job_id"],
        tag=row["tag"],
        restart_count=row["restart_count"],
        nodes=json.loads(row["nodes"]),
        submitted_at=row["submitted_at"],
        start=row["start"],
        end=row["end_"],
        exit_code=row["exit_code"],
        signal=row["signal"],
        reason=row["reason"],
        cause=row["cause"],
        in_job_restarts=row["in_job_restarts"],
        checkpoint_signal_at=row["checkpoint_signal_at"],
        failure_seen_at=row["failure_seen_at"],
        lost_nodes=json.loads(row["lost_nodes"]),
        version=row["version"],
    )


def event_record(row: sqlite3.Row) -> Event:
    """The event of an `events` row."""
    return Event(row["event_id"], row["time"], row["run_id"], row["kind"], json.loads(row["data"]))
