"""The daemon's decisions, as pure functions of what it observed (no I/O, no clock).

How an attempt ended (`Ending`) -> what it means (`classify` -> `Cause`) -> what to do
about it (`decide` -> `Decision`). Also: which nodes to keep out (`plan_exclusions`),
when to send the checkpoint signal (`signal_due`, `checkpoint_lead`) and how long to
sleep before the next look (`next_poll_interval`). docs/policy.md is the table in words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from ftslurm.core.contract import NAMED_EXITS, Disambiguation, ExitCode
from ftslurm.core.contract.reports import (
    CLEAN,
    OUT_OF_TRAINING,
    SAVED,
    Outcome,
    ResultVerdict,
    StragglerReport,
    ValidationReport,
    parse,
)
from ftslurm.core.recovery import Recovery, recovery
from ftslurm.core.settings import (
    RETRYABLE,
    Cause,
    FtSettings,
    straggler_move_threshold,
)
from ftslurm.core.types import JobState


@dataclass(frozen=True)
class Ending:
    """What the daemon knows about one attempt that is over."""

    state: JobState  # Slurm's verdict; PENDING/REQUEUED when Slurm requeued the job itself
    exit_code: int | None = None
    signal: int | None = None
    requeued_by_scheduler: bool = False
    nodes: tuple[str, ...] = ()
    down_nodes: tuple[str, ...] = ()  # nodes of the allocation that are not usable now
    rank_outcomes: tuple[str, ...] = ()  # from the task wrappers' reports (agent.task)
    checkpoint_signal_sent: bool = False  # by the daemon, for this attempt
    checkpoint_advanced: bool = False  # the run's checkpoint step moved during this attempt
    finished_marker: bool = False  # the training wrote FINISHED
    suspect_node: str | None = None  # named with exit 16
    # Enough usable nodes outside the attempt's allocation to place the job again
    # (`room_elsewhere`): a re-run on other hardware after exit 16 is possible.
    elsewhere: bool = True
    # A rank the launchers found hung when the job was told to stop ("rank 1 (node n2) hung
    # in section 'step': ..."), empty when none was.
    hung: str = ""
    checkpoints_known: bool = False  # the run reports its checkpoints (ftslurm.agent.progress)
    checkpoint_signal_at: float | None = None  # when the daemon sent it (unix time)
    checkpoint_after_signal: bool = False  # a checkpoint was reported after the signal
    heartbeats: bool = True  # False: the ranks wrote no heartbeats (no rank agent)
    disk_full_at: str | None = None  # "NODE at PATH" of a rank that died of ENOSPC
    # The checkpoint signal ("USR2") held back from ranks none of whose processes catch it
    # (a plain script, `ftslurm.agent.task`): the wall limit ended them instead.
    signal_withheld: str | None = None
    # what the first rank to fail said, in one line of its stderr ("rank 0 (n1):
    # ModuleNotFoundError: No module named 'foo'"), empty when none did
    error: str = ""
    # The last line of the first user error a rank reported ("ftslurm: cannot start 'X':
    # Permission denied", "python: can't open file 'X': [Errno 2] ..."), "" when none did.
    error_line: str = ""


def classify(e: Ending, settings: FtSettings) -> Cause:
    """What an ending means, in this order: the training's own FINISHED marker; Slurm's
    verdicts that leave no doubt (cancelled, node failure, boot failure, deadline); what
    the job said about itself (its wrappers' and launchers' outcomes); a clean ending; a
    node of the allocation found down; the exit status; then Slurm's state."""
    outcomes = set(e.rank_outcomes)
    code = e.exit_code
    if e.finished_marker:
        return Cause.FINISHED
    if e.state is JobState.CANCELLED:
        return Cause.CANCELLED
    if e.state is JobState.NODE_FAIL:
        return Cause.NODE_FAIL
    if e.state is JobState.BOOT_FAIL:
        return Cause.BOOT_FAIL
    if e.state is JobState.DEADLINE:
        return Cause.DEADLINE
    said = set(outcomes)
    said |= {name for name, c in _NAMED_CODES.items() if code == c}
    if code is not None and code in settings.user_error_exit_codes:
        said.add(Outcome.USER_ERROR)
    for outcome, cause in _SAID_BY_THE_JOB:  # in this order of precedence
        if outcome in said:
            return cause
    if e.state is JobState.TIMEOUT and not e.down_nodes:
        if e.hung:  # it sat hung until the wall limit: not a checkpointed ending
            return Cause.HANG
        if e.checkpoints_known:  # only a checkpoint newer than the start counts
            return Cause.CHECKPOINTED if e.checkpoint_advanced else Cause.TIMEOUT
    killed = e.signal is not None and e.signal != 0
    # "teardown_failed": a rank recorded its save and stop, then died tearing down. With
    # every other rank and node saying checkpointed, the save stands whatever Slurm's exit
    # code says (the abort's 134, say); next to a rank that failed first it is a crash.
    # A node that never trained ("spare") or stepped out for a spare ("benched") says
    # nothing of how the training ended.
    clean = bool(outcomes) and outcomes <= {*CLEAN, *OUT_OF_TRAINING}
    saved = bool(outcomes & SAVED)
    checkpointed = (
        (saved and clean)
        or code == ExitCode.CONTINUE
        or (not outcomes and e.checkpoint_signal_sent and code == 0 and not killed)
    )
    if e.state is JobState.COMPLETED:
        return Cause.CHECKPOINTED if checkpointed else Cause.FINISHED
    if checkpointed and not e.down_nodes:
        return Cause.CHECKPOINTED
    if e.down_nodes:
        return Cause.NODE_FAIL  # e.g. a FAILED job whose peer host died just before
    if e.state is JobState.OUT_OF_MEMORY:
        return Cause.OOM
    if e.state is JobState.TIMEOUT:
        # A script that does not handle the checkpoint signal was left to its wall limit on
        # purpose: it goes on from its own last checkpoint, a continuation.
        return Cause.CHECKPOINTED if e.checkpoint_advanced or e.signal_withheld else Cause.TIMEOUT
    if e.state is JobState.PREEMPTED or e.requeued_by_scheduler:
        return Cause.CHECKPOINTED if e.checkpoint_advanced else Cause.PREEMPTED
    return Cause.CRASH


