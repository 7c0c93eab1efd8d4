"""The mock scheduler on a virtual clock: jobs are models, time jumps from event to event.

The same state machine as the process-backed mock (`model`) decides everything Slurm
decides (placement, time limits, warning signals, requeue delay, node-failure detection);
here a job is a `JobModel` (how much work, how often and how long it checkpoints, what a
restart costs) instead of processes, so a month of a 2048-node job simulates in seconds.

`VirtualCluster` is the engine; `simulate_campaign` drives one long job to completion
under a simple continuation policy (requeue whatever ended early, at once), with node
failures drawn from a seeded Poisson process. The benchmarks build their policies on it.

What happens inside the allocation, for policies that act there (benchmarks/goodput.py):
`set_speed` slows a run (a straggler node) or stalls it (a hang), `restart_in_job` restarts
the ranks in the same allocation (from the newest memory checkpoint when the `JobModel` keeps
a memory tier; a start in a new allocation resumes from disk), `end_processes` makes the
job's processes exit by themselves (a crash, a watchdog), `preempt` is Slurm preemption
with a grace time, and the `on_start` / `on_run_end` hooks report every run with a
breakdown of its wall time (`RunBreakdown`). None of them is used by `simulate_campaign`.

`VirtualBackend` is the scheduler protocol over a `VirtualCluster`: the daemon's own
`Reconciler` runs against it on the virtual clock (benchmarks/goodput.py measures every
policy that way), so the simulated orchestration is the product's, not a copy of it.
"""

from __future__ import annotations

import heapq
import math
import random
import signal as _signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ftslurm.backends.batch import OneJobPerCommand
from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockNodeSpec, MockState
from ftslurm.core.timefmt import format_limit_exact
from ftslurm.core.types import (
    ClusterFacts,
    JobInfo,
    JobOptions,
    JobState,
    NodeInfo,
    SignalTarget,
)


