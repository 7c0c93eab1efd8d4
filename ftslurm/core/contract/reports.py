"""The JSON files the compute side writes and the daemon (and the commands) read, as typed,
frozen models, and the outcomes they speak of (pure).

One model per shared file of a run's directory (`RunDir`): a rank report
(`attempts/<k>/rank-<r>.json`), a node report (`node-<n>.json`), the ranks a launcher found
hung at the stop (`hung-node-<n>.json`), the claims of a hang launchers with spares
compare (`hang-claim-<n>.json`), the recovery folder's peer-loss reports
(`lost-<n>.json`), in-job round records (`round-<r>.json`), bench records
(`benched-<n>.json`), failed launchers (`launcher-failed-<n>.json`) and failed health
checks (`unhealthy-<n>.json`), `progress.json`, the straggler report and a rank's straggler
window (`stragglers/`), the rendezvous record, a rank's result validation
(`validation-rank-<r>.json`).

Old and new versions of ftslurm share these files, so a model reads whatever either
writes: a key it does not know is kept (`extra="allow"`) and a key left out takes its
default. A model serializes to exactly the keys its writer gave (`to_json`), the names
today's files have. Reading a file (a damaged one skipped) and writing one (atomic) is the
shell's: `ftslurm.runfiles`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, TypeAdapter, ValidationError

from ftslurm.core.contract import (
    BENCHED_RECORDS,
    HANG_CLAIMS,
    HUNG_NODE_REPORTS,
    LAUNCHER_FAILED_REPORTS,
    LIVE_RECORDS,
    NODE_REPORTS,
    PEER_LOST_REPORTS,
    RANK_REPORTS,
    ROUND_RECORDS,
    UNHEALTHY_REPORTS,
    VALIDATION_REPORTS,
)


class Outcome(str, Enum):
    """How a rank (its task wrapper's report) or a node (its launcher's report) ended: the
    `outcome` of `RankReport` and `NodeReport`, and what a rank's stop record says."""

    FINISHED = "finished"
    CHECKPOINTED = "checkpointed"  # exit 0 (or 75) after the checkpoint signal: continue me
    TEARDOWN_FAILED = "teardown_failed"  # saved and recorded its stop, then died tearing down
    RESUME_ELSEWHERE = "resume_elsewhere"  # exit 16
    FAILED_VALIDATION = "failed_validation"  # exit 17
    DO_NOT_RETRY = "do_not_retry"  # exit 93
    DISK_FULL = "disk_full"  # died of ENOSPC
    USER_ERROR = "user_error"  # the script's own error (an import, a missing file)
    KILLED = "killed"  # a signal ended it
    FAILED = "failed"
    STOPPED = "stopped"  # TERM/INT came before the command (the ranks) started
    HUNG = "hung"  # the launcher killed a hung rank
    RESTARTS_EXHAUSTED = "restarts_exhausted"  # the launcher used up its in-job restarts
    LAUNCHER_FAILED = "launcher_failed"  # the launcher failed before its ranks started
    SPARE = "spare"  # a spare node never needed
    BENCHED = "benched"  # a node that stepped out so a spare took its place
    UNHEALTHY = "unhealthy"  # the launcher's pre-flight health check failed: no rendezvous


# The outcomes of the launchers of nodes not training at the end (`ftslurm.agent.spares`):
# a spare never needed, and a node that stepped out so a spare took its place.
OUT_OF_TRAINING = frozenset({Outcome.SPARE, Outcome.BENCHED})


class NodeRole(str, Enum):
    """A node's part in a job with hot spares: what its lease says (`Lease.role`) and what a
    loss report says of the lost node (`PeerLost.role`)."""

    ACTIVE = "active"  # it trains (a spare that took a node over too)
    SPARE = Outcome.SPARE.value  # an idle spare: it waits to join the training
    # a spare whose ranks wait warm to take a lost node's over (live recovery); a lease says
    # it as `spare` with `warm` (a loss report as this role)
    WARM_SPARE = "warm_spare"


# The roles of a spare still waiting: its loss restarts no one, it takes a spare away.
WAITING_SPARES = frozenset({NodeRole.SPARE, NodeRole.WARM_SPARE})
# Endings that leave the training's state saved (with every other rank clean).
SAVED = frozenset({Outcome.CHECKPOINTED, Outcome.TEARDOWN_FAILED})
# Endings a run goes on from cleanly (`ftslurm report`'s clean end, `policy.classify`).
CLEAN = frozenset({Outcome.FINISHED, *SAVED})