_NAMED_CODES = {name: code for code, name in NAMED_EXITS.items()}
_SAID_BY_THE_JOB = (
    (Outcome.DO_NOT_RETRY, Cause.DO_NOT_RETRY),
    (Outcome.FAILED_VALIDATION, Cause.FAILED_VALIDATION),
    (Outcome.RESUME_ELSEWHERE, Cause.RESUME_ELSEWHERE),
    (Outcome.DISK_FULL, Cause.DISK_FULL),
    (Outcome.USER_ERROR, Cause.USER_ERROR),
    (Outcome.HUNG, Cause.HANG),
)


# The endings a failed rank's own words explain (its error line goes into the reason).
SAID_BY_A_RANK = frozenset(
    {
        Cause.USER_ERROR,
        Cause.CRASH,
        Cause.OOM,
        Cause.RESUME_ELSEWHERE,
        Cause.FAILED_VALIDATION,
        Cause.DO_NOT_RETRY,
    }
)


class Verdict(str, Enum):
    COMPLETE = "complete"
    CONTINUE = "continue"  # a new attempt that spends no failure budget
    RETRY = "retry"  # a new attempt that spends the failure budget
    FAIL = "fail"
    CANCEL = "cancel"


@dataclass(frozen=True)
class Budget:
    """The counters `decide` reads and returns updated (the run's, persisted)."""

    job_retries_used: int = 0
    cause_counts: dict[str, int] = field(default_factory=dict)
    continuations: int = 0
    stalled_continuations: int = 0


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    cause: Cause
    reason: str
    budget: Budget
    exclude: tuple[tuple[str, str], ...] = ()  # (node, why) to flag for later attempts
    # exit 16: the next attempt is a disambiguation run, on other nodes (a fresh job that
    # carries `Disambiguation`)
    disambiguate: bool = False
    # exit 17 after a disambiguation run: the result reproduced on other hardware, so the
    # nodes the run flagged for result validation were not at fault: unflag them
    clear_validation_flags: bool = False


