"""The mock scheduler's state machine: a small Slurm, as values and pure transitions.

Nothing here reads the clock, starts a process or touches a file: every operation takes
`now` and returns the `Effect`s the shell must carry out (launch a batch script, send a
signal, kill processes). The state is a pydantic model so the shell can store it as JSON
and several processes can share one simulated cluster; its changes are counted (`changes`)
so that the shell writes it back only when an operation changed it.

What it models, following Slurm's own behaviour (verified against a real 22.05 cluster by
the conformance suite): a FIFO queue with simple backfill over CPUs per node; node states
(idle, mixed/allocated, down, drained); excluded nodes (pending jobs only); time limits
(SIGTERM to steps and batch, SIGKILL after KillWait, state TIMEOUT); `--signal=[B:]SIG@T`;
requeue with the BeginTime delay and `StartTime=now`; node failure (DOWN after
SlurmdTimeout, NODE_FAIL, automatic requeue when allowed; with `--no-kill` the job shrinks to
its other nodes and runs on); cancel; exit codes; restart counts; finished jobs leaving the
controller's memory after MinJobAge (accounting keeps them).
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from ftslurm.core.inject import Injection, InjectKind, parse_injection
from ftslurm.core.timefmt import parse_time_limit
from ftslurm.core.types import (
    ClusterFacts,
    JobInfo,
    JobOptions,
    JobState,
    NodeInfo,
    NodeState,
    SignalTarget,
)
from ftslurm.errors import (
    ConfigError,
    InvalidJobId,
    InvalidPartition,
    JobStateConflict,
    SchedulerRejected,
)

# ---------------------------------------------------------------------- change counting

_changes = 0  # how many changes the state's models have seen in this process
_UNSET = object()


def changes() -> int:
    """A count that moves whenever a state changes: an assignment of a different value to a
    field, a job added, moved to accounting. The store writes the state back only when it
    moved during an operation (a query that changed nothing writes nothing)."""
    return _changes


def _changed() -> None:
    global _changes
    _changes += 1


def mark_changed() -> None:
    """Count a change the fields did not see (a list or dict changed in place)."""
    _changed()


class _Counted(BaseModel):
    """A model whose field assignments count as changes when the value differs."""

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name, _UNSET)
        if old is value or (type(old) is type(value) and old == value):
            return  # the same value: nothing changes
        _changed()
        super().__setattr__(name, value)


# ----------------------------------------------------------------------------- config


class MockNodeSpec(_Counted):
    name: str
    cpus: int = 2
    gpus: int = 0


MAX_JOB_ID = 0x03FF0000  # Slurm's MaxJobId default (67043328)


def _default_nodes() -> list[MockNodeSpec]:
    return [MockNodeSpec(name=f"n{i}") for i in range(1, 5)]


class MockConfig(_Counted):
    """The simulated cluster. Defaults: 4 nodes of 2 CPUs, Slurm's own defaults otherwise."""

    nodes: list[MockNodeSpec] = Field(default_factory=_default_nodes)
    partitions: dict[str, list[str]] | None = None  # None: one partition "debug" with all
    min_job_age_s: int = 300  # MinJobAge
    requeue_delay_s: int = 120  # SchedulerParameters=requeue_delay (default cred_expire)
    kill_wait_s: int = 30  # KillWait
    job_requeue: bool = True  # JobRequeue
    slurmd_timeout_s: int = 300  # SlurmdTimeout: a dead node is DOWN after this
    preempt_requeue: bool = True  # PreemptMode=REQUEUE (else CANCEL: the job ends PREEMPTED)
    accounting: bool = True
    cluster_name: str = "mock"
    # Slurm's FirstJobId. None: the store takes the next block of 1000 from the machine's
    # counter (`store.first_job_id`), so two mock clusters on one machine (two users', a
    # test suite's) share no job id.
    first_job_id: int | None = Field(None, ge=1, le=MAX_JOB_ID)

    def partition_map(self) -> dict[str, list[str]]:
        return self.partitions or {"debug": [n.name for n in self.nodes]}

    @property
    def default_partition(self) -> str:
        return next(iter(self.partition_map()))


# ------------------------------------------------------------------------------ state


class NodeStatus(str, Enum):
    UP = "up"
    DOWN = "down"
    DRAINED = "drained"


