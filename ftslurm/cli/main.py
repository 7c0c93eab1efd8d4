"""The `ftslurm` command line.

Errors are caught in one place (`main`): an `FtslurmError` prints `Error: <one line>` on
stderr and exits with its code; bad usage exits 2 with typer's usage message. No traceback
reaches the user for anything ftslurm anticipated.
"""

from __future__ import annotations

import sys

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


@app.command()
def version() -> None:
    """Print ftslurm's version."""
    typer.echo(__version__)


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, prog_name="ftslurm")  # exits through SystemExit
    except FtslurmError as exc:
        print(f"Error: {exc.user_message()}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0

if __name__ == "__main__":
    sys.exit(main())
