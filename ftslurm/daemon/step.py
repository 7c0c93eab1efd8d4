"""What the daemon does next for one attempt: a pure function of what it knows.

`step(attempt, observed, run, facts, now) -> list[Intent]` holds every decision of the
reconcile loop (`ftslurm.daemon.reconcile`, the shell): submit or adopt, requeue (held, the
exclusions, release, start now) or submit afresh, record what changed, send the checkpoint
signal, flag nodes, move a job off a straggler, classify an ending and decide (through the
pure `policy`), end the run. It reads no file, no clock and no scheduler: `observed` is the
scheduler's view of the attempt's job (one batched query), `facts` what the shell read
for it (the run's files, node flags, the node listing, the cancel flag as stored now).

What `step` needs and was not given, it asks for with one `Need` intent (and nothing
else): the shell gathers that and calls again. So a cycle reads the run's files and
lists the nodes only where a decision depends on them.

The intents are executed in order by the shell. The records (`Record`, `NewAttempt`,
`UpdateRun`, `FlagNode`, `Event`, `Finish`, `Trust`) between two actions are written in one
transaction before the next action, so the intent to act is stored before acting; every
action is safe to repeat (`reconcile` explains how).

**Quiet attempts.** For an attempt whose job is seen as it was recorded (queued or
running, the same state and nodes, no cancel: the watch path), when `step` decides nothing
but when to look again (only `Wake` intents, or none), its intents depend on `now` only
through those `Wake`s and the expiry of node flags (`active_flags`), and not on
`facts.poll_interval` (read for an ending only). A look wake (`Wake.look`) is now plus a
period, to read the run's files again: with the files unchanged, it decides nothing. So
called again with the same attempt, job, run and facts, before the earliest `Wake` that is
not a look and before the next flag expiry, `step` returns the same intents, the look wakes
moved on by the time passed. The shell relies on this to skip such steps (`reconcile`,
"Quiet attempts"); `tests/test_step_property.py` checks it.

It lives in `ftslurm.daemon` beside `policy` (whose functions it calls) and `records` (the
records it reads and returns), and like them does no I/O (checked by the architecture test).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ftslurm.core.cadence import Cadence, FailureHistory, cadence, live_coverage
from ftslurm.core.contract import Disambiguation
from ftslurm.core.contract.reports import (
    Benched,
    LauncherFailed,
    NodeReport,
    Outcome,
    PeerLost,
    Progress,
    RankReport,
    Report,
    RoundRecord,
    StragglerReport,
    Unhealthy,
    ValidationReport,
    parse,
    parse_all,
)
from ftslurm.core.inject import InjectKind, parse_injections, reached
from ftslurm.core.leases import (
    Lease,
    Seen,
    daemon_timeout,
    is_lost,
    never_started,
    never_started_at,
)
from ftslurm.core.recovery import BATCH_NODE_RANK, Recovery, Source, recovery
from ftslurm.core.settings import Cause, FtSettings
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import policy
from ftslurm.daemon.policy import Budget, Ending, Verdict
from ftslurm.daemon.records import Attempt, AttemptState, NodeFlag, Run, RunState, tag

CANCELLED_BY_USER = "cancelled by the user"


# ----------------------------------------------------------------------------- facts
@dataclass(frozen=True)
class Facts:
    """What the shell read for one attempt. A field left None was not read (yet)."""

    cancel_requested: bool | None = None  # the run's cancel flag as stored now
    trusted: bool = False  # this daemon recorded the intent: no job can carry its tag yet
    found: tuple[JobInfo, ...] | None = None  # jobs carrying the attempt's tag
    flags: tuple[NodeFlag, ...] = ()  # every node flag, expired ones too (repeat offenders)
    usable: Mapping[str, bool] | None = None  # node -> usable now, from the node listing
    previous: Attempt | None = None  # the attempt before this one, if any
    previous_known: bool = False  # whether `previous` was read
    files: RunFiles | None = None  # the run directory's reports about this attempt
    poll_interval: float = 1.0  # the loop's current interval (an ending seen one poll late)
    requeue_refused: bool = False  # the scheduler refused to requeue the attempt's job
    # the run's settings as parsed (the shell parses them once per run version); None:
    # `step` parses `run.settings` itself
    settings: FtSettings | None = None
    # node failures and node-days in the daemon's whole history (the tuned checkpoint
    # interval's failure rate); None: not read
    history: FailureHistory | None = None


@dataclass(frozen=True)
class RunFiles:
    """The run directory's files the decisions read (written by the compute side), as the
    contract's models (`ftslurm.core.contract.reports`); a plain JSON object given for one
    is read into its model (one that is not a valid report left out)."""

    progress: Progress = field(default_factory=Progress)  # progress.json
    rank_reports: tuple[RankReport, ...] = ()  # attempts/N/rank-*.json
    node_reports: tuple[NodeReport, ...] = ()  # attempts/N/node-*.json (launchers)
    finished_marker: bool = False  # FINISHED
    hung: str = ""  # the hung rank the launchers found at the stop, in words
    straggler_report: StragglerReport | None = None
    # the attempt's recovery folder (RunDir.recovery): the launchers' peer-loss reports
    # (lost-*.json), the in-job round records (round-*.json), the benched nodes
    lost: tuple[PeerLost, ...] = ()
    rounds: tuple[RoundRecord, ...] = ()
    benched: tuple[Benched, ...] = ()
    # launchers that failed before their ranks started (launcher-failed-*.json)
    launchers_failed: tuple[LauncherFailed, ...] = ()
    # nodes that failed their pre-flight health check (unhealthy-*.json)
    unhealthy: tuple[Unhealthy, ...] = ()
    # the launchers' last leases (RunDir.peer_lease), read at an ending only: when a node
    # Slurm declared failed was last heard of
    leases: tuple[Lease, ...] = ()
    # the launchers' node reports above were read (at an ending, or for an attempt that
    # lost a node: `_done_but_for_lost`); False: not read, not "none written"
    launchers_read: bool = False
    # the batch host's lease as the daemon watches it (`ftslurm.core.leases`: the changes
    # timed on the daemon's clock, read just before the step); None: not watched (a job of
    # one node)
    batch_lease: Seen | None = None
    # when the daemon first saw the batch script start the job's step (`RunDir.launched`),
    # on its clock; None: not seen (the setup lines still run, an older batch script)
    launched_at: float | None = None
    # the checkpoint interval the run directory holds (RunDir.cadence); None: none written
    cadence: Cadence | None = None
    # the rank agents' result validation reports of every attempt of the run so far
    # (attempts/*/validation-rank-*.json), read at an ending
    validation: tuple[ValidationReport, ...] = ()

    def __post_init__(self) -> None:
        for name, model in _REPORT_FIELDS.items():
            object.__setattr__(self, name, parse_all(model, tuple(getattr(self, name))))
        leases = (x if isinstance(x, Lease) else Lease.from_json(x) for x in self.leases)
        object.__setattr__(self, "leases", tuple(x for x in leases if x is not None))
        object.__setattr__(self, "progress", parse(Progress, self.progress) or Progress())
        object.__setattr__(self, "straggler_report", parse(StragglerReport, self.straggler_report))


_REPORT_FIELDS: dict[str, type[Report]] = dict(
    rank_reports=RankReport,
    node_reports=NodeReport,
    lost=PeerLost,
    rounds=RoundRecord,
    benched=Benched,
    launchers_failed=LauncherFailed,
    unhealthy=Unhealthy,
    validation=ValidationReport,
)


@dataclass(frozen=True)
class Loss:
    """A node that left the attempt: lost (a launcher's peer-loss report), benched (its
    launcher stepped out so a spare replaces it) or unhealthy (it failed its pre-flight
    health check and no spare took its place: `unhealthy`; one a spare replaced is benched,
    its health report in `health`)."""

    node: str
    node_rank: int | None
    report: PeerLost | Benched | Unhealthy
    benched: bool = False
    health: Unhealthy | None = None

    @property
    def unhealthy(self) -> bool:
        return isinstance(self.report, Unhealthy)


def losses(attempt: int, files: RunFiles, nodes: Sequence[str]) -> list[Loss]:
    """The nodes the attempt's recovery folder says were lost, benched or unhealthy, each
    once (a report of another attempt, or naming no node, is left out). A report without
    the node's name is placed by its node rank in the allocation (`nodes`)."""
    found: dict[str, Loss] = {}
    named: list[tuple[PeerLost | Benched | Unhealthy, int | None, str | None, bool]] = [
        *((r, r.lost_node_rank, r.lost_node, False) for r in files.lost),
        *((r, r.node_rank, r.node, True) for r in files.benched),
        *((r, r.node_rank, r.node, False) for r in files.unhealthy if not r.benched),
    ]
    health = {r.node_rank: r for r in files.unhealthy if r.attempt in (None, attempt) and r.benched}
    for r, rank, node, benched in named:
        if r.attempt not in (None, attempt):
            continue
        if not node:
            node = nodes[rank] if rank is not None and 0 <= rank < len(nodes) else None
        if node is not None and node not in found:
            found[node] = Loss(node, rank, r, benched, health.get(rank) if benched else None)
    return list(found.values())


