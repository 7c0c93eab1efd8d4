"""`ftslurm mock ...`: create, inspect, break and stop the mock cluster (laptop rehearsal).

The mock cluster lives in `FTSLURM_MOCK_HOME` (default `<ftslurm state dir>/mock`); use it
from other commands with `--backend mock`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ftslurm.backends import mock_home
from ftslurm.backends.mock import MockConfig, MockNodeSpec, MockScheduler
from ftslurm.backends.mock import procs as mock_procs
from ftslurm.backends.mock.controller import controller_pid, ensure_controller
from ftslurm.errors import ConfigError

app = typer.Typer(
    help="The mock Slurm cluster: rehearse failures without a cluster.", no_args_is_help=True
)


def _load_config(path: Path | None, nodes: int | None, **overrides) -> MockConfig | None:
    data: dict = {}
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"mock config {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ConfigError(f"mock config {str(path)!r} is not JSON: {exc}") from None
    if nodes is not None:
        data["nodes"] = [MockNodeSpec(name=f"n{i}").model_dump() for i in range(1, nodes + 1)]
    data.update({k: v for k, v in overrides.items() if v is not None})
    if not data:
        return None
    try:
        return MockConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"bad mock config: {where}: {first['msg']}") from None


def _default(setting: str):
    """A MockConfig setting's default, for the help texts."""
    field = MockConfig.model_fields[setting]
    return field.default_factory() if field.default_factory else field.default


@app.command()
def up(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="A JSON file of MockConfig settings. Default: Slurm's defaults.",
            show_default=False,
        ),
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes",
            min=1,
            help=f"Number of nodes (n1, n2, ...). Default: {len(_default('nodes'))}.",
            show_default=False,
        ),
    ] = None,
    slurmd_timeout: Annotated[
        int | None,
        typer.Option(
            "--slurmd-timeout",
            min=0,
            help="Seconds a failed node stays silent before it is "
            f"declared DOWN (SlurmdTimeout). Default: {_default('slurmd_timeout_s')}.",
            show_default=False,
        ),
    ] = None,
    requeue_delay: Annotated[
        int | None,
        typer.Option(
            "--requeue-delay",
            min=0,
            help="Seconds a requeued job waits before it may start "
            f"again. Default: {_default('requeue_delay_s')}.",
            show_default=False,
        ),
    ] = None,
    min_job_age: Annotated[
        int | None,
        typer.Option(
            "--min-job-age",
            min=0,
            help="Seconds an ended job stays visible in the queue "
            f"(MinJobAge). Default: {_default('min_job_age_s')}.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Create the mock cluster (settings apply only when it is new) and start its controller."""
    home = mock_home()
    fresh = not (home / "mock.sqlite").exists()
    cfg = _load_config(
        config,
        nodes,
        slurmd_timeout_s=slurmd_timeout,
        requeue_delay_s=requeue_delay,
        min_job_age_s=min_job_age,
    )
    if cfg is not None and not fresh:
        raise ConfigError(
            f"a mock cluster already exists in {home}; `ftslurm mock destroy` "
            "first to change its settings"
        )
    MockScheduler(home, cfg)
    ensure_controller(home)
    typer.echo(f"mock cluster {'created' if fresh else 'running'} in {home}")


@app.command()
def status() -> None:
    """Nodes and the controller of the mock cluster."""
    home = mock_home()
    if not (home / "mock.sqlite").exists():
        raise ConfigError(f"no mock cluster in {home}; run `ftslurm mock up`")
    table = Table("node", "state", "raw", "reason")
    for node in MockScheduler(home).nodes():
        table.add_row(node.name, node.state.value, node.raw_state, node.reason or "")
    Console(soft_wrap=True).print(table)
    pid = controller_pid(home)
    typer.echo(f"controller: {'running, pid ' + str(pid) if pid else 'stopped'}")


@app.command("fail-node")
def fail_node(node: str) -> None:
    """Kill a node: its processes die now; it is DOWN after SlurmdTimeout."""
    MockScheduler(mock_home()).fail_node(node)


@app.command()
def preempt(job_id: str) -> None:
    """Preempt a running job now: SIGTERM, SIGKILL after KillWait, then requeued (as the
    `preempt` injection, at the moment you choose)."""
    MockScheduler(mock_home()).preempt(job_id)


@app.command("revive-node")
def revive_node(node: str) -> None:
    """Bring a failed node back."""
    MockScheduler(mock_home()).revive_node(node)


@app.command()
def reset() -> None:
    """Start over after a rehearsal: every failed, down or drained node back up, and
    ftslurm's exclusions of the mock's nodes cleared (those flagged by dry runs or by hand),
    in one command. Runs, jobs and settings are kept."""
    from ftslurm.backends.slurm_cli.parse import compress_nodes
    from ftslurm.cli.common import _store
    from ftslurm.cli.nodes import _ask_daemon
    from ftslurm.core.types import NodeState
    from ftslurm.daemon import user_requests

    home = mock_home()
    if not (home / "mock.sqlite").exists():
        raise ConfigError(f"no mock cluster in {home}; run `ftslurm mock up`")
    mock = MockScheduler(home)
    infos = mock.nodes()
    broken = [
        n.name
        for n in infos
        if not n.responding or not n.state.usable or n.state is NodeState.DRAINING
    ]
    for name in broken:
        mock.revive_node(name)
    said = [f"{compress_nodes(broken)} back up" if broken else "every node was up"]
    names = {n.name for n in infos}
    with _store() as store:
        mock_runs = {r.run_id for r in store.list_runs() if r.spec.get("backend") == "mock"}
        flagged = sorted(
            f.node
            for f in store.node_flags()
            if f.node in names and (f.run_id is None or f.run_id in mock_runs)
        )
    if flagged:
        done, note = _ask_daemon(*user_requests.nodes_remove(flagged))
        said.append(
            f"{compress_nodes(flagged)} no longer excluded"
            if done is not None
            else f"removing the exclusion of {compress_nodes(flagged)}: {note}"
        )
    else:
        said.append("no exclusions to clear")
    typer.echo(f"mock cluster in {home} reset: {'; '.join(said)}")


def _stop(home: Path) -> None:
    pid = controller_pid(home)
    if pid:
        os.kill(pid, signal.SIGTERM)
    for job_dir in sorted((home / "jobs").glob("*")):
        mock_procs.kill_job(job_dir)


@app.command()
def down() -> None:
    """Stop the controller and kill every job process; the cluster's state is kept."""
    _stop(mock_home())
    typer.echo("mock cluster stopped")


@app.command()
def destroy() -> None:
    """`down`, then delete the mock cluster (its jobs, state and settings)."""
    home = mock_home()
    _stop(home)
    shutil.rmtree(home, ignore_errors=True)
    typer.echo(f"mock cluster in {home} removed")
