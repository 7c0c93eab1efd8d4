"""Goodput of one run: where its wall time went, and a timeline of what happened (pure).

`goodput(run, attempts, events, facts, now)` reads no file and no clock: the caller passes
the run's records from the store, the compute-side facts read from the run's files
(`ComputeFacts`) and the time up to which a live run is counted.

Wall time runs from the run's creation (`Run.created_at`) to its end (`Run.ended_at`; `now`
while it is active). It is cut into consecutive pieces, each in exactly one category, so the
categories add up to the wall time:

    queueing       an attempt was asked for but was not running: from the run's creation
                   (attempt 0), or from the daemon's decision to run the next attempt (the
                   `ended` event of the one before), until the attempt started (or ended
                   without starting).
    detection      an attempt had ended (the scheduler's end time) and the daemon had not
                   seen it yet (its `ended` event); for the last attempt, until the run was
                   marked ended. (The time Slurm takes to declare a dead node down comes
                   before the end time: it is part of the attempt, lost.)
    productive     compute whose steps were kept: everything before the last checkpoint of
                   an attempt (or of a round of ranks, see restarts), and the whole of an
                   attempt that finished training.
    checkpointing  the recorded save time of every checkpoint whose completion time is
                   known: the `save_s` seconds before its `time`.
    lost           compute after the last checkpoint of an attempt that did not keep it: a
                   failure (node failure, crash, timeout, preemption, OOM, ...), a
                   cancellation, a move off a straggler node, and the exit after a
                   continuation's final save (seconds, normally).
    restarts       the cost of in-job restarts (the launcher restarting every rank inside
                   the same allocation): for each, from the last checkpoint before it until
                   the next round of ranks started, i.e. the work redone plus the restart.
    unattributed   compute whose fate the recorded facts cannot tell, or cannot tell yet (a
                   running attempt's work since its last checkpoint); `notes` say why.

An attempt's compute is its scheduler start to its end. How it ended comes from its cause:
`finished` keeps all of it; `checkpointed` (a continuation) keeps it up to its last
checkpoint, or all of it when that checkpoint's time is not recorded (it is then taken to
have saved at its end: what the job's exit after the checkpoint signal says); a
continuation the daemon failed for making no checkpoint progress kept nothing of it; every
other cause loses what came after the last checkpoint.

What is exact and what is approximated:
- Times come from three clocks taken to agree: the scheduler's (attempt start and end), the
  daemon's (decisions) and the compute nodes' (checkpoints, rank starts). Where they
  disagree a little, pieces are clamped so that none overlaps another.
- Checkpoints are records of (step, completion time, save seconds) plus the time from which
  the records are complete (`checkpoints_complete_from`; before it a checkpoint may have
  been saved without a record left, e.g. pruned). In a span of compute the last checkpoint
  is known when a record falls in the span, or when the records are complete over the span
  and none falls in it (nothing was saved). Otherwise the whole span is unattributed,
  unless its ending kept it anyway (finished, or a continuation: productive).
- A recorded save counts as checkpointing even when it was asynchronous and overlapped
  training: checkpointing is then overstated and productive understated by as much. Saves
  without a recorded time cannot be placed: they stay in the compute around them and a
  note says so.
- An attempt resumes from the checkpoint that completed last before it started (and a
  round of ranks from the last one before it started).
- In-job restarts: each one's cost needs the time the next round of ranks started. When
  those times are not all recorded, a span between two known round starts (or the
  attempt's start and end) holds restarts at unknown times: up to its last checkpoint it is
  unattributed (its recorded saves aside); after that it is waste, counted as restarts when
  the span ends at a known restart and as lost when it ends in a failure (restart costs and
  the failure's loss cannot be told apart), and unattributed when it finished or runs.
- An attempt's startup (rendezvous, loading the checkpoint) is part of its compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftslurm.core.cadence import Cadence
from ftslurm.core.contract.reports import LiveRecovery, RoundRecord
from ftslurm.core.recovery import Recovery
from ftslurm.core.settings import Cause
from ftslurm.core.timefmt import format_duration
from ftslurm.daemon.records import Attempt, Event, Run
from ftslurm.report.notes import (
    distinct_live,
    health_text,
    live_note,
    spare_lost,
    validation_text,
)

QUEUEING = "queueing"
DETECTION = "detection"
PRODUCTIVE = "productive"
CHECKPOINTING = "checkpointing"
LOST = "lost"
RESTARTS = "restarts"
UNATTRIBUTED = "unattributed"
CATEGORIES = (PRODUCTIVE, CHECKPOINTING, LOST, RESTARTS, QUEUEING, DETECTION, UNATTRIBUTED)

# How a span of compute ended (see the module docstring).
_FINISHED, _CONTINUED, _STALLED, _FAILED = "finished", "continued", "stalled", "failed"
_RESTART, _RUNNING, _UNKNOWN = "restart", "running", "unknown"


# ---------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class CheckpointRecord:
    """One saved checkpoint, as far as it was recorded."""

    step: int | None
    time: float | None  # when the save completed (unix time); None: not recorded
    save_s: float | None = None  # how long the save took; None: not recorded


@dataclass(frozen=True)
class AttemptFacts:
    """What the compute side recorded about one attempt."""

    in_job_restarts: int = 0
    # When the ranks started again after each in-job restart, oldest first; None where not
    # recorded. May list only the latest ones: earlier restarts are then of unknown time.
    round_starts: tuple[float | None, ...] = ()
    hangs: tuple[tuple[float, str], ...] = ()  # (time, what) hangs the launchers detected


@dataclass(frozen=True)
class ComputeFacts:
    checkpoints: tuple[CheckpointRecord, ...] = ()
    # Every checkpoint that completed at or after this time has a record (with its time);
    # -inf: all of them, inf: no such guarantee.
    checkpoints_complete_from: float = math.inf
    attempts: Mapping[int, AttemptFacts] = field(default_factory=dict)
    # attempt -> its in-job round records (RunDir.round_record): when ranks ran again
    rounds: Mapping[int, tuple[RoundRecord, ...]] = field(default_factory=dict)
    # attempt -> its live recoveries (RunDir.live_record, live_given_up)
    live: Mapping[int, tuple[LiveRecovery, ...]] = field(default_factory=dict)


# ---------------------------------------------------------------------------- outputs
@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    category: str
    attempt: int | None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TimelineEntry:
    time: float
    kind: str  # submitted, requeued, adopted, started, ended, checkpoint, restart, hang, ...
    text: str
    attempt: int | None = None
    end: float | None = None  # for spans (an attempt's compute)


@dataclass(frozen=True)
class Breakdown:
    """Seconds per category; they add up to `wall_s`."""

    wall_s: float
    productive_s: float = 0.0
    checkpointing_s: float = 0.0
    lost_s: float = 0.0
    restarts_s: float = 0.0
    queueing_s: float = 0.0
    detection_s: float = 0.0
    unattributed_s: float = 0.0

    def seconds(self) -> dict[str, float]:
        return {c: float(getattr(self, f"{c}_s")) for c in CATEGORIES}

    def share(self, category: str) -> float:
        """The category's fraction of the wall time (0 when no time passed)."""
        return getattr(self, f"{category}_s") / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        return self.share(PRODUCTIVE)


