"""`ftslurm status`, `watch`, `wait` and `logs`: what the runs are doing, from the state
directory and the runs' folders (the prose of the notes is `ftslurm.report.notes`)."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ftslurm.backends import MOCK_HOME_ENV, create_backend, mock_home, split_backend_key
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.backends.slurm_cli.parse import compress_nodes
from ftslurm.cli.common import (
    _RUN_HELP,
    JsonOpt,
    RunArg,
    _resolve_run_arg,
    _run_or_fail,
    _store,
    console,
    err,
    fitted_table,
)
from ftslurm.core.cadence import Cadence
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Kind, Progress, RoundRecord
from ftslurm.core.settings import Cause
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import service
from ftslurm.daemon.records import Attempt, Run, RunState, parse_tag
from ftslurm.daemon.store import Store, marked_backends
from ftslurm.daemon.submission import backend_key
from ftslurm.errors import ConfigError, FtslurmError
from ftslurm.paths import state_dir
from ftslurm.report.notes import (
    HEALTH_EVENTS,
    Col,
    fmt_time,
    health_text,
    live_notes,
    lost_node_notes,
    moved_to_a_new_job,
    recovery_notes,
    result_checks,
    result_counts,
    split_reason,
    validation_text,
)
from ftslurm.runfiles import read_report, read_reports

# How an attempt that left a checkpoint to be continued from reads in `status`: its job
# exited 75 ("continue me"), which Slurm counts as FAILED, or 0 (a submitit-style exit).
CONTINUED = "CONTINUED"


def continued(attempt: Attempt, verdicts: dict[int, str]) -> bool:
    """Whether the attempt ended as a continuation: it checkpointed and the daemon went on
    from it (not a continuation failed for making no checkpoint progress)."""
    return attempt.cause == Cause.CHECKPOINTED and verdicts.get(attempt.attempt) != "fail"


def run_summary(store: Store, run: Run) -> dict[str, Any]:
    attempts = store.attempts(run.run_id)
    events = store.events(run.run_id)
    verdicts = {
        e.data["attempt"]: str(e.data.get("verdict"))
        for e in events
        if e.kind == "ended" and isinstance(e.data.get("attempt"), int)
    }
    flags = store.node_flags(time.time())
    return {
        "run_id": run.run_id,
        "name": run.name,
        "state": run.state.value,
        "created_at": run.created_at,
        "attempts": [
            {
                "attempt": a.attempt,
                "job_id": a.job_id,
                "state": a.state,
                "exit_code": a.exit_code,
                "nodes": a.nodes,
                "start": a.start,
                "end": a.end,
                "reason": a.reason,
                "cause": a.cause,
                "in_job_restarts": a.in_job_restarts,
                "continuation": continued(a, verdicts),
            }
            for a in attempts
        ],
        "job_retries_used": run.job_retries_used,
        "job_retries_max": run.settings.get("num_job_retries_on_failure"),
        "in_job_restarts_total": sum(a.in_job_restarts for a in attempts),
        "continuations": run.continuations,
        "excluded_nodes": sorted(f.node for f in flags),
        # the nodes this run flagged that are still flagged, with why
        "flagged_nodes": {f.node: f.reason for f in flags if f.run_id == run.run_id},
        # result validation (exit 16 and 17): what happened, in the daemon's words
        "validation": [
            {**e.data, "time": e.time, "text": validation_text(e.data)}
            for e in events
            if e.kind == "validation"
        ],
        # the rank agents' result validation: re-runs in place and their verdicts, counts
        **rank_validation(run, attempts),
        # failed pre-flight health checks (ftslurm.agent.health), in the daemon's words
        "health": [
            {**e.data, "time": e.time, "text": text}
            for e in events
            if e.kind in HEALTH_EVENTS and (text := health_text(e.kind, e.data))
        ],
        "last_checkpoint_step": checkpoint_step(run),
        "reason": run.reason,
        "backend": run.spec.get("backend"),
        "run_dir": run.spec.get("run_dir"),
        "checkpoint_dir": run.spec.get("checkpoint_dir"),
        "checkpoint_dir_from": run.spec.get("checkpoint_dir_from"),
        "checkpoint_cadence": cadence.data
        if (cadence := store.latest_event(run.run_id, "cadence"))
        else None,  # the interval last written (core.cadence)
    }


def rank_validation(run: Run, attempts: list[Attempt]) -> dict[str, list[dict[str, Any]]]:
    """What the rank agents' result validation left in the run's folder
    (`RunDir.validation`): its events with their words, and each attempt's counts."""
    run_dir = run.spec.get("run_dir")
    checks: list[dict[str, Any]] = []
    counts: list[dict[str, Any]] = []
    for a in attempts if run_dir else ():
        reports = read_reports(RunDir(run_dir), Kind.VALIDATION, a.attempt)
        checks += result_checks(a.attempt, reports)
        if (found := result_counts(a.attempt, reports)) is not None:
            counts.append(found)
    return {"result_checks": checks, "result_counts": counts}