class MockNode(_Counted):
    name: str
    cpus: int
    status: NodeStatus = NodeStatus.UP
    reason: str | None = None
    dead_since: float | None = None  # slurmd gone, not yet noticed by the controller


class WarnSignal(_Counted):
    sig: str
    before_end_s: int
    batch_only: bool


class MockInjection(_Counted):
    spec: str
    fired: bool = False
    # An injected crash or hang that found no process for its rank tries again from then
    # (see `rank_not_running`); None: due at its time alone.
    retry_at: float | None = None

    def parsed(self) -> Injection:
        return parse_injection(self.spec)


class MockJob(_Counted):
    job_id: str
    script: str = ""  # the store keeps it (and `env`) apart once saved: see store.py
    name: str
    comment: str | None = None
    partition: str
    nodes_wanted: int = 1
    cpus_per_node: int = 1
    ntasks_per_node: int = 1
    time_limit_s: int | None = None
    base_time_limit_s: int | None = None  # the limit asked for (an injected timeout is per attempt)
    exclude: list[str] = Field(default_factory=list)
    injections: list[MockInjection] = Field(default_factory=list)
    requeue_allowed: bool = True
    no_kill: bool = False  # --no-kill: a node's failure shrinks the job instead of ending it
    warn: WarnSignal | None = None
    workdir: str = "."
    output: str | None = None
    error: str | None = None
    open_mode: str = "truncate"
    env: dict[str, str] = Field(default_factory=dict)

    state: JobState = JobState.PENDING
    held: bool = False
    submit_time: float
    eligible_time: float
    start_time: float | None = None
    end_time: float | None = None
    nodes: list[str] = Field(default_factory=list)
    batch_host: str | None = None  # the node running the batch script (the first one)
    restart_count: int = 0
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    warn_sent: bool = False
    ending: JobState | None = None  # the state to take once the processes are gone
    requeue_on_end: bool = False
    hold_on_requeue: bool = False
    restart_counted: bool = False  # an explicit requeue counted the restart already
    kill_at: float | None = None  # when SIGKILL follows the SIGTERM already sent


class MockState(_Counted):
    config: MockConfig = Field(default_factory=MockConfig)
    next_job_id: int = 1
    nodes: dict[str, MockNode] = Field(default_factory=dict)
    jobs: dict[str, MockJob] = Field(default_factory=dict)  # in the controller's memory
    accounting: dict[str, MockJob] = Field(default_factory=dict)  # aged out (sacct)

    @classmethod
    def create(cls, config: MockConfig | None = None) -> MockState:
        config = config or MockConfig()
        nodes = {n.name: MockNode(name=n.name, cpus=n.cpus) for n in config.nodes}
        return cls(config=config, nodes=nodes, next_job_id=config.first_job_id or 1)


# ---------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Launch:
    job_id: str


@dataclass(frozen=True)
class Signal:
    job_id: str
    sig: int
    target: SignalTarget


@dataclass(frozen=True)
class KillJob:
    """SIGKILL every process of the job."""

    job_id: str


@dataclass(frozen=True)
class SignalRank:
    """Send a signal to one rank's task (injected crash or hang)."""

    job_id: str
    rank: int
    sig: int


@dataclass(frozen=True)
class NodeDown:
    """The controller declared `node` down under a `--no-kill` job, which lives on: the steps
    that spanned the node end (their tasks elsewhere are killed) unless they were started
    with `srun --no-kill`, whose tasks run on."""

    job_id: str
    node: str


@dataclass(frozen=True)
class KillNode:
    """SIGKILL every process the job has on `node` (the batch shell too, if it is there)."""

    job_id: str
    node: str


Effect = Launch | Signal | SignalRank | KillJob | KillNode | NodeDown

# What the shell observed about a running job's processes since the last step.
Exited = tuple[int | None, int | None]  # (exit code, signal); (None, None): vanished


def signal_number(sig: str | int) -> int:
    if isinstance(sig, int):
        return sig
    name = sig.upper()
    if name.isdigit():
        return int(name)
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(getattr(_signal, name))
    except AttributeError:
        raise ConfigError(f"unknown signal {sig!r}") from None


_WARN = re.compile(r"^(?:(?P<b>[BR]):)?(?P<sig>[A-Za-z0-9]+)(?:@(?P<t>\d+))?$")


