"""The reconcile loop: observe, decide, record intent, act idempotently.

One `cycle()`:
1. carry out recorded intents (a submission or a requeue the daemon decided on but may not
   have finished, e.g. because it was killed half-way);
2. observe every active attempt with ONE batched scheduler query (plus one node listing,
   only in a cycle where an attempt ended);
3. for a running attempt, send the checkpoint signal when it is due;
4. for an attempt that ended, classify the ending and decide (`policy`, pure), record the
   decision and the next attempt's intent in one transaction, then act on the intent.

Every action is safe to repeat: a submission intent first looks for a job carrying its
tag; a requeue intent checks the job's restart count before requeueing again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftslurm.agent.heartbeat import HUNG_AT_STOP
from ftslurm.agent.straggler import REPORT_FILE, STRAGGLER_DIR
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import policy
from ftslurm.daemon.policy import Budget, Ending, FtSettings, Verdict
from ftslurm.daemon.records import SUBMITTING, Attempt, NodeFlag, Run, RunState
from ftslurm.daemon.store import StateError, Store
from ftslurm.daemon.submission import backend_key, build_attempt, tag
from ftslurm.errors import (
    FtslurmError,
    InvalidJobId,
    JobStateConflict,
    PermanentError,
    SchedulerRejected,
    SchedulerUnavailable,
)
from ftslurm.fsutil import read_json

log = logging.getLogger("ftslurm.daemon")

REQUEUING = "REQUEUING"  # intent: bring job_id back for this attempt (requeue, start now)
NEVER_SUBMITTED = "NEVER_SUBMITTED"  # the scheduler refused the attempt's submission
_ENDED_STATES = {s.value for s in JobState if s.is_terminal}


def submit_attempt(store: Store, backend: SchedulerBackend, run: Run, a: Attempt,
                   clock: Callable[[], float] = time.time,
                   adopt: bool = True) -> Attempt:  # fmt: skip
    """Carry out a SUBMITTING intent: adopt the job that carries its tag, else submit.

    The job id is recorded and the run's cancel request read in one transaction: a
    `cancel` either finds the job id (and cancels the job) or is seen here, and then the
    job is cancelled at once."""
    # since: the run's creation, before which no job of it can have been submitted
    found = backend.find_jobs(a.tag, since=run.created_at) if adopt else []
    if found:
        job = max(found, key=lambda j: int(j.job_id.split("_")[0]))
        a = replace(a, job_id=job.job_id, state=job.state.value,
                    restart_count=job.restart_count)  # fmt: skip
        event = ("adopted", {"attempt": a.attempt, "job_id": job.job_id})
    else:
        exclude = current_exclusions(store, backend, run, clock())
        script, options = build_attempt(run.run_id, run.spec, run.settings, a.attempt, exclude)
        job_id = backend.submit(script, options)
        a = replace(a, job_id=job_id, state=JobState.PENDING.value, submitted_at=clock())
        event = ("submitted", {"attempt": a.attempt, "job_id": job_id, "exclude": list(exclude)})
    with store.transaction():
        store.update_attempt(a)
        store.append_event(run.run_id, *event, clock())
        current = store.get_run(run.run_id)
    if current is not None and current.cancel_requested and a.job_id:
        with contextlib.suppress(JobStateConflict, InvalidJobId):  # it ended meanwhile
            backend.cancel(a.job_id)
    return a


def current_exclusions(store: Store, backend: SchedulerBackend, run: Run,
                       now: float) -> tuple[str, ...]:  # fmt: skip
    flags = sorted(store.node_flags(now), key=lambda f: f.since, reverse=True)
    if not flags:
        return ()
    usable = [n.name for n in backend.nodes() if n.state.usable]
    needed = int(run.spec["options"]["nodes"])
    return policy.plan_exclusions([f.node for f in flags], usable, needed)


class Reconciler:
    def __init__(self, store: Store, backends: Callable[[str], SchedulerBackend],
                 clock: Callable[[], float] = time.time,
                 stop: threading.Event | None = None) -> None:  # fmt: skip
        self.store = store
        self.stop = stop  # set when the daemon is asked to stop: the cycle ends early
        self.backends = backends  # backend kind ("slurm", "mock") -> backend
        self.clock = clock
        self.interval = 1.0
        self.last_change: float | None = None
        self._trusted_intents: set[tuple[str, int]] = set()  # created by this process
        self._deferred: set[tuple[str, int]] = set()  # submissions the scheduler put off
        self._min_job_age: dict[str, float] = {}

    # ----------------------------------------------------------------- the cycle
    def cycle(self) -> float:
        """One pass over every active run; returns seconds until the next one is due."""
        deadlines: list[float] = []
        by_backend: dict[str, list[tuple[Run, Attempt]]] = {}
        for run in self.store.list_runs(active_only=True):
            if self.stop is not None and self.stop.is_set():
                return 0.0  # the daemon is stopping: intents stay recorded for next time
            a = self.store.latest_attempt(run.run_id)
            if a is None:
                continue
            if run.cancel_requested and a.state == SUBMITTING:
                self._finish(run, RunState.CANCELLED, "cancelled by the user")
                continue
            if a.state == SUBMITTING:
                a = self._try(run, a, lambda r=run, x=a: self._submit(r, x))
                if a is None or a.state == SUBMITTING:
                    continue
            by_backend.setdefault(backend_key(run.spec), []).append((run, a))
        for kind, items in by_backend.items():
            if self.stop is not None and self.stop.is_set():
                break
            backend = self.backends(kind)
            self._note_facts(kind, backend)  # once per backend: MinJobAge bounds the poll
            ids = [a.job_id for _, a in items if a.job_id]
            try:
                observed = backend.query(ids) if ids else {}  # ONE command for all of them
            except SchedulerUnavailable as exc:  # the other backends' runs go on
                log.warning("%s: scheduler unavailable, will look again: %s", kind, exc)
                deadlines.append(self.clock() + 5.0)
                continue
            nodes_cache: dict[str, bool] | None = None
            for run, a in items:
                info = observed.get(a.job_id or "")
                if info is None or info.state is JobState.UNKNOWN:
                    continue
                if a.state == REQUEUING and run.cancel_requested and info.state.is_active:
                    backend.cancel(a.job_id or "")
                    continue
                if a.state == REQUEUING and not (run.cancel_requested and info.state.is_terminal):
                    self._try(run, a, lambda r=run, x=a, i=info, b=backend:
                              self._requeue(b, r, x, i))  # fmt: skip
                    continue
                ended = info.state.is_terminal or info.restart_count > a.restart_count
                if a.state == REQUEUING:  # cancelled before it came back
                    self._finish(run, RunState.CANCELLED, "cancelled by the user")
                    continue
                if not ended:
                    deadline = self._watch(backend, run, a, info)
                    if deadline is not None:
                        deadlines.append(deadline)
                    continue
                if nodes_cache is None:
                    nodes_cache = {n.name: n.state.usable for n in backend.nodes()}
                self._ended(backend, run, a, info, nodes_cache)
        self.interval = policy.next_poll_interval(
            self.clock(), last_change=self.last_change, deadlines=deadlines,
            previous=self.interval, min_job_age_s=min(self._min_job_age.values(), default=60),
        )  # fmt: skip
        return self.interval

    def _try(self, run: Run, a: Attempt, action: Callable[[], Attempt | None]) -> Attempt | None:
        """Run an action; a scheduler outage leaves the intent for the next cycle, a
        permanent refusal ends the run with the scheduler's message."""
        try:
            return action()
        except SchedulerUnavailable as exc:
            log.warning("run %s: scheduler unavailable, will retry: %s", run.run_id, exc)
            if a.state == SUBMITTING and (run.run_id, a.attempt) not in self._deferred:
                self._deferred.add((run.run_id, a.attempt))  # said once per attempt
                self.store.append_event(run.run_id, "submit_deferred", {
                    "attempt": a.attempt, "message": exc.message}, self.clock())  # fmt: skip
            return None
        except (JobStateConflict, InvalidJobId) as exc:
            log.info("run %s: %s; looking again next cycle", run.run_id, exc)
            return None
        except StateError:  # the database failed, not the scheduler: the cycle ends here
            self._trusted_intents.discard((run.run_id, a.attempt))  # look for its job first
            raise
        except FtslurmError as exc:
            self._finish(run, RunState.FAILED, f"the scheduler refused: {exc}")
            return None

    # ------------------------------------------------------------------ intents
    def _submit(self, run: Run, a: Attempt) -> Attempt | None:
        """Carry out a submission intent, unless the run's cancellation was asked for; a
        permanent refusal ends the run: the attempt was never submitted."""
        if self._cancel_requested(run.run_id):
            self._finish(run, RunState.CANCELLED, "cancelled by the user")
            return None
        backend = self.backends(backend_key(run.spec))
        self._note_facts(backend_key(run.spec), backend)
        adopt = (run.run_id, a.attempt) not in self._trusted_intents
        try:
            a = submit_attempt(self.store, backend, run, a, self.clock, adopt=adopt)
        except (JobStateConflict, InvalidJobId):
            raise
        except PermanentError as exc:
            self._never_submitted(run, a, exc.message)
            return None
        self.last_change = self.clock()
        return a

    def _never_submitted(self, run: Run, a: Attempt, message: str) -> None:
        """The scheduler refused the attempt: it is marked so and the run ends FAILED."""
        now = self.clock()
        reason = f"never submitted: {message}"
        log.warning("run %s: attempt %d %s", run.run_id, a.attempt, reason)
        with self.store.transaction():
            self.store.update_attempt(replace(a, state=NEVER_SUBMITTED, reason=message,
                                              end=now))  # fmt: skip
            self._finish(run, RunState.FAILED, reason)
        self.last_change = now

    def _cancel_requested(self, run_id: str) -> bool:
        """The run's cancel flag as stored now (the copy a cycle read may be older)."""
        current = self.store.get_run(run_id)
        return bool(current and current.cancel_requested)

    def _requeue(self, backend: SchedulerBackend, run: Run, a: Attempt,
                 info: JobInfo) -> Attempt | None:  # fmt: skip
        """Bring the job back for attempt `a`: requeue (held) unless Slurm already did,
        set the exclusions, release, start now. Each step is checked, so it can repeat."""
        job = a.job_id or ""
        if self._cancel_requested(run.run_id):
            if info.state.is_terminal:
                self._finish(run, RunState.CANCELLED, "cancelled by the user")
                return None
            with contextlib.suppress(JobStateConflict, InvalidJobId):  # ended meanwhile
                backend.cancel(job)
            return a  # the next cycle sees it end
        try:
            if info.restart_count < a.restart_count:
                if not info.state.is_terminal and not (
                        info.state is JobState.RUNNING and self._moving(run, a)):
                    return a  # still ending; look again next cycle
                backend.requeue(job, hold=True)
                return a  # it shows as pending in a moment
            if info.state is JobState.RUNNING or info.state.is_terminal:
                # back already: a daemon released it and died before recording that
                return self._requeued(run, a, None)
            if info.state not in (JobState.PENDING, JobState.REQUEUED):
                return a  # e.g. still COMPLETING after the requeue: next cycle
            exclude = current_exclusions(self.store, backend, run, self.clock())
            merged = tuple(sorted(set(run.spec["options"]["exclude"]) | set(exclude)))
            backend.update_excluded_nodes(job, merged)
            if self._cancel_requested(run.run_id):  # asked for meanwhile: it stays held
                backend.cancel(job)
                return a
            backend.release(job)
            backend.start_now(job)
        except (JobStateConflict, InvalidJobId) as exc:
            if info.state.is_terminal and info.restart_count < a.restart_count:
                # it can no longer be requeued (e.g. forgotten): submit afresh instead
                log.info("run %s: cannot requeue job %s (%s); submitting afresh",
                         run.run_id, job, exc)  # fmt: skip
                a = replace(a, state=SUBMITTING, job_id=None, restart_count=0,
                            tag=tag(run.run_id, a.attempt))  # fmt: skip
                self.store.update_attempt(a)
                self._trusted_intents.add((run.run_id, a.attempt))
                return self._submit(run, a)
            return a  # not pending yet: next cycle
        return self._requeued(run, a, list(merged))

    def _flag(self, node: str, why: str, now: float, settings: FtSettings,
              run_id: str) -> None:  # fmt: skip
        """Flag a node, for longer when it is a repeat offender (`policy.flag_ttl`)."""
        previous = {f.node: f for f in self.store.node_flags()}.get(node)
        ttl = policy.flag_ttl(None if previous is None else (previous.since, previous.expires_at),
                              now, settings)  # fmt: skip
        self.store.flag_node(NodeFlag(node=node, reason=why, since=now,
                                      expires_at=None if ttl is None else now + ttl,
                                      run_id=run_id))  # fmt: skip

    def _requeued(self, run: Run, a: Attempt, exclude: list[str] | None) -> Attempt:
        """Record that the job is back for attempt `a` (the next cycle watches it)."""
        a = replace(a, state=JobState.PENDING.value)
        self.store.update_attempt(a)
        self.store.append_event(run.run_id, "requeued", {"attempt": a.attempt,
                                                         "job_id": a.job_id,
                                                         "exclude": exclude}, self.clock())
        self.last_change = self.clock()
        return a

    # ------------------------------------------------------------------ watching
    def _watch(self, backend: SchedulerBackend, run: Run, a: Attempt,
               info: JobInfo) -> float | None:  # fmt: skip
        """Record what changed; act on straggler reports; send the checkpoint signal when
        due. Returns when this attempt wants the next look (None: no sooner than usual)."""
        now = self.clock()
        changed = info.state.value != a.state or (info.nodes and list(info.nodes) != a.nodes)
        if changed:
            a = replace(a, state=info.state.value, nodes=list(info.nodes) or a.nodes,
                        start=info.start_time if info.state is JobState.RUNNING else a.start)
            self.store.update_attempt(a)
            self.last_change = now
            if info.state is JobState.RUNNING:
                self._started(run, a, now)
        if run.cancel_requested:
            backend.cancel(a.job_id or "")
            return None
        if info.state is not JobState.RUNNING:
            return None
        settings = FtSettings(**run.settings)
        if self._stragglers(backend, run, a, info, settings, now):
            return None  # moved off a straggler: the requeue intent takes it from here
        look_again = policy.straggler_look_again(settings, now)
        signal_due_at = self._checkpoint_signal(backend, run, a, info, settings, now)
        return min((t for t in (look_again, signal_due_at) if t is not None), default=None)

    def _checkpoint_signal(self, backend: SchedulerBackend, run: Run, a: Attempt,
                           info: JobInfo, settings: FtSettings,
                           now: float) -> float | None:  # fmt: skip
        """Send the checkpoint signal when due; returns when it will be due, if not yet."""
        if a.checkpoint_signal_at is not None:
            return None
        progress = read_json(Path(run.spec["run_dir"]) / "progress.json") or {}
        lead, warning = policy.checkpoint_lead(settings.preempt_time,
                                               progress.get("max_checkpoint_save_s"))
        if not settings.preempt_time or info.time_limit_s is None or info.start_time is None:
            return None
        if not policy.signal_due(info.start_time, info.time_limit_s, lead, now):
            return info.start_time + info.time_limit_s - lead
        if warning:
            self.store.append_event(run.run_id, "warning", {"message": warning}, now)
        self.store.append_event(run.run_id, "checkpoint_signal", {
            "attempt": a.attempt, "job_id": a.job_id, "signal": settings.checkpoint_signal,
            "due": info.start_time + info.time_limit_s - lead, "lead_s": lead}, now)
        a = replace(a, checkpoint_signal_at=now)
        self.store.update_attempt(a)  # intent recorded first: a repeat would be harmless
        try:
            backend.signal(a.job_id or "", settings.checkpoint_signal)
        except JobStateConflict:
            pass  # it ended meanwhile; the next cycle sees how
        return None

    def _stragglers(self, backend: SchedulerBackend, run: Run, a: Attempt, info: JobInfo,
                    settings: FtSettings, now: float) -> bool:  # fmt: skip
        """Flag the nodes the straggler report names as persistent; with
        `stop_if_straggler`, move the running job off them at once: the attempt ends here
        and a requeue intent (held, exclusions updated, released) begins the next one.
        Returns whether it moved the job."""
        report = read_json(Path(run.spec["run_dir"]) / STRAGGLER_DIR / REPORT_FILE)
        flags = policy.straggler_flags(report if isinstance(report, dict) else None,
                                       a.attempt, settings,
                                       [f.node for f in self.store.node_flags(now)])  # fmt: skip
        if not flags:
            return False
        new = [node for node, _ in flags]
        with self.store.transaction():
            for node, why in flags:
                self._flag(node, why, now, settings, run.run_id)
            self.store.append_event(run.run_id, "straggler", {
                "attempt": a.attempt, "job_id": a.job_id, "nodes": new,
                "reasons": dict(flags)}, now)  # fmt: skip
        log.info("run %s: straggler node(s) %s flagged", run.run_id, ", ".join(new))
        exclusions = current_exclusions(self.store, backend, run, now)
        budget = Budget(run.job_retries_used, dict(run.cause_counts), run.continuations,
                        run.stalled_continuations)  # fmt: skip
        d = policy.straggler_move(new, info.nodes or a.nodes, exclusions, budget, settings)
        if d is None:
            return False
        moved = replace(a, state=JobState.REQUEUED.value, end=now, reason=d.reason,
                        cause=d.cause.value, failure_seen_at=now)  # fmt: skip
        run = replace(run, cause_counts=dict(d.budget.cause_counts), reason=d.reason)
        nxt = Attempt(run.run_id, a.attempt + 1, REQUEUING, job_id=a.job_id, tag=a.tag,
                      restart_count=a.restart_count + 1)  # fmt: skip
        with self.store.transaction():  # the intent first: a crash after it repeats the move
            self.store.update_attempt(moved)
            self.store.update_run(run)
            self.store.add_attempt(nxt)
            self.store.append_event(run.run_id, "ended", {
                "attempt": a.attempt, "job_id": a.job_id, "state": moved.state,
                "cause": d.cause.value, "verdict": d.verdict.value, "reason": d.reason,
                "exit_code": None, "excluded": new}, now)  # fmt: skip
        self._trusted_intents.add((run.run_id, nxt.attempt))
        self.last_change = now
        self._try(run, nxt, lambda: self._requeue(backend, run, nxt, info))
        return True

    def _moving(self, run: Run, a: Attempt) -> bool:
        """Whether requeue intent `a` moves a job that is still running (off a straggler)."""
        before = [x for x in self.store.attempts(run.run_id) if x.attempt == a.attempt - 1]
        return bool(before) and before[0].cause == policy.Cause.STRAGGLER.value \
            and before[0].job_id == a.job_id

    def _started(self, run: Run, a: Attempt, now: float) -> None:
        """The attempt was seen running at `now`: the recovery latency is measured from the
        previous attempt's ending being observed to this (at most one poll late)."""
        if run.state is RunState.PENDING:
            run = replace(run, state=RunState.RUNNING)
            self.store.update_run(run)
        previous = [x for x in self.store.attempts(run.run_id) if x.attempt < a.attempt]
        if previous and previous[-1].failure_seen_at is not None:
            latency = now - previous[-1].failure_seen_at
            self.store.append_event(run.run_id, "recovered", {
                "attempt": a.attempt, "job_id": a.job_id, "latency_s": round(latency, 3)}, now)
        self.store.append_event(run.run_id, "running", {"attempt": a.attempt,
                                                       "job_id": a.job_id, "nodes": a.nodes}, now)

    # ------------------------------------------------------------------ endings
    def _ended(self, backend: SchedulerBackend, run: Run, a: Attempt, info: JobInfo,
               usable: dict[str, bool]) -> None:  # fmt: skip
        now = self.clock()
        if a.start is None and info.start_time is not None and not info.restart_count > (
                a.restart_count):  # it ran and ended between two looks
            a = replace(a, start=info.start_time)
            self._started(run, a, max(info.start_time, now - self.interval))
            run = self.store.get_run(run.run_id) or run
        settings = FtSettings(**run.settings)
        run_dir = Path(run.spec["run_dir"])
        nodes = tuple(info.nodes) or tuple(a.nodes)
        folder = run_dir / "attempts" / str(a.attempt)
        reports = [read_json(p) or {} for p in sorted(folder.glob("rank-*.json"))]
        launchers = [read_json(p) or {} for p in sorted(folder.glob("node-*.json"))]
        progress = read_json(run_dir / "progress.json") or {}
        ckpt = progress.get("checkpoint_step")
        advanced = ckpt is not None and (run.last_checkpoint_step is None
                                         or ckpt > run.last_checkpoint_step)  # fmt: skip
        requeued = info.restart_count > a.restart_count
        suspects = [r.get("node") for r in reports if r.get("outcome") == "resume_elsewhere"]
        signal_at = a.checkpoint_signal_at
        ckpt_at = progress.get("checkpoint_at")
        ending = Ending(
            state=info.state, exit_code=info.exit_code, signal=info.signal,
            requeued_by_scheduler=requeued, nodes=nodes,
            down_nodes=tuple(n for n in nodes if not usable.get(n, True)),
            rank_outcomes=tuple(str(r.get("outcome")) for r in reports + launchers
                                if r.get("outcome")),
            checkpoint_signal_sent=a.checkpoint_signal_at is not None,
            checkpoint_advanced=advanced,
            finished_marker=(run_dir / "FINISHED").exists(),
            suspect_node=suspects[0] if suspects else None,
            hung=hung_at_stop(folder), checkpoints_known=ckpt is not None,
            checkpoint_signal_at=signal_at, checkpoint_after_signal=signal_at is not None
            and isinstance(ckpt_at, (int, float)) and ckpt_at >= signal_at,
            heartbeats=all(r.get("heartbeats", True) for r in launchers),
            disk_full_at=next((f"{r.get('node')} at {r.get('disk_full_path') or 'an unknown path'}"
                               for r in reports if r.get("outcome") == "disk_full"), None),
        )  # fmt: skip
        cause = policy.classify(ending, settings)
        budget = Budget(run.job_retries_used, dict(run.cause_counts), run.continuations,
                        run.stalled_continuations)  # fmt: skip
        cancel = self._cancel_requested(run.run_id)  # as stored now, not as the cycle read it
        d = policy.decide(cause, ending, budget, settings, cancel)
        ended_state = info.state.value if info.state.is_terminal else (
            JobState.NODE_FAIL.value if cause is policy.Cause.NODE_FAIL
            else JobState.REQUEUED.value)  # fmt: skip
        finished = replace(
            a, state=ended_state, end=info.end_time or now, exit_code=info.exit_code,
            signal=info.signal, reason=d.reason, cause=cause.value, nodes=list(nodes),
            failure_seen_at=now if d.verdict in (Verdict.RETRY, Verdict.CONTINUE) else None,
            in_job_restarts=max([int(r.get("in_job_restarts", 0)) for r in launchers] or [0]),
        )  # fmt: skip
        run = replace(run, job_retries_used=d.budget.job_retries_used,
                      cause_counts=dict(d.budget.cause_counts),
                      continuations=d.budget.continuations,
                      stalled_continuations=d.budget.stalled_continuations,
                      last_checkpoint_step=ckpt if ckpt is not None else run.last_checkpoint_step,
                      reason=d.reason)  # fmt: skip
        nxt: Attempt | None = None
        if d.verdict in (Verdict.RETRY, Verdict.CONTINUE):
            nxt = self._next_attempt(run, finished, info)
        with self.store.transaction():
            self.store.update_attempt(finished)
            for node, why in d.exclude:
                self._flag(node, why, now, settings, run.run_id)
            self.store.append_event(run.run_id, "ended", {
                "attempt": a.attempt, "job_id": a.job_id, "state": ended_state,
                "cause": cause.value, "verdict": d.verdict.value, "reason": d.reason,
                "exit_code": info.exit_code, "excluded": [n for n, _ in d.exclude]}, now)
            if nxt is not None:
                self.store.update_run(run)
                self.store.add_attempt(nxt)
                self._trusted_intents.add((run.run_id, nxt.attempt))
            else:
                state = {Verdict.COMPLETE: RunState.COMPLETED, Verdict.FAIL: RunState.FAILED,
                         Verdict.CANCEL: RunState.CANCELLED}[d.verdict]  # fmt: skip
                self.store.update_run(replace(run, state=state, ended_at=now))
        self.last_change = now
        if nxt is not None:
            run = self.store.get_run(run.run_id) or run
            if nxt.state == SUBMITTING:
                self._try(run, nxt, lambda: self._submit(run, nxt))
            else:
                self._try(run, nxt, lambda: self._requeue(backend, run, nxt, info))

    def _next_attempt(self, run: Run, prev: Attempt, info: JobInfo) -> Attempt:
        """Requeue the same job when the controller still holds it (fast, keeps its id);
        otherwise a fresh submission."""
        if info.restart_count > prev.restart_count:  # Slurm already requeued it
            step = info.restart_count - prev.restart_count
            return Attempt(run.run_id, prev.attempt + step, REQUEUING, job_id=prev.job_id,
                           tag=prev.tag, restart_count=info.restart_count)  # fmt: skip
        if info.source not in ("sacct", "mock-accounting"):
            return Attempt(run.run_id, prev.attempt + 1, REQUEUING, job_id=prev.job_id,
                           tag=prev.tag, restart_count=prev.restart_count + 1)  # fmt: skip
        n = prev.attempt + 1
        return Attempt(run.run_id, n, SUBMITTING, tag=tag(run.run_id, n))

    def _finish(self, run: Run, state: RunState, reason: str) -> None:
        now = self.clock()
        self.store.update_run(replace(run, state=state, reason=reason, ended_at=now))
        self.store.append_event(run.run_id, "run_ended", {"state": state.value,
                                                         "reason": reason}, now)

    def _note_facts(self, kind: str, backend: SchedulerBackend) -> None:
        if kind not in self._min_job_age:
            try:
                self._min_job_age[kind] = float(backend.cluster_facts().min_job_age_s)
            except (SchedulerUnavailable, SchedulerRejected):
                pass  # asked again next cycle; meanwhile the poll stays conservative


def hung_at_stop(folder: Path) -> str:
    """The rank the launchers found hung when the attempt was told to stop, in words, or
    "": of several (a rank waiting on a hung peer looks hung too), the one silent longest."""
    found = []
    for path in folder.glob(HUNG_AT_STOP.format("*")):
        report = read_json(path) or {}
        for h in report.get("hung") or []:
            if isinstance(h, dict):
                found.append((float(h.get("silent_s") or 0.0), report.get("node"), h))
    if not found:
        return ""
    _, node, h = max(found, key=lambda f: f[0])
    rank = h.get("rank") if h.get("rank") is not None else f"local {h.get('local_rank')}"
    where = f" in section {h['section']!r}" if h.get("section") else ""
    return f"rank {rank} (node {node}) hung{where} when the job was told to stop: " \
           f"{h.get('reason')}"


def new_run_record(run_id: str, name: str, spec: dict[str, Any], settings: FtSettings,
                   now: float) -> tuple[Run, Attempt]:  # fmt: skip
    run = Run(run_id=run_id, name=name, state=RunState.PENDING, created_at=now, spec=spec,
              settings=settings.model_dump(mode="json"))  # fmt: skip
    return run, Attempt(run_id, 0, SUBMITTING, tag=tag(run_id, 0))