def _progress(run: Run) -> Progress:
    """The run's progress.json (what its script told: steps, checkpoints); an empty one
    when there is none."""
    run_dir = run.spec.get("run_dir")
    found = read_report(RunDir(run_dir).progress, Progress) if run_dir else None
    return found if found is not None else Progress()


def checkpoint_step(run: Run, progress: Progress | None = None) -> int | None:
    """The step of the run's newest checkpoint: what its script told in progress.json (at
    every save, so also while an attempt runs), else what the daemon recorded (at an
    attempt's end)."""
    told = (_progress(run) if progress is None else progress).checkpoint_step
    if told is not None:
        return told
    return run.last_checkpoint_step


def _fmt_nodes(nodes: Sequence[str]) -> str:
    """A node list as Slurm writes it (`n[1-2],m7`), or "-"."""
    return compress_nodes(nodes) if nodes else "-"


_STYLE = {"COMPLETED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan"}


_RUN_COLS = (
    Col("run", None),
    Col("name", 60, wraps=True),
    Col("state", 90),
    Col("submitted", 35),
    Col("attempt", 40),
    Col("job", 70),
    Col("job state", 20),
    Col("nodes", 50, wraps=True),
    Col("retries", 30),
    Col("cont.", 10),
    Col("ckpt step", 15),
    Col("reason", 45, wraps=True),
)


def _job_state(attempt: dict[str, Any]) -> str:
    """An attempt's state as `status` shows it: a continuation reads as one, not FAILED."""
    return CONTINUED if attempt.get("continuation") else str(attempt.get("state", "-"))


def _run_rows(
    summaries: list[dict[str, Any]], notes: dict[str, None], now: float
) -> list[list[str]]:
    rows = []
    for s in summaries:
        last = s["attempts"][-1] if s["attempts"] else {}
        style = _STYLE.get(s["state"], "")
        reason, once = split_reason(s["reason"])
        notes.update(dict.fromkeys(once))
        rows.append(
            [
                s["run_id"],
                escape(s["name"]),
                f"[{style}]{s['state']}[/]" if style else s["state"],
                fmt_time(s.get("created_at"), now),
                str(last.get("attempt", "-")),
                str(last.get("job_id") or "-"),
                _job_state(last) if last else "-",
                _fmt_nodes(last.get("nodes") or []),
                f"{s['job_retries_used']}/{s['job_retries_max']}",
                str(s["continuations"]),
                str(s["last_checkpoint_step"] if s["last_checkpoint_step"] is not None else "-"),
                escape(reason),
            ]
        )
    return rows


def _table(
    summaries: list[dict[str, Any]],
    width: int | None = None,
    notes: dict[str, None] | None = None,
    now: float | None = None,
) -> Table:
    """The runs table; the notes said once are collected into `notes`."""
    rows = _run_rows(summaries, {} if notes is None else notes, time.time() if now is None else now)
    return fitted_table(_RUN_COLS, rows, width or console.width, title="ftslurm runs")


def ordered(runs: Sequence[Run]) -> list[Run]:
    """Runs as `status` and `watch` list them: running first, then the other active ones,
    then those that ended; each group in the order they were submitted (pure)."""

    def rank(run: Run) -> int:
        return 0 if run.state is RunState.RUNNING else 1 if not run.state.is_terminal else 2

    return sorted(runs, key=rank)


_ATTEMPT_COLS = (
    Col("attempt", None),
    Col("job", 80),
    Col("state", 90),
    Col("cause", 70),
    Col("exit", 55),
    Col("nodes", 50, wraps=True),
    Col("start", 45),
    Col("end", 60),
    Col("reason", 40, wraps=True),
)