# ---------------------------------------------------------------------------- intents
@dataclass(frozen=True)
class Need:
    """Read these facts and call `step` again: "cancel" (the flag as stored now), "found"
    (jobs by tag), "nodes" (the listing), "previous" (the attempt before), "files" (every
    report of the run directory), "watch_files" (progress, the straggler report and the
    recovery folder) or "node_reports" (the watched files and the launchers' node reports:
    one listing of the attempt's folder, not the leases of every node)."""

    what: frozenset[str]


@dataclass(frozen=True)
class Record:
    """Store the attempt's record as given."""

    attempt: Attempt


@dataclass(frozen=True)
class NewAttempt:
    """Store the next attempt (an intent: SUBMITTING or REQUEUING)."""

    attempt: Attempt


@dataclass(frozen=True)
class UpdateRun:
    run: Run


@dataclass(frozen=True)
class Finish:
    """End the run (and log `run_ended`)."""

    state: RunState
    reason: str


@dataclass(frozen=True)
class FlagNode:
    node: str
    reason: str
    ttl_s: float | None  # None: no expiry


@dataclass(frozen=True)
class UnflagNode:
    """Remove the node's flag if it is still the one given (`reason`, set by `run_id`)."""

    node: str
    reason: str
    run_id: str


@dataclass(frozen=True)
class Event:
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Trust:
    """This daemon recorded attempt N's intent itself: no adoption search needed."""

    attempt: int


@dataclass(frozen=True)
class Adopt:
    """Record the job found carrying the attempt's tag as the attempt's job."""

    job: JobInfo


@dataclass(frozen=True)
class Submit:
    """Submit the attempt's job with these exclusions (and, after exit 16, the context of
    its disambiguation run)."""

    exclude: tuple[str, ...]
    disambiguate: Disambiguation | None = None


@dataclass(frozen=True)
class Cancel:
    job_id: str


@dataclass(frozen=True)
class Requeue:
    job_id: str
    hold: bool = True


@dataclass(frozen=True)
class SetExclusions:
    job_id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    """Release the held job (the shell reads the cancel flag again first)."""

    job_id: str


@dataclass(frozen=True)
class StartNow:
    job_id: str


@dataclass(frozen=True)
class Requeued:
    """The job is back for the attempt: record it PENDING (and log `requeued`)."""

    exclude: tuple[str, ...] | None


@dataclass(frozen=True)
class Signal:
    job_id: str
    signal: str


@dataclass(frozen=True)
class WriteCadence:
    """Write the run's checkpoint interval into its directory, for the rank agents."""

    cadence: Cadence


@dataclass(frozen=True)
class Wake:
    """Look at this attempt again no later than `at` (a signal due, a report to read).

    `look`: only to read the run's files again, `at` being the step's `now` plus a period
    (the straggler report's interval); nothing falls due at `at` that unchanged files would
    not show, and the next step sets it a period later again."""

    at: float
    look: bool = False


@dataclass(frozen=True)
class Changed:
    """Something changed: the loop polls fast for a while."""


Intent = (
    Need
    | Record
    | NewAttempt
    | UpdateRun
    | Finish
    | FlagNode
    | UnflagNode
    | Event
    | Trust
    | Adopt
    | Submit
    | Cancel
    | Requeue
    | SetExclusions
    | Release
    | StartNow
    | Requeued
    | Signal
    | WriteCadence
    | Wake
    | Changed
)
RECORDS = (Record, NewAttempt, UpdateRun, Finish, FlagNode, UnflagNode, Event, Trust, Changed)


def _need(*what: str) -> list[Intent]:
    return [Need(frozenset(what))]


# ------------------------------------------------------------------------------- step
def step(a: Attempt, observed: JobInfo | None, run: Run, facts: Facts, now: float) -> list[Intent]:
    """The intents for attempt `a` (the run's latest) given the scheduler's view of its
    job (`observed`; None or UNKNOWN: not seen) and the facts. See the module doc."""
    if a.state is AttemptState.SUBMITTING:
        return _submitting(a, run, facts, now)
    if observed is None or observed.state is JobState.UNKNOWN or not a.job_id:
        return []
    if a.state is AttemptState.REQUEUING:
        return _requeuing(a, observed, run, facts, now)
    if observed.state.is_terminal or observed.restart_count > a.restart_count:
        return _launcher_noted(a, facts, _ended(a, observed, run, facts, now))
    return _watch(a, observed, run, facts, now)


def active_flags(facts: Facts, now: float) -> list[str]:
    """The flagged nodes not expired at `now`, most recent flags first."""
    live = [f for f in facts.flags if f.expires_at is None or f.expires_at > now]
    return [f.node for f in sorted(live, key=lambda f: f.since, reverse=True)]


def _exclusions(run: Run, flagged: Sequence[str], usable: Mapping[str, bool]) -> tuple[str, ...]:
    return policy.plan_exclusions(
        flagged, [n for n, ok in usable.items() if ok], int(run.spec["options"]["nodes"])
    )


def _submitting(a: Attempt, run: Run, facts: Facts, now: float) -> list[Intent]:
    if a.attempt > 0 and not facts.previous_known:
        return _need("previous")
    # The previous attempt ended on a lost node while its job still ran: its job is
    # cancelled before anything is submitted (again after a crash: a repeat is harmless),
    # so two jobs of the run never train at once and Slurm cannot requeue the old one.
    lost_job = _lost_job(facts.previous)
    if run.cancel_requested:
        return [*lost_job, Finish(RunState.CANCELLED, CANCELLED_BY_USER)]
    if facts.cancel_requested is None:
        return _need("cancel")
    if facts.cancel_requested:
        return [*lost_job, Finish(RunState.CANCELLED, CANCELLED_BY_USER)]
    if not facts.trusted:
        if facts.found is None:
            return _need("found")
        if facts.found:  # submitted already: the old job was cancelled before
            return [Adopt(max(facts.found, key=lambda j: int(j.job_id.split("_")[0])))]
    prev = facts.previous
    context = (
        None
        if prev is None
        else policy.disambiguation(
            prev.cause, prev.attempt, prev.nodes, run.last_checkpoint_step, _settings(run, facts)
        )
    )
    flagged = active_flags(facts, now)
    if not flagged:
        return [*lost_job, Submit((), context)]
    if facts.usable is None:
        return _need("nodes")
    return [*lost_job, Submit(_exclusions(run, flagged, facts.usable), context)]


