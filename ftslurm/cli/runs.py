"""The run commands: submit, status, wait, cancel, logs, nodes, daemon, watch.

All of them read and write the state directory (`FTSLURM_HOME`, default the platform's
user state dir); the daemon owns the runs once submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ftslurm.backends import MOCK_HOME_ENV, create_backend, mock_home, state_dir
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.inject import parse_injections
from ftslurm.core.types import JobInfo
from ftslurm.daemon import service
from ftslurm.daemon.reconcile import new_run_record, submit_attempt
from ftslurm.daemon.records import SUBMITTING, NodeFlag, Run, RunState
from ftslurm.daemon.store import Store, marked_backends
from ftslurm.daemon.submission import backend_key, build_attempt, make_spec, tag
from ftslurm.errors import ConfigError, FtslurmError, SchedulerRejected, SchedulerUnavailable
from ftslurm.fsutil import private_dir
from ftslurm.recipe import load_recipe

console = Console()
err = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _store() -> Store:
    return Store(state_dir())


def _run_or_fail(store: Store, run_id: str) -> Run:
    """The run named by its id or by a unique prefix of it (as `git` takes a commit)."""
    runs = store.find_runs(run_id) if run_id else []
    if not runs:
        raise ConfigError(f"no run {run_id!r} in {store.path.parent}")
    if len(runs) > 1:
        names = ", ".join(r.run_id for r in runs[:5]) + (", ..." if len(runs) > 5 else "")
        raise ConfigError(f"run id prefix {run_id!r} is ambiguous: {names}")
    return runs[0]


# ---------------------------------------------------------------------------- submit
def submit(
    recipe: Annotated[Path, typer.Argument(help="A training script or a recipe file.")],
    args: Annotated[list[str] | None, typer.Argument(help="Arguments after `--`.")] = None,
    retries: Annotated[int | None, typer.Option("--retries",
                       help="num_job_retries_on_failure")] = None,
    in_job_restarts: Annotated[int | None, typer.Option("--in-job-restarts")] = None,
    preempt_time: Annotated[int | None, typer.Option("--preempt-time",
                            help="Seconds before the wall limit to ask for a checkpoint.")] = None,
    nodes: Annotated[int | None, typer.Option("-N", "--nodes")] = None,
    ntasks_per_node: Annotated[int | None, typer.Option("--ntasks-per-node")] = None,
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node")] = None,
    time_limit: Annotated[str | None, typer.Option("-t", "--time")] = None,
    partition: Annotated[str | None, typer.Option("-p", "--partition")] = None,
    account: Annotated[str | None, typer.Option("-A", "--account")] = None,
    exclude: Annotated[str | None, typer.Option("--exclude")] = None,
    name: Annotated[str | None, typer.Option("--name")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option("--checkpoint-dir")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run",
                       help="Run against the mock scheduler (laptop rehearsal).")] = False,
    inject: Annotated[list[str] | None, typer.Option("--inject",
                      help="KIND@TIME[:TARGET], repeatable (docs/fault-injection.md).")] = None,
    print_script: Annotated[bool, typer.Option("--print-script",
                            help="Print the sbatch script of the first attempt; submit nothing.")
                            ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a training run; the daemon then owns it until it ends."""
    loaded = load_recipe(recipe, list(args or ()))
    loaded = loaded.with_overrides(
        num_job_retries_on_failure=retries, num_in_job_restarts=in_job_restarts,
        preempt_time=preempt_time, nodes=nodes, ntasks_per_node=ntasks_per_node,
        gpus_per_node=gpus_per_node, time=time_limit, partition=partition, account=account,
        exclude=tuple(n for n in exclude.split(",") if n) if exclude is not None else None,
        name=name, checkpoint_dir=checkpoint_dir,
    )  # fmt: skip
    injections = parse_injections(tuple(inject or ()))
    backend_kind = "mock" if dry_run else "slurm"
    cluster_side = [i.kind.value for i in injections if not i.kind.in_job]
    if cluster_side and not dry_run:
        raise ConfigError(f"{', '.join(cluster_side)} can only be injected with --dry-run "
                          "(the mock scheduler)")  # fmt: skip
    home = state_dir()
    run_id = uuid.uuid4().hex[:10]
    run_dir = home / "runs" / run_id
    settings = loaded.settings()
    spec = make_spec(loaded, run_dir=run_dir, backend=backend_kind, workdir=str(Path.cwd()),
                     inject=tuple(i.spec() for i in injections),
                     mock_home=mock_home() if dry_run else None)  # fmt: skip
    script, _ = build_attempt(run_id, spec, settings.model_dump(mode="json"), 0, ())
    if print_script:
        typer.echo(script, nl=False)
        return
    if dry_run and not as_json:
        err.print("[dim]# dry run on the mock scheduler; attempt 0 runs:[/]")
        err.print(script, markup=False, highlight=False)
    store = Store(home)
    store.check_integrity()  # a damaged database is refused before anything is submitted
    private_dir(run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    run, attempt = new_run_record(run_id, loaded.name or recipe.name, spec, settings, time.time())
    with store.transaction():
        store.add_run(run)
        store.add_attempt(attempt)
        store.append_event(run_id, "created", {"recipe": str(recipe)}, time.time())
    job_id: str | None = None
    try:
        backend = create_backend(backend_kind, spec["mock_home"])
        attempt = submit_attempt(store, backend, run, attempt, adopt=False)
        job_id = attempt.job_id
    except SchedulerUnavailable as exc:
        err.print(f"the scheduler did not answer ({exc.message}); the daemon will submit "
                  "as soon as it does", markup=False)  # fmt: skip
    except SchedulerRejected as exc:
        store.update_run(replace(run, state=RunState.FAILED, reason=f"rejected: {exc.message}",
                                 ended_at=time.time()))  # fmt: skip
        raise
    service.start(home)
    service.wake(home)
    if as_json:
        typer.echo(json.dumps({"run_id": run_id, "job_id": job_id}))
    else:
        typer.echo(f"run {run_id} submitted as job {job_id}" if job_id else f"run {run_id}")


# ---------------------------------------------------------------------------- status
def run_summary(store: Store, run: Run) -> dict[str, Any]:
    attempts = store.attempts(run.run_id)
    return {
        "run_id": run.run_id, "name": run.name, "state": run.state.value,
        "attempts": [{
            "attempt": a.attempt, "job_id": a.job_id, "state": a.state,
            "exit_code": a.exit_code, "nodes": a.nodes, "start": a.start, "end": a.end,
            "reason": a.reason, "cause": a.cause, "in_job_restarts": a.in_job_restarts,
        } for a in attempts],
        "job_retries_used": run.job_retries_used,
        "job_retries_max": run.settings.get("num_job_retries_on_failure"),
        "in_job_restarts_total": sum(a.in_job_restarts for a in attempts),
        "continuations": run.continuations,
        "excluded_nodes": sorted(f.node for f in store.node_flags(time.time())),
        "last_checkpoint_step": run.last_checkpoint_step,
        "reason": run.reason, "backend": run.spec.get("backend"),
        "run_dir": run.spec.get("run_dir"),
    }  # fmt: skip


def _fmt_time(t: float | None) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else "-"


_STYLE = {"COMPLETED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan"}


def _table(summaries: list[dict[str, Any]]) -> Table:
    table = Table("run", "name", "state", "attempt", "job", "job state", "nodes", "retries",
                  "cont.", "ckpt step", "reason", title="ftslurm runs")  # fmt: skip
    for s in summaries:
        last = s["attempts"][-1] if s["attempts"] else {}
        style = _STYLE.get(s["state"], "")
        table.add_row(
            s["run_id"], s["name"], f"[{style}]{s['state']}[/]" if style else s["state"],
            str(last.get("attempt", "-")), str(last.get("job_id") or "-"),
            str(last.get("state", "-")), ",".join(last.get("nodes") or []) or "-",
            f"{s['job_retries_used']}/{s['job_retries_max']}", str(s["continuations"]),
            str(s["last_checkpoint_step"] if s["last_checkpoint_step"] is not None else "-"),
            s["reason"] or "",
        )  # fmt: skip
    return table


def status(
    run_id: Annotated[str | None, typer.Argument()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show runs (all, or one) with their attempts."""
    store = _store()
    runs = [_run_or_fail(store, run_id)] if run_id else store.list_runs()
    warn_orphan_jobs(store, runs)
    summaries = [run_summary(store, r) for r in runs]
    if as_json:
        typer.echo(json.dumps(summaries[0] if run_id else summaries, indent=1))
        return
    console.print(_table(summaries))
    if run_id:
        attempts = Table("attempt", "job", "state", "cause", "exit", "nodes", "start", "end",
                         "reason", title=f"attempts of {run_id}")  # fmt: skip
        for a in summaries[0]["attempts"]:
            attempts.add_row(str(a["attempt"]), str(a["job_id"] or "-"), a["state"],
                             a["cause"] or "-", str(a["exit_code"] if a["exit_code"] is not None
                                                    else "-"),
                             ",".join(a["nodes"]) or "-", _fmt_time(a["start"]),
                             _fmt_time(a["end"]), a["reason"] or "")  # fmt: skip
        console.print(attempts)
        s = summaries[0]
        console.print(f"{s['state']}" + (f": {s['reason']}" if s["reason"] else ""),
                      markup=False, highlight=False, soft_wrap=True)  # fmt: skip


def tagged_run(comment: str | None) -> str | None:
    """The run id in a job's ftslurm tag (`submission.tag`), or None for any other comment."""
    parts = (comment or "").split(":")
    if len(parts) == 3 and parts[2].isdigit() and tag(parts[1], int(parts[2])) == comment:
        return parts[1]
    return None


def orphan_jobs(jobs: list[JobInfo], known: set[str]) -> dict[str, str]:
    """Job id -> run id of the tagged jobs whose run is not in `known`."""
    found = {job.job_id: tagged_run(job.comment) for job in jobs}
    return {job: run for job, run in found.items() if run is not None and run not in known}


def _cheap_backends(store: Store, runs: list[Run]) -> list[SchedulerBackend]:
    """The backends this state directory has used (its runs', those the daemon recorded
    beside the database, the mock `FTSLURM_MOCK_HOME` names), where asking is cheap: a mock
    cluster that exists; the Slurm CLI where `squeue` exists, one try with a short timeout."""
    from ftslurm.backends.mock import MockScheduler
    from ftslurm.backends.mock.store import DB_FILE
    from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend

    keys = {backend_key(r.spec) for r in runs if "backend" in r.spec}
    keys |= set(marked_backends(store.home))
    if os.environ.get(MOCK_HOME_ENV):
        keys.add(f"mock:{mock_home()}")
    found: list[SchedulerBackend] = []
    for key in sorted(keys):
        kind, _, where = key.partition(":")
        if kind == "mock" and (Path(where or mock_home()) / DB_FILE).exists():
            found.append(MockScheduler(Path(where or mock_home())))
        elif kind == "slurm" and shutil.which("squeue"):
            found.append(SlurmCliBackend(CommandRunner(timeout_s=5.0), query_budget_s=0.0))
    return found


def warn_orphan_jobs(store: Store, runs: list[Run]) -> None:
    """Warn (one line, stderr) about jobs ftslurm tagged for runs this state directory does
    not have: their runs were lost with the database, and nothing manages them."""
    orphans: dict[str, str] = {}
    known = {r.run_id for r in runs}
    for backend in _cheap_backends(store, runs):
        try:
            jobs = backend.active_jobs()
        except FtslurmError:
            continue  # a scheduler that does not answer now is not worth a wait here
        for job, run in orphan_jobs(jobs, known).items():
            if store.get_run(run) is None:
                orphans[job] = run
    if orphans:
        err.print(f"warning: job(s) {', '.join(sorted(orphans))} carry ftslurm tags of "
                  f"run(s) {', '.join(sorted(set(orphans.values())))} that are not in "
                  f"{store.path}: nothing manages them (state lost? see `ftslurm daemon "
                  "recover`, or cancel them)", markup=False, highlight=False,
                  soft_wrap=True)  # fmt: skip


# ---------------------------------------------------------------------------- wait
def wait(
    run_id: Annotated[str, typer.Argument()],
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds.")] = None,
) -> None:
    """Wait for a run to end: exit 0 COMPLETED, 1 FAILED or CANCELLED, 124 on timeout."""
    store = _store()
    run = _run_or_fail(store, run_id)
    if not run.state.is_terminal:
        service.start(state_dir())
    deadline = None if timeout is None else time.monotonic() + timeout
    while not run.state.is_terminal:
        if deadline is not None and time.monotonic() >= deadline:
            err.print(f"run {run_id} is still {run.state.value} after {timeout:g}s")
            raise typer.Exit(124)
        time.sleep(0.25)
        run = _run_or_fail(store, run_id)
    err.print(f"run {run_id} {run.state.value}" + (f": {run.reason}" if run.reason else ""),
              markup=False)  # fmt: skip
    raise typer.Exit(0 if run.state is RunState.COMPLETED else 1)


# ---------------------------------------------------------------------------- cancel
def cancel(run_id: Annotated[str, typer.Argument()]) -> None:
    """Cancel a run: its current job is cancelled and nothing is retried."""
    store = _store()
    run = _run_or_fail(store, run_id)
    if run.state.is_terminal:
        typer.echo(f"run {run_id} already ended ({run.state.value})")
        return
    store.update_run(replace(run, cancel_requested=True))
    store.append_event(run_id, "cancel_requested", {}, time.time())
    latest = store.latest_attempt(run_id)
    if latest and latest.job_id and latest.state != SUBMITTING:
        try:
            create_backend(run.spec["backend"], run.spec.get("mock_home")).cancel(latest.job_id)
        except SchedulerUnavailable:
            pass  # the daemon cancels it when the scheduler answers
    service.start(state_dir())
    service.wake(state_dir())
    typer.echo(f"run {run_id}: cancel requested")


# ---------------------------------------------------------------------------- logs
def _attempt_sections(text: str) -> dict[int, str]:
    """Split a job's output into attempts by the header line the batch script prints."""
    sections: dict[int, list[str]] = {}
    current: int | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("=== ftslurm run ") and " attempt " in line:
            try:
                current = int(line.split(" attempt ", 1)[1].split(":", 1)[0])
            except ValueError:
                current = None
        if current is not None:
            sections.setdefault(current, []).append(line)
    return {k: "".join(v) for k, v in sections.items()}


def logs(
    run_id: Annotated[str, typer.Argument()],
    attempt: Annotated[int | None, typer.Option("--attempt", help="Default: the latest.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
) -> None:
    """Print the output of an attempt (the latest by default)."""
    store = _store()
    run = _run_or_fail(store, run_id)
    attempts = store.attempts(run_id)
    chosen = attempts[-1] if attempt is None else next(
        (a for a in attempts if a.attempt == attempt), None)  # fmt: skip
    if chosen is None:
        raise ConfigError(f"run {run_id} has no attempt {attempt}")
    if not chosen.job_id:
        raise ConfigError(f"attempt {chosen.attempt} of run {run_id} has no job yet")
    path = Path(run.spec["run_dir"]) / "logs" / f"job-{chosen.job_id}.out"
    shown = 0
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        section = _attempt_sections(text).get(chosen.attempt, "")
        sys.stdout.write(section[shown:])
        sys.stdout.flush()
        shown = len(section)
        run = _run_or_fail(store, run_id)
        current = store.latest_attempt(run_id)
        if not follow or run.state.is_terminal or (current and current.attempt != chosen.attempt):
            return
        time.sleep(0.5)


# ---------------------------------------------------------------------------- nodes
nodes_app = typer.Typer(help="The node exclusion list every later attempt gets.",
                        no_args_is_help=False, invoke_without_command=True)  # fmt: skip


@nodes_app.callback()
def nodes_default(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    if ctx.invoked_subcommand is None:
        nodes_list(as_json)


@nodes_app.command("list")
def nodes_list(as_json: JsonOpt = False) -> None:
    """Show excluded nodes with their reasons and expiry."""
    flags = _store().node_flags(time.time())
    if as_json:
        typer.echo(json.dumps([f.__dict__ for f in flags]))
        return
    table = Table("node", "reason", "since", "expires", "run", title="excluded nodes")
    for f in flags:
        table.add_row(f.node, f.reason, _fmt_time(f.since),
                      _fmt_time(f.expires_at) if f.expires_at else "never", f.run_id or "-")
    console.print(table)


@nodes_app.command("add")
def nodes_add(
    node: Annotated[str, typer.Argument()],
    reason: Annotated[str, typer.Option("--reason")] = "added by hand",
    ttl: Annotated[float | None, typer.Option("--ttl", help="Seconds; default: never.")] = None,
) -> None:
    """Keep a node out of every later attempt."""
    now = time.time()
    _store().flag_node(NodeFlag(node=node, reason=reason, since=now,
                                expires_at=now + ttl if ttl else None))  # fmt: skip
    typer.echo(f"{node} excluded")


@nodes_app.command("remove")
def nodes_remove(node: Annotated[str, typer.Argument()]) -> None:
    """Let a node be used again."""
    if not _store().unflag_node(node):
        raise ConfigError(f"{node} is not on the exclusion list")
    typer.echo(f"{node} no longer excluded")


# ---------------------------------------------------------------------------- daemon
daemon_app = typer.Typer(help="The daemon that owns the runs.", no_args_is_help=True)


@daemon_app.command("start")
def daemon_start() -> None:
    """Start the daemon for this state directory (no-op if it runs)."""
    typer.echo(f"daemon running (pid {service.start(state_dir())})")


@daemon_app.command("stop")
def daemon_stop() -> None:
    """Stop the daemon; runs are kept and resumed by the next one."""
    pid = service.stop(state_dir())
    typer.echo("no daemon was running" if pid is None else f"daemon (pid {pid}) stopped")


@daemon_app.command("status")
def daemon_status(as_json: JsonOpt = False) -> None:
    """Whether the daemon runs, and how many runs it owns."""
    home = state_dir()
    pid = service.running_pid(home)
    active = len(_store().list_runs(active_only=True))
    if as_json:
        typer.echo(json.dumps({"running": pid is not None, "pid": pid, "home": str(home),
                               "active_runs": active}))  # fmt: skip
    else:
        state = f"running (pid {pid})" if pid else "not running"
        typer.echo(f"daemon {state}; {active} active run(s) in {home}")
    if pid is None and active:
        raise typer.Exit(1)


@daemon_app.command("recover")
def daemon_recover() -> None:
    """Restore the state database from its last backup (the daemon must be stopped); the
    damaged files are kept."""
    restored = service.recover(state_dir())
    age = max(0.0, time.time() - restored.taken_at)
    kept = f"; the replaced files are in {restored.kept_in}" if restored.kept_in else ""
    typer.echo(f"restored {restored.runs} run(s) ({restored.active_runs} active) from the "
               f"backup of {datetime.fromtimestamp(restored.taken_at):%Y-%m-%d %H:%M:%S} "
               f"({_fmt_age(age)} old){kept}")  # fmt: skip


def _fmt_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@daemon_app.command("run")
def daemon_run(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Run the daemon in the foreground (for a systemd user unit)."""
    service.configure_logging(verbose)
    service.serve(state_dir())


# ---------------------------------------------------------------------------- watch
def watch(
    interval: Annotated[float, typer.Option("--interval", help="Seconds.")] = 1.0,
    until_done: Annotated[bool, typer.Option("--until-done",
                          help="Return when no run is active.")] = False,
) -> None:
    """A live view of every run."""
    store = _store()
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            runs = store.list_runs()
            live.update(_table([run_summary(store, r) for r in runs]))
            if until_done and not any(not r.state.is_terminal for r in runs):
                return
            time.sleep(interval)


def register(app: typer.Typer) -> None:
    extra = {"allow_extra_args": False}
    app.command(context_settings=extra)(submit)
    app.command()(status)
    app.command()(wait)
    app.command()(cancel)
    app.command()(logs)
    app.command()(watch)
    app.add_typer(nodes_app, name="nodes")
    app.add_typer(daemon_app, name="daemon")