def _attempts_table(
    summary: dict[str, Any], width: int, now: float, notes: dict[str, None] | None = None
) -> Table:
    rows = []
    for a in summary["attempts"]:
        reason, once = split_reason(a["reason"])
        if notes is not None:
            notes.update(dict.fromkeys(once))
        rows.append(
            [
                str(a["attempt"]),
                str(a["job_id"] or "-"),
                _job_state(a),
                a["cause"] or "-",
                str(a["exit_code"] if a["exit_code"] is not None else "-"),
                _fmt_nodes(a["nodes"]),
                fmt_time(a["start"], now),
                fmt_time(a["end"], now),
                escape(reason),
            ]
        )
    return fitted_table(_ATTEMPT_COLS, rows, width, title=f"attempts of {summary['run_id']}")


# ---------------------------------------------------------------------------- lost nodes
_HOLDING = (JobState.RUNNING.value, JobState.COMPLETING.value)


def _lost_nodes(store: Store, runs: Sequence[Run], now: float) -> list[str]:
    """Notes on the nodes of running attempts that stopped answering: one `nodes()` call per
    backend, and none when no attempt runs."""
    groups: dict[str, list[tuple[Run, Attempt]]] = {}
    for run in runs:
        if run.state.is_terminal:
            continue
        attempt = store.latest_attempt(run.run_id)
        if attempt is None or not attempt.nodes or attempt.state not in _HOLDING:
            continue
        key = backend_key(run.spec) if run.spec.get("backend") else "slurm"
        groups.setdefault(key, []).append((run, attempt))
    notes = []
    for key, items in groups.items():
        kind, home = split_backend_key(key)
        try:
            backend = create_backend(kind, home)
            infos = backend.nodes()
            timeout = backend.cluster_facts().slurmd_timeout_s
        except FtslurmError as exc:
            notes.append(f"could not ask the {kind} scheduler about nodes: {exc.message}")
            continue
        for run, attempt in items:
            notes += [
                f"run {run.run_id}: {note}"
                for note in lost_node_notes(attempt.nodes, infos, timeout, now)
            ]
    return notes


def _recoveries(store: Store, runs: Sequence[Run], now: float) -> list[str]:
    """Notes on the nodes lost under active runs and their recovery (`recovery_notes`)."""
    notes = []
    for run in runs:
        if run.state.is_terminal:
            continue
        attempts = store.attempts(run.run_id)
        events = [e for e in store.events(run.run_id) if e.kind == "node_lost"]
        if not events:
            continue
        rounds: dict[int, Sequence[RoundRecord]] = {}
        if run.spec.get("run_dir"):
            folder = RunDir(run.spec["run_dir"])
            for a in attempts[-2:]:
                rounds[a.attempt] = read_reports(folder, Kind.ROUND, a.attempt)
        notes += [f"run {run.run_id}: {n}" for n in recovery_notes(attempts, events, rounds, now)]
    return notes


def _live_recoveries(store: Store, runs: Sequence[Run], now: float) -> list[str]:
    """Notes on the live recoveries of the latest attempt of active runs (`live_notes`),
    after the launchers' fallback that ended the attempt before it, if one did."""
    notes = []
    for run in runs:
        attempt = store.latest_attempt(run.run_id)
        if run.state.is_terminal or attempt is None or not run.spec.get("run_dir"):
            continue
        folder = RunDir(run.spec["run_dir"])
        if attempt.attempt > 0:  # why live recovery could not keep the run in that job
            before = read_reports(folder, Kind.LIVE, attempt.attempt - 1)
            notes += [
                f"run {run.run_id}: attempt {attempt.attempt - 1}: {n}"
                for n in live_notes(moved_to_a_new_job(before), now, last=1)
            ]
        records = read_reports(folder, Kind.LIVE, attempt.attempt)
        notes += [f"run {run.run_id}: {n}" for n in live_notes(records, now)]
    return notes


def uses_checkpoints(summary: dict[str, Any], progress: Progress) -> bool:
    """Whether the run saves checkpoints where ftslurm put them: its script told of one, or
    its checkpoint folder holds something (a plain script may never write there)."""
    if progress.checkpoint_step is not None:
        return True
    folder = summary.get("checkpoint_dir")
    try:
        return bool(folder) and any(Path(folder).iterdir())
    except OSError:
        return False


def uses_cadence(summary: dict[str, Any], progress: Progress) -> bool:
    """Whether the run's ranks follow the tuned checkpoint interval: they report their steps
    to ftslurm (the rank agent, whose `should_checkpoint()` reads the interval), and no
    ending said they wrote no heartbeats."""
    silent = any(split_reason(a["reason"])[1] for a in summary["attempts"])
    return progress.step is not None and not silent