@dataclass(frozen=True)
class NodeLoss:
    """A node lost under the run, as the daemon recorded it (`node_lost` events), with its
    two latencies kept apart: detection (the node last heard of -> the launchers' report,
    or -> the daemon's sight of Slurm's verdict) and recovery (detection -> the ranks
    running again: the next attempt running, or for a spare the in-job round that started
    after the report, at its first step when recorded)."""

    attempt: int
    node: str | None
    source: str  # "peer" or "slurm" (ftslurm.core.recovery.Source)
    recovery: str  # "spare" or "new_job" (ftslurm.core.recovery.Recovery)
    detected_at: float
    detection_s: float | None  # None: when the node was last heard of is not known
    recovered_at: float | None  # None: not (yet) running again
    recovery_s: float | None
    # How the run went on, as the attempts show it: "spare" (inside the job), "requeue"
    # (the same job again: Slurm's requeue after NODE_FAIL), "new_job" (another job),
    # "spare_lost" (a spare still waiting was lost: nothing restarted, nothing to recover),
    # or None while no next attempt exists (`recovery` is then the daemon's decision alone)
    how: str | None = None


SPARE_LOST = "spare_lost"  # `NodeLoss.how` of a spare lost while it waited


def recovered_how(attempts: Sequence[Attempt], lost_in: int, recovery: str) -> str | None:
    """How the run went on after a node was lost in attempt `lost_in` (`NodeLoss.how`):
    the recovery recorded with the loss says spare or not; whether the next attempt ran as
    the same job requeued or as another job, only the attempts tell."""
    if recovery == Recovery.SPARE:
        return Recovery.SPARE.value
    by_no = {a.attempt: a for a in attempts}
    nxt = next((a for n, a in sorted(by_no.items()) if n > lost_in), None)
    if nxt is None or not nxt.job_id:
        return None
    lost = by_no.get(lost_in)
    return "requeue" if lost is not None and lost.job_id == nxt.job_id else "new_job"