def decide(
    cause: Cause, e: Ending, budget: Budget, settings: FtSettings, cancel_requested: bool = False
) -> Decision:
    """What to do after an attempt ended for `cause`, given what was spent so far. The
    reason names the hung rank, what the first failed rank said (the last line of its
    error, for the endings a rank's error explains), a checkpoint signal that was not
    acted on, and a run whose ranks wrote no heartbeats (its hangs are seen only by CPU
    idleness)."""
    d = _decide(cause, e, budget, settings, cancel_requested)
    notes = []
    if cause is Cause.HANG and e.hung:
        notes.append(e.hung)
    if cause in SAID_BY_A_RANK and e.error:
        notes.append(e.error)
    withheld = e.signal_withheld and e.state is JobState.TIMEOUT
    if withheld and cause in (Cause.CHECKPOINTED, Cause.TIMEOUT):
        notes.append(
            f"the script does not handle SIG{e.signal_withheld}: left to the wall "
            "limit, "
            + (
                "continued from its last checkpoint"
                if cause is Cause.CHECKPOINTED
                else "no checkpoint since the last"
            )
        )
    if (
        e.state is JobState.TIMEOUT
        and e.checkpoint_signal_at is not None
        and not withheld
        and e.checkpoints_known
        and not e.checkpoint_after_signal
    ):
        at = datetime.fromtimestamp(e.checkpoint_signal_at, timezone.utc)
        notes.append(
            f"checkpoint signal sent at {at:%Y-%m-%d %H:%M:%S} UTC, not acted on: "
            "no checkpoint after it"
        )
    if not e.heartbeats and settings.use_launcher:
        limit = settings.out_of_section_timeout
        notes.append(
            "the ranks wrote no heartbeats (no rank agent): hangs are detected only "
            + (f"by {limit:g}s without CPU use" if limit else "never (timeout off)")
        )
    if not notes:
        return d
    return replace(d, reason="; ".join([d.reason, *notes]))


def _stalled(e: Ending, budget: Budget) -> int:
    """Continuations in a row without checkpoint progress, this one included. A plain
    script (no rank agent: no heartbeats, no checkpoint reported) is not judged: the daemon
    cannot see its progress, and counting each continuation as stalled would end a long run
    after `max_stalled_continuations` wall limits however far it got. A run with the rank
    agent that reported no checkpoint yet is judged (its start may never reach one)."""
    if e.checkpoint_advanced:
        return 0
    seen = e.checkpoints_known or e.heartbeats
    return budget.stalled_continuations + (1 if seen else 0)


def _decide(
    cause: Cause, e: Ending, budget: Budget, settings: FtSettings, cancel_requested: bool
) -> Decision:
    if cause is Cause.FINISHED:
        return Decision(Verdict.COMPLETE, cause, "training finished", budget)
    if cancel_requested or cause is Cause.CANCELLED:
        why = "cancelled by the user" if cancel_requested else "cancelled outside ftslurm"
        return Decision(Verdict.CANCEL, cause, why, budget)
    if cause is Cause.CHECKPOINTED:
        stalled = _stalled(e, budget)
        if stalled >= settings.max_stalled_continuations:
            new = Budget(
                budget.job_retries_used, dict(budget.cause_counts), budget.continuations, stalled
            )
            return Decision(
                Verdict.FAIL, cause, f"no checkpoint progress over {stalled} continuations", new
            )
        new = Budget(
            budget.job_retries_used, dict(budget.cause_counts), budget.continuations + 1, stalled
        )
        return Decision(Verdict.CONTINUE, cause, "checkpointed: continuing", new)
    if cause is Cause.DISK_FULL:
        return Decision(
            Verdict.FAIL,
            cause,
            f"disk full on {e.disk_full_at or 'a node'}: free space and resubmit",
            budget,
        )
    if cause is Cause.USER_ERROR:
        return Decision(Verdict.FAIL, cause, user_error_reason(e), budget)
    if cause is Cause.FAILED_VALIDATION and disambiguated(budget):
        return Decision(Verdict.FAIL, cause, REPRODUCED, budget, clear_validation_flags=True)
    if cause is Cause.UNHEALTHY:
        return _unhealthy(e, budget, settings)
    if cause not in RETRYABLE:
        return Decision(Verdict.FAIL, cause, _NO_RETRY[cause], budget)
    exclude = _exclusions(cause, e, settings)
    validating = cause is Cause.RESUME_ELSEWHERE and settings.exclude_failed_nodes
    if validating and not e.elsewhere:
        return Decision(Verdict.FAIL, cause, NOWHERE_ELSE, budget, exclude)
    if validating and not disambiguated(budget):  # the first one is free
        counts = {**budget.cause_counts, cause.value: 1}
        new = replace(budget, cause_counts=counts)
        return Decision(Verdict.CONTINUE, cause, FIRST_DISAMBIGUATION, new, exclude, True)
    used, cap = budget.job_retries_used, settings.num_job_retries_on_failure
    if used >= cap:
        return Decision(
            Verdict.FAIL,
            cause,
            f"retry budget exhausted ({used}/{cap}); last ending: {cause.value}",
            budget,
            exclude,
        )
    spent = budget.cause_counts.get(cause.value, 0)
    free = 1 if validating else 0  # the first disambiguation is counted, not charged
    cause_cap = settings.cause_budgets.get(cause)
    if cause_cap is not None and spent - free >= cause_cap:
        return Decision(
            Verdict.FAIL,
            cause,
            f"retry budget for {cause.value} exhausted ({spent - free}/{cause_cap})",
            budget,
            exclude,
        )
    counts = dict(budget.cause_counts)
    counts[cause.value] = spent + 1
    stalled = 0 if e.checkpoint_advanced else budget.stalled_continuations
    new = Budget(used + 1, counts, budget.continuations, stalled)
    reason = f"{cause.value}: retry {used + 1}/{cap}"
    if validating:
        reason += f"; {DISAMBIGUATION_RUN}"
    return Decision(Verdict.RETRY, cause, reason, new, exclude, validating)


