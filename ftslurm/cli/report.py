"""`ftslurm report RUN_ID [--plot FILE.png] [--json]`: where a run's wall time went.

The numbers come from `ftslurm.report.goodput` (pure; the categories are defined there).
This module reads what it needs: the run's records from the state directory, and from the
run's files the compute side's facts (`read_compute_facts`): checkpoint records (the
manifests `ftslurm.checkpoint` writes next to each checkpoint, and `progress.json`), and per
attempt the launchers' node reports (in-job restarts, hangs) and the ranks' reports (when
the last round of ranks started).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ftslurm.cli.common import JsonOpt, RunArg, _run_or_fail, _store, console, err
from ftslurm.cli.status import rank_validation
from ftslurm.core.cadence import Cadence
from ftslurm.core.contract import CHECKPOINT_MANIFEST, RunDir
from ftslurm.core.contract.reports import (
    Kind,
    NodeReport,
    Outcome,
    Progress,
    RankReport,
    RoundRecord,
)
from ftslurm.core.recovery import Recovery
from ftslurm.daemon.records import Attempt, Run
from ftslurm.errors import ConfigError
from ftslurm.fsutil import read_json
from ftslurm.report.goodput import (
    CATEGORIES,
    SPARE_LOST,
    AttemptFacts,
    CheckpointRecord,
    ComputeFacts,
    GoodputReport,
    format_duration,
    goodput,
    losses_by_source,
)
from ftslurm.report.notes import fmt_time
from ftslurm.runfiles import read_report, read_reports

_CLEAN = {Outcome.FINISHED, Outcome.CHECKPOINTED}  # a launcher or rank that ended on its own
_MEANING = {
    "productive": "compute whose steps were kept",
    "checkpointing": "recorded checkpoint save time",
    "lost": "compute after the last checkpoint, lost at an ending",
    "restarts": "in-job restarts: redone work and the restart itself",
    "queueing": "waiting for an attempt to start",
    "detection": "an attempt had ended; the daemon had not seen it yet",
    "unattributed": "compute the records cannot place (see notes)",
}
_COLORS = {
    "productive": "#2e7d32",
    "checkpointing": "#1565c0",
    "lost": "#c62828",
    "restarts": "#ef6c00",
    "queueing": "#9e9e9e",
    "detection": "#6d4c41",
    "unattributed": "#d1c4e9",
}


# ---------------------------------------------------------------------------- reading
def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def _checkpoints(
    spec: dict[str, Any], progress: Progress | None
) -> tuple[list[CheckpointRecord], float]:
    """Checkpoint records and the time from which they are complete."""
    manifests = []
    folder = spec.get("checkpoint_dir")
    try:
        paths = list(Path(folder).iterdir()) if folder else []
    except OSError:  # not there (yet), or not readable: no records from it
        paths = []
    for path in paths:
        data = read_json(path) if CHECKPOINT_MANIFEST.fullmatch(path.name) else None
        if isinstance(data, dict) and _number(data.get("time")) is not None:
            step = data.get("step")
            at, took = _number(data["time"]), _number(data.get("save_s"))
            blocking = _number(data.get("blocking_s"))
            if at is not None and took is not None and blocking is not None:
                # asynchronous: the training stood still for `blocking_s` and went on while
                # the rest was written; what it saved is the state of when it went on
                at, took = at - max(0.0, took - blocking), blocking
            manifests.append(CheckpointRecord(step if isinstance(step, int) else None, at, took))
    told = progress.checkpoint_step if progress is not None else None
    records = sorted(manifests, key=lambda r: r.time or 0.0)
    if progress is not None and told is not None and told not in {r.step for r in records}:
        records.append(CheckpointRecord(told, None, _number(progress.checkpoint_save_s)))
    if manifests:
        newest = max((r.step for r in manifests if r.step is not None), default=None)
        # Only the newest checkpoints are kept: complete from the oldest one left, unless
        # the script told of a later checkpoint saved elsewhere.
        behind = told is not None and (newest is None or told > newest)
        return records, math.inf if behind else min(r.time or math.inf for r in manifests)
    if progress is not None and told is None:
        return records, -math.inf  # the script reports progress and told of no checkpoint
    return records, math.inf


def _attempt_facts(run: RunDir, attempt: int, recorded_restarts: int) -> AttemptFacts:
    nodes: list[NodeReport] = read_reports(run, Kind.NODE, attempt)
    ranks: list[RankReport] = read_reports(run, Kind.RANK, attempt)
    restarts = max([recorded_restarts] + [d.in_job_restarts for d in nodes])
    hangs = []
    for d in nodes:
        for h in d.hangs:
            at = _number(h.time)
            if at is not None:
                rank = "?" if h.local_rank is None else h.local_rank
                what = f"{'?' if d.node is None else d.node} local rank {rank}"
                if h.reason:
                    what += f": {h.reason}"
                hangs.append((at, what))
    starts: tuple[float | None, ...] = ()
    # A rank's report is rewritten by every round of ranks: when every launcher and rank
    # ended on its own, the reports are the last round's, and it started with the first.
    started = [_number(d.started_at) for d in ranks]
    if (
        restarts
        and nodes
        and ranks
        and all(d.outcome in _CLEAN for d in [*nodes, *ranks])
        and all(s is not None for s in started)
    ):
        starts = (min(s for s in started if s is not None),)
    return AttemptFacts(in_job_restarts=restarts, round_starts=starts, hangs=tuple(sorted(hangs)))


def read_compute_facts(run: Run, attempts: Sequence[Attempt]) -> ComputeFacts:
    """What the compute side left in the run's files (missing files: nothing known)."""
    if not run.spec.get("run_dir"):
        return ComputeFacts()
    run_dir = RunDir(run.spec["run_dir"])
    records, complete_from = _checkpoints(run.spec, read_report(run_dir.progress, Progress))
    facts = {a.attempt: _attempt_facts(run_dir, a.attempt, a.in_job_restarts) for a in attempts}
    rounds = {a.attempt: round_records(run_dir, a.attempt) for a in attempts}
    live = {a.attempt: tuple(read_reports(run_dir, Kind.LIVE, a.attempt)) for a in attempts}
    return ComputeFacts(tuple(records), complete_from, facts, rounds, live)