def _job_id(value: Any) -> Any:
    """Job ids are strings; an old writer's number is taken as one."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


JobId = Annotated[str | None, BeforeValidator(_job_id)]


def _items(kind: Any) -> BeforeValidator:
    """A list whose entries that are not a `kind` are left out (a list field another
    version filled differently costs those entries, not the report)."""
    adapter: TypeAdapter[Any] = TypeAdapter(kind)

    def keep(value: Any) -> list[Any]:
        out = []
        for item in value if isinstance(value, list) else ():
            if isinstance(item, bool) and kind in (int, float):
                continue
            try:
                out.append(adapter.validate_python(item, strict=kind in (int, str)))
            except ValidationError:
                pass
        return out

    return BeforeValidator(keep)


Strs = Annotated[list[str], _items(str)]
Ints = Annotated[list[int], _items(int)]


class Report(BaseModel):
    """A shared JSON file: unknown keys kept, missing ones defaulted, never changed."""

    model_config = ConfigDict(frozen=True, extra="allow")

    def to_json(self) -> dict[str, Any]:
        """The file's JSON: the keys its writer gave (and those it did not know, kept)."""
        return self.model_dump(mode="json", exclude_unset=True)


M = TypeVar("M", bound=Report)


def parse(model: type[M], data: object) -> M | None:
    """`data` (a file's JSON, or already a `model`) as `model`, or None when it is not one
    (not an object, or a known key of the wrong type): a damaged or foreign file is left
    out, never fatal."""
    if isinstance(data, model):
        return data
    if not isinstance(data, Mapping):
        return None
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


def parse_all(model: type[M], items: object) -> tuple[M, ...]:
    """The `model`s among `items` (those that are not one left out)."""
    found = (parse(model, x) for x in items) if isinstance(items, (list, tuple)) else ()
    return tuple(x for x in found if x is not None)


class RankReport(Report):
    """`attempts/<k>/rank-<r>.json`: what a rank's task wrapper reports when its command
    ends (`ftslurm.agent.task`)."""

    rank: int | None = None
    node: str | None = None
    job_id: JobId = None
    restart_count: int = 0
    attempt: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    checkpoint_signal_at: float | None = None
    injected: Strs = []
    outcome: str | None = None  # an `Outcome` (a newer one kept as its string)
    error_tail: str | None = None
    error_line: str | None = None
    saved_step: int | None = None
    disk_full_path: str | None = None
    # the checkpoint signal held back from it, by name (`WITHHELD_SIGNAL`)
    checkpoint_signal_withheld: str | None = None


class NodeHang(Report):
    """One hang a node's launcher restarted its ranks from (or stepped out for): an entry
    of `NodeReport.hangs`."""

    local_rank: int | None = None
    reason: str | None = None
    step: int | None = None  # the rank's last step when it hung
    time: float | None = None  # when it was found hung (epoch seconds)


class NodeReport(Report):
    """`attempts/<k>/node-<n>.json`: what a node's launcher reports when its ranks end (or
    when it failed or was stopped before they started; `ftslurm.agent.launch`)."""

    node_rank: int | None = None
    node: str | None = None
    job_id: JobId = None
    attempt: int | None = None
    outcome: str | None = None  # an `Outcome`
    exit_code: int | None = None
    signal: str | None = None  # the signal that stopped it before its ranks started
    role: str | None = None  # with spares: "active" or "spare"
    recovery: str | None = None  # "new_job" when the node's loss needs a new job
    benched: str | None = None  # why it stepped out ("hang", "straggler")
    in_job_restarts: int = 0
    max_restarts: int | None = None
    spare_swaps: int | None = None
    hangs: Annotated[list[NodeHang], _items(NodeHang)] = []  # per hang it restarted from
    teardown_failures: Strs = []
    started_at: float | None = None
    ended_at: float | None = None
    timeouts: dict[str, Any] | None = None
    heartbeats: bool = True  # False: hangs were judged by CPU use alone
    peers_lost: Ints = []
    # the global ranks of the node that withheld the checkpoint signal (`WITHHELD_RANKS`)
    checkpoint_signal_withheld_ranks: Ints = []
    # a launcher that failed before its ranks started (as in `LauncherFailed`)
    error: str | None = None
    phase: str | None = None
    time: float | None = None


class HungRank(Report):
    """One rank of a `HungNodeReport`."""

    local_rank: int | None = None
    rank: int | None = None
    reason: str | None = None
    section: str | None = None
    silent_s: float | None = None


