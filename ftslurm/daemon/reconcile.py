"""The reconcile loop: observe, decide (`step`, pure), record intent, act idempotently.

One `cycle()`:
1. for an attempt whose submission was decided (SUBMITTING), gather its facts, call
   `step` and carry out its intents: adopt the job carrying its tag, or submit;
2. observe every other active attempt with ONE batched scheduler query per backend;
3. for each, gather the facts `step` asks for (the run's files, node flags, the node
   listing: only in a cycle and for an attempt where a decision depends on them), call
   `step`, record its intents (and the records they change) in one transaction, then act;
4. at the end of the cycle, carry out the requeues, exclusions, releases and start-nows
   the steps decided, each kind as ONE batch action for all its jobs (`requeue_many`, then
   `update_excluded_nodes_many` per distinct node list, `release_many`, `start_now_many`),
   so a cycle in which many runs end costs a constant number of scheduler commands. A job
   the batch refused is handled as a single action's refusal: a refused requeue steps its
   attempt again, a refused exclusion, release or start now waits for the next cycle.

Every decision is in `ftslurm.daemon.step` (which calls `policy`). Every action is safe to
repeat: a submission intent first looks for a job carrying its tag (unless this process
recorded the intent itself); a requeue intent checks the job's restart count before
requeueing again. The run's cancel flag is read again where a cancel must win: before a
submission, after recording a job id, before an ending is decided, before a held job is
released (at the end of the cycle, just before the batch release: a run cancelled
meanwhile keeps its job held and is stepped again).

The daemon is the one writer of run state (docs/daemon.md, "One writer"): commands record
requests (`user_requests`, applied at the start of each cycle) and the cancel flag, and the
store's updates are compare-and-set on the version a record was read at. A record another
writer moved on (`StaleRecord`: a cancel request moves the run's version) ends the pass
without writing; the next pass reads it again and decides again. An action already taken
is never lost that way: a job submitted before a stale write is found by its tag next
cycle (the attempt's intent is no longer trusted), a requeue or a release is checked
against the job's restart count and state before it is repeated.

**What a cycle reads** (so that one over 10,000 quiet runs stays cheap):
- the runs and their latest attempts: one query of their versions (`Store.active_heads`),
  and only when something was committed since the last one (`Store.stamp`); a run or an
  attempt is decoded again only when its version moved on (the Reconciler keeps the
  records it read, keyed by version: a record is never changed in place, a write makes a
  new copy at a new version);
- the node flags: once per cycle when anything was committed, and again after this daemon
  flags a node; a run's `FtSettings`: parsed once per version of the run;
- the run's files (progress, straggler report and the attempt's recovery folder, whose own
  stat changes when a report is renamed into it; for a job of several nodes, the batch
  host's lease too, which the daemon judges itself: `step._batch_host_silent`) for a
  watched attempt: each is looked at
  with `os.stat` and read again only when its inode, size, mtime or ctime changed; a file
  changed less than a second before it was looked at is read again next time (a rewrite
  within the filesystem's timestamp granularity could keep them all). On NFS, attribute
  caching (`actimeo`) can delay the sight of a rewrite by the mount's cache time.

**Quiet attempts.** `step` is pure, and for an attempt it decided nothing for but when to
look again (only `Wake`s: a queued or running job seen as recorded) its intents change only
with its inputs, its non-look `Wake` deadlines and the flags' expiry (`step`'s module doc).
So the cycle skips `step` for such an attempt while all of these stand: the run's and the
attempt's versions (a cancel request moves the run's), the job as observed (every field
but the time of the observation), whether its intent is trusted, the node flags, the run's
files it read (their `os.stat` signature), and the time before its earliest non-look
`Wake` and before the next flag expiry. Its deadlines count as they would have: the
non-look `Wake`s as recorded, a look wake a period from now. `next_deadline` is the
earliest deadline of the last cycle, skipped attempts included.
"""

from __future__ import annotations

import bisect
import contextlib
import fnmatch
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.cadence import REWRITE_TOLERANCE, Cadence, FailureHistory
from ftslurm.core.contract import (
    NODE_REPORTS,
    RunDir,
)
from ftslurm.core.contract.reports import HungNodeReport, Kind, Progress, StragglerReport
from ftslurm.core.leases import Lease, Seen, daemon_timeout, is_lost, never_started, observe
from ftslurm.core.recovery import BATCH_NODE_RANK
from ftslurm.core.settings import FtSettings
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import policy
from ftslurm.daemon import step as core
from ftslurm.daemon.records import (
    NEVER_SUBMITTED,
    REQUEUING,
    SUBMITTING,
    Attempt,
    AttemptState,
    NodeFlag,
    Run,
    RunState,
)
from ftslurm.daemon.store import DiskFull, StaleRecord, StateError, Store, update_mirror
from ftslurm.daemon.submission import backend_key, build_attempt
from ftslurm.daemon.user_requests import apply_requests
from ftslurm.errors import (
    FtslurmError,
    InvalidJobId,
    JobStateConflict,
    PermanentError,
    SchedulerRejected,
    SchedulerUnavailable,
)
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.runfiles import read_report, read_reports

__all__ = ["NEVER_SUBMITTED", "REQUEUING", "Reconciler", "hung_at_stop", "submit_attempt"]

log = logging.getLogger("ftslurm.daemon")
HISTORY_REFRESH_S = 60.0  # how often the failure history behind tuned intervals is read
_MAX_ROUNDS = 12  # steps for one attempt in one cycle (facts asked for, attempts begun)
_RACY_NS = 1_000_000_000  # a file changed this recently is read again next time
# the job as observed, for comparing two observations: every field but when it was made
_OBSERVED = attrgetter(*(f.name for f in fields(JobInfo) if f.name != "observed_at"))
Signature = tuple[int, int, int, int] | object | None  # `_signature`


