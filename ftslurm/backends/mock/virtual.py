"""The mock scheduler on a virtual clock: jobs are models, time jumps from event to event.

The same state machine as the process-backed mock (`model`) decides everything Slurm
decides (placement, time limits, warning signals, requeue delay, node-failure detection);
here a job is a `JobModel` (how much work, how often and how long it checkpoints, what a
restart costs) instead of processes, so a month of a 2048-node job simulates in seconds.

`VirtualCluster` is the engine; `simulate_campaign` drives one long job to completion
under a simple continuation policy (requeue whatever ended early, at once), with node
failures drawn from a seeded Poisson process. The benchmarks build their policies on it.
"""

from __future__ import annotations

import heapq
import math
import random
import signal as _signal
from collections.abc import Callable
from dataclasses import dataclass, field

from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockNodeSpec, MockState
from ftslurm.core.types import JobOptions, JobState


@dataclass(frozen=True)
class JobModel:
    """A training job as the simulator sees it (all in seconds of wall time)."""

    work_s: float  # compute needed, at full speed
    checkpoint_interval_s: float  # compute between two checkpoints
    checkpoint_cost_s: float  # wall time one checkpoint takes
    restart_cost_s: float = 0.0  # start-up plus loading the checkpoint, at every start
    checkpoint_on_signal: bool = True  # a warning signal makes it checkpoint, then exit 0

    def finish_after(self, remaining_s: float) -> float:
        """Wall time from a start to the end of the work (checkpoints included)."""
        segments = max(1, math.ceil(remaining_s / self.checkpoint_interval_s))
        return self.restart_cost_s + remaining_s + (segments - 1) * self.checkpoint_cost_s

    def saved_after(self, elapsed_s: float, remaining_s: float) -> float:
        """Work safely checkpointed after `elapsed_s` of a run (never more than remaining)."""
        cycle = self.checkpoint_interval_s + self.checkpoint_cost_s
        done = max(0.0, elapsed_s - self.restart_cost_s)
        return min(remaining_s, math.floor(done / cycle) * self.checkpoint_interval_s)

    def computed_after(self, elapsed_s: float, remaining_s: float) -> float:
        """Work computed (saved or not) after `elapsed_s` of a run."""
        cycle = self.checkpoint_interval_s + self.checkpoint_cost_s
        done = max(0.0, elapsed_s - self.restart_cost_s)
        full, rest = divmod(done, cycle)
        return min(remaining_s, full * self.checkpoint_interval_s
                   + min(rest, self.checkpoint_interval_s))  # fmt: skip


@dataclass
class _Run:
    started: float
    remaining_at_start: float
    finish_at: float
    saved_on_exit: float | None = None  # set by a checkpoint-on-signal: what it will keep


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

    def __init__(self, config: MockConfig, start: float = 0.0) -> None:
        self.st = MockState.create(config)
        self.now = start
        self.models: dict[str, JobModel] = {}
        self.remaining: dict[str, float] = {}  # work left after the last checkpoint
        self.runs: dict[str, _Run] = {}
        self.stats = CampaignStats()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.on_end: Callable[[str, JobState], None] | None = None

    # ----------------------------------------------------------------- API
    def submit(self, options: JobOptions, job: JobModel) -> str:
        job_id = model.submit(self.st, "#!/bin/true\n", options, self.now)
        self.models[job_id] = job
        self.remaining[job_id] = job.work_s
        return job_id

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run `action` (e.g. a fault) at virtual time `when`."""
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, action))

    def fail_node(self, node: str) -> None:
        self.stats.node_failures += 1
        self._apply(model.fail_node(self.st, node, self.now))

    def run(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Process events in time order up to `until` or until `stop()` holds."""
        self._step({})
        while not stop():
            candidates = [t for t in (
                model.next_event_time(self.st),
                min((r.finish_at for r in self.runs.values()), default=None),
                self._timers[0][0] if self._timers else None,
            ) if t is not None]  # fmt: skip
            if not candidates or min(candidates) > until:
                self.now = until
                return
            self.now = max(self.now, min(candidates))
            self.stats.events += 1
            while self._timers and self._timers[0][0] <= self.now:
                heapq.heappop(self._timers)[2]()
            finished = {j: (0, None) for j, r in list(self.runs.items()) if r.finish_at <= self.now}
            for job_id in finished:
                self._end_run(job_id, completed=True)
            self._step(finished)

    # ----------------------------------------------------------- internals
    def _step(self, exited: dict[str, model.Exited]) -> None:
        effects = model.advance(self.st, self.now, exited)
        while effects:
            exited = self._apply(effects)
            effects = model.advance(self.st, self.now, exited) if exited else []
        for job_id, job in self.st.jobs.items():
            if job.state.is_terminal and job_id in self.remaining and self.on_end:
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
        return exited

    def _start_run(self, job_id: str) -> None:
        job = self.models[job_id]
        remaining = self.remaining[job_id]
        self.stats.attempts += 1
        self.runs[job_id] = _Run(self.now, remaining, self.now + job.finish_after(remaining))

    def _end_run(self, job_id: str, completed: bool) -> None:
        run = self.runs.pop(job_id)
        job = self.models[job_id]
        elapsed = self.now - run.started
        if completed and run.saved_on_exit is not None:
            saved = computed = run.saved_on_exit
        elif completed:
            saved = computed = run.remaining_at_start
        else:
            saved = job.saved_after(elapsed, run.remaining_at_start)
            computed = job.computed_after(elapsed, run.remaining_at_start)
        self.remaining[job_id] = run.remaining_at_start - saved
        self.stats.productive_s += saved
        self.stats.lost_s += computed - saved

    def _checkpoint_and_exit(self, job_id: str) -> None:
        """Warning signal: save what was computed, then leave (a continuation)."""
        run = self.runs[job_id]
        job = self.models[job_id]
        run.saved_on_exit = job.computed_after(self.now - run.started, run.remaining_at_start)
        run.finish_at = min(run.finish_at, self.now + job.checkpoint_cost_s)


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
    cfg = base.model_copy(update={"nodes": [MockNodeSpec(name=f"n{i}", cpus=1)
                                            for i in range(1, total + 1)]})  # fmt: skip
    cluster = VirtualCluster(cfg)
    limit = None if time_limit_s is None else f"0:{time_limit_s}"
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