@dataclass(frozen=True)
class JobModel:
    """A training job as the simulator sees it (all in seconds of wall time).

    One tier (the default): every `checkpoint_interval_s` of compute the job stands still
    `checkpoint_cost_s` to save to disk; any restart resumes from the newest disk checkpoint.

    Two tiers (`memory_interval_s` set): every `memory_interval_s` of compute it saves to
    node memory with peer replicas (`ftslurm.memory_checkpoint`), standing still
    `memory_cost_s`; every k-th of those saves (k = the disk interval over the memory one,
    rounded, at least 1) goes to disk instead, costing `checkpoint_cost_s` (its snapshot
    also serves as the memory copy). A restart inside the allocation (`restart_in_job`)
    resumes from the newest memory checkpoint and costs `memory_restart_cost_s`; a start in
    a new allocation has lost the memory tier and resumes from the newest disk checkpoint.

    Asynchronous disk saves (`write_s` > 0): `checkpoint_cost_s` is the blocking snapshot;
    the write goes on in the background for `write_s` (of the run's progress) and the
    checkpoint counts on disk only once written. The disk interval is never shorter than
    the write (a save waits for the previous one, `ftslurm.checkpoint`), and a save on the
    checkpoint signal waits for its own write before the job exits."""

    work_s: float  # compute needed, at full speed
    checkpoint_interval_s: float  # compute between two disk checkpoints
    checkpoint_cost_s: float  # wall time one disk checkpoint blocks the training
    restart_cost_s: float = 0.0  # start-up plus loading the checkpoint, at every start
    checkpoint_on_signal: bool = True  # a warning signal makes it checkpoint, then exit
    continue_code: int = 0  # the exit code after that checkpoint ("continue me")
    write_s: float = 0.0  # background write of an asynchronous disk save (0: synchronous)
    memory_interval_s: float | None = None  # compute between memory checkpoints (None: none)
    memory_cost_s: float = 0.0  # wall time one memory checkpoint blocks the training
    memory_restart_cost_s: float | None = None  # restart from memory (None: restart_cost_s)

    @property
    def tiered(self) -> bool:
        """Whether the job keeps a memory tier or saves asynchronously (else the one-tier,
        synchronous arithmetic, unchanged)."""
        return self.memory_interval_s is not None or self.write_s > 0

    @property
    def exit_save_s(self) -> float:
        """Wall time of the save on the checkpoint signal: blocking, then its write."""
        return self.checkpoint_cost_s + self.write_s

    @property
    def in_job_restart_cost_s(self) -> float:
        """Start-up of a restart inside the allocation (from memory, with a memory tier)."""
        if self.memory_interval_s is None or self.memory_restart_cost_s is None:
            return self.restart_cost_s
        return self.memory_restart_cost_s

    def layout(self) -> tuple[float, int]:
        """(compute per segment, segments per disk checkpoint): each segment ends with a
        checkpoint, the k-th with a disk one (one tier: every one)."""
        disk = max(self.checkpoint_interval_s, self.write_s)
        if self.memory_interval_s is None:
            return disk, 1
        seg = self.memory_interval_s
        return seg, max(1, round(disk / seg), math.ceil(self.write_s / seg))

    def finish_after(self, remaining_s: float) -> float:
        """Wall time from a start to the end of the work (checkpoints included)."""
        if not self.tiered:
            segments = max(1, math.ceil(remaining_s / self.checkpoint_interval_s))
            return self.restart_cost_s + remaining_s + (segments - 1) * self.checkpoint_cost_s
        seg, k = self.layout()
        saves = max(1, math.ceil(remaining_s / seg)) - 1
        disk = saves // k
        return (
            self.restart_cost_s
            + remaining_s
            + disk * self.checkpoint_cost_s
            + (saves - disk) * self.memory_cost_s
        )

    def positions(self, elapsed_s: float, remaining_s: float) -> tuple[float, float, float]:
        """(computed, newest memory checkpoint, newest disk checkpoint written) after
        `elapsed_s` of a run, in work from its start (never more than remaining). One
        tier: the memory position is the disk one."""
        if not self.tiered:
            saved = self.saved_after(elapsed_s, remaining_s)
            return self.computed_after(elapsed_s, remaining_s), saved, saved
        seg, k = self.layout()
        done = max(0.0, elapsed_s - self.restart_cost_s)
        period = k * seg + (k - 1) * self.memory_cost_s + self.checkpoint_cost_s
        full, rest = divmod(done, period)
        inside = min(k - 1, math.floor(rest / (seg + self.memory_cost_s))) if k > 1 else 0
        rest -= inside * (seg + self.memory_cost_s)
        memory = (full * k + inside) * seg
        computed = memory + min(rest, seg)
        written = math.floor(max(0.0, done - self.write_s) / period) * k * seg
        if self.memory_interval_s is None:  # no memory tier: only what is written counts
            memory = written
        return (min(remaining_s, computed), min(remaining_s, memory), min(remaining_s, written))

    def saved_after(self, elapsed_s: float, remaining_s: float) -> float:
        """Work safely checkpointed after `elapsed_s` of a run (never more than remaining);
        with two tiers, in memory."""
        if self.tiered:
            return self.positions(elapsed_s, remaining_s)[1]
        cycle = self.checkpoint_interval_s + self.checkpoint_cost_s
        done = max(0.0, elapsed_s - self.restart_cost_s)
        return min(remaining_s, math.floor(done / cycle) * self.checkpoint_interval_s)

    def computed_after(self, elapsed_s: float, remaining_s: float) -> float:
        """Work computed (saved or not) after `elapsed_s` of a run."""
        if self.tiered:
            return self.positions(elapsed_s, remaining_s)[0]
        cycle = self.checkpoint_interval_s + self.checkpoint_cost_s
        done = max(0.0, elapsed_s - self.restart_cost_s)
        full, rest = divmod(done, cycle)
        return min(
            remaining_s, full * self.checkpoint_interval_s + min(rest, self.checkpoint_interval_s)
        )


