"""What commands ask of the daemon, and how the daemon applies it.

The daemon is the one writer of run state and node flags (docs/daemon.md, "One writer"):
`ftslurm nodes add` and `nodes remove` record a request (`Store.add_request`) and wake the
daemon, which applies every pending request at the start of its next cycle
(`apply_requests`) and records the result that the command waits for.
"""

from __future__ import annotations

from typing import Any

from ftslurm.daemon.records import NodeFlag
from ftslurm.daemon.store import Request, Store

NODES_ADD = "nodes_add"  # data: nodes, reason, ttl_s (None: until removed)
NODES_REMOVE = "nodes_remove"  # data: nodes


def nodes_add(nodes: list[str], reason: str, ttl_s: float | None) -> tuple[str, dict[str, Any]]:
    """The request to keep `nodes` out of later attempts (kind, data)."""
    return NODES_ADD, {"nodes": list(nodes), "reason": reason, "ttl_s": ttl_s}


def nodes_remove(nodes: list[str]) -> tuple[str, dict[str, Any]]:
    """The request to let `nodes` be used again (kind, data)."""
    return NODES_REMOVE, {"nodes": list(nodes)}


def apply_requests(store: Store, now: float) -> int:
    """Apply every pending request, each in one transaction with its result and an event;
    returns how many were applied."""
    pending = store.pending_requests()
    for request in pending:
        with store.transaction():
            result = _apply(store, request)
            if store.finish_request(request.request_id, result, now):
                store.append_event(None, request.kind, {**request.data, **result}, now)
    return len(pending)


def _apply(store: Store, request: Request) -> dict[str, Any]:
    nodes = [str(n) for n in request.data.get("nodes") or []]
    if request.kind == NODES_ADD:
        ttl = request.data.get("ttl_s")
        since = request.created_at  # when the user asked
        for node in nodes:
            store.flag_node(
                NodeFlag(
                    node=node,
                    reason=str(request.data.get("reason") or ""),
                    since=since,
                    expires_at=since + ttl if ttl else None,
                )
            )
        return {"added": nodes}
    if request.kind == NODES_REMOVE:
        removed = [node for node in nodes if store.unflag_node(node)]
        return {"removed": removed, "missing": [n for n in nodes if n not in removed]}
    return {"error": f"unknown request {request.kind!r} (a newer ftslurm wrote it?)"}