def _unhealthy(e: Ending, budget: Budget, settings: FtSettings) -> Decision:
    """A node failed its pre-flight health check and no spare took its place: the attempt
    ended before any training, the node is flagged. The run goes on in a job without it and
    spends no failure budget (a CONTINUE, counted under `unhealthy`), as a node the checks
    caught costs the run nothing it could save by giving up. It is charged as a node
    failure (a retry) when the node cannot be kept out (`exclude_failed_nodes` off, or the
    node failed again while flagged: `e.elsewhere` False), or once the run's
    `cause_budgets["unhealthy"]` is spent: so a check that fails everywhere (a shared
    file system down) ends the run after the retry budget, not never."""
    spent = budget.cause_counts.get(Cause.UNHEALTHY.value, 0)
    cap = settings.cause_budgets.get(Cause.UNHEALTHY)
    if settings.exclude_failed_nodes and e.elsewhere and (cap is None or spent < cap):
        counts = {**budget.cause_counts, Cause.UNHEALTHY.value: spent + 1}
        new = replace(budget, cause_counts=counts)
        return Decision(Verdict.CONTINUE, Cause.UNHEALTHY, UNHEALTHY_MOVE, new)
    used, retries = budget.job_retries_used, settings.num_job_retries_on_failure
    if used >= retries:
        return Decision(
            Verdict.FAIL,
            Cause.UNHEALTHY,
            f"retry budget exhausted ({used}/{retries}); last ending: {Cause.UNHEALTHY.value}",
            budget,
        )
    counts = {**budget.cause_counts, Cause.UNHEALTHY.value: spent + 1}
    new = Budget(used + 1, counts, budget.continuations, budget.stalled_continuations)
    return Decision(
        Verdict.RETRY, Cause.UNHEALTHY, f"{Cause.UNHEALTHY.value}: retry {used + 1}/{retries}", new
    )


UNHEALTHY_MOVE = (
    "a node failed its health check: flagged, the run goes on without it; no retry spent"
)


# Result validation (exit 16, then 17): the one place of its words and its flag's reason.
VALIDATION_FLAG = "result validation"  # the reason of a node flagged for exit 16 (a prefix)
DISAMBIGUATION_RUN = "disambiguation run on other nodes"
FIRST_DISAMBIGUATION = (
    f"resume_elsewhere (exit 16): the nodes flagged ({VALIDATION_FLAG}), a {DISAMBIGUATION_RUN}; "
    "no retry spent"
)
NOWHERE_ELSE = (
    "resume_elsewhere (exit 16): no other nodes to re-run on (too few usable nodes outside "
    "the attempt's), so the model's fault cannot be told from the machine's: not retried"
)
FLAKY = "transient result faults on its ranks"  # the rest of a flaky node's flag reason