def _lost_job(prev: Attempt | None) -> list[Intent]:
    """Cancel the job of a previous attempt that lost a node (`lost_nodes`): ended for it,
    or ended when its live launchers were done while Slurm still waited on the dead node
    (`_done_but_for_lost`); or that ended with exit 16, whose disambiguation run is a fresh
    job (Slurm may have requeued the old one itself, a preemption's exit 16). Harmless when
    it has ended since."""
    if prev is None or not prev.job_id:
        return []
    if not prev.lost_nodes and prev.cause != Cause.RESUME_ELSEWHERE.value:
        return []
    return [Cancel(prev.job_id)]


def _requeuing(a: Attempt, info: JobInfo, run: Run, facts: Facts, now: float) -> list[Intent]:
    job = a.job_id or ""
    if run.cancel_requested:
        if info.state.is_active:
            return [Cancel(job)]
        if info.state.is_terminal:
            return [Finish(RunState.CANCELLED, CANCELLED_BY_USER)]
    if facts.cancel_requested is None:
        return _need("cancel")
    if facts.cancel_requested:  # as stored now: the copy the cycle read may be older
        if info.state.is_terminal:
            return [Finish(RunState.CANCELLED, CANCELLED_BY_USER)]
        return [Cancel(job)]  # the next cycle sees it end
    if facts.requeue_refused:
        if info.state.is_terminal and info.restart_count < a.restart_count:
            # it can no longer be requeued (e.g. forgotten): submit afresh instead
            fresh = replace(
                a,
                state=AttemptState.SUBMITTING,
                job_id=None,
                restart_count=0,
                tag=tag(run.run_id, a.attempt),
            )
            return [Record(fresh), Trust(a.attempt)]
        return []  # not pending yet: next cycle
    if info.restart_count < a.restart_count:
        if info.state is JobState.RUNNING and not facts.previous_known:
            return _need("previous")
        if not info.state.is_terminal and not (
            info.state is JobState.RUNNING and _moving(a, facts.previous)
        ):
            return []  # still ending; look again next cycle
        return [Requeue(job, hold=True)]  # it shows as pending in a moment
    if info.state is JobState.RUNNING or info.state.is_terminal:
        # back already: a daemon released it and died before recording that
        return [Requeued(None), Changed()]
    if info.state not in (JobState.PENDING, JobState.REQUEUED):
        return []  # e.g. still COMPLETING after the requeue: next cycle
    flagged = active_flags(facts, now)
    exclude: tuple[str, ...] = ()
    if flagged:
        if facts.usable is None:
            return _need("nodes")
        exclude = _exclusions(run, flagged, facts.usable)
    merged = tuple(sorted(set(run.spec["options"]["exclude"]) | set(exclude)))
    return [SetExclusions(job, merged), Release(job), StartNow(job), Requeued(merged), Changed()]


def _moving(a: Attempt, before: Attempt | None) -> bool:
    """Whether requeue intent `a` moves a job that is still running (off a straggler)."""
    return (
        before is not None
        and before.attempt == a.attempt - 1
        and before.cause == Cause.STRAGGLER.value
        and before.job_id == a.job_id
    )


def _started(a: Attempt, run: Run, facts: Facts, at: float) -> list[Intent]:
    """The attempt was seen running at `at`: the recovery latency is measured from the
    previous attempt's ending being observed to this (at most one poll late)."""
    out: list[Intent] = []
    if run.state is RunState.PENDING:
        out.append(UpdateRun(replace(run, state=RunState.RUNNING)))
    prev = facts.previous
    if prev is not None and prev.failure_seen_at is not None:
        out.append(
            Event(
                "recovered",
                {
                    "attempt": a.attempt,
                    "job_id": a.job_id,
                    "latency_s": round(at - prev.failure_seen_at, 3),
                },
            )
        )
    out.append(Event("running", {"attempt": a.attempt, "job_id": a.job_id, "nodes": a.nodes}))
    return out


def flag_node(
    node: str, why: str, flags: Sequence[NodeFlag], now: float, settings: FtSettings
) -> FlagNode:
    """Flag a node, for longer when it is a repeat offender (`policy.flag_ttl`)."""
    previous = {f.node: f for f in flags}.get(node)
    ttl = policy.flag_ttl(
        None if previous is None else (previous.since, previous.expires_at), now, settings
    )
    return FlagNode(node, why, ttl)


def _settings(run: Run, facts: Facts) -> FtSettings:
    return facts.settings if facts.settings is not None else FtSettings(**run.settings)


def _budget(run: Run) -> Budget:
    return Budget(
        run.job_retries_used, dict(run.cause_counts), run.continuations, run.stalled_continuations
    )


def _injected(
    run: Run,
    start: float | None,
    end: float | None,
    reports: Sequence[RankReport] = (),
    health: Sequence[Unhealthy] = (),
) -> list[str]:
    """The run's fired injections once an attempt that ran from `start` to `end` ended: the
    scheduler's (node_fail, preempt, timeout) that it ran long enough to reach, the
    crashes, hangs and spoiled results (nan, spike) its ranks' `reports` say they carried
    out, and the failed health checks the launchers' `health` reports say were injected (a
    straggler is never counted: its node stays slow; a persistent nan or spike is counted but
    carried on all the same, `still_to_fire`). Each fires once per run
    (`submission.build_attempt`)."""
    specs = tuple(run.spec.get("inject") or ())
    if not specs:
        return list(run.injected)
    ran = end - start if start is not None and end is not None else None
    done = set(run.injected) | set(reached(parse_injections(specs), ran))
    in_job = {
        i.spec()
        for i in parse_injections(specs)
        if i.kind in (InjectKind.CRASH, InjectKind.HANG) or i.kind.on_result
    }
    done |= {x for r in reports for x in r.injected if x in in_job}
    done |= {r.injected for r in health if r.injected and r.injected in specs}
    return sorted(done)


def _start(a: Attempt, info: JobInfo) -> float | None:
    return a.start if a.start is not None else info.start_time


def _watch(a: Attempt, info: JobInfo, run: Run, facts: Facts, now: float) -> list[Intent]:
    """Record what changed; act on straggler reports; send the checkpoint signal when due."""
    out: list[Intent] = []
    if info.state.value != a.state or (info.nodes and list(info.nodes) != a.nodes):
        a = replace(
            a,
            state=AttemptState.of(info.state),
            nodes=list(info.nodes) or a.nodes,
            start=info.start_time if info.state is JobState.RUNNING else a.start,
        )
        out += [Record(a), Changed()]
        if info.state is JobState.RUNNING:
            if not facts.previous_known:
                return _need("previous")
            out += _started(a, run, facts, now)
    if run.cancel_requested or facts.cancel_requested:
        return [*out, Cancel(a.job_id or "")]
    if info.state not in (JobState.RUNNING, JobState.COMPLETING):
        return out
    settings = _settings(run, facts)
    if facts.files is None:  # the recovery folder is read while the job holds its nodes
        return _need("watch_files")
    files = facts.files
    lost = _lost(a, info, run, facts, settings, files, now)
    if lost is not None:
        return [*out, *lost]
    failed = _launcher_failed(a, info, run, facts, files, now)
    if failed is not None:
        return failed if _asks(failed) else [*out, *failed]
    if a.lost_nodes:  # has every live launcher ended? Slurm waits on the dead node's task
        if not files.launchers_read:
            return _need("node_reports")
        done = _done_but_for_lost(a, info, files)
        if done is not None:
            ended = _ended(a, done, run, facts, now, stuck=True)
            return ended if _asks(ended) else [*out, *ended]
    if info.state is not JobState.RUNNING:
        return out
    tuned = _cadence(run, facts, settings, files)
    if tuned is None:
        return _need("history")
    out += tuned
    restarted = _in_job_restart(a, files)
    if restarted:
        a = restarted[0].attempt
        out += restarted
    running = _watch_running(a, info, run, facts, settings, files, now)
    return _need("nodes") if running is None else out + running