@dataclass
class _Run:
    started: float
    remaining_at_start: float
    finish_at: float
    saved_on_exit: float | None = None  # set by a checkpoint-on-signal: what it will keep
    serial: int = 0  # counts the runs of the cluster, from 1
    job: JobModel | None = None  # this run's model when it differs (an in-job restart)
    speed: float = 1.0  # progress per wall second: 1 full speed, < 1 slowed, 0 stalled
    speed_since: float | None = None  # when `speed` began (None: at `started`)
    progress_before: float = 0.0  # progress (model seconds) made before `speed_since`
    slow_s: float = 0.0  # wall time lost to running below full speed, before `speed_since`
    stalled_s: float = 0.0  # wall time at speed 0, before `speed_since`
    signal_progress: float | None = None  # progress when the checkpoint signal came
    # work kept in the memory tier of the last allocation, beyond its disk checkpoint, that
    # this run (in a new allocation) does not have: lost when it started
    rolled_back: float = 0.0


@dataclass(frozen=True)
class RunBreakdown:
    """Where the wall time of one run went: started-ended = startup + checkpoint + computed
    + slow + stalled, and saved (kept) <= computed."""

    job_id: str
    serial: int
    started: float
    ended: float
    completed: bool  # ended by itself (work done, or exit after the checkpoint signal)
    signalled: bool  # it got a checkpoint signal (warning or preemption) and began saving
    saved_s: float  # work kept
    computed_s: float  # work computed (kept or lost)
    startup_s: float  # start-up and checkpoint loading
    checkpoint_s: float  # writing checkpoints (periodic and on the signal)
    slow_s: float  # wall time lost to running below full speed
    stalled_s: float  # wall time at speed 0
    # work the earlier runs kept in memory only, lost when this one began in a new
    # allocation (from the disk checkpoint): counted kept before, lost now
    rolled_back_s: float = 0.0