def flaky_nodes(
    reports: Iterable[ValidationReport], settings: FtSettings, flagged: Iterable[str] = ()
) -> tuple[tuple[str, str], ...]:
    """The nodes to flag for the transient result faults the rank agents' re-runs found on
    them over the run's attempts (`reports`: every rank's, each attempt's): those with at
    least `transient_faults_to_flag`, left out those in `flagged` (the run flagged them for
    result validation already); (node, why), in name order."""
    after = settings.transient_faults_to_flag
    if after <= 0 or not settings.exclude_failed_nodes:
        return ()
    counts: dict[str, int] = {}
    for r in reports:
        if r.node is None:
            continue
        found = sum(1 for e in r.events if e.verdict == ResultVerdict.TRANSIENT.value)
        counts[r.node] = counts.get(r.node, 0) + found
    skip = set(flagged)
    return tuple(
        (node, f"{VALIDATION_FLAG}: {n} {FLAKY}")
        for node, n in sorted(counts.items())
        if n >= after and node not in skip
    )


REPRODUCED = (
    "the result reproduced on different hardware: the model's, not the machine's (exit 17); "
    "not retried"
)


def disambiguated(budget: Budget) -> bool:
    """Whether the run already had a disambiguation run (an exit 16 acted on)."""
    return budget.cause_counts.get(Cause.RESUME_ELSEWHERE.value, 0) > 0


def room_elsewhere(nodes: Iterable[str], usable_nodes: Iterable[str], nodes_needed: int) -> bool:
    """Whether the job can be placed again without any node of the attempt (`nodes`): at
    least `nodes_needed` usable nodes outside it. The attempt's nodes are flagged newest,
    so `plan_exclusions` keeps every one of them out exactly then."""
    return len(set(usable_nodes) - set(nodes)) >= nodes_needed


def disambiguation(
    previous_cause: str | None,
    previous_attempt: int,
    previous_nodes: Sequence[str],
    checkpoint_step: int | None,
    settings: FtSettings,
) -> Disambiguation | None:
    """The context the next attempt's job carries (`FTSLURM_DISAMBIGUATE`) when the attempt
    before it ended with exit 16 and the run re-runs elsewhere; else None."""
    if previous_cause != Cause.RESUME_ELSEWHERE.value or not settings.exclude_failed_nodes:
        return None
    return Disambiguation(
        attempt=previous_attempt, nodes=tuple(previous_nodes), step=checkpoint_step
    )


_NO_RETRY = {
    Cause.USER_ERROR: "user error: it would fail the same way again",
    Cause.FAILED_VALIDATION: "result validation failed (exit 17): not retried",
    Cause.DO_NOT_RETRY: "the job asked not to be retried (exit 93)",
    Cause.DEADLINE: "the job's deadline passed",
}


_CANNOT_START = re.compile(r"cannot start '(?P<path>.*)': (?P<why>.*)$")
_CANNOT_OPEN = re.compile(r"can't open file '(?P<path>.*)': \[Errno 2\]")


def user_error_reason(e: Ending) -> str:
    """Why a user error fails the run, in words: a command that is not found (exit 127, or
    python's "can't open file": a script deleted or moved since the submit) or cannot be
    executed (exit 126: not executable, no permission, not a program), naming the file the
    rank reported, else the rank's last error line."""
    line = " ".join(e.error_line.split())[:300]
    opened, started = _CANNOT_OPEN.search(line), _CANNOT_START.search(line)
    if opened:
        what = f"{opened['path']} not found (deleted or moved since the submit?)"
    elif e.exit_code == ExitCode.NOT_FOUND:
        what = f"{started['path']} not found" if started else "the command was not found"
        what += " (exit 127)"
    elif e.exit_code == ExitCode.CANNOT_EXECUTE:
        why = f": {started['why']}" if started else ""
        what = (
            f"{started['path'] if started else 'the command'} cannot be executed (exit "
            f"126{why}: not executable, no permission, or not a script or program)"
        )
    else:  # the rank's line itself, unless the rank's words follow as a note (`error`)
        what = "" if e.error else line
    return (
        f"user error: {what}: it would fail the same way again"
        if what
        else _NO_RETRY[Cause.USER_ERROR]
    )