def _in_job_restart(a: Attempt, files: RunFiles) -> list[Intent]:
    """The ranks restarted inside the job (a spare took a node's place, say) since the
    attempt was recorded: the attempt with its new round count (`Record` first) and the
    event. Empty: no new round."""
    restarted = max(
        (r.round for r in files.rounds if r.round is not None and r.attempt in (None, a.attempt)),
        default=0,
    )
    if restarted <= a.in_job_restarts:
        return []
    rec = max(files.rounds, key=lambda r: r.round if r.round is not None else -1)
    a = replace(a, in_job_restarts=restarted)
    return [
        Record(a),
        Event(
            "in_job_restart",
            {
                "attempt": a.attempt,
                "job_id": a.job_id,
                "round": restarted,
                "started_at": rec.started_at,
                "why": rec.why,
                "lost": list(rec.lost),
            },
        ),
        Changed(),
    ]


def _watch_running(
    a: Attempt,
    info: JobInfo,
    run: Run,
    facts: Facts,
    settings: FtSettings,
    files: RunFiles,
    now: float,
) -> list[Intent] | None:
    """A running attempt's stragglers, checkpoint signal and wakes. None: the node listing
    is needed."""
    out: list[Intent] = []
    flags = (
        policy.straggler_flags(
            files.straggler_report, a.attempt, settings, active_flags(facts, now)
        )
        if files.straggler_report
        else ()
    )
    if flags:
        moved = _straggler(a, info, run, facts, settings, flags, files, now)
        if moved is None:
            return None
        out += moved
        if any(isinstance(i, NewAttempt) for i in moved):
            return out  # moved off a straggler: the requeue intent takes it from here
    due = _signal(a, info, run, files, settings, now, out)
    look = policy.straggler_look_again(settings, now)
    if due is not None:
        out.append(Wake(due))
    silent_at = batch_lease_wake(a, info, files, settings)
    if silent_at is not None:
        out.append(Wake(silent_at))
    start_due = never_started_at(
        files.batch_lease, files.launched_at, settings.launcher_start_timeout_s
    )
    if start_due is not None and not a.lost_nodes:
        out.append(Wake(start_due))
    if look is not None:
        out.append(Wake(look, look=True))
    return out


def _cadence(run: Run, facts: Facts, settings: FtSettings, files: RunFiles) -> list[Intent] | None:
    """The run's checkpoint interval (`ftslurm.core.cadence`) to write when it differs
    from what its directory holds: for a run whose ranks recover live (`progress.json`'s
    `live_recovery`) with warm spares (the `live_recovery` setting), the disk's spaced for
    the node failures its spares cannot serve.
    None: the failure history is needed."""
    setting = settings.checkpoint_interval
    if setting == "auto" and facts.history is None:
        return None
    progress = files.progress
    nodes = max(1, int(run.spec.get("options", {}).get("nodes") or 1) - settings.spare_nodes)
    # node losses are served live when the ranks recover live and the spares wait warm
    served = progress.live_recovery and settings.live_recovery
    live = live_coverage(nodes, settings.spare_nodes) if served else None
    tuned = cadence(
        setting,
        nodes=nodes,
        save_s=_seconds(progress.checkpoint_save_s),
        save_prior_s=settings.checkpoint_save_prior_s,
        write_s=_seconds(progress.max_checkpoint_write_s),
        history=facts.history or FailureHistory(),
        prior_per_1000=settings.failure_rate_prior,
        prior_node_days=settings.failure_prior_node_days,
        memory_save_s=_seconds(progress.memory_save_s),
        memory_coverage=settings.memory_tier_coverage,
        live_coverage=live,
    )
    if (tuned.how == "off" and files.cadence is None) or not tuned.differs(files.cadence):
        return []
    return [WriteCadence(tuned)]  # idempotent; logged (`cadence`) once written


def _exit_save(progress: Progress) -> Any:
    """How long the save on the checkpoint signal takes, as the run reported its saves: the
    longest blocking part plus, for an asynchronous save, the longest background write,
    which the job waits for before it exits (`ftslurm.checkpoint`: `wait()`)."""
    save = progress.max_checkpoint_save_s
    write = _seconds(progress.max_checkpoint_write_s)
    if write is None or save is None:
        return save
    return float(save) + write


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _lost_event(a: Attempt, loss: Loss, how: Recovery, spares: int) -> Event:
    """`node_lost` (a peer-loss report: where the detection came from and its latency, and
    the lost node's role: a spare still waiting restarts no one) or `node_benched`, with
    the recovery chosen; `spares`: the spares left after every loss so far."""
    r = loss.report
    base = {
        "attempt": a.attempt,
        "job_id": a.job_id,
        "node": loss.node,
        "node_rank": loss.node_rank,
        "recovery": how.value,
    }
    if isinstance(r, Benched):
        return Event("node_benched", {**base, "why": r.why, "reason": r.reason, "time": r.time})
    if isinstance(r, Unhealthy):
        return Event(
            "node_unhealthy",
            {**base, "check": r.check, "detail": r.detail, "time": r.time},
        )
    heard, at = r.last_heard, r.time
    detection = round(at - heard, 3) if heard is not None and at is not None else None
    return Event(
        "node_lost",
        {
            **base,
            "source": _source(loss).value,
            "reported_by": r.reported_by,
            "last_heard": heard,
            "time": at,
            "detection_s": detection,
            **({"role": r.role, "spares_remaining": spares} if r.role is not None else {}),
        },
    )


def _source(loss: Loss) -> Source:
    daemon = isinstance(loss.report, PeerLost) and loss.report.source == Source.DAEMON.value
    return Source.DAEMON if daemon else Source.PEER


def _batch_host_silent(
    a: Attempt, info: JobInfo, files: RunFiles, settings: FtSettings, now: float
) -> Loss | None:
    """The batch host judged lost by the daemon itself: its launcher's lease, timed on the
    daemon's clock, silent for `daemon_timeout(peer_timeout_s)` while Slurm says the job
    runs, and no launcher reported it (the survivors may have gone with the rendezvous it
    hosted; a job of one node has no other watcher). A lease never read, or ended, is never
    lost. None: not silent."""
    seen, timeout = files.batch_lease, settings.peer_timeout_s
    nodes = a.nodes or list(info.nodes)
    if (
        info.state is not JobState.RUNNING
        or seen is None
        or seen.lease is None
        or not is_lost(seen, now, daemon_timeout(timeout, len(nodes)), float("inf"))
    ):
        return None
    node = seen.lease.node or (nodes[BATCH_NODE_RANK] if nodes else "")
    if not node:
        return None
    return Loss(
        node,
        BATCH_NODE_RANK,
        PeerLost(
            lost_node_rank=BATCH_NODE_RANK,
            lost_node=node,
            last_heard=seen.heard_at,
            lease_time=seen.lease.time,
            silent_s=round(now - seen.changed_at, 3),
            peer_timeout_s=timeout,
            reported_by="the daemon",
            time=now,
            source=Source.DAEMON.value,
            attempt=a.attempt,
            role=seen.lease.node_role() if isinstance(seen.lease, Lease) else None,
        ),
    )


def batch_lease_wake(
    a: Attempt, info: JobInfo, files: RunFiles, settings: FtSettings
) -> float | None:
    """When the batch host's lease, unchanged, would be judged silent (a `Wake`; the shell
    reads it again whenever it changes before that); None: no verdict to come (not
    running, never read, ended, or that node already acted on)."""
    seen = files.batch_lease
    if (
        info.state is not JobState.RUNNING
        or seen is None
        or seen.lease is None
        or seen.lease.ended is not None
        or seen.lease.node in a.lost_nodes
    ):
        return None
    return seen.changed_at + daemon_timeout(settings.peer_timeout_s, len(a.nodes or info.nodes))


