"""The run commands: submit, status, wait, cancel, logs, nodes, daemon, watch.

All of them read and write the state directory (`FTSLURM_HOME`, default the platform's
user state dir); the daemon owns the runs once submitted.
"""

from __future__ import annotations

import json
import math
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

from ftslurm.backends import create_backend, mock_home, state_dir
from ftslurm.core.inject import parse_duration, parse_injections
from ftslurm.core.validate import OWNED_SBATCH_FLAGS
from ftslurm.daemon import service
from ftslurm.daemon.policy import FtSettings
from ftslurm.daemon.reconcile import new_run_record, submit_attempt
from ftslurm.daemon.records import SUBMITTING, NodeFlag, Run, RunState
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError, SchedulerRejected, SchedulerUnavailable
from ftslurm.fsutil import private_dir
from ftslurm.recipe import load_recipe, no_limit_warning, sbatch_flags

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
def _default(setting: str, unit: str = "") -> str:
    """The default of a fault-tolerance setting, for a help text (FtSettings holds it)."""
    value = FtSettings.model_fields[setting].default
    return f"(default: the recipe's {setting}, else {value}{unit})"


_SBATCH = "Passed to sbatch as is"
_RECIPE = "(default: the recipe's, else Slurm's)"
_Text = str | None


def _opt(*names: str, help: str, hidden: bool = False) -> Any:
    return typer.Option(*names, help=help, hidden=hidden, show_default=False)