def _exclusions(cause: Cause, e: Ending, settings: FtSettings) -> tuple[tuple[str, str], ...]:
    if not settings.exclude_failed_nodes:
        return ()
    if cause in (Cause.NODE_FAIL, Cause.BOOT_FAIL):
        nodes = e.down_nodes or (e.nodes if cause is Cause.BOOT_FAIL else ())
        return tuple((n, f"{cause.value} under the run") for n in nodes)
    if cause is Cause.RESUME_ELSEWHERE:  # every node of the attempt: a re-run elsewhere
        nodes = e.nodes or ((e.suspect_node,) if e.suspect_node else ())
        return tuple((n, f"{VALIDATION_FLAG} (exit 16)") for n in nodes)
    return ()


def straggler_flags(
    report: StragglerReport | Mapping[str, Any] | None,
    attempt: int,
    settings: FtSettings,
    already_flagged: Iterable[str],
) -> tuple[tuple[str, str], ...]:
    """The (node, why) pairs to flag from the straggler report of a running attempt: its
    persistent nodes (below the threshold for `straggler_windows` windows) not flagged yet.
    Nothing when straggler exclusion is off or the report is of another attempt."""
    report = parse(StragglerReport, report)
    if not (settings.exclude_stragglers or settings.stop_if_straggler) or report is None:
        return ()
    if report.attempt != attempt:
        return ()
    flagged = set(already_flagged)
    worst = straggler_scores(report)
    found = []
    for node in report.persistent_nodes:
        if node not in flagged:
            score = f"score {worst[node]:.2f} " if node in worst else ""
            found.append(
                (
                    node,
                    f"straggler: {score}below {report.threshold} for "
                    f"{settings.straggler_windows} windows",
                )
            )
    return tuple(found)


def straggler_scores(report: StragglerReport | Mapping[str, Any] | None) -> dict[str, float]:
    """Each node's worst score (the lower of relative and individual, over its ranks) in
    the straggler report's latest window; a node the report does not score is absent."""
    report = parse(StragglerReport, report)
    worst: dict[str, float] = {}
    for s in report.scores if report is not None else ():
        if s.node is not None:
            score = min(s.relative, s.individual)
            worst[s.node] = min(score, worst.get(s.node, 1.0))
    return worst


def spares_take_stragglers(
    stragglers: Iterable[str], allocation: Sequence[str], gone: Iterable[int], spare_nodes: int
) -> bool:
    """Whether spares take the places of persistent straggler nodes just flagged, inside
    the job (their launchers step out, `ftslurm.agent.spares`), so the job is not moved:
    `ftslurm.core.recovery.recovery` of the node ranks lost or benched in the attempt
    (`gone`) plus the stragglers' (their places in `allocation`) says SPARE. False without
    spares, or when a straggler is the batch host or more nodes would leave than there are
    spares: then the job moves as without spares (`straggler_move`)."""
    if spare_nodes <= 0:
        return False
    ranks = {allocation.index(n) for n in stragglers if n in allocation}
    return recovery({*gone, *ranks}, spare_nodes) is Recovery.SPARE


def straggler_move(
    new_flags: Iterable[str],
    allocation: Iterable[str],
    exclusions: Iterable[str],
    budget: Budget,
    settings: FtSettings,
    scores: Mapping[str, float] | None = None,
) -> Decision | None:
    """Whether to move a running attempt off straggler nodes just flagged: only with
    `stop_if_straggler`, when one of them is in the allocation AND will be excluded (never
    when the job could not be placed without it), and while the straggler budget lasts.
    The move spends no failure budget; each one excludes a node more, so they are few.
    `scores` (`straggler_scores`): a node the report scores at or above the move's bar
    (`straggler_move_threshold`: 0.75 unless the run sets a threshold) is flagged but not
    moved off: the milder slowdowns live recovery's threshold flags are worth a second's
    step-out to a warm spare, not a restart of the whole job; a node without a score is
    moved off as before."""
    if not settings.stop_if_straggler:
        return None
    bar = straggler_move_threshold(settings.straggler_threshold)
    slow = {n for n in new_flags if (scores or {}).get(n, 0.0) < bar}
    moving = sorted(slow & set(allocation) & set(exclusions))
    if not moving:
        return None
    spent = budget.cause_counts.get(Cause.STRAGGLER.value, 0)
    cap = settings.cause_budgets.get(Cause.STRAGGLER)
    if cap is not None and spent >= cap:
        return None
    counts = {**budget.cause_counts, Cause.STRAGGLER.value: spent + 1}
    new = Budget(
        budget.job_retries_used, counts, budget.continuations, budget.stalled_continuations
    )
    return Decision(
        Verdict.CONTINUE, Cause.STRAGGLER, f"moved off straggler node(s) {', '.join(moving)}", new
    )