def _lost_words(loss: Loss) -> str:
    """ "n2 lost: reported by n1 after 21 s of silence"."""
    r = loss.report
    if isinstance(r, Benched):
        return f"{loss.node} stepped out ({r.why or Outcome.BENCHED.value})"
    if isinstance(r, Unhealthy):
        return f"{loss.node} failed its health check ({r.check}: {r.detail})"
    silent = r.silent_s
    after = f" after {silent:.0f} s of silence" if silent is not None else ""
    return f"{loss.node} lost: reported by {r.reported_by or 'a peer'}{after}"


def _lost(
    a: Attempt,
    info: JobInfo,
    run: Run,
    facts: Facts,
    settings: FtSettings,
    files: RunFiles,
    now: float,
) -> list[Intent] | None:
    """Act on the nodes the launchers report lost (or benched) that this attempt has not
    acted on yet (`Attempt.lost_nodes`): flag each, record where the news came from, and
    recover as `ftslurm.core.recovery.recovery` says: on a spare, nothing more (the
    launchers swap it in); in a new job, the attempt ends now as a node failure and the
    next one is a fresh submission (whose step cancels this job first: `_lost_job`), not a
    requeue: a requeued job stays COMPLETING on the dead node until SlurmdTimeout, a
    cancelled one frees the others at once. A run whose budget is spent fails and its job
    is cancelled. None: nothing new."""
    gone = losses(a.attempt, files, a.nodes or list(info.nodes))
    silent = _batch_host_silent(a, info, files, settings, now)
    if silent is not None and all(
        g.node_rank != BATCH_NODE_RANK and g.node != silent.node for g in gone
    ):
        gone.append(silent)
    new = [g for g in gone if g.node not in a.lost_nodes]
    if not new:
        return None
    how = recovery({g.node_rank for g in gone if g.node_rank is not None}, settings.spare_nodes)
    out: list[Intent] = []
    flagged = set(active_flags(facts, now))
    for g in new:  # a node flagged already (a straggler that then stepped out) keeps its flag:
        if settings.exclude_failed_nodes and g.node not in flagged:  # once, not a lemon's twice
            out.append(flag_node(g.node, _flag_why(g), facts.flags, now, settings))
        out.append(_lost_event(a, g, how, max(0, settings.spare_nodes - len(gone))))
    a = replace(a, lost_nodes=[*a.lost_nodes, *(g.node for g in new)])
    if how is Recovery.SPARE:
        return [*out, Record(a), Changed()]
    # a node that failed its health check again although flagged could not be kept out
    again = any(g.unhealthy and g.node in flagged for g in new)
    return _lost_job_ends(a, info, run, settings, files, gone, new, out, now, kept_out=not again)


def _flag_why(g: Loss) -> str:
    """A flag's reason for a node that left the attempt."""
    if g.unhealthy or g.health is not None:
        report = g.health if g.health is not None else g.report
        assert isinstance(report, Unhealthy)
        return report.words
    return f"benched: {_why(g)}" if g.benched else f"lost ({_source(g).value} report)"


def _lost_job_ends(
    a: Attempt,
    info: JobInfo,
    run: Run,
    settings: FtSettings,
    files: RunFiles,
    gone: list[Loss],
    new: list[Loss],
    out: list[Intent],
    now: float,
    kept_out: bool = True,
) -> list[Intent]:
    """The attempt that lost the nodes `new` (of `gone`) ends now as a node failure, after
    the intents `out` (flags, events): a retry is a fresh submission; a run whose budget is
    spent fails and its job is cancelled first. When every node in `new` failed its health
    check (none lost), the cause is `unhealthy` (`policy.decide`: no failure budget spent
    while the nodes can be `kept_out`)."""
    ckpt = files.progress.checkpoint_step
    advanced = ckpt is not None and (
        run.last_checkpoint_step is None or ckpt > run.last_checkpoint_step
    )
    nodes = tuple(info.nodes) or tuple(a.nodes)
    ending = Ending(
        state=JobState.NODE_FAIL,
        nodes=nodes,
        down_nodes=tuple(g.node for g in gone if not g.benched and not g.unhealthy),
        checkpoints_known=ckpt is not None,
        checkpoint_advanced=advanced,
        elsewhere=kept_out,
    )
    cause = Cause.UNHEALTHY if all(g.unhealthy for g in new) else Cause.NODE_FAIL
    d = policy.decide(cause, ending, _budget(run), settings)
    words = "; ".join(_lost_words(g) for g in new)
    reason = f"{words} (Slurm had not noticed yet); {d.reason}"
    again = d.verdict in (Verdict.RETRY, Verdict.CONTINUE)
    finished = replace(
        a,
        state=AttemptState.NODE_FAIL,
        end=now,
        reason=reason,
        cause=cause.value,
        nodes=list(nodes),
        failure_seen_at=now if again else None,
    )
    fired = _injected(run, _start(a, info), now, health=files.unhealthy)
    run = _charged(run, d, ckpt, reason, fired)
    ended = _ended_event(
        a,
        JobState.NODE_FAIL.value,
        cause,
        replace(d, reason=reason),
        None,
        [g.node for g in new],
    )
    if not again:  # the job is cancelled first: seen again after a crash, decided again
        return [
            Cancel(a.job_id or ""),
            *out,
            Record(finished),
            ended,
            UpdateRun(replace(run, state=RunState.FAILED, ended_at=now)),
            Changed(),
        ]
    nxt = Attempt(
        run.run_id, a.attempt + 1, AttemptState.SUBMITTING, tag=tag(run.run_id, a.attempt + 1)
    )
    return [
        *out,
        Record(finished),
        ended,
        UpdateRun(run),
        NewAttempt(nxt),
        Trust(nxt.attempt),
        Changed(),
    ]


def _straggler(
    a: Attempt,
    info: JobInfo,
    run: Run,
    facts: Facts,
    settings: FtSettings,
    flags: tuple[tuple[str, str], ...],
    files: RunFiles,
    now: float,
) -> list[Intent] | None:
    """Flag the nodes the straggler report names as persistent. While spares can take their
    places (`policy.spares_take_stragglers`), that is all: their launchers step out and a
    spare replaces each inside the job. Otherwise, with `stop_if_straggler`, move the
    running job off them at once: the attempt ends here and a requeue intent (held,
    exclusions updated, released) begins the next one, for the nodes that score below the
    move's bar (`policy.straggler_move`: 0.75 unless the run sets a threshold; a milder
    straggler is only flagged). None: list the nodes first."""
    new = [node for node, _ in flags]
    allocation = list(a.nodes or info.nodes)
    gone = [g.node_rank for g in losses(a.attempt, files, allocation) if g.node_rank is not None]
    spare = policy.spares_take_stragglers(new, allocation, gone, settings.spare_nodes)
    out: list[Intent] = [flag_node(node, why, facts.flags, now, settings) for node, why in flags]
    out.append(
        Event(
            "straggler",
            {
                "attempt": a.attempt,
                "job_id": a.job_id,
                "nodes": new,
                "reasons": dict(flags),
                **({"recovery": Recovery.SPARE.value} if spare else {}),
            },
        )
    )
    if spare or not settings.stop_if_straggler:
        return out
    if facts.usable is None:
        return None
    flagged = new + [n for n in active_flags(facts, now) if n not in new]
    exclusions = _exclusions(run, flagged, facts.usable)
    scores = policy.straggler_scores(files.straggler_report)
    d = policy.straggler_move(
        new, info.nodes or a.nodes, exclusions, _budget(run), settings, scores
    )
    if d is None:
        return out
    moved = replace(
        a,
        state=AttemptState.REQUEUED,
        end=now,
        reason=d.reason,
        cause=d.cause.value,
        failure_seen_at=now,
    )
    nxt = Attempt(
        run.run_id,
        a.attempt + 1,
        AttemptState.REQUEUING,
        job_id=a.job_id,
        tag=a.tag,
        restart_count=a.restart_count + 1,
    )
    return [
        *out,
        Record(moved),
        UpdateRun(
            replace(
                run,
                cause_counts=dict(d.budget.cause_counts),
                reason=d.reason,
                injected=_injected(run, _start(a, info), now),
            )
        ),
        NewAttempt(nxt),
        _ended_event(a, moved.state.value, d.cause, d, None, new),
        Trust(nxt.attempt),
        Changed(),
    ]


