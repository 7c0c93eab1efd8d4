"""What commands ask the daemon to do (the `requests` table), and the node flags the
daemon keeps (the `node_flags` table)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from ftslurm.daemon.records import NodeFlag
from ftslurm.daemon.store.connection import Connection


@dataclass(frozen=True)
class Request:
    """What a command asked the daemon to do (`requests` table)."""

    request_id: int
    kind: str
    data: dict[str, Any]
    created_at: float
    applied_at: float | None = None  # None: not applied yet
    result: dict[str, Any] | None = None  # what applying it did, for the command that asked


def request_record(row: sqlite3.Row) -> Request:
    """The request of a `requests` row."""
    result = row["result"]
    return Request(
        row["request_id"],
        row["kind"],
        json.loads(row["data"]),
        row["created_at"],
        row["applied_at"],
        None if result is None else json.loads(result),
    )


class RequestsMixin(Connection):
    """`Store`'s requests and node flags."""

    # ------------------------------------------------------------------ requests
    def add_request(self, kind: str, data: dict[str, Any], now: float) -> int:
        """Record what a command asks the daemon to do; returns the request's id."""
        cur = self._write(
            "INSERT INTO requests (kind, data, created_at) VALUES (?, ?, ?)",
            (kind, json.dumps(data), now),
        )
        return int(cur.lastrowid or 0)

    def pending_requests(self) -> list[Request]:
        """Requests not applied yet, oldest first."""
        rows = self._read("SELECT * FROM requests WHERE applied_at IS NULL ORDER BY request_id")
        return [request_record(r) for r in rows]

    def get_request(self, request_id: int) -> Request | None:
        rows = self._read("SELECT * FROM requests WHERE request_id = ?", (request_id,))
        return request_record(rows[0]) if rows else None

    def finish_request(self, request_id: int, result: dict[str, Any], now: float) -> bool:
        """Record that the daemon applied a request, and how; whether it was still pending
        (a request is applied once)."""
        cur = self._write(
            "UPDATE requests SET applied_at = ?, result = ? "
            "WHERE request_id = ? AND applied_at IS NULL",
            (now, json.dumps(result), request_id),
        )
        return cur.rowcount > 0

    # ------------------------------------------------------------------ node flags
    def flag_node(self, flag: NodeFlag) -> None:
        """Flag a node (replacing any flag it had)."""
        self._write(
            "INSERT OR REPLACE INTO node_flags (node, reason, since, expires_at, run_id) "
            "VALUES (?, ?, ?, ?, ?)",
            (flag.node, flag.reason, flag.since, flag.expires_at, flag.run_id),
        )

    def unflag_node(self, node: str, reason: str | None = None, run_id: str | None = None) -> bool:
        """Remove a node's flag (only when it is still the one with `reason` set by
        `run_id`, when given); whether it had one."""
        if reason is None:
            return self._write("DELETE FROM node_flags WHERE node = ?", (node,)).rowcount > 0
        cur = self._write(
            "DELETE FROM node_flags WHERE node = ? AND reason = ? AND run_id IS ?",
            (node, reason, run_id),
        )
        return cur.rowcount > 0

    def node_flags(self, now: float | None = None) -> list[NodeFlag]:
        """All flags by node name; with `now`, only those not expired at `now`."""
        sql, params = "SELECT * FROM node_flags", ()
        if now is not None:
            sql, params = sql + " WHERE expires_at IS NULL OR expires_at > ?", (now,)
        return [
            NodeFlag(r["node"], r["reason"], r["since"], r["expires_at"], r["run_id"])
            for r in self._read(sql + " ORDER BY node", params)
        ]