def _signature(path: str) -> Signature:
    """What tells a file's rewrite (inode, size, mtime, ctime); None: there is none; an
    object equal to no other when it cannot be looked at."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return object()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _settled(sig: Signature, wall_ns: int) -> bool:
    """Whether a later rewrite must change `sig`: the file was last changed well before
    `wall_ns`, when it was looked at (or it is missing)."""
    if sig is None:
        return True
    if not isinstance(sig, tuple):
        return False
    return max(sig[2], sig[3]) < wall_ns - _RACY_NS


@dataclass(frozen=True, slots=True)
class _Quiet:
    """What an attempt's last step was given when it decided nothing but when to look
    again: while all of it stands, a step would decide the same (module doc)."""

    run: Run  # the records as read (kept by version: another version is another copy)
    attempt: Attempt
    flags_epoch: int
    trust_epoch: int
    history_epoch: int
    trusted: bool
    observed: tuple[Any, ...]  # `_OBSERVED` of the job
    paths: tuple[str, ...]  # the run files it read
    sigs: tuple[Signature, ...]  # and their signatures then
    until: float  # its earliest non-look Wake, or the next flag expiry: step again then
    due: float  # its earliest non-look Wake (inf: none)
    look_every: float  # the period of its look wakes (inf: none)


@dataclass(frozen=True, slots=True)
class _Watched:
    """The run files a step read for a watched attempt, and their signatures then."""

    paths: tuple[str, ...]
    sigs: tuple[Signature, ...]
    files: core.RunFiles
    settled: bool  # the signatures are safe to compare later (`_settled`)


def submit_attempt(
    store: Store,
    backend: SchedulerBackend,
    run: Run,
    a: Attempt,
    intent: core.Adopt | core.Submit,
    clock: Callable[[], float] = time.time,
    write: Callable[[Attempt], Attempt] | None = None,
) -> Attempt:
    """Carry out a SUBMITTING intent: record the adopted job, or submit.

    The job id is recorded and the run's cancel request read in one transaction: a
    `cancel` either finds the job id (and cancels the job) or is seen here, and then the
    job is cancelled at once. `write` stores the attempt (default: `store.update_attempt`).
    When that write fails (`StaleRecord` included) after a submission, the job exists
    without its id recorded: the caller must look for it by tag before submitting again."""
    if isinstance(intent, core.Adopt):
        job = intent.job
        a = replace(
            a, job_id=job.job_id, state=AttemptState.of(job.state), restart_count=job.restart_count
        )
        event = ("adopted", {"attempt": a.attempt, "job_id": job.job_id})
    else:
        script, options = build_attempt(
            run.run_id,
            run.spec,
            run.settings,
            a.attempt,
            intent.exclude,
            run.injected,
            intent.disambiguate,
        )
        job_id = backend.submit(script, options)
        a = replace(a, job_id=job_id, state=AttemptState.PENDING, submitted_at=clock())
        event = (
            "submitted",
            {"attempt": a.attempt, "job_id": job_id, "exclude": list(intent.exclude)},
        )
    with store.transaction():
        if write is None:
            store.update_attempt(a)
        else:
            a = write(a)
        store.append_event(run.run_id, *event, clock())
        current = store.get_run(run.run_id)
    update_mirror(run, attempt=a.attempt, job_id=a.job_id)  # rebuilt from it if need be
    if current is not None and current.cancel_requested and a.job_id:
        with contextlib.suppress(JobStateConflict, InvalidJobId):  # it ended meanwhile
            backend.cancel(a.job_id)
    return a


_BATCHED = (core.Requeue, core.SetExclusions, core.Release, core.StartNow)
_LOOKED = (AttemptState.RUNNING, AttemptState.COMPLETING)  # the attempts `look` looks at
# Once every launcher of an attempt left its node report (a job of one node: its batch
# host's lease ended), `look` wakes a cycle at every look for this long, or until a cycle
# saw the job end: the scheduler's end can lag the reports (the batch script's last lines,
# an epilog, KillWait), and a daemon backed off to a minute would see it a minute late.
ENDING_LOOK_S = 60.0


@dataclass(eq=False)
class _Planned:
    """The batched actions `step` decided for one attempt's job in this cycle."""

    kind: str  # the backend
    run: Run
    attempt: Attempt
    job_id: str
    requeue: bool | None = None  # requeue (held if True)
    exclude: tuple[str, ...] | None = None  # replace its excluded nodes
    release: bool = False
    start_now: bool = False
    requeued: core.Requeued | None = None  # recorded once the actions are done