def _signal(
    a: Attempt,
    info: JobInfo,
    run: Run,
    files: RunFiles,
    settings: FtSettings,
    now: float,
    out: list[Intent],
) -> float | None:
    """Send the checkpoint signal when due (appending its intents to `out`); returns when
    it will be due, if not yet."""
    if a.checkpoint_signal_at is not None:
        return None
    lead, warning = policy.checkpoint_lead(settings.preempt_time, _exit_save(files.progress))
    if not settings.preempt_time or info.time_limit_s is None or info.start_time is None:
        return None
    due = info.start_time + info.time_limit_s - lead
    if not policy.signal_due(info.start_time, info.time_limit_s, lead, now):
        return due
    if warning:
        out.append(Event("warning", {"message": warning}))
    out.append(
        Event(
            "checkpoint_signal",
            {
                "attempt": a.attempt,
                "job_id": a.job_id,
                "signal": settings.checkpoint_signal,
                "due": due,
                "lead_s": lead,
            },
        )
    )
    # the intent recorded first: a repeat would be harmless
    out.append(Record(replace(a, checkpoint_signal_at=now)))
    out.append(Signal(a.job_id or "", settings.checkpoint_signal))
    return None


def _launcher_failed(
    a: Attempt, info: JobInfo, run: Run, facts: Facts, files: RunFiles, now: float
) -> list[Intent] | None:
    """A launcher that failed before its ranks started (its report in the recovery folder:
    a port it could not bind, a rendezvous that timed out) ends the attempt now, not when
    the other launchers' rendezvous or Slurm's `srun --wait` gives up: recorded as a failed
    job with the launcher's error first in the reason (`_launcher_noted`); the next attempt
    is a fresh job and the old one is cancelled once this is recorded. None: no such report
    (or a node of the attempt was lost, which explains it and is acted on as a loss)."""
    first = _launcher_failure(a, files) or _never_started(
        a, info, files, _settings(run, facts), now
    )
    if first is None:
        return None
    code = first.exit_code
    done = replace(
        info,
        state=JobState.FAILED,
        signal=None,
        exit_code=code if code is not None and code > 0 else 1,
        end_time=first.time or now,
    )
    return _launcher_noted(a, facts, _ended(a, done, run, facts, now, stuck=True), first)


NEVER_STARTED = "start"  # the phase of a launcher that never started (`_never_started`)


def _never_started(
    a: Attempt, info: JobInfo, files: RunFiles, settings: FtSettings, now: float
) -> LauncherFailed | None:
    """Node rank 0's launcher (or first task wrapper) that never started: the batch script
    started the job's step `launcher_start_timeout_s` ago (on the daemon's clock) and no
    lease of it was ever read (`leases.never_started`): its Python never ran, or died
    before it wrote anything, so no report of it will ever come. Taken as a launcher that
    failed (`_launcher_failed`), with the words to say so. None: no such verdict (not
    running, a lease seen, a node of the attempt lost, or not yet due)."""
    timeout = settings.launcher_start_timeout_s
    if (
        info.state is not JobState.RUNNING
        or a.lost_nodes
        or not never_started(files.batch_lease, files.launched_at, now, timeout)
    ):
        return None
    nodes = a.nodes or list(info.nodes)
    return LauncherFailed(
        node_rank=BATCH_NODE_RANK,
        node=nodes[BATCH_NODE_RANK] if nodes else None,
        job_id=a.job_id,
        attempt=a.attempt,
        error=(
            f"no sign of it {timeout:.0f} s after the job's step started "
            f"(launcher_start_timeout_s): its Python never ran, or died before it wrote "
            f"anything"
        ),
        phase=NEVER_STARTED,
        time=now,
    )


def _launcher_failure(a: Attempt, files: RunFiles) -> LauncherFailed | None:
    """The first report of a launcher of the attempt's job that failed before its ranks
    started, unless a node of the attempt was lost (the loss explains it)."""
    failed = sorted(
        (
            r
            for r in files.launchers_failed
            if r.attempt in (None, a.attempt) and str(r.job_id) == str(a.job_id)
        ),
        key=lambda r: r.time or 0.0,
    )
    return failed[0] if failed and not a.lost_nodes else None


def _launcher_noted(
    a: Attempt, facts: Facts, ended: list[Intent], first: LauncherFailed | None = None
) -> list[Intent]:
    """An attempt's ending with the error of a launcher that failed before its ranks
    started (`first`, else its report in the recovery folder) put first in its reason (and
    the report in the "ended" event), so that "a launcher never started the ranks" is told
    from a failure of the training."""
    if first is None:
        first = None if _asks(ended) or facts.files is None else _launcher_failure(a, facts.files)
    if first is None or _asks(ended):
        return ended
    if first.phase == NEVER_STARTED:
        note = (
            f"the launcher never started on node {first.node or '?'} (node rank "
            f"{first.node_rank}): {first.error}"
        )
    else:
        note = (
            f"a launcher failed before its ranks started (node {first.node}, node "
            f"rank {first.node_rank}, in the {first.phase or 'rendezvous'}): "
            f"{first.error or 'no error recorded'}"
        )
    said = next(
        (i.data.get("reason") for i in ended if isinstance(i, Event) and i.kind == "ended"), None
    )

    def noted(i: Intent) -> Intent:
        if isinstance(i, Record) and i.attempt.reason == said:
            return Record(replace(i.attempt, reason=f"{note}; {said}"))
        if isinstance(i, UpdateRun) and i.run.reason == said:
            return UpdateRun(replace(i.run, reason=f"{note}; {said}"))
        if isinstance(i, Event) and i.kind == "ended":
            return Event(
                i.kind,
                {
                    **i.data,
                    "reason": f"{note}; {said}",
                    Outcome.LAUNCHER_FAILED.value: first.to_json(),
                },
            )
        return i

    return [noted(i) for i in ended] if said is not None else ended


def _asks(intents: list[Intent]) -> bool:
    return len(intents) == 1 and isinstance(intents[0], Need)


def _done_but_for_lost(a: Attempt, info: JobInfo, files: RunFiles) -> JobInfo | None:
    """The job as it would have ended, when every node of the allocation but the lost ones
    has left its launcher's report: with `--no-kill` (hot spares) the step, and so the job,
    waits for the dead node's task until Slurm marks the node down (SlurmdTimeout), long
    after the training ended. Its state and exit code are the launchers' (the highest
    code, as srun's); None while a live launcher still runs."""
    nodes = a.nodes or list(info.nodes)
    lost = {g.node_rank for g in losses(a.attempt, files, nodes) if not g.benched}
    ended = {r.node_rank for r in files.node_reports}
    if not lost or not nodes or not set(range(len(nodes))) - lost <= ended:
        return None
    code = max((r.exit_code or 0 for r in files.node_reports), default=0)
    return replace(
        info,
        state=JobState.COMPLETED if code == 0 else JobState.FAILED,
        exit_code=code,
        signal=None,
        end_time=max((r.ended_at or 0.0 for r in files.node_reports), default=0.0) or None,
    )