_HOW = {
    Recovery.SPARE.value: "a spare takes over",
    "requeue": "the job is requeued",
    "new_job": "a new job",
}


def node_losses(
    attempts: Sequence[Attempt],
    events: Sequence[Event],
    rounds: Mapping[int, Sequence[RoundRecord]],
) -> tuple[NodeLoss, ...]:
    """The run's node losses with their detection and recovery times (`NodeLoss`)."""
    running = sorted(
        (e.time, int(e.data["attempt"]))
        for e in events
        if e.kind == "running" and isinstance(e.data.get("attempt"), int)
    )
    out = []
    for e in events:
        d = e.data
        if e.kind != "node_lost" or not isinstance(d.get("attempt"), int):
            continue
        at = d.get("time")
        detected = float(at) if isinstance(at, (int, float)) else e.time
        back: float | None = None
        waiting = spare_lost(d) is not None
        if waiting:
            back = None  # nothing stopped: nothing to come back
        elif d.get("recovery") == Recovery.SPARE:
            starts = []
            for r in rounds.get(d["attempt"], ()):
                start, first = r.started_at, r.first_step_at
                if start is not None and start >= detected:
                    starts.append(first if first is not None else start)
            back = min(starts, default=None)
        else:
            back = next((t for t, n in running if n > d["attempt"] and t >= e.time), None)
        took = d.get("detection_s")
        out.append(
            NodeLoss(
                attempt=d["attempt"],
                node=d.get("node"),
                source=str(d.get("source") or "peer"),
                recovery=str(d.get("recovery") or "new_job"),
                detected_at=detected,
                detection_s=float(took) if isinstance(took, (int, float)) else None,
                recovered_at=back,
                recovery_s=None if back is None else max(0.0, back - detected),
                how=SPARE_LOST
                if waiting
                else recovered_how(attempts, d["attempt"], str(d.get("recovery") or "new_job")),
            )
        )
    return tuple(out)


def losses_by_source(losses: Sequence[NodeLoss]) -> dict[str, dict[str, Any]]:
    """Per source: how many losses, and the mean detection and recovery seconds of those
    whose times are known."""
    out: dict[str, dict[str, Any]] = {}
    for source in sorted({x.source for x in losses}):
        mine = [x for x in losses if x.source == source]
        det = [x.detection_s for x in mine if x.detection_s is not None]
        rec = [x.recovery_s for x in mine if x.recovery_s is not None]
        out[source] = {
            "count": len(mine),
            "detection_s": sum(det) / len(det) if det else None,
            "recovery_s": sum(rec) / len(rec) if rec else None,
        }
    return out