class Reconciler:
    def __init__(
        self,
        store: Store,
        backends: Callable[[str], SchedulerBackend],
        clock: Callable[[], float] = time.time,
        stop: threading.Event | None = None,
    ) -> None:
        self.store = store
        self.stop = stop  # set when the daemon is asked to stop: the cycle ends early
        self.backends = backends  # backend kind ("slurm", "mock") -> backend
        self.clock = clock
        self.interval = 1.0
        self.last_change: float | None = None
        self._trusted_intents: set[tuple[str, int]] = set()  # created by this process
        self._trust_epoch = 0  # moves on when `_trusted_intents` changes
        self._deferred: set[tuple[str, int]] = set()  # submissions the scheduler put off
        self._min_job_age: dict[str, float] = {}
        self._nodes: dict[str, dict[str, bool]] = {}  # this cycle's node listing per backend
        # the failure history per cluster (`_failure_history`): (read at, what)
        self._history: tuple[float, dict[str, FailureHistory]] | None = None
        self._history_epoch = 0  # moves on when the failure history taken up moves
        # the versions this pass moved records on itself: (table, run id, attempt) ->
        # {version written from: version it became}
        self._moved: dict[tuple[str, str, int], dict[int, int]] = {}
        # the cycle's batched actions, per attempt (run id, attempt), carried out at its end
        self._batch: dict[tuple[str, int], _Planned] = {}
        self._refused: dict[str, FtslurmError] = {}  # job id -> its batch's refusal
        # the earliest deadline of the last pass (a Wake of an attempt, a retry after the
        # scheduler was unavailable), skipped quiet attempts included; None: none
        self.next_deadline: float | None = None
        self._deadlines: list[float] = []
        self._quiet_min = math.inf  # the earliest deadline of the attempts skipped this pass
        # what the last passes read, kept until it changes (module doc)
        self._stamp: tuple[int, int] | None = None
        self._pairs: list[tuple[Run, Attempt]] = []  # active runs with their latest attempt
        self._plan: (
            tuple[
                list[tuple[Run, Attempt]],
                dict[str, list[tuple[Run, Attempt]]],
                dict[str, list[str]],
            ]
            | None
        ) = None
        self._runs: dict[str, Run] = {}
        self._latest: dict[str, Attempt] = {}
        self._kinds: dict[str, str] = {}  # run id -> backend key
        # runs whose settings are the same text share one decoded dict (never changed in
        # place), parsed once: JSON text -> dict; id of a dict -> (it, its FtSettings)
        self._shared: dict[str, Any] = {}
        self._parsed: dict[int, tuple[dict[str, Any], FtSettings]] = {}
        self._flags: tuple[NodeFlag, ...] = ()
        self._flags_stale = True
        self._flags_epoch = 0  # moves on when the flags change
        self._expiries: list[float] = []  # the flags' expiry times, sorted
        self._quiet: dict[str, _Quiet] = {}  # run id -> its quiet attempt
        self._watched: dict[str, _Watched] = {}  # run id -> the files last read for it
        # (run id, attempt) -> the batch host's lease as last read (`_batch_lease`)
        self._batch_seen: dict[tuple[str, int], Seen] = {}
        # run id -> (the attempt, its watched files)
        self._paths: dict[str, tuple[int, tuple[str, ...]]] = {}
        # (run id, attempt) -> its node reports as last counted by `look`
        self._reports_seen: dict[tuple[str, int], int] = {}
        # (run id, attempt) -> when `look` first saw its launchers all gone (ENDING_LOOK_S)
        self._ending_since: dict[tuple[str, int], float] = {}
        # (run id, attempt) -> when the daemon first saw its batch script start the step
        # (`RunDir.launched`), on its clock: node rank 0's launcher is timed from there
        self._launched_seen: dict[tuple[str, int], float] = {}

    # ----------------------------------------------------------------- the cycle
    def cycle(self) -> float:
        """One pass over every active run; returns seconds until the next one is due.

        A record changed by another writer meanwhile (`StaleRecord`: e.g. a cancel request)
        ends the pass without writing over it; the next pass, at once, reads and decides
        again."""
        self._batch, self._refused = {}, {}
        self._deadlines, self._quiet_min = [], math.inf
        try:
            return self._cycle()
        except StaleRecord as exc:
            log.info("%s; deciding again", exc.message)
            return 0.0
        finally:
            earliest = min(self._deadlines, default=math.inf)
            earliest = min(earliest, self._quiet_min)
            self.next_deadline = None if earliest == math.inf else earliest

    def _cycle(self) -> float:
        full: DiskFull | None = None
        try:
            apply_requests(self.store, self.clock())  # what commands asked (nodes add/remove)
        except DiskFull as exc:  # applied when there is room; the runs are looked at now
            full = exc
        deadlines = self._deadlines
        self._nodes, self._moved = {}, {}
        pairs = self._active()
        if self._flags_stale:  # something was committed: the flags as they are now
            self._read_flags()
        if self.stop is not None and self.stop.is_set():
            return 0.0  # the daemon is stopping: intents stay recorded for next time
        plan = self._plan
        if plan is not None and plan[0] is pairs:  # nothing changed: grouped as last time
            by_backend, ids_by_backend = plan[1], plan[2]
        else:
            by_backend, ids_by_backend = {}, {}
            submitting = False
            for run, a in pairs:
                if self.stop is not None and self.stop.is_set():
                    return 0.0  # the daemon is stopping: intents stay recorded for next time
                if a.state is SUBMITTING:
                    submitting = True
                    kind = self._kind(run)
                    self._note_facts(kind, self.backends(kind))
                    got = self._advance(run, a, None, deadlines)
                    if got is None or got.state is SUBMITTING:
                        continue
                    run, a = self.store.get_run(run.run_id) or run, got
                    if run.state.is_terminal:
                        continue
                by_backend.setdefault(self._kind(run), []).append((run, a))
            for kind, items in by_backend.items():
                ids_by_backend[kind] = [a.job_id for _, a in items if a.job_id]
            # kept while nothing changes (a submission changed something: not kept)
            self._plan = None if submitting else (pairs, by_backend, ids_by_backend)
        for kind, items in by_backend.items():
            if self.stop is not None and self.stop.is_set():
                break
            backend = self.backends(kind)
            self._note_facts(kind, backend)  # once per backend: MinJobAge bounds the poll
            ids = ids_by_backend[kind]
            try:
                observed = backend.query(ids) if ids else {}  # ONE command for all of them
            except SchedulerUnavailable as exc:  # the other backends' runs go on
                log.warning("%s: scheduler unavailable, will look again: %s", kind, exc)
                deadlines.append(self.clock() + 5.0)
                continue
            now = self.clock()  # the time of this observation, for the quiet attempts
            quiet, unknown, looks = self._quiet, JobState.UNKNOWN, math.inf
            for run, a in items:
                info = observed.get(a.job_id or "")
                if info is None or info.state is unknown:
                    continue
                q = quiet.get(run.run_id)
                if q is None or not self._still_quiet(q, run, a, info, now):
                    self._advance(run, a, info, deadlines)
                elif q.look_every < looks:  # its look wake: a period from now
                    looks = q.look_every
            self._quiet_min = min(self._quiet_min, now + looks)
        self._act_batched(deadlines)  # the cycle's requeues, exclusions, releases, start-nows
        if self._quiet_min < math.inf:
            deadlines.append(self._quiet_min)
        self.interval = policy.next_poll_interval(
            self.clock(),
            last_change=self.last_change,
            deadlines=deadlines,
            previous=self.interval,
            min_job_age_s=min(self._min_job_age.values(), default=60),
        )
        if full is not None:
            raise full  # the daemon reports the full disk (and polls at this interval)
        return self.interval

    # ------------------------------------------------------------- one attempt
    def _advance(
        self, run: Run, a: Attempt, info: JobInfo | None, deadlines: list[float]
    ) -> Attempt | None:
        """Step attempt `a` and carry out the intents until it waits for the next cycle;
        returns the attempt as it stands then (None: the run ended, or it cannot go on)."""
        kind = self._kind(run)
        backend = self.backends(kind)
        self._quiet.pop(run.run_id, None)
        facts = self._facts(run, a)
        asked: set[str] = set()  # the facts gathered for this attempt
        for _ in range(_MAX_ROUNDS):
            intents: list[core.Intent] = []
            try:
                now = self.clock()
                intents = core.step(a, info, run, facts, now)
                if len(intents) == 1 and isinstance(intents[0], core.Need):
                    if "cancel" in intents[0].what:  # the run as stored now, with its version:
                        run = self.store.get_run(run.run_id) or run  # a later request
                    asked |= intents[0].what
                    facts = self._gather(intents[0].what, kind, backend, run, a, facts)
                    continue  # makes the decision's writes stale (decided again)
                if (
                    info is not None
                    and asked <= {"watch_files"}
                    and all(isinstance(i, core.Wake) for i in intents)
                ):
                    self._remember_quiet(run, a, info, facts, intents, now)
                nxt = self._execute(backend, run, a, intents, deadlines)
            except SchedulerUnavailable as exc:
                log.warning("run %s: scheduler unavailable, will retry: %s", run.run_id, exc)
                if a.state is SUBMITTING and (run.run_id, a.attempt) not in self._deferred:
                    self._deferred.add((run.run_id, a.attempt))  # said once per attempt
                    self.store.append_event(
                        run.run_id,
                        "submit_deferred",
                        {"attempt": a.attempt, "message": exc.message},
                        self.clock(),
                    )
                return None
            except (JobStateConflict, InvalidJobId) as exc:
                if a.state is REQUEUING and not facts.requeue_refused:
                    asked.add("again")
                    facts = replace(facts, requeue_refused=True)  # step decides what then
                    log.info("run %s: job %s refused the requeue: %s", run.run_id, a.job_id, exc)
                    continue
                log.info("run %s: %s; looking again next cycle", run.run_id, exc)
                return None
            except StateError:  # the database failed, not the scheduler: the cycle ends here
                self._trusted_intents.discard((run.run_id, a.attempt))  # look for its job first
                self._trust_epoch += 1
                raise
            except PermanentError as exc:
                if a.state is SUBMITTING:  # the attempt was never submitted
                    self._never_submitted(run, a, exc.message)
                else:
                    self._finish(run, RunState.FAILED, f"the scheduler refused: {exc}")
                return None
            except FtslurmError as exc:
                self._finish(run, RunState.FAILED, f"the scheduler refused: {exc}")
                return None
            if nxt is None:
                return None
            if nxt.attempt == a.attempt and not (a.state is REQUEUING and nxt.state is SUBMITTING):
                return nxt  # it waits for the next look (a submitted one: later this cycle)
            # a new attempt began, or a requeue turned into a fresh submission: step it too
            run = self.store.get_run(run.run_id) or run
            if run.state.is_terminal:
                return None
            a = nxt
            facts, asked = self._facts(run, a), {"again"}  # a new attempt: stepped afresh
        log.warning(
            "run %s: attempt %d still undecided after %d steps", run.run_id, a.attempt, _MAX_ROUNDS
        )
        return a

    def _facts(self, run: Run, a: Attempt) -> core.Facts:
        if self._flags_stale:
            self._read_flags()
        return core.Facts(
            trusted=(run.run_id, a.attempt) in self._trusted_intents,
            flags=self._flags,
            poll_interval=self.interval,
            settings=self._parsed_settings(run),
            history=self._failure_history(self._kind(run)),
        )

    # ------------------------------------------------- what the cycle keeps (module doc)
    def _active(self) -> list[tuple[Run, Attempt]]:
        """Every active run with its latest attempt, oldest first: the list of the last
        pass when nothing was committed since; otherwise the versions are read again and
        only the records whose version moved on are decoded again."""
        stamp = self.store.stamp()  # before reading: a commit after it is seen next time
        if stamp == self._stamp:
            return self._pairs
        self._flags_stale = True
        heads = self.store.active_heads()
        runs, latest = self._runs, self._latest
        old_runs = [h[0] for h in heads if (r := runs.get(h[0])) is None or r.version != h[1]]
        old_attempts = [
            h[0]
            for h in heads
            if h[2] is not None
            and ((x := latest.get(h[0])) is None or (x.attempt, x.version) != (h[2], h[3]))
        ]
        runs.update(self.store.runs_by_id(old_runs, self._shared))
        latest.update(self.store.latest_attempts(old_attempts))
        active = {h[0] for h in heads}
        for cache in (runs, latest, self._kinds, self._quiet, self._watched, self._paths):
            for run_id in cache.keys() - active:  # ended (or gone): forgotten
                del cache[run_id]
        if len(self._shared) + len(self._parsed) > 2 * len(runs):  # settings of ended runs
            used = {id(r.settings) for r in runs.values()}
            self._shared = {t: d for t, d in self._shared.items() if id(d) in used}
            self._parsed = {i: p for i, p in self._parsed.items() if i in used}
        self._pairs = [(runs[h[0]], latest[h[0]]) for h in heads if h[0] in runs and h[0] in latest]
        self._stamp = stamp
        return self._pairs

    def _kind(self, run: Run) -> str:
        kind = self._kinds.get(run.run_id)
        if kind is None:
            kind = self._kinds[run.run_id] = backend_key(run.spec)
        return kind

    def _parsed_settings(self, run: Run) -> FtSettings | None:
        """The run's `FtSettings`, parsed once per settings read (runs with the same
        settings share them; None: they do not parse, and `step` raises as it did)."""
        got = self._parsed.get(id(run.settings))
        if got is not None and got[0] is run.settings:
            return got[1]
        try:
            settings = FtSettings(**run.settings)
        except ValueError:
            return None
        self._parsed[id(run.settings)] = (run.settings, settings)
        return settings

    def _read_flags(self) -> None:
        flags = tuple(self.store.node_flags())
        if flags != self._flags:
            self._flags, self._flags_epoch = flags, self._flags_epoch + 1
            self._expiries = sorted(f.expires_at for f in flags if f.expires_at is not None)
        self._flags_stale = False

    def _remember_quiet(
        self,
        run: Run,
        a: Attempt,
        info: JobInfo,
        facts: core.Facts,
        wakes: list[core.Intent],
        now: float,
    ) -> None:
        """Keep what this step was given: it decided nothing but when to look again."""
        paths: tuple[str, ...] = ()
        sigs: tuple[Signature, ...] = ()
        if facts.files is not None:
            seen = self._watched.get(run.run_id)
            if seen is None or seen.files is not facts.files or not seen.settled:
                return  # files it read may change unseen: step it again next time
            paths, sigs = seen.paths, seen.sigs
        due = min(
            (w.at for w in wakes if isinstance(w, core.Wake) and not w.look), default=math.inf
        )
        look = min(
            (w.at - now for w in wakes if isinstance(w, core.Wake) and w.look), default=math.inf
        )
        i = bisect.bisect_right(self._expiries, now)
        expiry = self._expiries[i] if i < len(self._expiries) else math.inf
        self._quiet[run.run_id] = _Quiet(
            run=run,
            attempt=a,
            flags_epoch=self._flags_epoch,
            trust_epoch=self._trust_epoch,
            history_epoch=self._history_epoch,
            trusted=facts.trusted,
            observed=_OBSERVED(info),
            paths=paths,
            sigs=sigs,
            until=min(due, expiry),
            due=due,
            look_every=look,
        )

    def _still_quiet(self, q: _Quiet, run: Run, a: Attempt, info: JobInfo, now: float) -> bool:
        """Whether nothing quiet attempt `a`'s last step was given has changed (`q`); then
        its deadlines count as the step's would (module doc)."""
        if (
            q.run is not run
            or q.attempt is not a
            or now >= q.until
            or q.flags_epoch != self._flags_epoch
            or q.observed != _OBSERVED(info)
            or q.history_epoch != self._history_epoch
        ):
            return False
        if q.trust_epoch != self._trust_epoch and q.trusted != (
            (run.run_id, a.attempt) in self._trusted_intents
        ):
            return False
        if q.paths and tuple(map(_signature, q.paths)) != q.sigs:
            return False
        if q.due < self._quiet_min:
            self._quiet_min = q.due
        return True

    def _with_batch_lease(self, run: Run, a: Attempt, files: core.RunFiles) -> core.RunFiles:
        """`files` with the batch host's lease as read now; kept as the watched files, so
        a step that decided nothing but when to look again stays quiet until the lease
        changes (it is one of the watched paths) or its `Wake` (`step.batch_lease_wake`:
        the lease, unchanged, would be judged silent) falls due."""
        lease = self._batch_lease(run, a)
        launched = self._launched(run, a)
        if lease == files.batch_lease and launched == files.launched_at:
            return files
        files = replace(files, batch_lease=lease, launched_at=launched)
        watched = self._watched.get(run.run_id)
        if watched is not None:
            self._watched[run.run_id] = replace(watched, files=files)
        return files

    def _launched(self, run: Run, a: Attempt) -> float | None:
        """When the daemon first saw the attempt's batch script start the job's step (its
        mark, `RunDir.launched`), on its own clock; None: not seen yet."""
        key = (run.run_id, a.attempt)
        if key not in self._launched_seen:
            if not RunDir(Path(run.spec["run_dir"])).launched(a.attempt).exists():
                return None
            if len(self._launched_seen) > 2 * len(self._pairs) + 16:  # of attempts gone by
                live = {(r.run_id, x.attempt) for r, x in self._pairs}
                self._launched_seen = {k: v for k, v in self._launched_seen.items() if k in live}
            self._launched_seen[key] = self.clock()
        return self._launched_seen[key]

    def _batch_lease(self, run: Run, a: Attempt) -> Seen | None:
        """The batch host's lease of an attempt, read now (one small file) and timed on the
        daemon's clock: the daemon is its watcher of last resort (`step`), and the only one
        of a job of one node."""
        key = (run.run_id, a.attempt)
        seen = self._batch_seen.get(key)
        if seen is None:
            self._batch_seen = {k: v for k, v in self._batch_seen.items() if k[0] != run.run_id}
            seen = Seen(BATCH_NODE_RANK, self.clock())
        path = RunDir(Path(run.spec["run_dir"])).peer_lease(a.attempt, BATCH_NODE_RANK)
        now = self.clock()  # the daemon's wall clock, as the step's `now`
        seen = self._batch_seen[key] = observe(seen, Lease.from_json(read_json(path)), now, now)
        return seen

    def _watched_files(self, run: Run, a: Attempt) -> core.RunFiles:
        """Progress, the straggler report and the attempt's recovery folder of a watched
        attempt: read again only when one of them changed since the last read (module doc;
        a report renamed into the folder changes the folder's own stat)."""
        known = self._paths.get(run.run_id)
        if known is None or known[0] != a.attempt:
            rd = RunDir(Path(run.spec["run_dir"]))
            # the batch host's lease last: read again when it changes
            watched = [
                str(rd.progress),
                str(rd.straggler_report),
                str(rd.recovery(a.attempt)),
                str(rd.cadence),
                str(rd.launched(a.attempt)),  # the step started: the launcher is timed
                str(rd.peer_lease(a.attempt, BATCH_NODE_RANK)),
            ]
            known = self._paths[run.run_id] = (a.attempt, tuple(watched))
        paths = known[1]
        wall = time.time_ns()
        sigs = tuple(_signature(p) for p in paths)
        seen = self._watched.get(run.run_id)
        if seen is not None and seen.sigs == sigs and seen.settled and seen.paths is paths:
            return seen.files
        files = read_run_files(Path(run.spec["run_dir"]), a.attempt, ending=False)
        settled = all(_settled(sig, wall) for sig in sigs)
        self._watched[run.run_id] = _Watched(paths, sigs, files, settled)
        return files

    # ------------------------------------------------- the look between cycles (module doc)
    def look(self) -> bool:
        """The cheap look between two cycles, whatever the back-off, with no scheduler
        query: for each running attempt whose files a cycle has read, a stat of its
        recovery folder, a listing of its attempt folder and a read of its batch host's
        lease. True: a cycle must run now (a loss or bench report came, a launcher left its
        node report, or the batch host's lease would now be judged silent)."""
        now = self.clock()
        wake = False
        for run, a in self._pairs:
            if a.state not in _LOOKED or not a.job_id:
                continue
            known, seen = self._paths.get(run.run_id), self._watched.get(run.run_id)
            if known is None or known[0] != a.attempt or seen is None or seen.paths is not known[1]:
                continue  # no cycle has read its files yet: the next one will
            key = (run.run_id, a.attempt)
            rd = RunDir(Path(run.spec["run_dir"]))
            recovery = str(rd.recovery(a.attempt))
            if _signature(recovery) != seen.sigs[known[1].index(recovery)]:
                wake = True
            try:
                reports = sum(
                    1
                    for e in os.scandir(rd.attempt(a.attempt))
                    if fnmatch.fnmatch(e.name, NODE_REPORTS)
                )
            except OSError:
                reports = 0
            if reports > self._reports_seen.get(key, reports):
                wake = True
            self._reports_seen[key] = reports
            nnodes = _nodes(run, a)
            if nnodes and reports >= nnodes:
                wake = self._ending(key, now) or wake
            lease = self._batch_seen.get(key)
            if lease is None or a.state is not AttemptState.RUNNING:
                continue
            lease = self._batch_seen[key] = observe(
                lease,
                Lease.from_json(read_json(rd.peer_lease(a.attempt, BATCH_NODE_RANK))),
                now,
                now,
            )
            if nnodes == 1 and isinstance(lease.lease, Lease) and lease.lease.ended:
                wake = self._ending(key, now) or wake  # (a job without the launcher)
            settings = self._parsed_settings(run)
            launched = self._launched(run, a) if lease.lease is None else None
            if (
                settings is not None
                and not a.lost_nodes
                and never_started(lease, launched, now, settings.launcher_start_timeout_s)
            ):
                wake = True  # node rank 0's launcher never started: the cycle ends it
            if (
                settings is not None
                and isinstance(lease.lease, Lease)
                and lease.lease.node not in a.lost_nodes
                and is_lost(
                    lease,
                    now,
                    daemon_timeout(settings.peer_timeout_s, len(a.nodes) or _nodes(run, a)),
                    math.inf,
                )
            ):
                wake = True
        if len(self._reports_seen) > 2 * len(self._pairs) + 16:  # of attempts gone by
            live = {(r.run_id, a.attempt) for r, a in self._pairs}
            self._reports_seen = {k: v for k, v in self._reports_seen.items() if k in live}
            self._ending_since = {k: v for k, v in self._ending_since.items() if k in live}
        return wake

    def _ending(self, key: tuple[str, int], now: float) -> bool:
        """Whether `look` wakes a cycle for an attempt whose launchers are all gone while
        the scheduler, at the last cycle, still ran its job (`ENDING_LOOK_S`)."""
        since = self._ending_since.setdefault(key, now)
        return now - since < ENDING_LOOK_S

    def _gather(
        self,
        what: frozenset[str],
        kind: str,
        backend: SchedulerBackend,
        run: Run,
        a: Attempt,
        facts: core.Facts,
    ) -> core.Facts:
        """Read the facts `step` asked for."""
        got: dict[str, Any] = {}
        if "cancel" in what:  # `run` was read again for it (`_advance`)
            got["cancel_requested"] = run.cancel_requested
        if "found" in what:  # since: the run's creation, before which no job of it existed
            got["found"] = tuple(backend.find_jobs(a.tag, since=run.created_at))
        if "nodes" in what:
            if kind not in self._nodes:  # one listing per backend per cycle
                self._nodes[kind] = {n.name: n.state.usable for n in backend.nodes()}
            got["usable"] = self._nodes[kind]
        if "history" in what:
            got["history"] = self._failure_history(kind)
        if "previous" in what:
            got.update(
                previous=self.store.attempt_before(run.run_id, a.attempt), previous_known=True
            )
        if "files" in what:
            got["files"] = read_run_files(
                Path(run.spec["run_dir"]), a.attempt, ending=True, nnodes=_nodes(run, a)
            )
            if facts.files is not None:  # what the daemon watched itself stands
                got["files"] = replace(
                    got["files"],
                    batch_lease=facts.files.batch_lease,
                    launched_at=facts.files.launched_at,
                )
        elif "node_reports" in what:  # the attempt lost a node: are its launchers done?
            rd = RunDir(Path(run.spec["run_dir"]))
            got["files"] = replace(
                self._watched_files(run, a),
                launchers_read=True,
                node_reports=tuple(read_reports(rd, Kind.NODE, a.attempt)),
            )
        elif "watch_files" in what:
            got["files"] = self._with_batch_lease(run, a, self._watched_files(run, a))
        return replace(facts, **got)

    def _execute(
        self,
        backend: SchedulerBackend,
        run: Run,
        a: Attempt,
        intents: list[core.Intent],
        deadlines: list[float],
    ) -> Attempt | None:
        """Carry out `step`'s intents in order: the records between two actions in one
        transaction, before the next action. Requeue, exclusions, release and start now
        are planned for the end of the cycle (`_act_batched`), with the `Requeued` record
        that follows them; `step` puts them last. Returns the attempt to go on with (a new
        one: step it too), or None when the run ended."""
        now = self.clock()
        pending: list[core.Intent] = []
        current: Attempt | None = a
        for intent in [*intents, None]:
            if intent is not None and isinstance(intent, core.RECORDS):
                pending.append(intent)
                continue
            if pending:
                current = self._record(run, current, pending, now)
                pending = []
            if intent is None:
                break
            job = getattr(intent, "job_id", "")
            if (run.run_id, a.attempt) in self._batch and not isinstance(
                intent, (*_BATCHED, core.Requeued, core.Wake)
            ):
                raise AssertionError(f"{type(intent).__name__} after a batched action")
            if isinstance(intent, core.Wake):
                deadlines.append(intent.at)
            elif isinstance(intent, (core.Adopt, core.Submit)):
                current = submit_attempt(
                    self.store, backend, run, a, intent, self.clock, self._write_attempt
                )
                self.last_change = self.clock()
            elif isinstance(intent, core.Cancel):
                with contextlib.suppress(JobStateConflict, InvalidJobId):  # ended meanwhile
                    backend.cancel(job)
            elif isinstance(intent, _BATCHED):
                refused = self._refused.pop(job, None) if isinstance(intent, core.Requeue) else None
                if refused is not None:  # stepped again after its batch refused the requeue
                    raise refused
                self._plan_action(run, a, intent)
            elif isinstance(intent, core.Requeued):
                planned = self._batch.get((run.run_id, a.attempt))
                if planned is not None:  # recorded once its job is released and started
                    planned.requeued = intent
                else:
                    current = self._requeued(run, a, intent)
            elif isinstance(intent, core.Signal):
                with contextlib.suppress(JobStateConflict):  # it ended meanwhile: next cycle
                    backend.signal(job, intent.signal)
            elif isinstance(intent, core.WriteCadence):
                self._write_cadence(run, intent.cadence)
        return current

    def _failure_history(self, cluster: str) -> FailureHistory:
        """Node failures and node-days of the store's whole history on `cluster` (a
        `backend_key`: the tuned checkpoint intervals' failure rate), read again at most
        every HISTORY_REFRESH_S and taken up only where it moved: a new failure, or 10% more
        node-days. Each take-up moves `_history_epoch`, which wakes the quiet attempts
        (their interval may change)."""
        now = self.clock()
        if self._history is None or now - self._history[0] >= HISTORY_REFRESH_S:
            old = self._history[1] if self._history is not None else {}
            fresh = self.store.failure_history(now, backend_key)
            kept = {
                c: h
                if (o := old.get(c)) is None
                or h.failures != o.failures
                or h.node_days > o.node_days * (1 + REWRITE_TOLERANCE)
                else o
                for c, h in fresh.items()
            }
            if self._history is None or kept != old:
                self._history_epoch += 1
            self._history = (now, kept)
        return self._history[1].get(cluster, FailureHistory())

    def _write_cadence(self, run: Run, cadence: Cadence) -> None:
        """Write the run's checkpoint interval for its rank agents, then log it (`cadence`).
        A failed write is tried again: the next step finds the file still stale."""
        path = RunDir(Path(run.spec["run_dir"])).cadence
        try:
            write_json_atomic(path, cadence.to_json())
        except OSError as exc:
            log.warning("run %s: could not write %s: %s", run.run_id, path, exc)
            return
        self.store.append_event(run.run_id, "cadence", cadence.to_json(), self.clock())

    def _requeued(self, run: Run, a: Attempt, intent: core.Requeued) -> Attempt:
        """The job is back for attempt `a`: record it PENDING and log `requeued`."""
        with self.store.transaction():
            current = self._write_attempt(replace(a, state=AttemptState.PENDING))
            self.store.append_event(
                run.run_id,
                "requeued",
                {
                    "attempt": a.attempt,
                    "job_id": a.job_id,
                    "exclude": None if intent.exclude is None else list(intent.exclude),
                },
                self.clock(),
            )
        return current

    # ------------------------------------------------------- the batched actions
    def _plan_action(self, run: Run, a: Attempt, intent: core.Intent) -> None:
        key = (run.run_id, a.attempt)
        planned = self._batch.get(key)
        if planned is None:
            planned = self._batch[key] = _Planned(
                backend_key(run.spec), run, a, getattr(intent, "job_id", "")
            )
        if isinstance(intent, core.Requeue):
            planned.requeue = intent.hold
        elif isinstance(intent, core.SetExclusions):
            planned.exclude = intent.nodes
        elif isinstance(intent, core.Release):
            planned.release = True
        elif isinstance(intent, core.StartNow):
            planned.start_now = True

    def _act_batched(self, deadlines: list[float]) -> None:
        """Carry out the cycle's planned actions, per backend and per kind, each kind in
        one batch action for all its jobs: requeue, then exclusions (one per distinct node
        list), release, start now. The intents were recorded before; a refused job is
        handled as a single action's refusal was: a refused requeue steps the attempt
        again (`requeue_refused`), a refused exclusion, release or start now waits for the
        next cycle, another refusal ends the run FAILED. Attempts stepped again (a refused
        requeue, a cancel requested before the release) may plan actions of their own:
        they are carried out in a further round."""
        stale: StaleRecord | None = None
        for _ in range(_MAX_ROUNDS):
            if not self._batch or (self.stop is not None and self.stop.is_set()):
                break
            by_kind: dict[str, list[_Planned]] = {}
            for planned in self._batch.values():
                by_kind.setdefault(planned.kind, []).append(planned)
            self._batch = {}
            for kind, planned_here in by_kind.items():
                backend = self.backends(kind)
                try:
                    stale = self._act_on(backend, planned_here, deadlines) or stale
                except SchedulerUnavailable as exc:  # the attempts are looked at again
                    log.warning("%s: scheduler unavailable, will retry: %s", kind, exc)
                    deadlines.append(self.clock() + 5.0)
        self._batch, self._refused = {}, {}
        if stale is not None:
            raise stale

    def _act_on(
        self, backend: SchedulerBackend, todo: list[_Planned], deadlines: list[float]
    ) -> StaleRecord | None:
        """One round of batched actions on one backend (`_act_batched`)."""
        again: list[_Planned] = []  # to step again: a refused requeue, a cancel requested
        act = functools.partial(self._batch_action, again=again)
        for hold in (True, False):
            act(
                [p for p in todo if p.requeue is hold],
                functools.partial(backend.requeue_many, hold=hold),
                "requeue",
            )
        todo = [p for p in todo if p.requeue is None]  # the requeued: pending next cycle
        done = [p for p in todo if p.exclude is None]
        for nodes in sorted({p.exclude for p in todo if p.exclude is not None}):
            done += act(
                [p for p in todo if p.exclude == nodes],
                functools.partial(backend.update_excluded_nodes_many, nodes=nodes),
                "exclusions",
            )
        cancelled = [p for p in done if p.release and self._cancel_requested(p.run.run_id)]
        again += cancelled  # asked for meanwhile: it stays held, and is stepped again
        todo = [p for p in done if p not in cancelled]
        released = act([p for p in todo if p.release], backend.release_many, "release")
        todo = [p for p in todo if not p.release or p in released]
        started = act([p for p in todo if p.start_now], backend.start_now_many, "start now")
        todo = [p for p in todo if not p.start_now or p in started]
        stale: StaleRecord | None = None
        for p in todo:
            if p.requeued is not None:
                try:
                    self._requeued(p.run, p.attempt, p.requeued)
                except StaleRecord as exc:  # the others are recorded; decided again next pass
                    stale = exc
        if again:
            stale = self._step_again(backend, again, deadlines) or stale
        return stale

    def _batch_action(
        self,
        planned: list[_Planned],
        batch: Callable[[list[str]], dict[str, FtslurmError]],
        what: str,
        again: list[_Planned],
    ) -> list[_Planned]:
        """The batch action on `planned`; returns those it did not refuse. A refused
        requeue goes to `again` (step decides what then: `requeue_refused`)."""
        if not planned:
            return []
        ids = [p.job_id for p in planned]
        try:
            refused = batch(ids)
        except SchedulerUnavailable:
            raise
        except FtslurmError as exc:  # the command itself was refused
            refused = dict.fromkeys(ids, exc)
        for p in planned:
            exc = refused.get(p.job_id)
            if exc is None:
                continue
            if isinstance(exc, JobStateConflict | InvalidJobId):
                if p.requeue is not None:
                    self._refused[p.job_id] = exc
                    again.append(p)
                else:
                    log.info(
                        "run %s: job %s refused the %s: %s; looking again next cycle",
                        p.run.run_id,
                        p.job_id,
                        what,
                        exc,
                    )
            else:
                self._finish(p.run, RunState.FAILED, f"the scheduler refused: {exc}")
        return [p for p in planned if p.job_id not in refused]

    def _step_again(
        self, backend: SchedulerBackend, again: list[_Planned], deadlines: list[float]
    ) -> StaleRecord | None:
        """Step the runs whose action was refused or cancelled meanwhile, as they are now."""
        stale: StaleRecord | None = None
        observed = backend.query([p.job_id for p in again])
        for p in again:
            info = observed.get(p.job_id)
            if info is None or info.state is JobState.UNKNOWN:
                continue  # next cycle
            run = self.store.get_run(p.run.run_id)  # its cancel flag as now
            a = self.store.latest_attempt(p.run.run_id)
            if run is None or a is None or run.state.is_terminal:
                continue
            try:
                self._advance(run, a, info, deadlines)
            except StaleRecord as exc:
                stale = exc
            finally:
                self._refused.pop(p.job_id, None)
        return stale

    def _record(
        self, run: Run, a: Attempt | None, records: list[core.Intent], now: float
    ) -> Attempt | None:
        """Write `records` in one transaction; returns the attempt to go on with."""
        current = a
        trusted: list[tuple[str, int]] = []
        with self.store.transaction():
            for r in records:
                if isinstance(r, core.Record):
                    written = self._write_attempt(r.attempt)
                    if a is not None and written.attempt == a.attempt:
                        current = written
                elif isinstance(r, core.NewAttempt):
                    self.store.add_attempt(r.attempt)
                    current = r.attempt
                elif isinstance(r, core.UpdateRun):
                    self._write_run(r.run)
                elif isinstance(r, core.Finish):
                    self._finish(run, r.state, r.reason)
                    current = None
                elif isinstance(r, core.FlagNode):
                    self._write_flag(r, now, run.run_id)
                elif isinstance(r, core.UnflagNode):
                    self._flags_stale = True  # read again before the next step
                    self._flags_epoch += 1
                    self.store.unflag_node(r.node, r.reason, r.run_id)
                elif isinstance(r, core.Event):
                    self.store.append_event(run.run_id, r.kind, r.data, now)
                elif isinstance(r, core.Trust):
                    trusted.append((run.run_id, r.attempt))
                elif isinstance(r, core.Changed):
                    self.last_change = now
        if trusted:
            self._trusted_intents.update(trusted)
            self._trust_epoch += 1
        for r in records:
            if isinstance(r, core.FlagNode) and r.reason.startswith("straggler"):
                log.info("run %s: straggler node %s flagged", run.run_id, r.node)
            if isinstance(r, core.UnflagNode):
                log.info("run %s: node %s unflagged (%s)", run.run_id, r.node, r.reason)
        if (
            current is not None
            and current.state is SUBMITTING
            and a is not None
            and a.state is not SUBMITTING
            and current.attempt == a.attempt
        ):
            log.info("run %s: cannot requeue job %s; submitting afresh", run.run_id, a.job_id)
        return current

    def _rebased(self, key: tuple[str, str, int], version: int) -> int:
        """The version a copy read at `version` stands at after this pass's own writes.

        A step's intents are derived one from the other (a record changed, then the
        checkpoint signal's time set on that copy), and each may carry the version its
        first copy was read at: a write this pass made itself does not make them stale.
        Another writer's change still does (its version is not one this pass wrote)."""
        moves = self._moved.get(key, {})
        while version in moves:
            version = moves[version]
        return version

    def _write_attempt(self, a: Attempt) -> Attempt:
        """Store `a` (compare-and-set); returns the copy written, at its new version."""
        key = ("attempt", a.run_id, a.attempt)
        a = replace(a, version=self._rebased(key, a.version))
        read_at = a.version
        self.store.update_attempt(a)
        self._moved.setdefault(key, {})[read_at] = a.version
        return a

    def _write_run(self, run: Run) -> None:
        """Store `run` (compare-and-set), as `_write_attempt`."""
        key = ("run", run.run_id, -1)
        run = replace(run, version=self._rebased(key, run.version))
        read_at = run.version
        self.store.update_run(run)
        self._moved.setdefault(key, {})[read_at] = run.version

    def _write_flag(self, flag: core.FlagNode, now: float, run_id: str) -> None:
        self._flags_stale = True  # read again before the next step
        self._flags_epoch += 1  # no attempt is quiet under the flags as they were
        self.store.flag_node(
            NodeFlag(
                node=flag.node,
                reason=flag.reason,
                since=now,
                expires_at=None if flag.ttl_s is None else now + flag.ttl_s,
                run_id=run_id,
            )
        )

    def _never_submitted(self, run: Run, a: Attempt, message: str) -> None:
        """The scheduler refused the attempt: it is marked so and the run ends FAILED."""
        now = self.clock()
        reason = f"never submitted: {message}"
        log.warning("run %s: attempt %d %s", run.run_id, a.attempt, reason)
        with self.store.transaction():
            self._write_attempt(replace(a, state=NEVER_SUBMITTED, reason=message, end=now))
            self._finish(run, RunState.FAILED, reason)
        self.last_change = now

    def _cancel_requested(self, run_id: str) -> bool:
        """The run's cancel flag as stored now (the copy a cycle read may be older)."""
        current = self.store.get_run(run_id)
        return bool(current and current.cancel_requested)

    def _finish(self, run: Run, state: RunState, reason: str) -> None:
        now = self.clock()
        current = self.store.get_run(run.run_id) or run  # the run as the step just left it
        self._write_run(replace(current, state=state, reason=reason, ended_at=now))
        self.store.append_event(
            run.run_id, "run_ended", {"state": state.value, "reason": reason}, now
        )
        update_mirror(run, state=state.value, reason=reason, ended_at=now)

    def _note_facts(self, kind: str, backend: SchedulerBackend) -> None:
        if kind not in self._min_job_age:
            try:
                self._min_job_age[kind] = float(backend.cluster_facts().min_job_age_s)
            except (SchedulerUnavailable, SchedulerRejected):
                pass  # asked again next cycle; meanwhile the poll stays conservative