def _ended(
    a: Attempt, info: JobInfo, run: Run, facts: Facts, now: float, stuck: bool = False
) -> list[Intent]:
    """Classify the ending, decide, record it and the next attempt's intent (or the run's
    end) together. `stuck`: the job's launchers are done but Slurm holds it for a dead
    node (`_done_but_for_lost`): the next attempt is a fresh job, and the old one is
    cancelled once this is recorded (again before the next submission: `_lost_job`)."""
    needs = [
        w
        for w, missing in (
            ("cancel", facts.cancel_requested is None),
            ("files", facts.files is None),
            ("previous", not facts.previous_known),
            ("nodes", facts.usable is None),
        )
        if missing
    ]
    if needs:
        return _need(*needs)
    assert facts.files is not None and facts.usable is not None
    out, a, run = _started_late(a, info, run, facts, now)
    settings = _settings(run, facts)
    files = facts.files
    requeued = info.restart_count > a.restart_count
    # Of a job it requeued, Slurm lists what is left of the allocation (the survivors of a
    # lost node while they complete) or already the next one: the attempt ran on a.nodes.
    nodes = tuple(a.nodes) if requeued and a.nodes else tuple(info.nodes) or tuple(a.nodes)
    # nodes the launchers reported lost (or benched) that the attempt had not acted on yet
    gone = [
        g for g in losses(a.attempt, files, a.nodes or list(nodes)) if g.node not in a.lost_nodes
    ]
    peer_lost = [g.node for g in gone if not g.benched and not g.unhealthy]
    unhealthy = [g.node for g in gone if g.unhealthy]
    ending = _ending(a, info, run, facts, settings, nodes, peer_lost)
    cause = policy.classify(ending, settings)
    if peer_lost and cause is not Cause.FINISHED:  # a node was lost under it: whatever
        cause = Cause.NODE_FAIL  # the survivors died of, or a cancel after the loss
    elif unhealthy and cause is not Cause.FINISHED:  # a node failed its health check: the
        cause = Cause.UNHEALTHY  # others never trained
    cancel = run.cancel_requested or bool(facts.cancel_requested)  # a cancel is final
    d = policy.decide(cause, ending, _budget(run), settings, cancel)
    ended_state = (
        info.state.value
        if info.state.is_terminal
        else (JobState.NODE_FAIL.value if cause is Cause.NODE_FAIL else JobState.REQUEUED.value)
    )
    again = d.verdict in (Verdict.RETRY, Verdict.CONTINUE)
    finished = replace(
        a,
        state=AttemptState(ended_state),
        end=info.end_time or now,
        exit_code=info.exit_code,
        signal=info.signal,
        reason=d.reason,
        cause=cause.value,
        nodes=list(nodes),
        failure_seen_at=now if again else None,
        in_job_restarts=max([r.in_job_restarts for r in files.node_reports] + [a.in_job_restarts]),
        lost_nodes=[*a.lost_nodes, *(g.node for g in gone)],
    )
    ckpt = files.progress.checkpoint_step
    fired = _injected(run, finished.start, finished.end, files.rank_reports, files.unhealthy)
    run = _charged(run, d, ckpt, d.reason, fired)
    out.append(Record(finished))
    out += [flag_node(node, why, facts.flags, now, settings) for node, why in d.exclude]
    excluded = [n for n, _ in d.exclude]
    flaky = _flaky(run, files, facts, settings, excluded) if d.verdict is not Verdict.CANCEL else ()
    out += [flag_node(node, why, facts.flags, now, settings) for node, why in flaky]
    out += _gone_at_the_end(a, gone, facts, settings, now)
    if cause is Cause.NODE_FAIL and not peer_lost:  # Slurm's verdict came first
        out += _slurm_lost(a, ending.down_nodes, files, now)
    out.append(_ended_event(a, ended_state, cause, d, info.exit_code, excluded))
    out += _validation(a, run, facts, cause, d, excluded)
    if flaky:
        out.append(
            Event(
                "validation",
                {
                    "attempt": a.attempt,
                    "job_id": a.job_id,
                    "verdict": "flaky",
                    "flagged": [n for n, _ in flaky],
                    "reason": "; ".join(f"{n}: {why}" for n, why in flaky),
                },
            )
        )
    # a disambiguation run is a fresh job: a requeued one would run the old script, which
    # does not carry the context (`Submit.disambiguate`)
    fresh = bool(peer_lost) or bool(unhealthy) or stuck or (again and d.disambiguate)
    out += _after_ending(run, finished, info, d.verdict, fresh=fresh, now=now)
    if stuck or (fresh and requeued):  # recorded first; the job no longer trains (it waits on
        out.append(Cancel(a.job_id or ""))  # a dead node, or Slurm requeued it after exit 16)
    return out


def _flaky(
    run: Run, files: RunFiles, facts: Facts, settings: FtSettings, excluded: list[str]
) -> tuple[tuple[str, str], ...]:
    """The nodes to flag now for the transient result faults found on them in the run
    (`policy.flaky_nodes`): not those this ending flags already, nor those the run has a
    result-validation flag on (flagged once, not at every later ending)."""
    mine = [f.node for f in _validation_flags(run, facts)]
    return policy.flaky_nodes(files.validation, settings, [*excluded, *mine])


def _validation_flags(run: Run, facts: Facts) -> list[NodeFlag]:
    """The flags this run set for result validation (exit 16, or transient faults)."""
    return [
        f
        for f in facts.flags
        if f.run_id == run.run_id and f.reason.startswith(policy.VALIDATION_FLAG)
    ]


def _validation(
    a: Attempt, run: Run, facts: Facts, cause: Cause, d: policy.Decision, flagged: list[str]
) -> list[Intent]:
    """Result validation's intents at an ending: exit 16's event (the nodes flagged, the
    disambiguation run or why there is none), and exit 17's after a disambiguation run
    (the verdict; the run's result-validation flags removed, those nodes were not at
    fault). Nothing for other endings, nor for a cancelled run."""
    if d.verdict is Verdict.CANCEL:
        return []
    if cause is Cause.RESUME_ELSEWHERE:
        return [
            Event(
                "validation",
                {
                    "attempt": a.attempt,
                    "job_id": a.job_id,
                    "exit_code": 16,
                    "verdict": "disambiguate" if d.disambiguate else d.verdict.value,
                    "flagged": flagged,
                    "reason": d.reason,
                },
            )
        ]
    if not d.clear_validation_flags:
        return []
    mine = _validation_flags(run, facts)
    return [
        *(UnflagNode(f.node, f.reason, run.run_id) for f in mine),
        Event(
            "validation",
            {
                "attempt": a.attempt,
                "job_id": a.job_id,
                "exit_code": 17,
                "verdict": "reproduced",
                "unflagged": sorted({f.node for f in mine}),
                "reason": d.reason,
            },
        ),
    ]


def _started_late(
    a: Attempt, info: JobInfo, run: Run, facts: Facts, now: float
) -> tuple[list[Intent], Attempt, Run]:
    """The start of a job that ran and ended between two looks, recorded before its end
    (`_started`): its intents, and the attempt and run as they leave them."""
    if a.start is not None or info.start_time is None or info.restart_count > a.restart_count:
        return [], a, run
    a = replace(a, start=info.start_time)
    started = _started(a, run, facts, max(info.start_time, now - facts.poll_interval))
    run = next((i.run for i in started if isinstance(i, UpdateRun)), run)
    return started, a, run