class HungNodeReport(Report):
    """`attempts/<k>/hung-node-<n>.json`: the ranks a launcher found hung when it was told
    to stop."""

    node_rank: int | None = None
    node: str | None = None
    time: float | None = None
    hung: Annotated[list[HungRank], _items(HungRank)] = []


class PeerLost(Report):
    """`recovery/lost-<n>.json`: a launcher's report that node `lost_node_rank` fell silent
    (`ftslurm.agent.peers`); the daemon builds one for the batch host it judged silent
    itself (`source`: "daemon")."""

    lost_node_rank: int | None = None
    lost_node: str | None = None
    last_heard: float | None = None
    lease_time: float | None = None
    silent_s: float | None = None
    peer_timeout_s: float | None = None
    how: str | None = None  # "dropped" (its connection closed) or "silent"
    reported_by: str | None = None
    reported_by_node_rank: int | None = None
    time: float | None = None
    job_id: JobId = None
    attempt: int | None = None
    source: str | None = None  # `ftslurm.core.recovery.Source`; a launcher's: left out
    # the lost node's role as its last lease said (`NodeRole`): a training node, or a spare
    # still waiting (idle or warm), whose loss restarts no one; None: a job without spares,
    # or an older writer
    role: str | None = None


class RoundRecord(Report):
    """`recovery/round-<r>.json`: in-job round `round` (the ranks restarted inside the
    allocation), written when its ranks start and again at their first step."""

    round: int | None = None
    started_at: float | None = None
    first_step_at: float | None = None
    step: int | None = None
    world_size: int | None = None
    nnodes_active: int | None = None
    spares_left: int | None = None
    why: str | None = None
    lost: Strs = []
    job_id: JobId = None
    attempt: int | None = None

    def at_first_step(self, at: float, step: int) -> RoundRecord:
        """This record again, with the time and step of the round's first reported step."""
        return self.model_copy(update={"first_step_at": at, "step": step})


class LiveRecovery(Report):
    """`recovery/live-<group>-<r>.json`: a live recovery, the running ranks kept
    (`RunDir.live_record`)."""

    round: int | None = None  # the live group's round formed after the fault
    failed_round: int | None = None
    why: str | None = None  # what failed, as the rank that declared it said
    detected_by: str | None = None  # "error": a collective raised; "restart": a rank came back
    failed_at: float | None = None  # when this rank saw the step fail (epoch seconds)
    formed_at: float | None = None  # the new group formed and the state handed over
    first_commit_at: float | None = None  # the first step committed after it
    step: int | None = None  # the step that runs again (one step redone)
    state_from: int | None = None  # the rank that sent the state; None: every rank held it
    senders: list[int] = []  # a sharded state's (`shards`): each part's sender, when several
    receivers: list[int] = []
    world_size: int | None = None
    job_id: JobId = None
    attempt: int | None = None

    took_over: int | None = None  # a warm spare's node took over this node rank's ranks
    standby: int | None = None  # this rank's crashed process was replaced by a warm standby
    # a rank gave live recovery up (`RunDir.live_given_up`): the fallback, today's path next
    given_up: str | None = None
    rank: int | None = None  # the rank that gave up
    # a launcher's fallback (`RunDir.live_fallback`): its node rank, and where the run goes
    # on ("new_job"; None: every rank restarted in the job)
    node_rank: int | None = None
    recovery: str | None = None

    def committed(self, at: float) -> LiveRecovery:
        """This record again, with the time of the first step committed after it."""
        return self.model_copy(update={"first_commit_at": at})


class TakeOver(Report):
    """`HeartbeatDir.takeover(local_rank)`, node-local: a warm spare's launcher hands one
    of its waiting ranks the rank of a lost or stepped-out node (its one writer)."""

    node_rank: int | None = None  # the node whose ranks are taken over
    rank: int | None = None  # the global rank this process becomes
    world_size: int | None = None
    group: str | None = None  # the live group's key prefix (`live_rules.Keys`)
    time: float | None = None
    # a warm standby of the node itself: the local rank whose place it takes (a crashed
    # rank's); None for a spare node's rank, which takes over `node_rank`'s
    local_rank: int | None = None


class Benched(Report):
    """`recovery/benched-<n>.json`: a node whose launcher stepped out so that a spare
    replaces it."""

    node_rank: int | None = None
    node: str | None = None
    why: str | None = None  # "hang", "straggler"
    reason: str | None = None
    time: float | None = None
    job_id: JobId = None
    attempt: int | None = None