@dataclass(frozen=True)
class GoodputReport:
    run_id: str
    begin: float
    end: float
    breakdown: Breakdown
    segments: tuple[Segment, ...]
    timeline: tuple[TimelineEntry, ...]
    notes: tuple[str, ...]
    losses: tuple[NodeLoss, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        b = self.breakdown
        return {
            "run_id": self.run_id,
            "begin": self.begin,
            "end": self.end,
            "wall_s": b.wall_s,
            "goodput": b.goodput,
            "breakdown": {c: {"seconds": s, "share": b.share(c)} for c, s in b.seconds().items()},
            "timeline": [
                {
                    "time": e.time,
                    "offset_s": e.time - self.begin,
                    "kind": e.kind,
                    "attempt": e.attempt,
                    "end": e.end,
                    "text": e.text,
                }
                for e in self.timeline
            ],
            "segments": [
                {"start": s.start, "end": s.end, "category": s.category, "attempt": s.attempt}
                for s in self.segments
            ],
            "notes": list(self.notes),
            "node_losses": [
                {
                    "attempt": x.attempt,
                    "node": x.node,
                    "source": x.source,
                    "recovery": x.recovery,
                    "detected_at": x.detected_at,
                    "detection_s": x.detection_s,
                    "recovered_at": x.recovered_at,
                    "recovery_s": x.recovery_s,
                    "how": x.how,
                }
                for x in self.losses
            ],
            "losses_by_source": losses_by_source(self.losses),
        }


# ---------------------------------------------------------------------------- the cut
class _Cutter:
    """Lays consecutive pieces from `begin` on; never past `end`, never overlapping."""

    def __init__(self, begin: float, end: float) -> None:
        self.pos, self.end = begin, end
        self.segments: list[Segment] = []

    def put(self, until: float, category: str, attempt: int | None) -> float:
        """The piece from where the last one stopped to `until`; returns its seconds."""
        until = min(until, self.end)
        if until <= self.pos:
            return 0.0
        added = until - self.pos
        last = self.segments[-1] if self.segments else None
        if last and last.category == category and last.attempt == attempt:
            self.segments[-1] = Segment(last.start, until, category, attempt)
        else:
            self.segments.append(Segment(self.pos, until, category, attempt))
        self.pos = until
        return added


def _span_pieces(
    start: float, stop: float, ending: str, unknown_restarts: int, facts: ComputeFacts
) -> tuple[list[tuple[float, str]], str | None]:
    """The pieces [(until, category)] of one span of compute, and why part of it could not
    be attributed (None when all of it could)."""
    records = sorted(
        (r for r in facts.checkpoints if r.time is not None and start < r.time <= stop),
        key=lambda r: r.time or 0.0,
    )
    if records:
        last: float | None = records[-1].time
    elif facts.checkpoints_complete_from <= start or ending == _STALLED:
        last = start  # nothing was saved in this span
    else:
        last = None
    if last is None:  # where the last checkpoint is, is not known
        if ending in (_FINISHED, _CONTINUED) and not unknown_restarts:
            return [(stop, PRODUCTIVE)], None
        if unknown_restarts:
            return [(stop, UNATTRIBUTED)], "restarts"
        return [(stop, UNATTRIBUTED)], _RUNNING if ending == _RUNNING else "checkpoint"
    head = UNATTRIBUTED if unknown_restarts else PRODUCTIVE
    pieces: list[tuple[float, str]] = []
    pos = start
    for r in records:
        if not r.save_s or r.save_s <= 0 or r.time is None or r.time <= pos:
            continue
        pieces += [(max(pos, r.time - r.save_s), head), (r.time, CHECKPOINTING)]
        pos = r.time
    pieces.append((last, head))
    if ending == _RESTART:
        tail = RESTARTS
    elif ending in (_CONTINUED, _STALLED, _FAILED):
        tail = LOST
    elif ending == _FINISHED and not unknown_restarts:
        tail = PRODUCTIVE
    else:
        tail = UNATTRIBUTED
    pieces.append((stop, tail))
    if unknown_restarts:
        return pieces, "restarts"
    return pieces, _RUNNING if tail == UNATTRIBUTED and ending == _RUNNING else (
        "ending" if tail == UNATTRIBUTED else None
    )


def _ending(a: Attempt, ended: Event | None, run_active: bool) -> str:
    if a.end is None:
        return _RUNNING if run_active else _UNKNOWN
    cause = a.cause or (ended.data.get("cause") if ended else None)
    verdict = ended.data.get("verdict") if ended else None
    if cause == "finished":
        return _FINISHED
    if cause == Cause.CHECKPOINTED:
        return _STALLED if verdict == "fail" else _CONTINUED
    return _UNKNOWN if cause is None else _FAILED


def _round_starts(a: Attempt, af: AttemptFacts) -> tuple[float | None, ...]:
    n = max(a.in_job_restarts, af.in_job_restarts, len(af.round_starts))
    return (None,) * (n - len(af.round_starts)) + tuple(af.round_starts)


# ---------------------------------------------------------------------------- the report
def goodput(
    run: Run, attempts: Sequence[Attempt], events: Sequence[Event], facts: ComputeFacts, now: float
) -> GoodputReport:
    """The breakdown, the pieces it sums and the timeline of one run (see the docstring)."""
    begin = run.created_at
    active = not run.state.is_terminal
    finish = now if active or run.ended_at is None else run.ended_at
    finish = max(finish, begin)
    attempts = sorted(attempts, key=lambda a: a.attempt)
    ended: dict[int, Event] = {}
    for e in events:
        if e.kind == "ended" and isinstance(e.data.get("attempt"), int):
            ended[e.data["attempt"]] = e
    cut = _Cutter(begin, finish)
    notes: list[str] = []
    for i, a in enumerate(attempts):
        if i:
            prev = attempts[i - 1]
            seen = ended[prev.attempt].time if prev.attempt in ended else prev.failure_seen_at
            if prev.end is not None and seen is not None:
                cut.put(seen, DETECTION, prev.attempt)
        if a.start is None:
            cut.put(a.end if a.end is not None else finish, QUEUEING, a.attempt)
            continue
        cut.put(a.start, QUEUEING, a.attempt)
        notes += _compute(cut, a, ended.get(a.attempt), active, facts, finish)
    if attempts and attempts[-1].end is not None:
        cut.put(finish, DETECTION, attempts[-1].attempt)
    cut.put(finish, QUEUEING, attempts[-1].attempt if attempts else None)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for s in cut.segments:
        totals[s.category] += s.seconds
    breakdown = Breakdown(wall_s=finish - begin, **{f"{c}_s": v for c, v in totals.items()})
    for r in facts.checkpoints:
        if r.time is None:
            step = f"step {r.step}" if r.step is not None else "a checkpoint"
            took = f" took {format_duration(r.save_s)} to save;" if r.save_s else ""
            notes.append(
                f"the checkpoint of {step}{took} when it was saved is not recorded, "
                "so its save time is not in checkpointing"
            )
    return GoodputReport(
        run.run_id,
        begin,
        finish,
        breakdown,
        tuple(cut.segments),
        _timeline(run, attempts, events, facts, begin, finish),
        tuple(notes),
        node_losses(attempts, events, facts.rounds),
    )


def _compute(
    cut: _Cutter, a: Attempt, ended: Event | None, active: bool, facts: ComputeFacts, finish: float
) -> list[str]:
    """Lay the pieces of attempt `a`'s compute; returns notes on what it could not place."""
    assert a.start is not None
    stop = a.end if a.end is not None else finish
    ending = _ending(a, ended, active)
    af = facts.attempts.get(a.attempt, AttemptFacts())
    spans: list[tuple[float, float, str, int]] = []
    start, unknown = a.start, 0
    for r in _round_starts(a, af):
        if r is None or not start < r < stop:
            unknown += 1
            continue
        spans.append((start, r, _RESTART, unknown))
        start, unknown = r, 0
    spans.append((start, stop, ending, unknown))
    unplaced: dict[str, float] = {}
    before: list[str] = []  # what the unknown last checkpoints came before
    lost_to_restarts = 0.0
    for span_start, span_stop, span_ending, span_unknown in spans:
        pieces, why = _span_pieces(span_start, span_stop, span_ending, span_unknown, facts)
        for until, category in pieces:
            added = cut.put(until, category, a.attempt)
            if category == UNATTRIBUTED and why:
                unplaced[why] = unplaced.get(why, 0.0) + added
            if category == LOST and span_unknown:
                lost_to_restarts += added
        if why == "checkpoint":
            before.append(
                "an in-job restart"
                if span_ending == _RESTART
                else f"its ending ({a.cause or 'cause not recorded'})"
            )
    notes = []
    k = f"attempt {a.attempt}"
    if unplaced.get("checkpoint"):
        notes.append(
            f"{k}: {format_duration(unplaced['checkpoint'])} unattributed: no "
            f"checkpoint record tells when its last checkpoint before "
            f"{' and before '.join(dict.fromkeys(before))} was saved"
        )
    if unplaced.get("ending"):
        notes.append(
            f"{k}: {format_duration(unplaced['ending'])} after its last checkpoint "
            "unattributed: how it ended is not recorded"
        )
    if unplaced.get(_RUNNING):
        notes.append(
            f"{k} is running: {format_duration(unplaced[_RUNNING])} of work since "
            "its last checkpoint is not kept yet (unattributed)"
        )
    unknown_total = sum(span[3] for span in spans)
    if unknown_total and (unplaced.get("restarts") or lost_to_restarts):
        extra = (
            (f"; the {format_duration(lost_to_restarts)} counted as lost includes their cost")
            if lost_to_restarts
            else ""
        )
        notes.append(
            f"{k}: {unknown_total} in-job restart(s) at unrecorded times: "
            f"{format_duration(unplaced.get('restarts', 0.0))} unattributed{extra}"
        )
    if ending == _CONTINUED and not any(
        r.time is not None and a.start < r.time <= stop for r in facts.checkpoints
    ):
        notes.append(
            f"{k} ended checkpointed; no record gives its save's time, so it is "
            "taken to have saved at its end"
        )
    return notes


# ---------------------------------------------------------------------------- timeline
def _timeline(
    run: Run,
    attempts: Sequence[Attempt],
    events: Iterable[Event],
    facts: ComputeFacts,
    begin: float,
    finish: float,
) -> tuple[TimelineEntry, ...]:
    entries: list[TimelineEntry] = [TimelineEntry(begin, "created", f"run {run.run_id} created")]
    verdicts: dict[int, str] = {}  # attempt -> the daemon's verdict at its end
    for e in events:
        k = _attempt_of(e)
        if e.kind == "ended":
            if k is not None and e.data.get("verdict"):
                verdicts[k] = str(e.data["verdict"])
        elif (entry := _event_entry(e, k, attempts)) is not None:
            entries.append(entry)
    for a in attempts:
        entries += _attempt_entries(a, verdicts.get(a.attempt))
        entries += _restart_entries(a, facts.attempts.get(a.attempt, AttemptFacts()), finish)
        for r in distinct_live(facts.live.get(a.attempt, ())):
            assert r.failed_at is not None
            said = f"attempt {a.attempt}: {live_note(r)}"
            entries.append(TimelineEntry(r.failed_at, "live", said, a.attempt))
    entries += _checkpoint_entries(attempts, facts.checkpoints, finish)
    if run.state.is_terminal:
        why = f": {run.reason}" if run.reason else ""
        entries.append(TimelineEntry(finish, "run_ended", f"run {run.state.value}{why}"))
    order = {id(e): n for n, e in enumerate(entries)}
    return tuple(sorted(entries, key=lambda e: (e.time, order[id(e)])))


def _attempt_of(e: Event) -> int | None:
    """The attempt an event is about, or None."""
    k = e.data.get("attempt")
    return k if isinstance(k, int) else None


def _event_entry(e: Event, k: int | None, attempts: Sequence[Attempt]) -> TimelineEntry | None:
    """The timeline's line for one of the daemon's events (about attempt `k`), or None for
    an event it does not show."""
    if e.kind == "cadence":
        cadence = Cadence.from_json(e.data)
        return None if cadence is None else TimelineEntry(e.time, e.kind, cadence.describe())
    if e.kind == "cancel_requested":
        return TimelineEntry(e.time, e.kind, "cancel requested")
    text = _event_text(e.kind, e.data, k, attempts)
    return None if text is None else TimelineEntry(e.time, e.kind, text, k)


def _event_text(
    kind: str, d: Mapping[str, Any], k: int | None, attempts: Sequence[Attempt]
) -> str | None:
    """What an event of `kind` with data `d` about attempt `k` says, or None."""
    job = f"job {d.get('job_id')}"
    if kind == "submitted":
        return f"attempt {k} submitted as {job}{_excluding(d)}"
    if kind == "requeued":
        return f"attempt {k}: {job} requeued{_excluding(d)}"
    if kind == "adopted":
        return f"attempt {k}: adopted {job}"
    if kind == "checkpoint_signal":
        lead = (
            f" ({d['lead_s']:g}s before the wall limit)"
            if isinstance(d.get("lead_s"), (int, float))
            else ""
        )
        return f"checkpoint signal {d.get('signal')} sent to attempt {k}{lead}"
    if kind == "recovered" and isinstance(d.get("latency_s"), (int, float)):
        latency = format_duration(d["latency_s"])
        return f"attempt {k} running {latency} after the previous ending was seen"
    if kind == "node_lost":
        return _node_lost_text(d, k, attempts)
    if kind == "straggler":
        return f"straggler node(s) flagged: {', '.join(d.get('nodes') or [])}"
    if kind == "warning":
        return f"warning: {d.get('message')}"
    if kind == "validation":
        return validation_text(d)
    return health_text(kind, d)


def _excluding(d: Mapping[str, Any]) -> str:
    return f", excluding {','.join(d['exclude'])}" if d.get("exclude") else ""


def _node_lost_text(d: Mapping[str, Any], k: int | None, attempts: Sequence[Attempt]) -> str:
    """A lost node: who saw it, how long after it was last heard, and how the run went on."""
    who = {"slurm": "Slurm", "daemon": "the daemon"}.get(
        str(d.get("source")), f"peer {d.get('reported_by')}"
    )
    took = (
        f" {format_duration(d['detection_s'])} after it was last heard"
        if isinstance(d.get("detection_s"), (int, float))
        else ""
    )
    waiting = spare_lost(d)
    if waiting is not None:
        return f"{d.get('node') or 'a node'} lost (seen by {who}{took}): {waiting}"
    recorded = str(d.get("recovery") or "new_job")
    went_on = recovered_how(attempts, k, recorded) if k is not None else None
    spare = recorded == Recovery.SPARE
    how = _HOW[went_on or (Recovery.SPARE if spare else Recovery.NEW_JOB).value]
    return f"{d.get('node') or 'a node'} lost (seen by {who}{took}): {how}"


def _attempt_entries(a: Attempt, verdict: str | None) -> list[TimelineEntry]:
    """Attempt `a` started (a span to its end) and ended (with the daemon's `verdict`)."""
    k = a.attempt
    entries = []
    if a.start is not None:
        nodes = ",".join(a.nodes) or "?"
        entries.append(
            TimelineEntry(
                a.start, "started", f"attempt {k} started on {nodes} (job {a.job_id})", k, a.end
            )
        )
    if a.end is not None:
        ran = (
            f" after {format_duration(a.end - a.start)}"
            if a.start is not None
            else (" before starting")
        )
        how = ", ".join(x for x in (a.state, a.cause) if x)
        then = f" -> {verdict}" if verdict is not None else ""
        why = f" ({a.reason})" if a.reason else ""
        entries.append(
            TimelineEntry(a.end, "ended", f"attempt {k} ended{ran}: {how}{then}{why}", k)
        )
    return entries


def _restart_entries(a: Attempt, af: AttemptFacts, finish: float) -> list[TimelineEntry]:
    """Attempt `a`'s in-job restarts (those at unrecorded times in one line) and hangs."""
    k = a.attempt
    entries = []
    starts = _round_starts(a, af)
    for n, r in enumerate(starts, 1):
        if r is not None:
            entries.append(
                TimelineEntry(
                    r,
                    "restart",
                    f"attempt {k}: ranks running again after in-job restart {n}",
                    k,
                )
            )
    missing = sum(r is None for r in starts)
    if missing:
        at = a.end if a.end is not None else (a.start if a.start is not None else finish)
        entries.append(
            TimelineEntry(
                at,
                "restart",
                f"attempt {k}: {missing} in-job restart(s) at unrecorded times",
                k,
            )
        )
    for t, what in af.hangs:
        entries.append(TimelineEntry(t, "hang", f"attempt {k}: hang detected ({what})", k))
    return entries


def _checkpoint_entries(
    attempts: Sequence[Attempt], checkpoints: Iterable[CheckpointRecord], finish: float
) -> list[TimelineEntry]:
    """The checkpoints whose save time is recorded, each with the attempt it fell in."""
    ranges = [
        (a.start, a.end if a.end is not None else finish, a.attempt)
        for a in attempts
        if a.start is not None
    ]
    entries = []
    for r in checkpoints:
        if r.time is None:
            continue
        k = next((n for s, e, n in ranges if s <= r.time <= e), None)
        took = f" ({format_duration(r.save_s)})" if r.save_s else ""
        step = f"step {r.step}" if r.step is not None else "a checkpoint"
        entries.append(TimelineEntry(r.time, "checkpoint", f"checkpoint of {step} saved{took}", k))
    return entries
