"""The `ftslurm` command line.

Errors are caught in one place (`main`): an `FtslurmError` prints `Error: <one line>` on
stderr and exits with its code; bad usage exits 2 with the usage message (and a hint where
the mistake is a common one). No traceback reaches the user for anything ftslurm anticipated.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ftslurm import __version__
from ftslurm.cli import report, runs
from ftslurm.cli.mock import app as mock_app
from ftslurm.cli.scheduler import app as scheduler_app
from ftslurm.errors import FtslurmError

app = typer.Typer(
    name="ftslurm",
    help="Slurm-native fault tolerance for long distributed PyTorch training runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
runs.register(app)
report.register(app)
app.add_typer(scheduler_app, name="scheduler")
app.add_typer(mock_app, name="mock")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", help="Print ftslurm's version and exit.", is_eager=True,
        callback=_print_version)] = False,
) -> None:
    """Slurm-native fault tolerance for long distributed PyTorch training runs."""


@app.command()
def version() -> None:
    """Print ftslurm's version."""
    typer.echo(__version__)


SCRIPT_ARGS_HINT = ("put the script's own arguments after `--`: "
                    "ftslurm submit train.py -- --lr 3e-4")  # fmt: skip


def _click():
    """The click that typer runs on (typer carries its own copy in recent releases)."""
    try:
        from typer import _click as click  # type: ignore[attr-defined]
    except ImportError:  # typer releases that use the click package
        import click
    return click


def _usage_hint(exc: Exception) -> str | None:
    """A hint for a usage error people make often, or None."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command.name if ctx is not None and ctx.command is not None else None
    if type(exc).__name__ == "NoSuchOption" and command == "submit":
        return SCRIPT_ARGS_HINT
    return None


def _show_usage_error(exc: Exception) -> None:
    """Print a usage error as typer does (with rich when it is there), then any hint."""
    try:
        from typer import rich_utils

        rich_utils.rich_format_error(exc)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - typer without rich
        exc.show()  # type: ignore[attr-defined]
    hint = _usage_hint(exc)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    click = _click()
    try:
        result = app(args=argv, prog_name="ftslurm", standalone_mode=False)
    except FtslurmError as exc:
        print(f"Error: {exc.user_message()}", file=sys.stderr)
        return exc.exit_code
    except click.exceptions.ClickException as exc:  # bad usage: standalone mode is off
        _show_usage_error(exc)
        return exc.exit_code
    except click.exceptions.Abort:
        print("Aborted!", file=sys.stderr)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