class HangEvidence(str, Enum):
    """What a launcher saw of a rank it judged hung (`HangClaim.evidence`)."""

    # stopped or traced, or stuck in the kernel (uninterruptible) for the whole look: it
    # waits on no peer, so it is the hang the others' ranks wait on
    FROZEN = "frozen"
    # sleeping or running: it may be waiting in a collective on another node's hung rank
    RUNNING = "running"


class HangClaim(Report):
    """`attempts/<k>/hang-claim-<n>.json`: a launcher with spares found a rank of its node
    hung. A hung rank blocks its peers in their next collective, so their launchers judge a
    hang too: before any steps out they compare these (`spare_rules.hang_culprit`)."""

    node_rank: int | None = None
    node: str | None = None
    local_rank: int | None = None
    reason: str | None = None
    step: int | None = None
    evidence: str | None = None  # `HangEvidence`
    time: float | None = None
    job_id: JobId = None
    attempt: int | None = None


class LauncherFailed(Report):
    """`recovery/launcher-failed-<n>.json`: a launcher that failed before its ranks
    started."""

    node_rank: int | None = None
    node: str | None = None
    job_id: JobId = None
    attempt: int | None = None
    error: str | None = None
    phase: str | None = None  # "setup" or "rendezvous"
    exit_code: int | None = None
    time: float | None = None


class Unhealthy(Report):
    """`recovery/unhealthy-<n>.json`: a node whose launcher failed its pre-flight health
    check (`ftslurm.agent.health`) and left before the rendezvous."""

    node_rank: int | None = None
    node: str | None = None
    job_id: JobId = None
    attempt: int | None = None
    check: str | None = None  # the check that failed ("checkpoint_dir", "gpu", "site", ...)
    detail: str | None = None  # what it found, in words
    value: float | None = None  # what it measured
    floor: float | None = None  # the floor it missed
    benched: bool = False  # a spare takes its place in this job (it wrote `benched-<n>.json`)
    injected: str | None = None  # the `unhealthy` injection that failed it (its spec)
    time: float | None = None

    @property
    def words(self) -> str:
        """ "health check failed: disk: 12 MB free, below 256 MB" (a flag's reason)."""
        return f"health check failed: {self.check or '?'}: {self.detail or 'no detail'}"


class Progress(Report):
    """`progress.json`: the training's step and checkpoints (`ftslurm.agent.progress`)."""

    step: int | None = None
    checkpoint_step: int | None = None
    checkpoint_at: float | None = None
    checkpoint_path: str | None = None
    checkpoint_save_s: float | None = None
    checkpoint_write_s: float | None = None
    max_checkpoint_save_s: float | None = None
    max_checkpoint_write_s: float | None = None
    memory_step: int | None = None
    memory_save_s: float | None = None
    # the run's ranks recover live (`ftslurm.agent.live`: rank 0 formed a live group): the
    # daemon spaces disk checkpoints for the failures live recovery cannot serve
    live_recovery: bool | None = None
    finished: bool = False
    attempt: int | None = None
    updated_at: float | None = None


class StragglerScore(Report):
    rank: int | None = None
    node: str | None = None
    relative: float = 1.0
    individual: float = 1.0
    median_s: float | None = None


class StragglerReport(Report):
    """`stragglers/report.json`: the scores of the latest window
    (`ftslurm.agent.straggler`), read by the daemon and the launchers."""

    window_index: int | None = None
    attempt: int | None = None
    reference: str | None = None
    threshold: float | None = None
    scores: Annotated[list[StragglerScore], _items(StragglerScore)] = []
    stragglers: Annotated[list[StragglerScore], _items(StragglerScore)] = []
    persistent_nodes: Strs = []
    skipped_ranks: Ints = []
    updated_at: float | None = None


class StragglerWindow(Report):
    """`stragglers/rank-<r>.json`: the last window of step times a rank published (read by
    the launcher that scores them; it checks the values itself)."""

    rank: Any = None
    node: Any = None
    attempt: Any = None
    window_index: Any = None
    median_s: Any = None
    samples: Any = None


class StopRecord(Report):
    """`attempts/<k>/stopping-rank-<r>.json`: "saved step S, stopping", recorded by the rank
    agent before its teardown (`ftslurm.agent.rank`), read by the task wrapper and the
    launcher."""

    rank: int | None = None
    step: int | None = None
    outcome: str | None = None  # `Outcome.CHECKPOINTED` or `Outcome.FINISHED`
    pid: int | None = None
    time: float | None = None