@dataclass
class CampaignStats:
    wall_s: float = 0.0
    productive_s: float = 0.0  # work computed and kept
    lost_s: float = 0.0  # work computed, then lost to an interruption
    attempts: int = 0
    node_failures: int = 0
    by_ending: dict[str, int] = field(default_factory=dict)
    completed: bool = False
    events: int = 0

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive time / wall time."""
        return self.productive_s / self.wall_s if self.wall_s else 0.0


class VirtualCluster:
    """Drive `model` with a virtual clock; jobs are `JobModel`s."""

    def __init__(self, config: MockConfig, start: float = 0.0, queue_wait_s: float = 0.0) -> None:
        """`queue_wait_s`: other jobs hold the nodes this long after every requeue, so a job
        back in the queue is not started before it went there + `queue_wait_s`, whatever
        its BeginTime says (a start-now included); the requeue delay runs concurrently."""
        self.st = MockState.create(config)
        self.queue_wait_s = queue_wait_s
        self._queued: dict[str, tuple[int, float]] = {}  # job -> (restart count, not before)
        self.now = start
        self.models: dict[str, JobModel] = {}
        self.remaining: dict[str, float] = {}  # workload -> work left after its last checkpoint
        # workload -> work left after its newest memory checkpoint, in the allocation that
        # holds it (jobs with two tiers; at most `remaining`)
        self.in_memory: dict[str, float] = {}
        self.workloads: dict[str, str] = {}  # job -> its workload
        self._ended: set[tuple[str, int]] = set()  # (job, restart count) endings reported
        self.runs: dict[str, _Run] = {}
        self.stats = CampaignStats()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.on_end: Callable[[str, JobState], None] | None = None
        self.on_start: Callable[[str], None] | None = None  # a run began (after Launch)
        self.on_run_end: Callable[[RunBreakdown], None] | None = None
        # the model a run about to start follows (the job id; True: a restart inside the
        # allocation): the compute side reads its checkpoint cadence at every start
        self.plan_start: Callable[[str, bool], JobModel] | None = None
        self._exits: dict[str, model.Exited] = {}  # processes that ended by themselves
        self.changed = True  # the state changed outside `run` (an action): step it first
        self._serial = 0

    # ----------------------------------------------------------------- API
    def submit(
        self,
        options: JobOptions,
        job: JobModel,
        queue_wait_s: float = 0.0,
        workload: str | None = None,
        script: str = "#!/bin/true\n",
    ) -> str:
        """Submit a job; it waits `queue_wait_s` for nodes before it can start. Jobs of one
        `workload` (default: the job alone) share its work: a fresh job of a workload
        resumes from the work its earlier jobs checkpointed."""
        job_id = model.submit(self.st, script, options, self.now)
        self.changed = True
        if queue_wait_s > 0:
            self._queued[job_id] = (0, self.now + queue_wait_s)
            self.st.jobs[job_id].eligible_time = self.now + queue_wait_s
        self.models[job_id] = job
        key = self.workloads[job_id] = workload or job_id
        self.remaining.setdefault(key, job.work_s)
        return job_id

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run `action` (e.g. a fault) at virtual time `when`."""
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, action))

    def fail_node(self, node: str, idle: bool = False) -> None:
        """The node's host dies: the run of a job on it ends now (its ranks are gone and the
        others wait on them), unless the node is `idle` in its job (a hot spare, running no
        rank); Slurm notices after SlurmdTimeout either way."""
        self.stats.node_failures += 1
        effects = model.fail_node(self.st, node, self.now)
        self._apply([] if idle else effects)

    def run(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Process events in time order up to `until` or until `stop()` holds."""
        if self.changed or self._exits:  # an action since the last step (e.g. a release)
            self._step(self._take_exits())
        while not stop():
            when = self.next_event_time()
            if when > until:
                self.now = until
                return
            self.now = max(self.now, when)
            self.stats.events += 1
            while self._timers and self._timers[0][0] <= self.now:
                heapq.heappop(self._timers)[2]()
            finished = {
                j: (self._exit_code(j, r), None)
                for j, r in list(self.runs.items())
                if r.finish_at <= self.now
            }
            for job_id in finished:
                self._end_run(job_id, completed=True)
            self._step({**self._take_exits(), **finished})

    def next_event_time(self) -> float:
        """When something happens next (a scheduler event, a run's end, a timer); inf when
        nothing will."""
        candidates = [
            t
            for t in (
                model.next_event_time(self.st),
                min((r.finish_at for r in self.runs.values()), default=None),
                self._timers[0][0] if self._timers else None,
            )
            if t is not None
        ]
        return min(candidates, default=math.inf)

    def _exit_code(self, job_id: str, run: _Run) -> int:
        """A run that saved on a signal exits with its model's "continue me" code."""
        return self._model(job_id, run).continue_code if run.saved_on_exit is not None else 0

    # ------------------------------------------------ inside the allocation
    def act(self, effects: list[model.Effect]) -> None:
        """Carry out effects of a `model` operation (e.g. `model.requeue` of a running job)
        from a timer: the runs they end are reported at the next step."""
        self.changed = True
        self._exits.update(self._apply(effects))

    def set_speed(self, job_id: str, speed: float) -> None:
        """From now on the job's current run progresses at `speed` (1: full speed; below 1:
        held back by a slow node; 0: stalled, e.g. hung). The wall time lost is recorded."""
        run = self.runs.get(job_id)
        if run is None or speed == run.speed:
            return
        self._settle(run)
        run.speed = speed
        run.finish_at = self._finish_time(run, self._model(job_id, run))

    def restart_in_job(self, job_id: str, restart_cost_s: float | None = None) -> None:
        """The job's launcher restarts the ranks in the same allocation: the current run ends
        (work since its last checkpoint is lost) and a new one starts now from the newest
        memory checkpoint (with one tier: the disk one), paying `restart_cost_s` (default:
        the model's `in_job_restart_cost_s`) to start up and load it. Slurm sees nothing."""
        if job_id in self.runs:
            self._end_run(job_id, completed=False)
        job = self.st.jobs.get(job_id)
        if job is not None and job.state is JobState.RUNNING:
            self._start_run(job_id, restart_cost_s=restart_cost_s, in_job=True)

    def memory_ahead_s(self, job_id: str) -> float:
        """Work the job's memory tier holds beyond its disk checkpoint (lost if the next
        start is in a new allocation)."""
        key = self.workloads[job_id]
        memory = self.in_memory.get(key)
        return 0.0 if memory is None else self.remaining[key] - memory

    def end_processes(self, job_id: str, code: int = 1) -> None:
        """The job's processes exit by themselves now with `code` (a crash that srun
        propagates, a watchdog abort, a launcher that gives up): work since the last
        checkpoint is lost and Slurm sees the exit at the next step."""
        if job_id in self.runs:
            self._end_run(job_id, completed=False)
        job = self.st.jobs.get(job_id)
        if job is not None and job.state in (JobState.RUNNING, JobState.COMPLETING):
            self._exits[job_id] = (code, None)

    def preempt(self, job_id: str, grace_s: float, save: bool) -> None:
        """Slurm preempts the job (PreemptMode=REQUEUE): SIGTERM now, SIGKILL after
        `grace_s` (GraceTime), then the job goes back to the queue. With `save` the job
        checkpoints on the signal and exits once saved (if the save fits in the grace)."""
        job = self.st.jobs.get(job_id)
        if job is None or job.state is not JobState.RUNNING:
            return
        model._terminate(job, JobState.PREEMPTED, self.now, 0)
        job.kill_at = self.now + grace_s
        job.requeue_on_end = self.st.config.preempt_requeue and job.requeue_allowed
        if job_id not in self.runs:
            self._exits[job_id] = (0, int(_signal.SIGTERM))
        elif save and self.models[job_id].checkpoint_on_signal:
            self._checkpoint_and_exit(job_id)
        else:
            self._end_run(job_id, completed=False)
            self._exits[job_id] = (0, int(_signal.SIGTERM))

    def breakdown(self, job_id: str) -> RunBreakdown | None:
        """The breakdown of the job's current run so far (None when it has none)."""
        run = self.runs.get(job_id)
        if run is None:
            return None
        job = self._model(job_id, run)
        progress = self._progress(run)
        saved = job.saved_after(progress, run.remaining_at_start)
        computed = job.computed_after(progress, run.remaining_at_start)
        return self._breakdown(job_id, run, job, False, saved, computed)

    # ----------------------------------------------------------- internals
    def _step(self, exited: dict[str, model.Exited]) -> None:
        self.changed = False
        self._hold_in_queue()
        effects = model.advance(self.st, self.now, exited)
        while effects:
            exited = self._apply(effects)
            self._hold_in_queue()
            effects = model.advance(self.st, self.now, exited) if exited else []
        if self.on_end is None:
            return
        for job_id, job in list(self.st.jobs.items()):
            key = (job_id, job.restart_count)
            if job.state.is_terminal and job_id in self.workloads and key not in self._ended:
                self._ended.add(key)  # reported once per ending
                self.on_end(job_id, job.state)

    def _apply(self, effects: list[model.Effect]) -> dict[str, model.Exited]:
        """Carry out effects on the models; return the runs that ended (processes gone)."""
        exited: dict[str, model.Exited] = {}
        for effect in effects:
            match effect:
                case model.Launch(job_id):
                    self._start_run(job_id)
                case model.Signal(job_id, sig, _) if job_id in self.runs:
                    if sig in (_signal.SIGTERM, _signal.SIGKILL):
                        self._end_run(job_id, completed=False)
                        exited[job_id] = (0, sig)
                    elif sig != _signal.SIGCONT and self.models[job_id].checkpoint_on_signal:
                        self._checkpoint_and_exit(job_id)
                case model.KillJob(job_id) | model.KillNode(job_id, _) if job_id in self.runs:
                    self._end_run(job_id, completed=False)
                    exited[job_id] = (0, int(_signal.SIGKILL))
                case model.SignalRank(job_id, _, _) if job_id in self.runs:
                    self._end_run(job_id, completed=False)
                    exited[job_id] = (1, None)
                case model.Signal(job_id, _signal.SIGTERM | _signal.SIGKILL, _) | model.KillJob(
                    job_id
                ) if self._runless(job_id):
                    exited[job_id] = (0, int(_signal.SIGKILL))  # what is left dies at once
        return exited

    def _runless(self, job_id: str) -> bool:
        """Whether the job holds nodes with no run left (its ranks died with a node, the
        job not ended yet): stopping it ends it at once."""
        job = self.st.jobs.get(job_id)
        return (
            job_id not in self.runs
            and job_id in self.models
            and job is not None
            and job.state in (JobState.RUNNING, JobState.COMPLETING)
        )

    def _start_run(
        self, job_id: str, restart_cost_s: float | None = None, in_job: bool = False
    ) -> None:
        """A run starts: in the allocation (`in_job`) from the newest memory checkpoint, in
        a new one from the disk checkpoint (what only memory held is lost)."""
        planned = self.plan_start is not None
        if self.plan_start is not None:
            self.models[job_id] = self.plan_start(job_id, in_job)
        job = self.models[job_id]
        if in_job and restart_cost_s is None:
            restart_cost_s = job.in_job_restart_cost_s
        own = None if restart_cost_s is None else replace(job, restart_cost_s=restart_cost_s)
        job = own or job
        key = self.workloads[job_id]
        remaining = self.remaining[key]
        memory = self.in_memory.pop(key, None)
        rolled_back = 0.0
        if memory is not None and in_job:
            remaining = memory
        elif memory is not None:
            rolled_back = remaining - memory
            self.stats.productive_s -= rolled_back
            self.stats.lost_s += rolled_back
        self.stats.attempts += 1
        self._serial += 1
        self.runs[job_id] = _Run(
            self.now,
            remaining,
            self.now + job.finish_after(remaining),
            serial=self._serial,
            job=own or (job if planned else None),
            rolled_back=rolled_back,
        )
        if self.on_start:
            self.on_start(job_id)

    def _end_run(self, job_id: str, completed: bool) -> None:
        run = self.runs.pop(job_id)
        job = self._model(job_id, run)
        elapsed = self._progress(run)
        key = self.workloads[job_id]
        if completed and run.saved_on_exit is not None:
            saved = computed = written = run.saved_on_exit
        elif completed:
            saved = computed = written = run.remaining_at_start
        elif job.tiered:
            computed, saved, written = job.positions(elapsed, run.remaining_at_start)
        else:
            saved = written = job.saved_after(elapsed, run.remaining_at_start)
            computed = job.computed_after(elapsed, run.remaining_at_start)
        if job.tiered:  # memory holds `saved`; the disk, what was written (else as before)
            self.in_memory[key] = run.remaining_at_start - saved
            if written > 0 or completed:
                self.remaining[key] = run.remaining_at_start - written
        else:
            self.remaining[key] = run.remaining_at_start - saved
        self.stats.productive_s += saved
        self.stats.lost_s += computed - saved
        if self.on_run_end:
            self.on_run_end(self._breakdown(job_id, run, job, completed, saved, computed))

    def _checkpoint_and_exit(self, job_id: str) -> None:
        """Warning signal: save what was computed, then leave (a continuation). A second
        signal while it saves (Slurm's own after the daemon's) changes nothing."""
        run = self.runs[job_id]
        if run.saved_on_exit is not None:
            return
        job = self._model(job_id, run)
        progress = self._progress(run)
        run.saved_on_exit = job.computed_after(progress, run.remaining_at_start)
        run.signal_progress = progress
        if run.speed == 1.0 and run.speed_since is None:
            run.finish_at = min(run.finish_at, self.now + job.exit_save_s)
        else:
            run.finish_at = self._finish_time(run, job)

    def _hold_in_queue(self) -> None:
        """Keep each requeued job out until it has waited `queue_wait_s` in the queue."""
        if self.queue_wait_s <= 0 and not self._queued:
            return
        for job_id, job in self.st.jobs.items():
            if job.state is not JobState.PENDING:
                continue
            seen = self._queued.get(job_id)
            if seen is None or seen[0] != job.restart_count:
                if job.restart_count == 0 or self.queue_wait_s <= 0:
                    continue  # a first submission waits only what submit() was told
                seen = self._queued[job_id] = (
                    job.restart_count,
                    job.submit_time + self.queue_wait_s,
                )
            job.eligible_time = max(job.eligible_time, seen[1])

    def _take_exits(self) -> dict[str, model.Exited]:
        exits, self._exits = self._exits, {}
        return exits

    def _model(self, job_id: str, run: _Run) -> JobModel:
        return run.job or self.models[job_id]

    def _progress(self, run: _Run) -> float:
        """Progress of a run by now, in model seconds (wall seconds at full speed)."""
        since = run.started if run.speed_since is None else run.speed_since
        return run.progress_before + (self.now - since) * run.speed

    def _lost_to_speed(self, run: _Run) -> tuple[float, float]:
        """(slow_s, stalled_s) by now."""
        since = run.started if run.speed_since is None else run.speed_since
        span = self.now - since
        if run.speed == 0:
            return run.slow_s, run.stalled_s + span
        return run.slow_s + span * (1.0 - run.speed), run.stalled_s

    def _settle(self, run: _Run) -> None:
        run.slow_s, run.stalled_s = self._lost_to_speed(run)
        run.progress_before = self._progress(run)
        run.speed_since = self.now

    def _finish_time(self, run: _Run, job: JobModel) -> float:
        target = job.finish_after(run.remaining_at_start)
        if run.signal_progress is not None:
            target = min(target, run.signal_progress + job.exit_save_s)
        if run.speed <= 0:
            return math.inf
        return self.now + max(0.0, target - self._progress(run)) / run.speed

    def _breakdown(
        self, job_id: str, run: _Run, job: JobModel, completed: bool, saved: float, computed: float
    ) -> RunBreakdown:
        progress = self._progress(run)
        slow, stalled = self._lost_to_speed(run)
        startup = min(progress, job.restart_cost_s)
        return RunBreakdown(
            job_id=job_id,
            serial=run.serial,
            started=run.started,
            ended=self.now,
            completed=completed,
            signalled=run.signal_progress is not None,
            saved_s=saved,
            computed_s=computed,
            startup_s=startup,
            checkpoint_s=progress - startup - computed,
            slow_s=slow,
            stalled_s=stalled,
            rolled_back_s=run.rolled_back,
        )


class VirtualBackend(OneJobPerCommand):
    """The scheduler protocol (`ftslurm.backends.protocol.SchedulerBackend`) over a
    `VirtualCluster`, at its virtual time: the daemon's `Reconciler` drives a simulated
    cluster through it exactly as it drives Slurm or the process-backed mock (the goodput
    benchmark measures the product this way).

    Every job submitted runs `job` (a `JobModel`); `workload(options)` names the work it
    belongs to (default: its name), so a fresh submission of a run resumes from the work
    its earlier jobs checkpointed. A resubmission waits the cluster's `queue_wait_s` as a
    requeue does; the first job of a workload does not. Actions take effect at once in the
    model; the processes they end are reported at the cluster's next step."""

    def __init__(
        self,
        cluster: VirtualCluster,
        job: JobModel,
        workload: Callable[[JobOptions], str] | None = None,
        amend: Callable[[JobOptions], JobOptions] | None = None,
    ) -> None:
        """`amend`: what the submitting tool itself adds to every job's options (a
        baseline's own sbatch header, e.g. its `--signal`)."""
        self.cluster = cluster
        self.job = job
        self.workload = workload or (lambda options: options.name or "job")
        self.amend = amend or (lambda options: options)

    @property
    def _st(self) -> MockState:
        return self.cluster.st

    @property
    def _now(self) -> float:
        return self.cluster.now

    def submit(self, script: str, options: JobOptions) -> str:
        options = self.amend(options)
        key = self.workload(options)
        wait = self.cluster.queue_wait_s if key in self.cluster.remaining else 0.0
        return self.cluster.submit(
            options, self.job, queue_wait_s=wait, workload=key, script=script
        )

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        return model.query(self._st, list(dict.fromkeys(str(j) for j in job_ids)), self._now)

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        return model.find_jobs(self._st, comment, since, self._now)

    def active_jobs(self) -> list[JobInfo]:
        return model.active_jobs(self._st, self._now)

    def cancel(self, job_id: str) -> None:
        self.cluster.act(model.cancel(self._st, str(job_id), self._now))

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        self.cluster.act(model.requeue(self._st, str(job_id), hold, self._now))

    def release(self, job_id: str) -> None:
        model.release(self._st, str(job_id))
        self.cluster.changed = True

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        model.update_excluded_nodes(self._st, str(job_id), list(nodes))
        self.cluster.changed = True

    def start_now(self, job_id: str) -> None:
        model.start_now(self._st, str(job_id), self._now)
        self.cluster.changed = True

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        self.cluster.act(model.send_signal(self._st, str(job_id), sig, target))

    def nodes(self) -> list[NodeInfo]:
        return model.node_infos(self._st)

    def cluster_facts(self) -> ClusterFacts:
        return model.cluster_facts(self._st)


def simulate_campaign(
    *,
    nodes: int,
    spare_nodes: int,
    days: float,
    job: JobModel,
    failures_per_node_day: float,
    repair_s: float = 3600.0,
    time_limit_s: int | None = None,
    seed: int = 0,
    config: MockConfig | None = None,
) -> CampaignStats:
    """One job of `nodes` nodes worked on for up to `days`, continued at once after every
    early end (the simplest daemon), with node failures at the given rate."""
    total = nodes + spare_nodes
    base = config or MockConfig(requeue_delay_s=120, slurmd_timeout_s=300, kill_wait_s=30)
    cfg = base.model_copy(
        update={"nodes": [MockNodeSpec(name=f"n{i}", cpus=1) for i in range(1, total + 1)]}
    )
    cluster = VirtualCluster(cfg)
    limit = None if time_limit_s is None else format_limit_exact(time_limit_s)
    job_id = cluster.submit(JobOptions(nodes=nodes, time_limit=limit), job)
    rng = random.Random(seed)
    horizon = days * 86400.0
    rate = failures_per_node_day * nodes / 86400.0  # per second, over the job's nodes

    def schedule_failure(after: float) -> None:
        when = after + rng.expovariate(rate) if rate > 0 else math.inf
        if when < horizon:
            cluster.at(when, lambda: fail_one(when))

    def fail_one(when: float) -> None:
        running = cluster.st.jobs.get(job_id)
        pool = running.nodes if running and running.nodes else list(cluster.st.nodes)
        node = rng.choice(pool)
        cluster.fail_node(node)
        cluster.at(when + repair_s, lambda: model.revive_node(cluster.st, node))
        schedule_failure(when)

    def continue_job(jid: str, state: JobState) -> None:
        stats = cluster.stats
        stats.by_ending[state.value] = stats.by_ending.get(state.value, 0) + 1
        if cluster.remaining[jid] <= 1e-9:
            stats.completed = True
            cluster.remaining.pop(jid)
            return
        model.requeue(cluster.st, jid, False, cluster.now)
        model.start_now(cluster.st, jid, cluster.now)

    cluster.on_end = continue_job
    schedule_failure(0.0)
    cluster.run(horizon, stop=lambda: cluster.stats.completed)
    cluster.stats.wall_s = cluster.now
    return cluster.stats