def round_records(run_dir: RunDir, attempt: int) -> tuple[RoundRecord, ...]:
    """The attempt's in-job round records (`RunDir.round_record`), oldest round first."""
    found: list[RoundRecord] = read_reports(run_dir, Kind.ROUND, attempt)
    return tuple(sorted(found, key=lambda r: r.round if r.round is not None else 0))


# ---------------------------------------------------------------------------- output
def _breakdown_table(rep: GoodputReport, title: str) -> Table:
    table = Table("category", "seconds", "% of wall", "time", "what", title=title)
    b = rep.breakdown
    for category, seconds in b.seconds().items():
        table.add_row(
            category,
            f"{seconds:.1f}",
            f"{100 * b.share(category):.1f}",
            format_duration(seconds),
            _MEANING[category],
        )
    table.add_row(
        "wall",
        f"{b.wall_s:.1f}",
        "100.0",
        format_duration(b.wall_s),
        "creation to end (or now)",
        style="bold",
    )
    return table


def _losses_table(rep: GoodputReport) -> Table:
    """Each lost node: who saw it, detection (last heard -> seen) and recovery (seen -> the
    ranks running again) apart; then the means per source."""
    table = Table("attempt", "node", "source", "detection", "recovery", "how", title="lost nodes")

    def fmt(s: float | None) -> str:
        return "-" if s is None else format_duration(s)

    for x in rep.losses:
        how = {
            Recovery.SPARE.value: "spare (in the job)",
            "requeue": "job requeued",
            "new_job": "new job",
            SPARE_LOST: "nothing restarted (a waiting spare)",
        }.get(x.how or "", "none (yet)")
        if x.how == SPARE_LOST:
            back = "-"
        else:
            back = fmt(x.recovery_s) if x.recovered_at is not None else "not yet"
        table.add_row(
            str(x.attempt),
            x.node or "-",
            x.source,
            fmt(x.detection_s),
            back,
            how,
        )
    for source, m in losses_by_source(rep.losses).items():
        table.add_row(
            "all",
            f"{m['count']} lost",
            source,
            fmt(m["detection_s"]),
            fmt(m["recovery_s"]),
            "mean",
            style="bold",
        )
    return table


def _timeline_table(rep: GoodputReport) -> Table:
    table = Table("time", "+elapsed", "attempt", "kind", "what", title="timeline")
    now = time.time()
    for e in rep.timeline:
        table.add_row(
            fmt_time(e.time, now),
            format_duration(max(0.0, e.time - rep.begin)),
            "-" if e.attempt is None else str(e.attempt),
            e.kind,
            e.text,
        )
    return table


_MARKS = {  # timeline kind: (marker, color, legend label)
    "checkpoint": ("|", "black", "checkpoint"),
    "restart": ("x", "#ef6c00", "in-job restart"),
    "hang": ("v", "#c62828", "hang"),
}