def _ending(
    a: Attempt,
    info: JobInfo,
    run: Run,
    facts: Facts,
    settings: FtSettings,
    nodes: tuple[str, ...],
    peer_lost: list[str],
) -> Ending:
    """What `policy.classify` reads of an ending: Slurm's view of the job and what its
    ranks' and launchers' reports and the run's progress say."""
    assert facts.files is not None and facts.usable is not None
    files = facts.files
    reports, launchers = files.rank_reports, files.node_reports
    ckpt, ckpt_at = files.progress.checkpoint_step, files.progress.checkpoint_at
    suspects = [r.node for r in reports if r.outcome == Outcome.RESUME_ELSEWHERE]
    signal_at = a.checkpoint_signal_at
    down = tuple(n for n in nodes if not facts.usable.get(n, True))
    return Ending(
        state=info.state,
        exit_code=info.exit_code,
        signal=info.signal,
        requeued_by_scheduler=info.restart_count > a.restart_count,
        nodes=nodes,
        down_nodes=down + tuple(n for n in peer_lost if n not in down),
        rank_outcomes=tuple(r.outcome for r in (*reports, *launchers) if r.outcome),
        checkpoint_signal_sent=signal_at is not None,
        checkpoint_advanced=ckpt is not None
        and (run.last_checkpoint_step is None or ckpt > run.last_checkpoint_step),
        finished_marker=files.finished_marker,
        suspect_node=suspects[0] if suspects else None,
        elsewhere=policy.room_elsewhere(
            nodes, [n for n, ok in facts.usable.items() if ok], int(run.spec["options"]["nodes"])
        ),
        hung=files.hung,
        checkpoints_known=ckpt is not None,
        checkpoint_signal_at=signal_at,
        checkpoint_after_signal=signal_at is not None
        and ckpt_at is not None
        and ckpt_at >= signal_at,
        heartbeats=all(r.heartbeats for r in launchers),
        disk_full_at=next(
            (
                f"{r.node} at {r.disk_full_path or 'an unknown path'}"
                for r in reports
                if r.outcome == Outcome.DISK_FULL
            ),
            None,
        ),
        signal_withheld=next(
            (r.checkpoint_signal_withheld for r in reports if r.checkpoint_signal_withheld), None
        )
        or (
            settings.checkpoint_signal
            if any(r.checkpoint_signal_withheld_ranks for r in launchers)
            else None
        ),
        error=first_error(reports),
        error_line=next(
            (
                str(r.error_line or r.error_tail or "").strip().rsplit("\n", 1)[-1]
                for r in reports
                if r.outcome == Outcome.USER_ERROR
            ),
            "",
        ),
    )


def _charged(
    run: Run, d: policy.Decision, ckpt: int | None, reason: str, injected: list[str]
) -> Run:
    """The run once decision `d` on its attempt's ending is recorded: the budgets it
    charged, the latest checkpoint, the reason, the injections fired."""
    return replace(
        run,
        job_retries_used=d.budget.job_retries_used,
        cause_counts=dict(d.budget.cause_counts),
        continuations=d.budget.continuations,
        stalled_continuations=d.budget.stalled_continuations,
        last_checkpoint_step=ckpt if ckpt is not None else run.last_checkpoint_step,
        reason=reason,
        injected=injected,
    )


def _gone_at_the_end(
    a: Attempt, gone: list[Loss], facts: Facts, settings: FtSettings, now: float
) -> list[Intent]:
    """The nodes reported lost or benched that the attempt had not acted on before it
    ended: benched ones flagged, each one's event (recovered in a new job)."""
    out: list[Intent] = []
    if settings.exclude_failed_nodes:
        out += [
            flag_node(g.node, _flag_why(g), facts.flags, now, settings)
            for g in gone
            if g.benched or g.unhealthy
        ]
    left = max(0, settings.spare_nodes - len(gone))
    return out + [_lost_event(a, g, Recovery.NEW_JOB, left) for g in gone]


def _why(loss: Loss) -> str | None:
    """Why a benched node stepped out ("hang", "straggler")."""
    return loss.report.why if isinstance(loss.report, Benched) else None


def _ended_event(
    a: Attempt,
    state: str,
    cause: Cause,
    d: policy.Decision,
    exit_code: int | None,
    excluded: list[str],
) -> Event:
    """The "ended" event of an attempt: how it ended and what was decided."""
    return Event(
        "ended",
        {
            "attempt": a.attempt,
            "job_id": a.job_id,
            "state": state,
            "cause": cause.value,
            "verdict": d.verdict.value,
            "reason": d.reason,
            "exit_code": exit_code,
            "excluded": excluded,
        },
    )


def _after_ending(
    run: Run, finished: Attempt, info: JobInfo, verdict: Verdict, fresh: bool, now: float
) -> list[Intent]:
    """What follows a recorded ending: the next attempt (a fresh job when `fresh`: one
    requeued would wait for a lost node) or the run's end."""
    if verdict in (Verdict.RETRY, Verdict.CONTINUE):
        nxt = next_attempt(run, finished, info)
        if fresh:
            nxt = Attempt(
                run.run_id, nxt.attempt, AttemptState.SUBMITTING, tag=tag(run.run_id, nxt.attempt)
            )
        return [UpdateRun(run), NewAttempt(nxt), Trust(nxt.attempt), Changed()]
    state = {
        Verdict.COMPLETE: RunState.COMPLETED,
        Verdict.FAIL: RunState.FAILED,
        Verdict.CANCEL: RunState.CANCELLED,
    }[verdict]
    return [UpdateRun(replace(run, state=state, ended_at=now)), Changed()]


def first_error(reports: Sequence[RankReport | Mapping[str, Any]]) -> str:
    """What the first rank to fail said (its report's `error_line`), with the rank and
    node: "rank 0 (n1): ModuleNotFoundError: No module named 'foo'"; empty when no rank
    report carries one."""
    failed = [r for r in parse_all(RankReport, tuple(reports)) if r.error_line]
    if not failed:
        return ""
    r = min(failed, key=lambda r: (_seconds(r.ended_at) or float("inf"), str(r.rank)))
    node = f" ({r.node})" if r.node else ""
    return f"rank {r.rank}{node}: {r.error_line}"


def _slurm_lost(a: Attempt, down: Sequence[str], files: RunFiles, now: float) -> list[Intent]:
    """`node_lost` from Slurm's verdict (NODE_FAIL before any peer report): its latency is
    the daemon's sight of it less the node's last lease, when its launcher left one."""
    leases = {x.node: x for x in files.leases if x.node}
    fresh = [n for n in down if n not in a.lost_nodes]  # not acted on already (a spare)
    if down and not fresh:
        return []
    out: list[Intent] = []
    for node in fresh or [None]:
        lease = leases.get(node or "")
        heard = lease.time if lease is not None else None
        out.append(
            Event(
                "node_lost",
                {
                    "attempt": a.attempt,
                    "job_id": a.job_id,
                    "node": node,
                    "node_rank": lease.node_rank if lease is not None else None,
                    "source": Source.SLURM.value,
                    "reported_by": "slurm",
                    "last_heard": heard,
                    "time": now,
                    "detection_s": None if heard is None else round(now - heard, 3),
                    "recovery": Recovery.NEW_JOB.value,
                },
            )
        )
    return out


def next_attempt(run: Run, prev: Attempt, info: JobInfo) -> Attempt:
    """Requeue the same job when the controller still holds it (fast, keeps its id);
    otherwise (known only from accounting) a fresh submission."""
    if info.restart_count > prev.restart_count:  # Slurm already requeued it
        n = prev.attempt + info.restart_count - prev.restart_count
        return Attempt(
            run.run_id,
            n,
            AttemptState.REQUEUING,
            job_id=prev.job_id,
            tag=prev.tag,
            restart_count=info.restart_count,
        )
    if not info.from_accounting:
        return Attempt(
            run.run_id,
            prev.attempt + 1,
            AttemptState.REQUEUING,
            job_id=prev.job_id,
            tag=prev.tag,
            restart_count=prev.restart_count + 1,
        )
    n = prev.attempt + 1
    return Attempt(run.run_id, n, AttemptState.SUBMITTING, tag=tag(run.run_id, n))