def submit(
    recipe: Annotated[Path, typer.Argument(help="A training script or a recipe file.")],
    args: Annotated[list[str] | None, typer.Argument(help="Arguments after `--`.")] = None,
    retries: Annotated[int | None, _opt("--retries", help="Job resubmissions after a failure "
                       f"(num_job_retries_on_failure). {_default('num_job_retries_on_failure')}"
                       )] = None,
    in_job_restarts: Annotated[int | None, _opt("--in-job-restarts",
                               help="Rank restarts inside one job, per attempt. "
                               f"{_default('num_in_job_restarts')}")] = None,
    preempt_time: Annotated[_Text, _opt("--preempt-time", help="How long before the time "
                            "limit to ask for a checkpoint: 90, 90s, 5m, 1h (plain numbers are "
                            f"seconds; 0: never). {_default('preempt_time', ' s')}")] = None,
    nodes: Annotated[int | None, _opt("-N", "--nodes", help="Nodes. (default: the recipe's, "
                     "else 1)")] = None,
    ntasks_per_node: Annotated[int | None, _opt("--ntasks-per-node", help="Ranks per node. "
                               "(default: the recipe's, else --gpus-per-node, else --ntasks / "
                               "--nodes, else 1)")] = None,
    ntasks: Annotated[int | None, _opt("-n", "--ntasks", help="Ranks in all: a multiple of "
                      f"--nodes (ftslurm starts as many on each node). {_RECIPE}")] = None,
    gpus_per_node: Annotated[int | None, _opt("--gpus-per-node", help="GPUs per node; also "
                             f"the ranks per node unless --ntasks-per-node is given. {_RECIPE}"
                             )] = None,
    cpus_per_task: Annotated[int | None, _opt("-c", "--cpus-per-task",
                             help=f"CPUs per rank. {_RECIPE}")] = None,
    time_limit: Annotated[_Text, _opt("-t", "--time", help="Wall time limit of each attempt, "
                          "in sbatch's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                          "D-HH:MM:SS; UNLIMITED, infinite or 0 for no limit. "
                          "(default: the recipe's, else the partition's)")] = None,
    partition: Annotated[_Text, _opt("-p", "--partition", help=f"Partition. {_RECIPE}")] = None,
    account: Annotated[_Text, _opt("-A", "--account", help=f"Account. {_RECIPE}")] = None,
    exclude: Annotated[_Text, _opt("-x", "--exclude", help="Nodes never to use, "
                       "comma-separated (ftslurm adds the nodes it flags). (default: none)")
                       ] = None,
    name: Annotated[_Text, _opt("-J", "--job-name", "--name", help="Job name. (default: the "
                    "recipe's, else ftslurm-RUN_ID)")] = None,
    mem: Annotated[_Text, _opt("--mem", help=f"Memory per node, e.g. 64G (unit: M if none). "
                   f"{_SBATCH}. {_RECIPE}")] = None,
    mem_per_cpu: Annotated[_Text, _opt("--mem-per-cpu", help="Memory per CPU, e.g. 4G (unit: "
                           f"M if none). {_SBATCH}. {_RECIPE}")] = None,
    gres: Annotated[_Text, _opt("--gres", help=f"Generic resources per node, e.g. gpu:8. "
                    f"{_SBATCH}. {_RECIPE}")] = None,
    gpus: Annotated[_Text, _opt("-G", "--gpus", help=f"GPUs in all, e.g. 16 or a100:16. "
                    f"{_SBATCH}. {_RECIPE}")] = None,
    constraint: Annotated[_Text, _opt("-C", "--constraint", help="Node features, e.g. "
                          f"'a100&ib'. {_SBATCH}. {_RECIPE}")] = None,
    qos: Annotated[_Text, _opt("-q", "--qos", help=f"Quality of service. {_SBATCH}. {_RECIPE}")
                   ] = None,
    dependency: Annotated[_Text, _opt("-d", "--dependency", help="Start after other jobs, e.g. "
                          f"afterok:123 (first attempt and retries alike). {_SBATCH}. "
                          f"{_RECIPE}")] = None,
    mail_type: Annotated[_Text, _opt("--mail-type", help=f"e.g. END,FAIL. {_SBATCH}. "
                         f"{_RECIPE}")] = None,
    mail_user: Annotated[_Text, _opt("--mail-user", help=f"Mail address. {_SBATCH}. {_RECIPE}")
                         ] = None,
    nodelist: Annotated[_Text, _opt("-w", "--nodelist", help="Nodes to run on, "
                        f"comma-separated. {_SBATCH}. {_RECIPE}")] = None,
    exclusive: Annotated[bool, _opt("--exclusive", help="Whole nodes, shared with no other "
                         "job. (default: off, or the recipe's)")] = False,
    reservation: Annotated[_Text, _opt("--reservation", help=f"Reservation. {_SBATCH}. "
                           f"{_RECIPE}")] = None,
    wckey: Annotated[_Text, _opt("--wckey", help=f"Workload characterization key. {_SBATCH}. "
                     f"{_RECIPE}")] = None,
    sbatch_arg: Annotated[list[str] | None, _opt("--sbatch-arg", help="Any other sbatch flag, "
                          "e.g. --sbatch-arg=--begin=now+1hour; repeatable. Flags ftslurm sets "
                          "itself are refused. (default: none)")] = None,
    output: Annotated[_Text, _opt("-o", "--output", "-e", "--error", hidden=True,
                      help="Refused: ftslurm owns the job's output file.")] = None,
    array: Annotated[_Text, _opt("-a", "--array", hidden=True,
                     help="Refused: one run is one job per attempt.")] = None,
    checkpoint_dir: Annotated[_Text, _opt("--checkpoint-dir", help="Where the run keeps its "
                              "checkpoints (FTSLURM_CHECKPOINT_DIR), relative to the current "
                              "folder. (default: the recipe's, else RUN_DIR/checkpoints)")
                              ] = None,
    dry_run: Annotated[bool, _opt("--dry-run", help="Run against the mock scheduler (laptop "
                       "rehearsal). (default: off)")] = False,
    inject: Annotated[list[str] | None, _opt("--inject", help="KIND@TIME[:TARGET], TIME in "
                      "seconds or 90s, 5m, 2h; repeatable (docs/fault-injection.md). "
                      "(default: none)")] = None,
    print_script: Annotated[bool, _opt("--print-script", help="Print the sbatch script of the "
                            "first attempt; submit nothing. (default: off)")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a training run; the daemon then owns it until it ends."""
    if output is not None:
        raise ConfigError(f"-o/-e: {OWNED_SBATCH_FLAGS['output']}")
    if array is not None:
        raise ConfigError(f"--array: {OWNED_SBATCH_FLAGS['array']}")
    preempt_s = None
    if preempt_time is not None:
        try:
            preempt_s = math.ceil(parse_duration(preempt_time))
        except ConfigError as exc:
            raise ConfigError(f"--preempt-time: {exc.user_message()}") from None
    loaded = load_recipe(recipe, list(args or ()))
    # Each --sbatch-arg is one word of sbatch's command line: `--k=v`, `--k`, `-kv`, or
    # a flag and its value in two (`--sbatch-arg=-q --sbatch-arg=high`).
    from_args = sbatch_flags(list(sbatch_arg or ()), "--sbatch-arg")
    flags = {"mem": mem, "mem-per-cpu": mem_per_cpu, "gres": gres, "gpus": gpus,
             "constraint": constraint, "qos": qos, "dependency": dependency,
             "mail-type": mail_type, "mail-user": mail_user, "nodelist": nodelist,
             "ntasks": None if ntasks is None else str(ntasks), "reservation": reservation,
             "wckey": wckey}  # fmt: skip
    sbatch_extra = {**loaded.sbatch_extra, **from_args.pop("sbatch_extra", {}),
                    **{k: v for k, v in flags.items() if v is not None},
                    **({"exclusive": None} if exclusive else {})}  # fmt: skip
    loaded = loaded.with_overrides(**{**from_args, **{k: v for k, v in dict(
        num_job_retries_on_failure=retries, num_in_job_restarts=in_job_restarts,
        preempt_time=preempt_s, nodes=nodes, ntasks_per_node=ntasks_per_node,
        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, time=time_limit,
        partition=partition, account=account,
        exclude=tuple(n for n in exclude.split(",") if n) if exclude is not None else None,
        name=name, checkpoint_dir=checkpoint_dir, sbatch_extra=sbatch_extra,
    ).items() if v is not None}})  # fmt: skip
    # Printed once everything is validated (an error then stays the only line).
    warning = no_limit_warning(loaded.time) if loaded.time_limit_s() is None else None
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
    if warning and settings.preempt_time:
        typer.echo(f"Warning: {warning}", err=True)
    if print_script:
        typer.echo(script, nl=False)
        return
    if dry_run and not as_json:
        err.print("[dim]# dry run on the mock scheduler; attempt 0 runs:[/]")
        err.print(script, markup=False, highlight=False)
    store = Store(home)
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
