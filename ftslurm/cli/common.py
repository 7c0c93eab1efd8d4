"""What the run commands share: the state directory's store, a RUN argument resolved to
its run, the consoles, waiting on the daemon, tables that fit the terminal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ftslurm.daemon import service
from ftslurm.daemon.records import Run
from ftslurm.daemon.store import Store
from ftslurm.errors import ConfigError, FtslurmError
from ftslurm.paths import state_dir
from ftslurm.report.notes import Col, fit_columns

console = Console()
err = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _store() -> Store:
    return Store(state_dir())


def _run_or_fail(store: Store, ref: str) -> Run:
    """The run that `ref` names: its id, a unique prefix of its id (as `git` takes a commit),
    or its `--name` when no other run has it, or when exactly one of the runs that have it
    is active (`submit` refuses a `--name` an active run has). An exact id always wins."""
    if not ref:
        raise ConfigError("no run given: name it by its id, a prefix of its id, or its name")
    runs = store.find_runs(ref)
    if len(runs) == 1 and runs[0].run_id == ref:
        return runs[0]
    ids = {r.run_id for r in runs}
    named = [r for r in store.list_runs() if r.name == ref and r.run_id not in ids]
    active = [r for r in named if not r.state.is_terminal]
    if not runs and len(named) > 1 and len(active) == 1:
        return active[0]  # a name reused after its run ended names the active run
    runs += named
    if not runs:
        raise ConfigError(
            f"no run {ref!r} in {store.path.parent} (give a run id, a prefix "
            "of one, or a run's name; `ftslurm status` lists them)"
        )
    if len(runs) > 1:
        shown = ", ".join(f"{r.run_id} ({r.name})" for r in runs[:5])
        more = f" and {len(runs) - 5} more" if len(runs) > 5 else ""
        raise ConfigError(f"{ref!r} is ambiguous: it names {shown}{more}")
    return runs[0]


def _resolve_run_arg(value: str | None) -> str | None:
    """The one place a RUN argument is resolved: every command gets the full run id."""
    if value is None:
        return None
    with _store() as store:
        return _run_or_fail(store, value).run_id


_RUN_HELP = "A run id, a unique prefix of one, or a run's name (when no other run has it)."
RunArg = Annotated[
    str,
    typer.Argument(metavar="RUN", help=_RUN_HELP, show_default=False, callback=_resolve_run_arg),
]
_Text = str | None


def _opt(*names: str, help: str, hidden: bool = False) -> Any:
    return typer.Option(*names, help=help, hidden=hidden, show_default=False)


def _await_daemon(
    home: Path, later: str, wait_s: float, check: Callable[[], tuple[bool, Any, str]]
) -> tuple[Any, str]:
    """Start or wake the daemon, then poll `check` (done?, value, note) until it is done,
    `wait_s` has passed or the daemon is gone. Returns the value and the note, or None and
    `later` with what holds it up."""
    try:
        service.start(home)
        service.wake(home)
    except FtslurmError as exc:
        return None, f"{later}, once it runs ({exc.user_message()})"
    deadline = time.monotonic() + wait_s
    while True:
        done, value, note = check()
        if done:
            return value, note
        if time.monotonic() >= deadline:
            return None, f"{later} (it did not within {wait_s:g}s)"
        if service.serving(home) is None:
            return None, f"{later}, once it runs (`ftslurm daemon start`)"
        time.sleep(0.05)


def fitted_table(
    cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int, title: str | None = None
) -> Table:
    """A table for a terminal `width` columns wide: the columns that fit (`fit_columns`);
    ids never cut, never wrapped; other cells fold (wrap) rather than end in an ellipsis."""
    widths = [[Text.from_markup(cell).cell_len for cell in row] for row in rows]
    shown = fit_columns(cols, widths, width)
    table = Table(title=title)
    for i in shown:
        col = cols[i]
        if col.keep is None:
            longest = max([len(col.header), *(w[i] for w in widths)])
            table.add_column(col.header, no_wrap=True, min_width=longest)
        else:
            table.add_column(col.header, overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table