def parse_warn_signal(spec: str) -> WarnSignal:
    """`--signal=[B:]SIG[@TIME]` (TIME defaults to 60 s, as in Slurm)."""
    match = _WARN.match(spec.strip())
    if not match:
        raise ConfigError(f"malformed --signal {spec!r}", hint="use [B:]SIG[@SECONDS]")
    signal_number(match["sig"])
    return WarnSignal(
        sig=match["sig"].upper(), before_end_s=int(match["t"] or 60), batch_only=match["b"] == "B"
    )


# -------------------------------------------------------------------------- operations


def submit(st: MockState, script: str, options: JobOptions, now: float) -> str:
    partitions = st.config.partition_map()
    partition = options.partition or st.config.default_partition
    if partition not in partitions:
        raise InvalidPartition(f"sbatch: Invalid partition name specified ({partition})")
    wanted = options.nodes or 1
    usable = [n for n in partitions[partition] if n not in options.exclude]
    if wanted > len(usable):
        raise SchedulerRejected("sbatch: Requested node configuration is not available")
    per_node = (options.ntasks_per_node or 1) * (options.cpus_per_task or 1)
    if per_node > max(st.nodes[n].cpus for n in usable):
        raise SchedulerRejected("sbatch: Requested node configuration is not available")
    limit = parse_time_limit(options.time_limit) if options.time_limit else None
    injections = [MockInjection(spec=parse_injection(s).spec()) for s in options.inject]
    job_id = str(st.next_job_id)
    st.next_job_id += 1
    extra = dict(options.extra)
    _changed()
    st.jobs[job_id] = MockJob(
        job_id=job_id,
        script=script,
        name=options.name or "sbatch",
        comment=options.comment,
        partition=partition,
        nodes_wanted=wanted,
        cpus_per_node=per_node,
        ntasks_per_node=options.ntasks_per_node or 1,
        time_limit_s=limit,
        base_time_limit_s=limit,
        exclude=list(options.exclude),
        injections=injections,
        requeue_allowed=st.config.job_requeue if options.requeue is None else options.requeue,
        no_kill=options.no_kill,
        warn=parse_warn_signal(options.signal) if options.signal else None,
        workdir=options.workdir or ".",
        output=options.output,
        error=options.error,
        open_mode=extra.get("open-mode") or "truncate",
        env=dict(options.env),
        held=options.hold,
        submit_time=now,
        eligible_time=now,
        reason="JobHeldUser" if options.hold else None,
    )
    return job_id


def _job(st: MockState, job_id: str) -> MockJob:
    job = st.jobs.get(str(job_id))
    if job is None:
        raise InvalidJobId(f"Invalid job id specified for job {job_id}")
    return job


def cancel(st: MockState, job_id: str, now: float) -> list[Effect]:
    job = _job(st, job_id)
    if job.state is JobState.PENDING or job.state is JobState.REQUEUED:
        _finish(st, job, JobState.CANCELLED, now)
        return []
    if job.state is JobState.RUNNING:
        return _terminate(job, JobState.CANCELLED, now, st.config.kill_wait_s)
    if job.state is JobState.COMPLETING and job.requeue_on_end:
        # being requeued: as Slurm ("prevent job requeue"), it ends CANCELLED instead of
        # coming back; its processes are already being stopped
        job.requeue_on_end, job.hold_on_requeue, job.ending = False, False, JobState.CANCELLED
    return []  # otherwise already ending or ended


def preempt(st: MockState, job_id: str, now: float) -> list[Effect]:
    """The scheduler preempts a running job (as the `preempt` injection does, on demand):
    SIGTERM now, SIGKILL after KillWait, then back in the queue (PreemptMode=REQUEUE and a
    requeueable job) or PREEMPTED."""
    job = _job(st, job_id)
    if job.state is not JobState.RUNNING:
        raise JobStateConflict(f"Job {job_id} is not running ({job.state.value})")
    effects = _terminate(job, JobState.PREEMPTED, now, st.config.kill_wait_s)
    job.requeue_on_end = st.config.preempt_requeue and job.requeue_allowed
    return effects


def requeue(st: MockState, job_id: str, hold: bool, now: float) -> list[Effect]:
    job = _job(st, job_id)
    if not job.requeue_allowed:
        raise JobStateConflict("Requested operation is presently disabled")
    if job.state is JobState.PENDING:
        raise JobStateConflict(f"Job is pending execution for job {job_id}")
    if job.state.is_terminal:
        _back_to_queue(st, job, hold, now)
        return []
    if job.state is JobState.COMPLETING and job.requeue_on_end:
        return []
    effects = _terminate(job, JobState.REQUEUED, now, st.config.kill_wait_s)
    job.requeue_on_end, job.hold_on_requeue = True, hold
    # as Slurm: Restarts counts up at once, while the job is still COMPLETING
    job.restart_count, job.restart_counted = job.restart_count + 1, True
    return effects


