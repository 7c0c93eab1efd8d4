"""The run commands: submit, status, wait, cancel, logs, nodes, daemon, watch.

All of them read and write the state directory (`FTSLURM_HOME`, default the platform's
user state dir); the daemon owns the runs once submitted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ftslurm.backends import create_backend, mock_home, state_dir
from ftslurm.core.inject import parse_injections
from ftslurm.daemon import service
from ftslurm.daemon.reconcile import NEVER_SUBMITTED, new_run_record
from ftslurm.daemon.records import NodeFlag, Run, RunState
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import (
    ConfigError,
    FtslurmError,
    InvalidJobId,
    JobStateConflict,
    SchedulerRejected,
    SchedulerUnavailable,
)
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
    store = Store(home)
    private_dir(run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    run, attempt = new_run_record(run_id, loaded.name or recipe.name, spec, settings, time.time())
    with store.transaction():  # the run and its submission intent: the daemon submits it
        store.add_run(run)
        store.add_attempt(attempt)
        store.append_event(run_id, "created", {"recipe": str(recipe)}, time.time())
    _pause_for_tests()
    job_id, note = _await_submission(store, home, run_id)
    where = " on the mock scheduler" if dry_run else ""
    if as_json:
        typer.echo(json.dumps({"run_id": run_id, "job_id": job_id}))
    elif job_id:
        typer.echo(f"run {run_id} submitted as job {job_id}{where}; "
                   f"see `ftslurm status {run_id}`")  # fmt: skip
    else:
        typer.echo(f"run {run_id} recorded{where}; {note}; see `ftslurm status {run_id}`")


# How long `submit` waits for the daemon to submit the run, and `cancel` for a submission
# under way to be recorded (seconds).
SUBMIT_WAIT_S = 60.0
# Test hook: `submit` stops itself (SIGSTOP) right after recording the run when this is set,
# so a test can hold it at the worst moment.
PAUSE_ENV = "FTSLURM_TEST_PAUSE_AFTER_RECORD"


def _pause_for_tests() -> None:
    if os.environ.get(PAUSE_ENV):
        os.kill(os.getpid(), signal.SIGSTOP)


def _await_submission(store: Store, home: Path, run_id: str) -> tuple[str | None, str]:
    """Start or wake the daemon (the only party that submits) and wait, bounded, until it
    recorded the job id or ended the run. Returns the job id, or None and what happens
    next; `SchedulerRejected` when the scheduler refused the job."""
    later = "the daemon will submit it"
    try:
        service.start(home)
        service.wake(home)
    except FtslurmError as exc:
        return None, f"{later} once it runs ({exc.user_message()})"
    deadline = time.monotonic() + SUBMIT_WAIT_S
    while True:
        run = store.get_run(run_id)
        latest = store.latest_attempt(run_id)
        if latest is not None and latest.job_id:
            return latest.job_id, ""
        if run is not None and run.state.is_terminal:
            if latest is not None and latest.state == NEVER_SUBMITTED:
                raise SchedulerRejected(f"the scheduler refused the job: {latest.reason}")
            return None, f"it ended {run.state.value}: {run.reason}"
        deferred = [e for e in store.events(run_id) if e.kind == "submit_deferred"]
        if deferred:
            return None, (f"{later} when the scheduler answers "
                          f"({deferred[-1].data.get('message')})")  # fmt: skip
        if time.monotonic() >= deadline:
            return None, f"{later}: the scheduler did not answer within {SUBMIT_WAIT_S:g}s"
        if service.running_pid(home) is None:
            return None, f"{later} once it runs (`ftslurm daemon start`)"
        time.sleep(0.1)


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
    run_id = run.run_id
    # the flag and the latest attempt in one transaction: the daemon records a new job id
    # and reads the flag in one too, so either this sees the job or the daemon sees the flag
    requested, latest = store.request_cancel(run_id, time.time())
    if not requested:
        ended = store.get_run(run_id) or run
        typer.echo(f"run {run_id} already ended ({ended.state.value})")
        return
    home = state_dir()
    service.start(home)
    service.wake(home)
    deadline = time.monotonic() + SUBMIT_WAIT_S
    while latest is not None and not latest.job_id and time.monotonic() < deadline:
        # a submission may be under way: wait until the daemon recorded its job (and
        # cancelled it) or ended the run, so that no job starts after this replies
        current = store.get_run(run_id)
        if current is None or current.state.is_terminal:
            break
        time.sleep(0.1)
        latest = store.latest_attempt(run_id)
    if latest is not None and latest.job_id:
        try:
            create_backend(run.spec["backend"], run.spec.get("mock_home")).cancel(latest.job_id)
        except (SchedulerUnavailable, JobStateConflict, InvalidJobId):
            pass  # ended already, or the daemon cancels it when the scheduler answers
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