def flag_ttl(
    previous: tuple[float, float | None] | None, now: float, settings: FtSettings
) -> float | None:
    """How long a new flag on a node lasts, given its previous flag (since, expires_at) if it
    had one. A first flag, or one after the node behaved for `node_exclusion_max_ttl_s`
    since its last flag ran out, gets `node_exclusion_ttl_s`. A node flagged again sooner
    (a healthy node fails about once in 250 node-years: twice within a week marks a lemon)
    gets twice its last TTL, at most `node_exclusion_max_ttl_s`. A flag without expiry
    (`ftslurm nodes add` without one) stays without expiry (None)."""
    base = settings.node_exclusion_ttl_s
    cap = max(base, settings.node_exclusion_max_ttl_s)
    if previous is None:
        return base
    since, expires_at = previous
    if expires_at is None:
        return None
    last = max(expires_at - since, base)
    if now - expires_at < cap:
        return min(2 * last, cap)
    return base


def plan_exclusions(
    flagged: Sequence[str], usable_nodes: Iterable[str], nodes_needed: int
) -> tuple[str, ...]:
    """The nodes to pass as `--exclude`: every flagged node, most recent flags first, but
    never so many that fewer than `nodes_needed` usable nodes remain to place the job."""
    usable = set(usable_nodes)
    spare = len(usable) - nodes_needed
    chosen: list[str] = []
    for node in flagged:  # newest first
        if node in chosen:
            continue
        if node in usable:
            if spare <= 0:
                continue
            spare -= 1
        chosen.append(node)
    return tuple(sorted(chosen))


def checkpoint_lead(preempt_time: float, max_save_s: float | None) -> tuple[float, str | None]:
    """Seconds before the wall limit to send the checkpoint signal. A save measured longer
    than the lead allows stretches it (twice the save, plus a margin) with a warning."""
    if max_save_s is None or 2 * max_save_s + 5 <= preempt_time:
        return float(preempt_time), None
    lead = 2 * max_save_s + 5
    return lead, (
        f"checkpoint saves take up to {max_save_s:.0f}s: preempt_time "
        f"{preempt_time}s is too short, signalling {lead:.0f}s before the limit"
    )


def signal_due(start: float | None, time_limit_s: float | None, lead_s: float, now: float) -> bool:
    """Whether the checkpoint signal is due for an attempt running since `start`."""
    if start is None or time_limit_s is None:
        return False
    return now >= start + time_limit_s - lead_s


def straggler_look_again(settings: FtSettings, now: float) -> float | None:
    """When the daemon should read a running attempt's straggler report again: once per
    report interval while the run acts on stragglers, so a persistent straggler is moved off
    (or flagged) within about one interval rather than one back-off period (up to 60 s)."""
    if not settings.use_launcher or not (settings.exclude_stragglers or settings.stop_if_straggler):
        return None
    return now + settings.straggler_report_interval_s


def next_poll_interval(
    now: float,
    *,
    last_change: float | None,
    deadlines: Iterable[float],
    previous: float,
    min_job_age_s: float,
    floor: float = 1.0,
    ceiling: float = 60.0,
) -> float:
    """How long to wait before the next look: short right after a change (a submission, a
    state change), up to the next deadline (a signal to send), otherwise backing off
    geometrically to `ceiling`, and always well under MinJobAge so no ending is missed."""
    cap = max(floor, min(ceiling, min_job_age_s / 3))
    if last_change is not None and now - last_change < 30:
        interval = floor
    else:
        interval = min(cap, max(floor, previous * 2))
    for deadline in deadlines:
        if deadline > now:
            interval = min(interval, max(0.2, deadline - now))
        else:
            interval = min(interval, 0.2)
    return interval
