"""`ftslurm nodes`: the node exclusion list every later attempt gets (the daemon applies
the requests `add` and `remove` record)."""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any

import hostlist
import typer
from rich.markup import escape

from ftslurm.backends.slurm_cli.parse import compress_nodes
from ftslurm.cli.common import JsonOpt, _await_daemon, _store, console, err, fitted_table
from ftslurm.core.validate import bad_char, check_line
from ftslurm.daemon import user_requests
from ftslurm.daemon.store import Request
from ftslurm.errors import ConfigError
from ftslurm.paths import state_dir
from ftslurm.report.notes import Col, fmt_time

nodes_app = typer.Typer(
    help="The node exclusion list every later attempt gets.",
    no_args_is_help=False,
    invoke_without_command=True,
)


@nodes_app.callback()
def nodes_default(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    if ctx.invoked_subcommand is None:
        nodes_list(as_json)


_NODE_COLS = (
    Col("node", None),
    Col("reason", 50, wraps=True),
    Col("since", 60),
    Col("expires", 70),
    Col("run", 40),
)


@nodes_app.command("list")
def nodes_list(as_json: JsonOpt = False) -> None:
    """Show excluded nodes with their reasons and expiry."""
    store = _store()
    flags = store.node_flags(time.time())
    pending = len(store.pending_requests())
    if pending:
        err.print(
            f"{pending} node request(s) not applied yet: the daemon applies them on its next cycle",
            markup=False,
            highlight=False,
        )
    if as_json:
        typer.echo(json.dumps([f.__dict__ for f in flags]))
        return
    now = time.time()
    # A reason stored before control characters were refused shows them escaped (\x1b),
    # never as raw terminal sequences.
    rows = [
        [
            f.node,
            escape(f.reason if not bad_char(f.reason) else repr(f.reason)[1:-1]),
            fmt_time(f.since, now),
            fmt_time(f.expires_at, now) if f.expires_at else "never",
            f.run_id or "-",
        ]
        for f in flags
    ]
    console.print(fitted_table(_NODE_COLS, rows, console.width, title="excluded nodes"))


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def node_names(text: str) -> list[str]:
    """Node names from `n1`, `n1,n2` or a hostlist expression (`n[1-3]`), as Slurm writes
    them; blank, whitespace and control characters are refused (pure)."""
    if not text.strip():
        raise ConfigError("a node name cannot be empty")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ConfigError(f"node name {text!r} contains whitespace or a control character")
    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist:
        raise ConfigError(f"{text!r} is not a node name or hostlist (like n[1-3])") from None
    bad = [n for n in names if not _NODE_NAME.fullmatch(n)]
    if bad or not names:
        raise ConfigError(f"{text!r} is not a node name or hostlist (like n[1-3])")
    return names


@nodes_app.command("add")
def nodes_add(
    node: Annotated[
        str,
        typer.Argument(
            metavar="NODES",
            show_default=False,
            help=("A node name, or several as Slurm writes them: n1,n2 or n[1-3]."),
        ),
    ],
    reason: Annotated[
        str, typer.Option("--reason", help="Why, shown in `nodes list`.")
    ] = "added by hand",
    ttl: Annotated[
        float | None,
        typer.Option(
            "--ttl",
            help="Seconds until the node may be used again. Default: never (until `nodes remove`).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Keep nodes out of every later attempt."""
    names = node_names(node)
    check_line("--reason", reason)  # one line of printable text: `nodes list` prints it
    if ttl is not None and ttl <= 0:
        raise ConfigError(f"--ttl must be a positive number of seconds, not {ttl:g}")
    done, note = _ask_daemon(*user_requests.nodes_add(names, reason, ttl))
    if done is None:
        typer.echo(f"{compress_nodes(names)}: exclusion recorded; {note}")
    else:
        typer.echo(f"{compress_nodes(names)} excluded")


@nodes_app.command("remove")
def nodes_remove(
    node: Annotated[
        str,
        typer.Argument(metavar="NODES", show_default=False, help="A node name, n1,n2 or n[1-3]."),
    ],
) -> None:
    """Let nodes be used again."""
    names = node_names(node)
    flagged = {f.node for f in _store().node_flags()}
    missing = [n for n in names if n not in flagged]
    if not missing:
        done, note = _ask_daemon(*user_requests.nodes_remove(names))
        if done is None:
            typer.echo(f"{compress_nodes(names)}: removal recorded; {note}")
            return
        missing = list((done.result or {}).get("missing") or [])  # removed meanwhile
    if missing:
        raise ConfigError(f"{compress_nodes(missing)} not on the exclusion list")
    typer.echo(f"{compress_nodes(names)} no longer excluded")


# How long `nodes add` and `nodes remove` wait for the daemon to apply their request (s).
REQUEST_WAIT_S = 15.0


def _ask_daemon(kind: str, data: dict[str, Any]) -> tuple[Request | None, str]:
    """Record a request for the daemon (the one writer of node flags), start or wake it,
    and wait, bounded, until it applied the request. Returns the applied request, or None
    and what happens next."""
    store = _store()
    request_id = store.add_request(kind, data, time.time())

    def applied() -> tuple[bool, Request | None, str]:
        request = store.get_request(request_id)
        return request is not None and request.applied_at is not None, request, ""

    return _await_daemon(
        state_dir(), "the daemon applies it on its next cycle", REQUEST_WAIT_S, applied
    )