def release(st: MockState, job_id: str) -> None:
    job = _job(st, job_id)
    if job.held:
        job.held = False
        job.reason = None


def update_excluded_nodes(st: MockState, job_id: str, nodes: list[str]) -> None:
    job = _job(st, job_id)
    if job.state is not JobState.PENDING:
        raise JobStateConflict(f"Job is no longer pending execution for job {job_id}")
    unknown = [n for n in nodes if n not in st.nodes]
    if unknown:
        raise SchedulerRejected(f"Invalid node name specified: {','.join(unknown)}")
    job.exclude = list(nodes)


def start_now(st: MockState, job_id: str, now: float) -> None:
    job = _job(st, job_id)
    if job.state is not JobState.PENDING:
        raise JobStateConflict(f"Job is no longer pending execution for job {job_id}")
    job.eligible_time = now


def send_signal(st: MockState, job_id: str, sig: str | int, target: SignalTarget) -> list[Effect]:
    job = _job(st, job_id)
    if job.state is JobState.PENDING:
        raise JobStateConflict(f"Job is pending execution for job {job_id}")
    if job.state is not JobState.RUNNING:
        raise JobStateConflict("Job/step already completing or completed")
    return [Signal(job.job_id, signal_number(sig), SignalTarget(target))]


def fail_node(st: MockState, node: str, now: float) -> list[Effect]:
    """The node's host dies: its processes vanish now; Slurm notices after SlurmdTimeout."""
    n = st.nodes[node]
    if n.dead_since is None:
        n.dead_since = now
    return [
        KillNode(j.job_id, node)
        for j in st.jobs.values()
        if node in j.nodes and j.state in (JobState.RUNNING, JobState.COMPLETING)
    ]


def revive_node(st: MockState, node: str) -> None:
    """slurmd is back (ReturnToService=2: a DOWN node returns when it registers)."""
    n = st.nodes[node]
    n.dead_since = None
    n.status, n.reason = NodeStatus.UP, None


def drain_node(st: MockState, node: str, reason: str) -> None:
    n = st.nodes[node]
    n.status, n.reason = NodeStatus.DRAINED, reason


# --------------------------------------------------------------------------- advancing


def advance(st: MockState, now: float, exited: dict[str, Exited]) -> list[Effect]:
    """Everything that happens by `now`, given which running jobs' processes have ended."""
    effects: list[Effect] = []
    cfg = st.config
    for job_id, (code, sig) in exited.items():
        job = st.jobs.get(job_id)
        if job and job.state in (JobState.RUNNING, JobState.COMPLETING):
            _processes_ended(st, job, code, sig, now)
    for node in st.nodes.values():
        if (
            node.dead_since is not None
            and node.status is not NodeStatus.DOWN
            and now >= node.dead_since + cfg.slurmd_timeout_s
        ):
            node.status, node.reason = NodeStatus.DOWN, "Not responding"
            effects += _node_failed(st, node.name, now)
    for job in list(st.jobs.values()):
        if job.state is JobState.RUNNING:
            effects += _injection_events(st, job, now)
        if job.state is JobState.RUNNING:
            effects += _time_events(job, now, cfg.kill_wait_s)
        elif job.state is JobState.COMPLETING and job.kill_at is not None and now >= job.kill_at:
            job.kill_at = None
            effects.append(KillJob(job.job_id))
    effects += _schedule(st, now)
    for job in list(st.jobs.values()):
        if (
            job.state.is_terminal
            and job.end_time is not None
            and now >= job.end_time + cfg.min_job_age_s
        ):
            _changed()
            del st.jobs[job.job_id]
            if cfg.accounting:
                st.accounting[job.job_id] = job
    return effects