def status(
    run_id: Annotated[
        str | None,
        typer.Argument(
            metavar="RUN",
            help=f"{_RUN_HELP} Default: every run.",
            show_default=False,
            callback=_resolve_run_arg,
        ),
    ] = None,
    active: Annotated[
        bool, typer.Option("--active", help="Only the runs that have not ended.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show runs (all, or one) with their attempts, the nodes lost under an active run with
    the recovery under way, and nodes of a running attempt that stopped answering. Running
    runs come first."""
    store = _store()
    runs = [_run_or_fail(store, run_id)] if run_id else ordered(store.list_runs(active))
    warn_orphan_jobs(store, runs)
    warn_no_daemon(store.home, runs)
    summaries = [run_summary(store, r) for r in runs]
    now = time.time()
    recoveries = _recoveries(store, runs, now)
    notes = recoveries + _live_recoveries(store, runs, now) + _lost_nodes(store, runs, now)
    if as_json:
        if run_id:
            typer.echo(json.dumps({**summaries[0], "notes": notes}, indent=1))
        else:
            typer.echo(json.dumps(summaries, indent=1))
        return
    if not summaries:
        typer.echo("no active runs" if active else "no runs yet (`ftslurm submit`)")
        return
    said_once: dict[str, None] = {}
    console.print(_table(summaries, notes=said_once, now=now))
    if run_id:
        console.print(_attempts_table(summaries[0], console.width, now, said_once))
        s = summaries[0]
        reason, once = split_reason(s["reason"])
        said_once.update(dict.fromkeys(once))
        console.print(
            f"{s['state']}" + (f": {reason}" if reason else ""),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        progress = _progress(runs[0])
        if s["checkpoint_dir"] and uses_checkpoints(s, progress):
            source = f" (from {s['checkpoint_dir_from']})" if s["checkpoint_dir_from"] else ""
            console.print(
                f"checkpoints in: {s['checkpoint_dir']}{source}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        cadence = Cadence.from_json(s["checkpoint_cadence"])
        if cadence is not None and uses_cadence(s, progress):
            console.print(
                f"checkpoints: {cadence.describe()}", markup=False, highlight=False, soft_wrap=True
            )
        for c in s["result_counts"]:
            console.print(f"validation: {c['text']}", markup=False, highlight=False, soft_wrap=True)
        for v in [*s["result_checks"], *s["validation"]]:
            console.print(f"validation: {v['text']}", markup=False, highlight=False, soft_wrap=True)
        for h in s["health"]:
            console.print(f"health: {h['text']}", markup=False, highlight=False, soft_wrap=True)
        if s["validation"] or s["health"]:
            flagged = "; ".join(f"{n}: {why}" for n, why in sorted(s["flagged_nodes"].items()))
            console.print(
                f"nodes flagged by this run: {flagged or 'none'}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    for note in said_once:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    for note in notes:
        said = "lost node" if note in recoveries else "warning"
        console.print(f"{said}: {note}", markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------- jobs without a run
def tagged_run(comment: str | None) -> str | None:
    """The run id in a job's ftslurm tag (`records.tag`), or None for any other comment."""
    parsed = parse_tag(comment)
    return parsed[0] if parsed else None


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
        kind, where = split_backend_key(key)
        home = Path(where) if where else mock_home()
        if kind == "mock" and (home / DB_FILE).exists():
            found.append(MockScheduler(home))
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
        err.print(
            f"warning: job(s) {', '.join(sorted(orphans))} carry ftslurm tags of "
            f"run(s) {', '.join(sorted(set(orphans.values())))} that are not in "
            f"{store.path}: nothing manages them (state lost? see `ftslurm daemon "
            "recover`, or cancel them)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def warn_no_daemon(home: Path, runs: Sequence[Run]) -> None:
    """One line (stderr) when runs have not ended and no daemon serves them: nothing submits
    a PENDING run, watches a RUNNING one or retries it until a daemon runs."""
    waiting = [r for r in runs if not r.state.is_terminal]
    if not waiting:
        return
    try:
        if service.serving(home) or service.queued_daemon_job(home):
            return
    except FtslurmError:
        return  # a scheduler that does not answer now: not known, not worth a wait here
    which = (
        f"run {waiting[0].run_id}"
        if len(waiting) == 1
        else f"the {len(waiting)} runs that have not ended"
    )
    err.print(
        f"warning: no daemon serves {home}: nothing submits, watches or retries "
        f"{which} until one runs (`ftslurm daemon start`)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


# ---------------------------------------------------------------------------- wait
def wait(
    run_id: RunArg,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Give up after this many seconds (exit 124). Default: no limit.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Wait for a run to end and print how it ended: exit 0 COMPLETED, 1 FAILED or
    CANCELLED, 124 on timeout."""
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
    # the result on stdout (`wait RUN > result.txt`, `$(ftslurm wait RUN)`); only the
    # timeout above goes to stderr
    typer.echo(f"run {run_id} {run.state.value}" + (f": {run.reason}" if run.reason else ""))
    raise typer.Exit(0 if run.state is RunState.COMPLETED else 1)


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
    run_id: RunArg,
    attempt: Annotated[
        int | None,
        typer.Option(
            "--attempt", help="Which attempt (0, 1, ...). Default: the latest.", show_default=False
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep printing as the run goes on, each new attempt's output "
            "as it starts; stop when the run ends.",
        ),
    ] = False,
) -> None:
    """Print the output of an attempt (the latest by default)."""
    store = _store()
    run = _run_or_fail(store, run_id)
    attempts = store.attempts(run.run_id)
    chosen = (
        attempts[-1]
        if attempt is None
        else next((a for a in attempts if a.attempt == attempt), None)
    )
    if chosen is None:
        have = f"attempts 0 to {attempts[-1].attempt}" if attempts else "no attempts"
        raise ConfigError(f"run {run.run_id} has no attempt {attempt} (it has {have})")
    if not chosen.job_id and not follow:
        raise ConfigError(f"attempt {chosen.attempt} of run {run.run_id} has no job yet")
    folder = RunDir(run.spec["run_dir"]).logs
    shown: dict[int, int] = {}
    while True:
        ended = run.state.is_terminal  # read before the files: their last lines are printed
        for a in store.attempts(run.run_id) if follow else [chosen]:
            if a.attempt < chosen.attempt or not a.job_id:
                continue
            path = folder / f"job-{a.job_id}.out"
            text = path.read_text(errors="replace") if path.exists() else ""
            section = _attempt_sections(text).get(a.attempt, "")
            sys.stdout.write(section[shown.get(a.attempt, 0) :])
            shown[a.attempt] = len(section)
        sys.stdout.flush()
        if not follow or ended:
            return
        time.sleep(0.5)
        run = _run_or_fail(store, run.run_id)


# ---------------------------------------------------------------------------- watch
def watch_view(
    summaries: list[dict[str, Any]], width: int, height: int, now: float
) -> RenderableType:
    """What `watch` shows in a `width` x `height` terminal: the runs table (running runs
    first, as `ordered` lists them) with as many rows as fit, leaving out the oldest ended
    runs first, and one line saying how many were left out."""
    shown = list(summaries)
    left_out = 0
    measure = Console(width=width, file=io.StringIO(), color_system=None)
    while True:
        said_once: dict[str, None] = {}
        parts: list[RenderableType] = [_table(shown, width, said_once, now)]
        parts += [Text(f"note: {n}", overflow="ellipsis", no_wrap=True) for n in said_once]
        if left_out:
            parts.append(
                Text(
                    f"{left_out} more run(s) not shown: `ftslurm status` lists every run",
                    overflow="ellipsis",
                    no_wrap=True,
                )
            )
        view = Group(*parts)
        lines = measure.render_lines(view, measure.options.update(width=width), pad=False)
        if len(lines) <= height or not shown:
            return view
        ended = [i for i, x in enumerate(shown) if RunState(x["state"]).is_terminal]
        shown.pop(ended[0] if ended else -1)
        left_out += 1


def watch(
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes.", min=0.05)
    ] = 1.0,
    until_done: Annotated[
        bool, typer.Option("--until-done", help="Return when no run is active.")
    ] = False,
) -> None:
    """A live view of every run: running runs first, as many as the terminal holds."""
    store = _store()
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            runs = ordered(store.list_runs())
            width, height = console.size
            live.update(
                watch_view(
                    [run_summary(store, r) for r in runs], width, max(height - 1, 5), time.time()
                )
            )
            if until_done and not any(not r.state.is_terminal for r in runs):
                return
            time.sleep(interval)