class ResultVerdict(str, Enum):
    """The rank agent's verdict on a suspicious result (`ValidationEvent.verdict`;
    `ftslurm.agent.validation_rules` decides it, the daemon counts the transient ones)."""

    OK = "ok"  # nothing wrong (a sampled re-run, or a peer's suspicious result)
    RERUN = "rerun"  # not settled: re-run in place (again)
    TRANSIENT = "transient"  # the re-run differed and is sane: this rank's node computed wrong
    PERSISTENT = "persistent"  # reproduced on this hardware: checkpoint, exit 16
    MODEL = "model"  # a NaN/Inf reproduced on other hardware: exit 17
    CORRECT = "correct"  # a spike reproduced on other hardware: the model's own, accepted
    COUNTED = "counted"  # report_stats: counted, nothing done


class ValidationEvent(Report):
    """A suspicious result and what its re-runs made of it: an entry of
    `ValidationReport.events` (`ftslurm.agent.validation_rules` names the kinds, verdicts
    and actions; values as text: a NaN is no JSON number)."""

    step: int | None = None
    kind: str | None = None  # nan, inf, spike (the first result's); "sampled" in report_stats
    verdict: str | None = None  # transient, persistent, model, correct, counted, ok
    action: str | None = None  # what the group did: go_on, exit_16, exit_17
    value: str | None = None  # the first result
    rerun: str | None = None  # the last re-run's result
    reruns: int = 0
    differed: bool = False  # the re-run's result differed from the first
    time: float | None = None


class ValidationReport(Report):
    """`attempts/<k>/validation-rank-<r>.json`: a rank's result validation in an attempt
    (`ftslurm.agent.validation`), rewritten at each event."""

    rank: int | None = None
    node: str | None = None
    attempt: int | None = None
    job_id: JobId = None
    mode: str | None = None  # "enforce" or "report_stats"
    checks: int = 0  # results validated
    reruns: int = 0  # steps re-run in place
    differed: int = 0  # re-runs whose result differed from the first (non-determinism)
    events: Annotated[list[ValidationEvent], _items(ValidationEvent)] = []


class Rendezvous(Report):
    """`rendezvous-<restart>.json`: the endpoint the launcher of node rank 0 bound
    (`rendezvous_record`, `published_rendezvous`)."""

    host: str | None = None
    port: int | None = None
    id: str | None = None
    job_id: str | None = None  # as written: a number is another launch's
    step_id: str | None = None
    restart_count: int | None = None
    pid: int | None = None
    time: float | None = None


class Kind(Enum):
    """The reports `ftslurm.runfiles.read_reports` gathers: (the folder of `RunDir` they
    live in, their file pattern, their model)."""

    RANK = ("attempt", RANK_REPORTS, RankReport)
    NODE = ("attempt", NODE_REPORTS, NodeReport)
    HUNG_NODE = ("attempt", HUNG_NODE_REPORTS, HungNodeReport)
    HANG_CLAIM = ("attempt", HANG_CLAIMS, HangClaim)
    PEER_LOST = ("recovery", PEER_LOST_REPORTS, PeerLost)
    ROUND = ("recovery", ROUND_RECORDS, RoundRecord)
    BENCHED = ("recovery", BENCHED_RECORDS, Benched)
    LAUNCHER_FAILED = ("recovery", LAUNCHER_FAILED_REPORTS, LauncherFailed)
    LIVE = ("recovery", LIVE_RECORDS, LiveRecovery)
    UNHEALTHY = ("recovery", UNHEALTHY_REPORTS, Unhealthy)
    STRAGGLER_WINDOW = ("stragglers", RANK_REPORTS, StragglerWindow)
    VALIDATION = ("attempt", VALIDATION_REPORTS, ValidationReport)

    @property
    def folder(self) -> str:
        return self.value[0]

    @property
    def pattern(self) -> str:
        return self.value[1]

    @property
    def model(self) -> type[Report]:
        return self.value[2]


# The keys only these files have: a string spelling one of them as a key (`x["k"]`,
# `x.get("k")`) outside the contract reads a report as a dict again (the architecture test).
REPORT_ONLY_KEYS = frozenset(
    {
        "lost_node_rank",
        "lost_node",
        "lease_time",
        "reported_by_node_rank",
        "first_step_at",
        "first_commit_at",
        "state_from",
        "nnodes_active",
        "spares_left",
        "error_tail",
        "error_line",
        "saved_step",
        "disk_full_path",
        "teardown_failures",
        "peers_lost",
        "spare_swaps",
        "max_restarts",
        "checkpoint_step",
        "checkpoint_at",
        "max_checkpoint_save_s",
        "max_checkpoint_write_s",
        "checkpoint_save_s",
        "persistent_nodes",
        "skipped_ranks",
        "outcome",
    }
)