def next_event_time(st: MockState) -> float | None:
    """The earliest time at which `advance` has something to do without new input."""
    times: list[float] = []
    cfg = st.config
    for node in st.nodes.values():
        if node.dead_since is not None and node.status is not NodeStatus.DOWN:
            times.append(node.dead_since + cfg.slurmd_timeout_s)
    for job in st.jobs.values():
        if (
            job.state is JobState.RUNNING
            and job.time_limit_s is not None
            and job.start_time is not None
        ):
            end = job.start_time + job.time_limit_s
            times.append(end)
            if job.warn and not job.warn_sent:
                times.append(end - job.warn.before_end_s)
        if job.kill_at is not None:
            times.append(job.kill_at)
        if job.state is JobState.RUNNING and job.start_time is not None:
            times += [
                max(job.start_time + inj.parsed().at_s, inj.retry_at or 0.0)
                for inj in job.injections
                if not inj.fired and inj.parsed().kind is not InjectKind.TIMEOUT
            ]
        if job.state is JobState.PENDING and not job.held and job.reason != RESOURCES:
            times.append(job.eligible_time)  # (one waiting for nodes waits for an event)
        if job.state.is_terminal and job.end_time is not None:
            times.append(job.end_time + cfg.min_job_age_s)
    return min(times) if times else None


def _time_events(job: MockJob, now: float, kill_wait: int) -> list[Effect]:
    if job.time_limit_s is None or job.start_time is None:
        return []
    end = job.start_time + job.time_limit_s
    effects: list[Effect] = []
    if job.warn and not job.warn_sent and now >= end - job.warn.before_end_s:
        job.warn_sent = True
        target = SignalTarget.BATCH if job.warn.batch_only else SignalTarget.STEPS
        effects.append(Signal(job.job_id, signal_number(job.warn.sig), target))
    if now >= end:
        effects += _terminate(job, JobState.TIMEOUT, now, kill_wait)
    return effects


def _injection_events(st: MockState, job: MockJob, now: float) -> list[Effect]:
    """Fire the injections whose time has come in this attempt (each fires once)."""
    effects: list[Effect] = []
    for inj in job.injections:
        spec = inj.parsed()
        if inj.fired or spec.kind is InjectKind.TIMEOUT or now < job.start_time + spec.at_s:
            continue
        if inj.retry_at is not None and now < inj.retry_at:
            continue
        match spec.kind:
            case InjectKind.NODE_FAIL:
                inj.fired = True
                node = _target_node(job, spec)
                if node in st.nodes:  # `submit` refuses others; an old record is no crash
                    effects += fail_node(st, node, now)
            case InjectKind.PREEMPT:
                inj.fired = True
                effects += preempt(st, job.job_id, now)
            case InjectKind.CRASH:
                inj.fired = True
                effects.append(SignalRank(job.job_id, spec.rank or 0, int(_signal.SIGKILL)))
            case InjectKind.HANG:
                inj.fired = True
                effects.append(SignalRank(job.job_id, spec.rank or 0, int(_signal.SIGSTOP)))
            case _:  # a straggler, a failed health check, a wrong result: carried out
                inj.fired = True  # inside the job (FTSLURM_INJECT), not here
        if job.state is not JobState.RUNNING:
            break
    return effects


# How often an injected crash or hang looks again for its rank's process.
RANK_RETRY_S = 0.5


def rank_not_running(st: MockState, effect: SignalRank, now: float) -> None:
    """The shell found no process for the rank an injected crash or hang was for (its step
    has not started it yet: on a loaded machine a rank may start seconds after the job).
    The injection is due again in RANK_RETRY_S, so it fires once the rank runs, never not
    at all; it stays pending while the job runs."""
    job = st.jobs.get(effect.job_id)
    if job is None:
        return
    kind = InjectKind.CRASH if effect.sig == int(_signal.SIGKILL) else InjectKind.HANG
    for inj in reversed(job.injections):
        spec = inj.parsed()
        if inj.fired and spec.kind is kind and (spec.rank or 0) == effect.rank:
            inj.fired, inj.retry_at = False, now + RANK_RETRY_S
            return


def _target_node(job: MockJob, spec: Injection) -> str:
    if spec.node is not None:
        return spec.node
    index = spec.node_index if spec.node_index is not None else len(job.nodes) - 1
    return job.nodes[min(index, len(job.nodes) - 1)]


def _terminate(job: MockJob, ending: JobState, now: float, kill_wait: int) -> list[Effect]:
    """SIGCONT + SIGTERM to everything now, SIGKILL after KillWait (as Slurm)."""
    job.state, job.ending, job.kill_at = JobState.COMPLETING, ending, now + kill_wait
    return [
        Signal(job.job_id, int(_signal.SIGCONT), SignalTarget.ALL),
        Signal(job.job_id, int(_signal.SIGTERM), SignalTarget.ALL),
    ]


