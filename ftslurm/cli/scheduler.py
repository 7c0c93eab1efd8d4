"""`ftslurm scheduler ...`: the scheduler protocol, one call per command.

For inspecting a cluster and rehearsing recovery steps by hand; the daemon makes the same
calls. Every command accepts `--backend` (slurm, pyslurm, auto) and most accept `--json`.
"""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ftslurm.backends import create_backend
from ftslurm.core.types import JobInfo, JobOptions, SignalTarget
from ftslurm.errors import ConfigError

app = typer.Typer(
    help="Talk to the scheduler directly (submit, query, requeue, ...).", no_args_is_help=True
)

BackendOpt = Annotated[str, typer.Option("--backend", help="slurm, pyslurm, auto or mock")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _console() -> Console:
    return Console(soft_wrap=True)


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def jobs_table(jobs: list[JobInfo]) -> Table:
    table = Table("job", "state", "exit", "nodes", "restarts", "reason", "name")
    for info in jobs:
        exit_text = "" if info.exit_code is None else str(info.exit_code)
        if info.signal:
            exit_text += f" (sig {info.signal})"
        table.add_row(
            info.job_id,
            info.state.value,
            exit_text,
            ",".join(info.nodes),
            str(info.restart_count),
            info.reason or "",
            info.name or "",
        )
    return table


def _flag(*names: str, help: str) -> Any:
    return typer.Option(*names, help=help, show_default=False)


# `scheduler submit`'s options.
_Script = Annotated[Path, typer.Argument(help="the batch script to submit")]
_Nodes = Annotated[
    int | None, _flag("-N", "--nodes", help="Number of nodes. Default: the scheduler's (1).")
]
_TasksPerNode = Annotated[
    int | None, _flag("--ntasks-per-node", help="Tasks per node. Default: the scheduler's (1).")
]
_Time = Annotated[
    str | None,
    _flag(
        "-t",
        "--time",
        help="Time limit in Slurm's forms (MM, HH:MM:SS, D-HH). Default: the partition's.",
    ),
]
_Partition = Annotated[
    str | None,
    _flag("-p", "--partition", help="Partition. Default: the cluster's default partition."),
]
_Account = Annotated[
    str | None, _flag("-A", "--account", help="Account to charge. Default: yours.")
]
_Exclude = Annotated[
    str | None, _flag("--exclude", help="Nodes to keep the job off: n1,n2. Default: none.")
]
_Name = Annotated[str | None, _flag("--name", help="Job name. Default: the script's file name.")]
_Comment = Annotated[str | None, _flag("--comment", help="Job comment (free text). Default: none.")]
_Hold = Annotated[bool, typer.Option("--hold", help="Submit held; `release` starts it.")]
_Inject = Annotated[
    list[str] | None,
    _flag(
        "--inject",
        help="KIND@TIME[:TARGET], repeatable (see docs/fault-injection.md). Default: none.",
    ),
]


@app.command()
def submit(
    script: _Script,
    nodes: _Nodes = None,
    ntasks_per_node: _TasksPerNode = None,
    time: _Time = None,
    partition: _Partition = None,
    account: _Account = None,
    exclude: _Exclude = None,
    name: _Name = None,
    comment: _Comment = None,
    hold: _Hold = False,
    inject: _Inject = None,
    backend: BackendOpt = "slurm",
    as_json: JsonOpt = False,
) -> None:
    """Submit a batch script; print its job id."""
    if not script.is_file():
        raise ConfigError(f"batch script {str(script)!r} does not exist")
    options = JobOptions(
        name=name,
        nodes=nodes,
        ntasks_per_node=ntasks_per_node,
        time_limit=time,
        partition=partition,
        account=account,
        comment=comment,
        hold=hold,
        exclude=tuple(n for n in (exclude or "").split(",") if n),
        workdir=str(Path.cwd()),
        inject=tuple(inject or ()),
    )
    job_id = create_backend(backend).submit(script.read_text(), options)
    typer.echo(json.dumps({"job_id": job_id}) if as_json else job_id)


@app.command()
def query(
    job_ids: Annotated[list[str], typer.Argument(help="job ids")],
    backend: BackendOpt = "slurm",
    as_json: JsonOpt = False,
) -> None:
    """Show the state of jobs (one scheduler command for all of them)."""
    result = create_backend(backend).query(job_ids)
    if as_json:
        typer.echo(json.dumps(_jsonable(result), indent=2))
    else:
        _console().print(jobs_table(list(result.values())))


@app.command()
def cancel(job_id: str, backend: BackendOpt = "slurm") -> None:
    """Cancel a job (a job that already ended is not an error)."""
    create_backend(backend).cancel(job_id)


@app.command()
def requeue(
    job_id: str,
    hold: Annotated[bool, typer.Option("--hold", help="keep it held until released")] = False,
    backend: BackendOpt = "slurm",
) -> None:
    """Put a running or finished job back in the queue."""
    create_backend(backend).requeue(job_id, hold=hold)


@app.command()
def release(job_id: str, backend: BackendOpt = "slurm") -> None:
    """Release a held job."""
    create_backend(backend).release(job_id)


@app.command("start-now")
def start_now(job_id: str, backend: BackendOpt = "slurm") -> None:
    """Make a pending job eligible at once (drops the requeue delay)."""
    create_backend(backend).start_now(job_id)


@app.command()
def exclude(
    job_id: str,
    nodes: Annotated[str, typer.Argument(help="n1,n2 (empty string clears)")],
    backend: BackendOpt = "slurm",
) -> None:
    """Replace the excluded nodes of a pending job."""
    create_backend(backend).update_excluded_nodes(job_id, [n for n in nodes.split(",") if n])


@app.command()
def signal(
    job_id: str,
    sig: Annotated[str, typer.Argument(help="e.g. USR1")],
    target: Annotated[
        SignalTarget,
        typer.Option(
            "--target", help="steps: every task of every step; batch: the batch shell; all: both."
        ),
    ] = SignalTarget.STEPS,
    backend: BackendOpt = "slurm",
) -> None:
    """Send a signal to a job's steps, its batch shell, or both."""
    create_backend(backend).signal(job_id, sig, target)


@app.command()
def nodes(backend: BackendOpt = "slurm", as_json: JsonOpt = False) -> None:
    """List the nodes with their states."""
    result = create_backend(backend).nodes()
    if as_json:
        typer.echo(json.dumps(_jsonable(result), indent=2))
        return
    table = Table("node", "state", "raw", "reason")
    for node in result:
        table.add_row(node.name, node.state.value, node.raw_state, node.reason or "")
    _console().print(table)


@app.command()
def facts(backend: BackendOpt = "slurm", as_json: JsonOpt = False) -> None:
    """Show the cluster settings ftslurm's decisions depend on."""
    result = create_backend(backend).cluster_facts()
    if as_json:
        typer.echo(json.dumps(_jsonable(result), indent=2))
        return
    for key, value in dataclasses.asdict(result).items():
        typer.echo(f"{key}: {value}")
