"""`ftslurm daemon ...`: start, stop, status, recover, run (foreground) and submit (the
daemon as a Slurm job)."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Annotated

import typer

from ftslurm.backends import create_backend
from ftslurm.cli.common import JsonOpt, _opt, _store, _Text
from ftslurm.core.leases import DAEMON_LEASE_TIMEOUT_S
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.daemon import as_job, service
from ftslurm.daemon.store import Store
from ftslurm.errors import ConfigError
from ftslurm.paths import state_dir
from ftslurm.recipe import sbatch_flags
from ftslurm.report.notes import fmt_age

daemon_app = typer.Typer(help="The daemon that owns the runs.", no_args_is_help=True)


# How long a daemon's lease must stay silent before another daemon takes it over.
LeaseTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--lease-timeout",
        min=1.0,
        help="Seconds a daemon's lease must stay silent (its daemon "
        "dead or cut off) before another daemon takes it over.",
    ),
]


@daemon_app.command("start")
def daemon_start() -> None:
    """Start the daemon for this state directory (no-op if it runs)."""
    typer.echo(f"daemon running ({service.start(state_dir(), auto=False).describe()})")


@daemon_app.command("submit")
def daemon_submit(
    time_limit: Annotated[
        str,
        typer.Option(
            "--time",
            "-t",
            help="The daemon job's time limit (Slurm syntax); it hands over to "
            "a successor job before it.",
        ),
    ] = as_job.DEFAULT_TIME,
    partition: Annotated[
        _Text,
        _opt("--partition", "-p", help="Partition of the daemon job (default: the cluster's)."),
    ] = None,
    account: Annotated[
        _Text, _opt("--account", "-A", help="Account of the daemon job (default: the user's).")
    ] = None,
    handover: Annotated[
        int,
        typer.Option(
            "--handover",
            min=60,
            help="Seconds before the time limit at which the daemon job "
            "submits its successor and hands over.",
        ),
    ] = as_job.DEFAULT_HANDOVER_S,
    lease_timeout: LeaseTimeoutOpt = DAEMON_LEASE_TIMEOUT_S,
    sbatch_arg: Annotated[
        list[str] | None,
        _opt(
            "--sbatch-arg",
            help="Any other sbatch "
            "flag for the daemon job, e.g. --sbatch-arg=--qos=long; "
            "repeatable (default: none).",
        ),
    ] = None,
    print_script: Annotated[
        bool, _opt("--print-script", help="Print the daemon job's script and submit nothing.")
    ] = False,
) -> None:
    """Run the daemon as a small Slurm job (one CPU, requeued if its node dies, handing
    over to a successor job before its time limit): no service on a login node needed."""
    limit = parse_time_limit(time_limit)
    if limit is None:
        raise ConfigError("--time: the daemon job needs a time limit")
    if handover >= limit:
        raise ConfigError(f"--handover {handover}s is not shorter than --time {time_limit}")
    given = sbatch_flags(list(sbatch_arg or ()), "--sbatch-arg")
    extra = dict(given.pop("sbatch_extra", {}))
    partition, account = given.pop("partition", partition), given.pop("account", account)
    if "exclude" in given:  # nodes the daemon job must avoid: a plain sbatch flag here
        nodes = given.pop("exclude")
        extra["exclude"] = nodes if isinstance(nodes, str) else ",".join(nodes)
    if given:
        raise ConfigError(
            f"--sbatch-arg: the daemon job sets {', '.join(sorted(given))} "
            "itself (one task on one node; --time, --partition, --account, "
            "--exclude and other sbatch flags are taken)"
        )
    job = as_job.DaemonJob(
        state_dir(), sys.executable, time_limit, handover, lease_timeout, partition, account, extra
    )
    options = job.options()  # a bad value is one line here, before anything is submitted
    if print_script:
        typer.echo(job.script(), nl=False)
        return
    home = state_dir()
    with Store(home) as store:
        store.check_integrity()
    found = service.serving(home)
    if found is not None and not found.pending:
        raise ConfigError(
            f"a daemon already serves {home} ({found.describe()})",
            hint="stop it first, or let it serve",
        )
    del options
    job_id = as_job.submit(create_backend("slurm"), job)
    typer.echo(f"daemon job {job_id} submitted; `ftslurm daemon status` shows where it runs")


@daemon_app.command("stop")
def daemon_stop() -> None:
    """Stop the daemon; runs are kept and resumed by the next one."""
    pid = service.stop(state_dir())
    typer.echo("no daemon was running" if pid is None else f"daemon (pid {pid}) stopped")


@daemon_app.command("status")
def daemon_status(as_json: JsonOpt = False) -> None:
    """Whether the daemon runs, and how many runs it owns."""
    home = state_dir()
    found = service.serving(home) or service.queued_daemon_job(home)
    active = len(_store().list_runs(active_only=True))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "running": found is not None and not found.pending,
                    "pid": found.pid if found and not found.pending else None,
                    "host": found.host if found and not found.pending else None,
                    "job_id": found.job_id if found else None,
                    "home": str(home),
                    "active_runs": active,
                }
            )
        )
    else:
        state = (
            "not running"
            if found is None
            else f"queued ({found.describe()})"
            if found.pending
            else f"running ({found.describe()})"
        )
        typer.echo(f"daemon {state}; {active} active run(s) in {home}")
    if found is None and active:
        raise typer.Exit(1)


@daemon_app.command("recover")
def daemon_recover() -> None:
    """Restore the state database from its last backup (the daemon must be stopped); the
    damaged files are kept."""
    restored = service.recover(state_dir())
    if restored.taken_at is None:
        typer.echo(
            f"the state database is sound and keeps its {restored.runs} run(s) "
            f"({restored.active_runs} active); runs it had lost are rebuilt"
        )
    else:
        age = max(0.0, time.time() - restored.taken_at)
        kept = f"; the replaced files are in {restored.kept_in}" if restored.kept_in else ""
        typer.echo(
            f"restored {restored.runs} run(s) ({restored.active_runs} active) from the "
            f"backup of {datetime.fromtimestamp(restored.taken_at):%Y-%m-%d %H:%M:%S} "
            f"({fmt_age(age)} old){kept}"
        )
    for line in restored.rebuilt:  # runs rebuilt from their folders, jobs nothing manages
        typer.echo(line)


@daemon_app.command("run")
def daemon_run(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log at debug level (default: info).")
    ] = False,
    lease_timeout: LeaseTimeoutOpt = DAEMON_LEASE_TIMEOUT_S,
    job: Annotated[
        bool, typer.Option("--job", hidden=True, help="Run as a daemon job (`daemon submit`).")
    ] = False,
    successor: Annotated[
        bool,
        typer.Option(
            "--successor", hidden=True, help="A daemon job's successor: wait for the lease."
        ),
    ] = False,
) -> None:
    """Run the daemon in the foreground (for a systemd user unit)."""
    service.configure_logging(verbose)
    service.serve(state_dir(), lease_timeout_s=lease_timeout, job=job, successor=successor)