def _nodes(run: Run, a: Attempt) -> int:
    """The attempt's node count (options.nodes counts the spares: `make_spec`)."""
    return max(len(a.nodes), int(run.spec.get("options", {}).get("nodes") or 0))


def read_run_files(run_dir: Path, attempt: int, *, ending: bool, nnodes: int = 0) -> core.RunFiles:
    """The run directory's files `step` reads: progress, the straggler report and the
    attempt's recovery folder (peer-loss reports, round records, benched nodes) while an
    attempt runs; with `ending`, also the attempt's rank and node reports, FINISHED, the
    hung-at-stop reports, the leases of its `nnodes` nodes, and the result validation
    reports of every attempt so far."""
    paths = RunDir(run_dir)
    progress = read_report(paths.progress, Progress) or Progress()
    straggler = read_report(paths.straggler_report, StragglerReport)
    cadence = Cadence.from_json(read_json(paths.cadence))
    found = dict(
        lost=tuple(read_reports(paths, Kind.PEER_LOST, attempt)),
        rounds=tuple(read_reports(paths, Kind.ROUND, attempt)),
        benched=tuple(read_reports(paths, Kind.BENCHED, attempt)),
        launchers_failed=tuple(read_reports(paths, Kind.LAUNCHER_FAILED, attempt)),
        unhealthy=tuple(read_reports(paths, Kind.UNHEALTHY, attempt)),
    )
    if not ending:
        return core.RunFiles(
            progress=progress, straggler_report=straggler, cadence=cadence, **found
        )
    leases = (Lease.from_json(read_json(paths.peer_lease(attempt, n))) for n in range(nnodes))
    return core.RunFiles(
        progress=progress,
        straggler_report=straggler,
        cadence=cadence,
        **found,
        launchers_read=True,
        leases=tuple(x for x in leases if x is not None),
        rank_reports=tuple(read_reports(paths, Kind.RANK, attempt)),
        node_reports=tuple(read_reports(paths, Kind.NODE, attempt)),
        finished_marker=paths.finished.exists(),
        hung=hung_at_stop(read_reports(paths, Kind.HUNG_NODE, attempt)),
        validation=tuple(
            r for k in range(attempt + 1) for r in read_reports(paths, Kind.VALIDATION, k)
        ),
    )


def hung_at_stop(reports: list[HungNodeReport]) -> str:
    """The rank the launchers found hung when the attempt was told to stop, in words, or
    "": of several (a rank waiting on a hung peer looks hung too), the one whose last sign
    of life came first. Each node's launcher judges when the stop reaches it, so silences
    measured on two nodes are compared as times: the report's time less the silence."""
    found = [
        ((report.time or 0.0) - (h.silent_s or 0.0), report.node, h)
        for report in reports
        for h in report.hung
    ]
    if not found:
        return ""
    _, node, h = min(found, key=lambda f: f[0])
    rank = h.rank if h.rank is not None else f"local {h.local_rank}"
    where = f" in section {h.section!r}" if h.section else ""
    return f"rank {rank} (node {node}) hung{where} when the job was told to stop: {h.reason}"