def _processes_ended(
    st: MockState, job: MockJob, code: int | None, sig: int | None, now: float
) -> None:
    if (
        job.no_kill
        and job.ending is None
        and code is None
        and job.batch_host is not None
        and job.batch_host not in job.nodes
    ):
        # A --no-kill job that lost its batch host: as Slurm, it stays RUNNING on the
        # nodes left, with no batch script, until it is cancelled or reaches its limit.
        return
    if job.requeue_on_end:
        _back_to_queue(st, job, job.hold_on_requeue, now)
        return
    if job.ending is not None:
        final = job.ending
    elif code == 0 and not sig:
        final = JobState.COMPLETED
    else:
        final = JobState.FAILED
    job.exit_code, job.signal = (code if code is not None else 0), sig
    _finish(st, job, final, now)
    if final is JobState.FAILED:
        job.reason = "NonZeroExitCode"


def _finish(st: MockState, job: MockJob, state: JobState, now: float) -> None:
    job.state, job.end_time, job.kill_at, job.ending = state, now, None, None
    if job.exit_code is None:
        job.exit_code = 0
    if job.start_time is None:
        job.start_time = now


RESOURCES = "Resources"  # squeue's reason of an eligible job waiting for nodes
REQUEUE_HELD = "job requeued in held state"  # squeue's reason after `scontrol requeuehold`


def _back_to_queue(st: MockState, job: MockJob, hold: bool, now: float) -> None:
    job.state = JobState.PENDING
    job.restart_count += 0 if job.restart_counted else 1
    job.restart_counted = False
    job.nodes, job.batch_host, job.start_time, job.end_time = [], None, None, None
    job.exit_code, job.signal, job.ending, job.kill_at = None, None, None, None
    job.requeue_on_end, job.hold_on_requeue, job.warn_sent = False, False, False
    job.time_limit_s = job.base_time_limit_s
    job.submit_time = now
    job.eligible_time = now + st.config.requeue_delay_s + 1
    job.held = hold
    job.reason = REQUEUE_HELD if hold else "BeginTime"


def _node_failed(st: MockState, node: str, now: float) -> list[Effect]:
    effects: list[Effect] = []
    for job in list(st.jobs.values()):
        if node not in job.nodes or job.state not in (JobState.RUNNING, JobState.COMPLETING):
            continue
        if job.no_kill and job.state is JobState.RUNNING and len(job.nodes) > 1:
            # As Slurm: the allocation shrinks to the other nodes and the job runs on (even
            # when the batch host is the lost node: then with no batch script left).
            job.nodes = [n for n in job.nodes if n != node]
            effects.append(NodeDown(job.job_id, node))
            continue
        effects.append(KillJob(job.job_id))
        if job.requeue_allowed:
            _back_to_queue(st, job, False, now)
        else:
            job.exit_code = 0
            _finish(st, job, JobState.NODE_FAIL, now)
    return effects


def _free_cpus(st: MockState) -> dict[str, int]:
    free = {n.name: n.cpus for n in st.nodes.values()}
    for job in st.jobs.values():
        if job.state in (JobState.RUNNING, JobState.COMPLETING):
            for node in job.nodes:
                free[node] -= job.cpus_per_node
    return free


def _schedule(st: MockState, now: float) -> list[Effect]:
    """FIFO by submit order; a job that does not fit lets later ones try (simple backfill)."""
    ready: list[MockJob] = []
    for job in st.jobs.values():  # held and not yet eligible jobs only take their reason
        if job.state is not JobState.PENDING:
            continue
        if job.held:
            if job.reason != REQUEUE_HELD and job.reason != "JobHeldUser":
                job.reason = "JobHeldUser"
        elif now < job.eligible_time:
            job.reason = "BeginTime"
        else:
            ready.append(job)
    effects: list[Effect] = []
    free = _free_cpus(st) if ready else {}
    for job in sorted(ready, key=lambda j: (j.eligible_time, int(j.job_id))):
        candidates = [
            n
            for n in st.config.partition_map()[job.partition]
            if n not in job.exclude
            and st.nodes[n].status is NodeStatus.UP
            and st.nodes[n].dead_since is None
            and free[n] >= job.cpus_per_node
        ]
        if len(candidates) < job.nodes_wanted:
            job.reason = RESOURCES
            continue
        chosen = candidates[: job.nodes_wanted]
        for node in chosen:
            free[node] -= job.cpus_per_node
        job.state, job.nodes, job.start_time, job.reason = JobState.RUNNING, chosen, now, None
        job.batch_host = chosen[0]
        for inj in job.injections:  # an injected wall limit applies to this attempt
            spec = inj.parsed()
            if spec.kind is InjectKind.TIMEOUT and not inj.fired:
                inj.fired, job.time_limit_s = True, int(spec.at_s)
                break
        effects.append(Launch(job.job_id))
    return effects