def write_plot(rep: GoodputReport, path: Path, title: str) -> None:
    """A PNG: the attempts' pieces on a time axis (one row per attempt) with checkpoints and
    restarts marked, and the breakdown as one bar of shares."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed", hint="pip install matplotlib"
        ) from None
    wall = rep.breakdown.wall_s
    unit, scale = ("h", 3600.0) if wall > 7200 else ("min", 60.0) if wall > 120 else ("s", 1.0)
    rows = sorted({s.attempt for s in rep.segments if s.attempt is not None}) or [0]
    fig = Figure(figsize=(11, 2.6 + 0.4 * len(rows)))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [max(2, len(rows)), 1]})
    _plot_attempts(top, rep, rows, scale)
    top.set_xlim(0, max(wall / scale, 1e-9))
    top.set_xlabel(f"time since the run was created ({unit})")
    top.set_title(title)
    _plot_shares(bottom, rep)
    handles = [
        Patch(color=_COLORS[c], label=f"{c} {100 * rep.breakdown.share(c):.1f}%")
        for c in CATEGORIES
        if rep.breakdown.share(c) > 0
    ]
    handles += top.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    fig.set_layout_engine("constrained")
    try:
        fig.savefig(path, format="png", dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def _plot_attempts(ax: Any, rep: GoodputReport, rows: list[int], scale: float) -> None:
    """One row per attempt: its pieces by category, with checkpoints, restarts and hangs
    marked (`scale` seconds per unit of the time axis)."""
    y = {k: n for n, k in enumerate(rows)}
    for category in CATEGORIES:
        for k in rows:
            bars = [
                ((s.start - rep.begin) / scale, s.seconds / scale)
                for s in rep.segments
                if s.category == category and (s.attempt if s.attempt is not None else rows[0]) == k
            ]
            if bars:
                ax.broken_barh(bars, (y[k] - 0.35, 0.7), facecolors=_COLORS[category])
    for kind, (marker, color, label) in _MARKS.items():
        pts = [
            ((e.time - rep.begin) / scale, y.get(e.attempt, 0))
            for e in rep.timeline
            if e.kind == kind and "unrecorded" not in e.text
        ]
        if pts:
            ax.plot(
                *zip(*pts, strict=True),
                linestyle="",
                marker=marker,
                color=color,
                markersize=10,
                label=label,
            )
    ax.set_yticks(range(len(rows)), [f"attempt {k}" for k in rows])
    ax.invert_yaxis()


def _plot_shares(ax: Any, rep: GoodputReport) -> None:
    """The breakdown as one bar of shares of the wall time, each share of 6% or more
    labelled."""
    left = 0.0
    for category in CATEGORIES:
        share = 100 * rep.breakdown.share(category)
        if share <= 0:
            continue
        ax.barh(0, share, left=left, color=_COLORS[category])
        if share >= 6:
            ax.text(
                left + share / 2,
                0,
                f"{share:.0f}%",
                ha="center",
                va="center",
                color="white",
                fontsize=9,
            )
        left += share
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("% of wall time")


def report(
    run_id: RunArg,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            dir_okay=False,
            show_default=False,
            help="Also write a timeline/breakdown plot to this PNG file. Default: no plot.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's goodput: wall time by category (productive, checkpointing, lost, restarts,
    queueing, ...) and a timeline of its attempts, in-job restarts and checkpoints."""
    with _store() as store:
        run = _run_or_fail(store, run_id)
        attempts = store.attempts(run.run_id)
        events = store.events(run.run_id)
    rep = goodput(run, attempts, events, read_compute_facts(run, attempts), time.time())
    title = (
        f"run {run.run_id} ({run.name}): {run.state.value}, goodput "
        f"{100 * rep.breakdown.goodput:.1f}% of {format_duration(rep.breakdown.wall_s)}"
    )
    if plot is not None:
        write_plot(rep, plot, title)
        err.print(f"plot written to {plot}", markup=False, highlight=False)
    cadence = next(
        (Cadence.from_json(e.data) for e in reversed(events) if e.kind == "cadence"), None
    )  # the interval last written (core.cadence)
    validation = rank_validation(run, attempts)  # the rank agents' re-runs and verdicts
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "name": run.name,
                    "state": run.state.value,
                    **rep.to_dict(),
                    "checkpoint_cadence": cadence and cadence.to_json(),
                    **validation,
                }
            )
        )
        return
    console.print(_breakdown_table(rep, title))
    if cadence is not None:
        console.print(
            f"checkpoints: {cadence.describe()}", markup=False, highlight=False, soft_wrap=True
        )
    if rep.losses:
        console.print(_losses_table(rep))
    console.print(_timeline_table(rep))
    for v in [*validation["result_counts"], *validation["result_checks"]]:
        console.print(f"validation: {v['text']}", markup=False, highlight=False, soft_wrap=True)
    for note in rep.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command()(report)