# ------------------------------------------------------------------------------ views


def job_info(job: MockJob, now: float, from_accounting: bool = False) -> JobInfo:
    shown = job.state
    # JobInfo is a frozen dataclass: its __init__ sets each field through object.__setattr__,
    # about 8x the cost of filling its __dict__ at once, which is most of a query of 10,000
    # jobs. Every field is given here (tests/test_mock_store.py checks both ways agree).
    info = _new(JobInfo)
    info.__dict__.update(
        job_id=job.job_id,
        state=shown,
        observed_at=now,
        raw_state=shown.value,
        exit_code=job.exit_code,
        signal=job.signal,
        nodes=tuple(job.nodes),
        submit_time=job.submit_time,
        start_time=job.start_time,
        end_time=job.end_time if shown.is_terminal else None,
        time_limit_s=job.time_limit_s,
        restart_count=job.restart_count,
        reason=job.reason,
        name=job.name,
        comment=job.comment,
        from_accounting=from_accounting,
    )
    return info


_new = object.__new__


def find_jobs(st: MockState, comment: str, since: float | None, now: float) -> list[JobInfo]:
    """squeue's answer; when empty and `since` is given, sacct's (jobs aged out since)."""
    live = [job_info(j, now) for j in st.jobs.values() if j.comment == comment]
    if live or since is None:
        return live
    return [
        job_info(j, now, from_accounting=True)
        for j in st.accounting.values()
        if j.comment == comment and j.submit_time >= since
    ]


def active_jobs(st: MockState, now: float) -> list[JobInfo]:
    """squeue's default listing (the mock cluster has one user): the jobs not yet ended."""
    return [job_info(j, now) for j in st.jobs.values() if not j.state.is_terminal]


def query(st: MockState, job_ids: list[str], now: float) -> dict[str, JobInfo]:
    result = {}
    for job_id in job_ids:
        if job_id in st.jobs:
            result[job_id] = job_info(st.jobs[job_id], now)
        elif job_id in st.accounting:
            result[job_id] = job_info(st.accounting[job_id], now, from_accounting=True)
        else:
            result[job_id] = JobInfo.unknown(job_id, now, "unknown to the mock controller")
    return result


def node_infos(st: MockState) -> list[NodeInfo]:
    free = _free_cpus(st)
    infos = []
    for node in st.nodes.values():
        if node.status is NodeStatus.DOWN:
            state, raw = NodeState.DOWN, "down*" if node.dead_since is not None else "down"
        elif node.status is NodeStatus.DRAINED:
            state, raw = NodeState.DRAINED, "drain"
        elif free[node.name] == node.cpus:
            state, raw = NodeState.IDLE, "idle"
        elif free[node.name] == 0:
            state, raw = NodeState.ALLOCATED, "alloc"
        else:
            state, raw = NodeState.MIXED, "mix"
        silent_since = None
        if node.dead_since is not None and node.status is not NodeStatus.DOWN:
            raw += "*"  # not responding, not yet marked down
            silent_since = node.dead_since
        infos.append(
            NodeInfo(
                name=node.name,
                state=state,
                raw_state=raw,
                reason=node.reason,
                not_responding_since=silent_since,
            )
        )
    return infos


def cluster_facts(st: MockState) -> ClusterFacts:
    cfg = st.config
    return ClusterFacts(
        min_job_age_s=cfg.min_job_age_s,
        accounting=cfg.accounting,
        kill_wait_s=cfg.kill_wait_s,
        job_requeue=cfg.job_requeue,
        version="mock",
        cluster_name=cfg.cluster_name,
        slurmd_timeout_s=cfg.slurmd_timeout_s,
    )
