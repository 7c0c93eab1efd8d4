"""The daemon's pure decisions (ftslurm.daemon.policy): tables, properties, edge cases.

docs/policy.md describes the same behaviour in words; the tables here are its source.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ftslurm.core.contract import Disambiguation
from ftslurm.core.settings import RECOVERY_SECTION
from ftslurm.core.types import JobState
from ftslurm.daemon.policy import (
    RETRYABLE,
    Budget,
    Cause,
    Decision,
    Ending,
    FtSettings,
    Verdict,
    checkpoint_lead,
    classify,
    decide,
    disambiguation,
    flag_ttl,
    next_poll_interval,
    plan_exclusions,
    room_elsewhere,
    signal_due,
    spares_take_stragglers,
    straggler_flags,
    straggler_look_again,
    straggler_move,
)

DEFAULT = FtSettings()
TERMINAL = frozenset({Verdict.COMPLETE, Verdict.FAIL, Verdict.CANCEL})
C, J = Cause, JobState


HUNG = "rank 1 (node n2) hung in section 'step' when the job was told to stop: no sign of life"


def E(state: JobState = J.FAILED, code: int | None = None, **kw) -> Ending:
    return Ending(state=state, exit_code=code, **kw)


# ---------------------------------------------------------------------------------- classify
@pytest.mark.parametrize(
    "state, code, other",
    [
        (J.COMPLETED, 0, "spare"),  # every node exits 0: a checkpointed continuation
        (J.COMPLETED, 0, "benched"),
        (J.FAILED, 134, "spare"),  # a teardown abort after the save
        (J.FAILED, 134, "benched"),
    ],
)
def test_a_spare_never_needed_or_a_benched_node_leaves_a_clean_ending_clean(state, code, other):
    """The launcher of a node that did not train at the end says "spare" or "benched":
    beside the nodes that checkpointed, the ending is still a checkpoint, not a finish or
    a crash."""
    e = E(state, code, rank_outcomes=("checkpointed", "teardown_failed", other))
    assert classify(e, DEFAULT) is C.CHECKPOINTED
    assert classify(E(state, code, rank_outcomes=("failed", other)), DEFAULT) is not C.CHECKPOINTED


def test_the_outcomes_out_of_training_are_the_launchers_words():
    from ftslurm.agent import spares
    from ftslurm.daemon.policy import OUT_OF_TRAINING

    assert OUT_OF_TRAINING == {spares.SPARE, spares.BENCHED}


CLASSIFY_ROWS = [
    # The FINISHED marker overrides everything else.
    ("marker/completed", E(J.COMPLETED, 0, finished_marker=True), {}, C.FINISHED),
    ("marker/beats-cancelled", E(J.CANCELLED, 0, finished_marker=True), {}, C.FINISHED),
    (
        "marker/beats-node-fail",
        E(J.NODE_FAIL, finished_marker=True, down_nodes=("n1",)),
        {},
        C.FINISHED,
    ),
    ("marker/beats-exit-93", E(J.FAILED, 93, finished_marker=True), {}, C.FINISHED),
    (
        "marker/beats-user-error",
        E(J.FAILED, 1, rank_outcomes=("user_error",), finished_marker=True),
        {},
        C.FINISHED,
    ),
    (
        "marker/beats-checkpointed",
        E(J.TIMEOUT, 0, rank_outcomes=("checkpointed",), finished_marker=True),
        {},
        C.FINISHED,
    ),
    # Cancelled comes next, before any hardware verdict.
    ("cancelled", E(J.CANCELLED, 0, signal=15), {}, C.CANCELLED),
    ("cancelled/with-down-node", E(J.CANCELLED, 0, down_nodes=("n1",)), {}, C.CANCELLED),
    ("cancelled/with-exit-93", E(J.CANCELLED, 93), {}, C.CANCELLED),
    # Slurm's verdict about the hardware, then the nodes that are not usable any more.
    ("node-fail", E(J.NODE_FAIL, 0, nodes=("n1", "n2")), {}, C.NODE_FAIL),
    ("node-fail/with-exit-93", E(J.NODE_FAIL, 93), {}, C.NODE_FAIL),
    (
        "failed/with-down-nodes",
        E(J.FAILED, 1, nodes=("n1", "n2"), down_nodes=("n2",)),
        {},
        C.NODE_FAIL,
    ),
    ("failed/exit-17-with-down-node", E(J.FAILED, 17, down_nodes=("n2",)), {}, C.FAILED_VALIDATION),
    (
        "completed/checkpointed-with-down-node",
        E(J.COMPLETED, 0, down_nodes=("n2",), rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    ("timeout/with-down-node", E(J.TIMEOUT, 0, down_nodes=("n1",)), {}, C.NODE_FAIL),
    ("boot-fail", E(J.BOOT_FAIL, nodes=("n1", "n2")), {}, C.BOOT_FAIL),
    ("boot-fail/with-down-node", E(J.BOOT_FAIL, down_nodes=("n1",)), {}, C.BOOT_FAIL),
    ("deadline", E(J.DEADLINE, 0), {}, C.DEADLINE),
    (
        "deadline/checkpointed",
        E(J.DEADLINE, 0, rank_outcomes=("checkpointed",), checkpoint_advanced=True),
        {},
        C.DEADLINE,
    ),
    ("deadline/exit-93", E(J.DEADLINE, 93), {}, C.DEADLINE),
    # What the job said about itself: 93, then 17, then 16, then user errors.
    ("failed/exit-93", E(J.FAILED, 93), {}, C.DO_NOT_RETRY),
    (
        "outcome/do-not-retry",
        E(J.FAILED, 1, rank_outcomes=("killed", "do_not_retry")),
        {},
        C.DO_NOT_RETRY,
    ),
    (
        "exit-93/beats-validation-outcome",
        E(J.FAILED, 93, rank_outcomes=("failed_validation",)),
        {},
        C.DO_NOT_RETRY,
    ),
    (
        "exit-93/beats-checkpointed-outcome",
        E(J.FAILED, 93, rank_outcomes=("checkpointed",)),
        {},
        C.DO_NOT_RETRY,
    ),
    ("failed/exit-17", E(J.FAILED, 17), {}, C.FAILED_VALIDATION),
    (
        "outcome/failed-validation",
        E(J.FAILED, 1, rank_outcomes=("failed_validation",)),
        {},
        C.FAILED_VALIDATION,
    ),
    (
        "exit-17/beats-exit-16-outcome",
        E(J.FAILED, 17, rank_outcomes=("resume_elsewhere",)),
        {},
        C.FAILED_VALIDATION,
    ),
    ("failed/exit-16", E(J.FAILED, 16), {}, C.RESUME_ELSEWHERE),
    (
        "outcome/resume-elsewhere",
        E(J.FAILED, 1, rank_outcomes=("resume_elsewhere", "killed")),
        {},
        C.RESUME_ELSEWHERE,
    ),
    ("preempted/exit-16", E(J.PREEMPTED, 16), {}, C.RESUME_ELSEWHERE),
    ("outcome/user-error", E(J.FAILED, 1, rank_outcomes=("user_error",)), {}, C.USER_ERROR),
    # A rank that recorded its save and then died tearing down (exit 134 from the abort):
    # the node reports and the ranks say checkpointed, Slurm says FAILED; the save stands.
    (
        "teardown/abort-after-save",
        E(J.FAILED, 134, rank_outcomes=("checkpointed", "teardown_failed", "checkpointed")),
        {},
        C.CHECKPOINTED,
    ),
    (
        "teardown/every-rank-aborted",
        E(J.FAILED, 134, signal=6, rank_outcomes=("teardown_failed", "teardown_failed")),
        {},
        C.CHECKPOINTED,
    ),
    (
        "teardown/node-fail-still-wins",
        E(J.NODE_FAIL, rank_outcomes=("teardown_failed",)),
        {},
        C.NODE_FAIL,
    ),
    # ... but a rank that died before recording its save makes it a crash
    (
        "teardown/one-rank-died-before-its-save",
        E(J.FAILED, 134, rank_outcomes=("teardown_failed", "killed", "failed")),
        {},
        C.CRASH,
    ),
    # ENOSPC: its own cause, whatever else the ranks said
    (
        "outcome/disk-full",
        E(J.FAILED, 1, rank_outcomes=("disk_full", "killed"), disk_full_at="n2 at /ckpt"),
        {},
        C.DISK_FULL,
    ),
    (
        "outcome/disk-full-beats-checkpointed",
        E(J.FAILED, 1, rank_outcomes=("checkpointed", "disk_full")),
        {},
        C.DISK_FULL,
    ),
    (
        "outcome/disk-full-beats-user-error",
        E(J.FAILED, 1, rank_outcomes=("user_error", "disk_full")),
        {},
        C.DISK_FULL,
    ),
    # in-job restarts used up on hangs: a hang, not a crash
    (
        "outcome/restarts-used-up-on-hangs",
        E(J.FAILED, 74, rank_outcomes=("hung", "failed")),
        {},
        C.HANG,
    ),
    (
        "outcome/user-error-beats-hung",
        E(J.FAILED, 1, rank_outcomes=("user_error", "hung")),
        {},
        C.USER_ERROR,
    ),
    (
        "outcome/do-not-retry-beats-disk-full",
        E(J.FAILED, 93, rank_outcomes=("disk_full",)),
        {},
        C.DO_NOT_RETRY,
    ),
    (
        "outcome/user-error-beats-checkpointed",
        E(J.TIMEOUT, 0, rank_outcomes=("checkpointed", "user_error")),
        {},
        C.USER_ERROR,
    ),
    (
        "exit-2/configured-user-error",
        E(J.FAILED, 2),
        {"user_error_exit_codes": (2, 3)},
        C.USER_ERROR,
    ),
    ("exit-2/not-configured", E(J.FAILED, 2), {}, C.CRASH),
    (
        "exit-16/with-user-error-codes",
        E(J.FAILED, 16),
        {"user_error_exit_codes": (2,)},
        C.RESUME_ELSEWHERE,
    ),
    ("exit-0/never-a-user-error", E(J.COMPLETED, 0), {"user_error_exit_codes": (2,)}, C.FINISHED),
    ("launcher/continue-code", E(J.FAILED, 75), {}, C.CHECKPOINTED),
    ("launcher/restarts-exhausted", E(J.FAILED, 74), {}, C.CRASH),
    # COMPLETED: finished, unless it exited after the checkpoint signal.
    ("completed", E(J.COMPLETED, 0), {}, C.FINISHED),
    (
        "completed/outcomes-finished",
        E(J.COMPLETED, 0, rank_outcomes=("finished", "finished")),
        {},
        C.FINISHED,
    ),
    (
        "completed/after-signal-no-reports",
        E(J.COMPLETED, 0, checkpoint_signal_sent=True),
        {},
        C.CHECKPOINTED,
    ),
    (
        "completed/after-signal-reports-finished",
        E(J.COMPLETED, 0, checkpoint_signal_sent=True, rank_outcomes=("finished",)),
        {},
        C.FINISHED,
    ),
    (
        "completed/after-signal-exit-unknown",
        E(J.COMPLETED, None, checkpoint_signal_sent=True),
        {},
        C.FINISHED,
    ),
    (
        "completed/checkpointed-outcome",
        E(J.COMPLETED, 0, rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    # OUT_OF_MEMORY: retried, whatever the ranks saved.
    ("oom", E(J.OUT_OF_MEMORY, 0, signal=9), {}, C.OOM),
    (
        "oom/checkpointed-outcome",
        E(J.OUT_OF_MEMORY, 0, rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    (
        "oom/one-rank-failed",
        E(J.OUT_OF_MEMORY, 0, rank_outcomes=("checkpointed", "killed")),
        {},
        C.OOM,
    ),
    # TIMEOUT: continued when it checkpointed (or its checkpoint step moved).
    ("timeout", E(J.TIMEOUT, 0, signal=15), {}, C.TIMEOUT),
    (
        "timeout/after-signal-no-reports",
        E(J.TIMEOUT, 0, checkpoint_signal_sent=True),
        {},
        C.CHECKPOINTED,
    ),
    ("timeout/after-signal-exit-1", E(J.TIMEOUT, 1, checkpoint_signal_sent=True), {}, C.TIMEOUT),
    (
        "timeout/checkpointed-outcome",
        E(J.TIMEOUT, 0, rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    (
        "timeout/checkpoint-advanced",
        E(J.TIMEOUT, None, checkpoint_advanced=True),
        {},
        C.CHECKPOINTED,
    ),
    (
        "timeout/killed-outcome",
        E(J.TIMEOUT, 0, checkpoint_signal_sent=True, rank_outcomes=("killed",)),
        {},
        C.TIMEOUT,
    ),
    # ... but not when a rank sat hung until the wall limit, nor, when the run reports its
    # checkpoints, without a checkpoint newer than the one the attempt started from.
    (
        "timeout/hung-at-the-wall-limit",
        E(J.TIMEOUT, 0, checkpoint_advanced=True, checkpoints_known=True, hung=HUNG),
        {},
        C.HANG,
    ),
    (
        "timeout/hung-beats-checkpointed-outcome",
        E(J.TIMEOUT, 75, hung=HUNG, rank_outcomes=("checkpointed",)),
        {},
        C.HANG,
    ),
    (
        "timeout/hung-with-down-node",
        E(J.TIMEOUT, 0, hung=HUNG, down_nodes=("n1",)),
        {},
        C.NODE_FAIL,
    ),
    (
        "timeout/no-new-checkpoint",
        E(J.TIMEOUT, 0, rank_outcomes=("checkpointed",), checkpoints_known=True),
        {},
        C.TIMEOUT,
    ),
    (
        "timeout/no-new-checkpoint-after-signal",
        E(J.TIMEOUT, 0, checkpoint_signal_sent=True, checkpoints_known=True),
        {},
        C.TIMEOUT,
    ),
    (
        "timeout/new-checkpoint-signal-ignored",
        E(
            J.TIMEOUT,
            0,
            checkpoint_signal_sent=True,
            checkpoint_signal_at=1000.0,
            checkpoints_known=True,
            checkpoint_advanced=True,
        ),
        {},
        C.CHECKPOINTED,
    ),
    (
        "completed/hung-at-stop-but-saved",
        E(J.COMPLETED, 0, hung=HUNG, rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    # The checkpoint signal withheld from a script that does not catch it: the wall limit
    # ended it on purpose, a continuation from its own last checkpoint (a plain script that
    # reports none); a run that reports its checkpoints still needs a new one (6b).
    (
        "timeout/signal-withheld",
        E(
            J.TIMEOUT,
            None,
            signal=9,
            rank_outcomes=("killed",),
            checkpoint_signal_sent=True,
            signal_withheld="USR2",
        ),
        {},
        C.CHECKPOINTED,
    ),
    (
        "timeout/signal-withheld-no-new-checkpoint",
        E(J.TIMEOUT, None, checkpoints_known=True, signal_withheld="USR2"),
        {},
        C.TIMEOUT,
    ),
    (
        "failed/signal-withheld-is-still-a-crash",
        E(J.FAILED, 1, rank_outcomes=("failed",), signal_withheld="USR2"),
        {},
        C.CRASH,
    ),
    # PREEMPTED, or requeued by Slurm itself: continued only with a "checkpointed" report.
    ("preempted", E(J.PREEMPTED, 0), {}, C.PREEMPTED),
    (
        "preempted/checkpointed-outcome",
        E(J.PREEMPTED, 0, rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    (
        "preempted/checkpoint-advanced-only",
        E(J.PREEMPTED, 0, checkpoint_advanced=True),
        {},
        C.CHECKPOINTED,
    ),
    (
        "preempted/after-signal-no-reports",
        E(J.PREEMPTED, 0, checkpoint_signal_sent=True),
        {},
        C.CHECKPOINTED,
    ),
    ("requeued-by-scheduler", E(J.PENDING, None, requeued_by_scheduler=True), {}, C.PREEMPTED),
    (
        "requeued-by-scheduler/checkpointed",
        E(J.REQUEUED, None, requeued_by_scheduler=True, rank_outcomes=("checkpointed",)),
        {},
        C.CHECKPOINTED,
    ),
    (
        "requeued-by-scheduler/failed-state",
        E(J.FAILED, 1, requeued_by_scheduler=True),
        {},
        C.PREEMPTED,
    ),
    # Anything else is a crash.
    ("failed/exit-1", E(J.FAILED, 1), {}, C.CRASH),
    ("failed/exit-137", E(J.FAILED, 137), {}, C.CRASH),
    ("failed/killed-by-signal", E(J.FAILED, 0, signal=9, rank_outcomes=("killed",)), {}, C.CRASH),
    ("failed/exit-0", E(J.FAILED, 0), {}, C.CRASH),
    (
        "failed/checkpointed-outcome",
        E(J.FAILED, 1, rank_outcomes=("checkpointed", "failed")),
        {},
        C.CRASH,
    ),
]


@pytest.mark.parametrize(
    "ending,overrides,cause", [pytest.param(*row[1:], id=row[0]) for row in CLASSIFY_ROWS]
)
def test_classify(ending, overrides, cause):
    assert classify(ending, FtSettings(**overrides)) is cause


def test_classify_table_covers_every_ending_state():
    ended = {state for state in JobState if state.is_terminal}
    seen = {row[1].state for row in CLASSIFY_ROWS}
    assert ended <= seen
    # not endings Slurm or the ranks report: a move off a straggler, a node's failed health
    # check (the daemon's step reads its report)
    assert {row[3] for row in CLASSIFY_ROWS} == set(Cause) - {Cause.STRAGGLER, Cause.UNHEALTHY}
    assert len({row[0] for row in CLASSIFY_ROWS}) == len(CLASSIFY_ROWS)


def test_timeout_killed_by_signal_after_checkpoint_signal_is_not_a_checkpoint():
    e = E(J.TIMEOUT, 0, signal=9, checkpoint_signal_sent=True)
    assert classify(e, DEFAULT) is C.TIMEOUT


# ---------------------------------------------------------------------------------- decide


def B(
    used: int = 0, counts: dict[str, int] | None = None, cont: int = 0, stalled: int = 0
) -> Budget:
    return Budget(used, dict(counts or {}), cont, stalled)


V = Verdict
NODE_FAIL_E = E(J.NODE_FAIL, nodes=("n1", "n2"), down_nodes=("n2",))
CKPT = E(J.TIMEOUT, 0, rank_outcomes=("checkpointed",))
# the same with the run's checkpoints known (none newer: a stalled continuation)
CKPT_KNOWN = dataclasses.replace(CKPT, checkpoints_known=True)
CKPT_PROGRESS = E(J.TIMEOUT, 0, rank_outcomes=("checkpointed",), checkpoint_advanced=True)

# id, cause, ending, budget in, settings, cancel_requested -> verdict, reason words,
# budget out, exclusions
DECIDE_ROWS = [
    (
        "unhealthy/free",
        C.UNHEALTHY,
        E(J.NODE_FAIL),
        B(1, {"crash": 1}),
        {},
        False,
        V.CONTINUE,
        ["health check", "no retry spent"],
        B(1, {"crash": 1, "unhealthy": 1}),
        (),
    ),
    (
        "unhealthy/not-kept-out",
        C.UNHEALTHY,
        E(J.NODE_FAIL, elsewhere=False),
        B(),
        {},
        False,
        V.RETRY,
        ["unhealthy: retry 1/2"],
        B(1, {"unhealthy": 1}),
        (),
    ),
    (
        "finished",
        C.FINISHED,
        E(J.COMPLETED, 0),
        B(1, {"crash": 1}),
        {},
        False,
        V.COMPLETE,
        ["training finished"],
        B(1, {"crash": 1}),
        (),
    ),
    (
        "cancelled-outside",
        C.CANCELLED,
        E(J.CANCELLED),
        B(),
        {},
        False,
        V.CANCEL,
        ["cancelled outside ftslurm"],
        B(),
        (),
    ),
    (
        "cancel-requested/crash",
        C.CRASH,
        E(J.FAILED, 1),
        B(),
        {},
        True,
        V.CANCEL,
        ["cancelled by the user"],
        B(),
        (),
    ),
    (
        "cancel-requested/finished-wins",
        C.FINISHED,
        E(J.COMPLETED, 0),
        B(),
        {},
        True,
        V.COMPLETE,
        ["training finished"],
        B(),
        (),
    ),
    (
        "cancel-requested/checkpointed",
        C.CHECKPOINTED,
        CKPT,
        B(0, {}, 2, 1),
        {},
        True,
        V.CANCEL,
        ["cancelled by the user"],
        B(0, {}, 2, 1),
        (),
    ),
    (
        "cancel-requested/node-fail-no-exclusion",
        C.NODE_FAIL,
        NODE_FAIL_E,
        B(),
        {},
        True,
        V.CANCEL,
        ["cancelled by the user"],
        B(),
        (),
    ),
    (
        "user-error",
        C.USER_ERROR,
        E(J.FAILED, 1),
        B(),
        {},
        False,
        V.FAIL,
        ["user error", "fail the same way"],
        B(),
        (),
    ),
    (
        "exit-17",
        C.FAILED_VALIDATION,
        E(J.FAILED, 17),
        B(),
        {},
        False,
        V.FAIL,
        ["validation failed", "exit 17", "not retried"],
        B(),
        (),
    ),
    (
        "exit-93",
        C.DO_NOT_RETRY,
        E(J.FAILED, 93),
        B(),
        {},
        False,
        V.FAIL,
        ["asked not to be retried", "exit 93"],
        B(),
        (),
    ),
    (
        "disk-full/not-retried-not-counted",
        C.DISK_FULL,
        E(J.FAILED, 1, rank_outcomes=("disk_full",), disk_full_at="n2 at /ckpt/step-9.pt"),
        B(1, {"crash": 1}),
        {},
        False,
        V.FAIL,
        ["disk full on n2 at /ckpt/step-9.pt: free space and resubmit"],
        B(1, {"crash": 1}),
        (),
    ),
    (
        "disk-full/unknown-where",
        C.DISK_FULL,
        E(J.FAILED, 1),
        B(),
        {},
        False,
        V.FAIL,
        ["disk full on a node: free space and resubmit"],
        B(),
        (),
    ),
    ("deadline", C.DEADLINE, E(J.DEADLINE), B(), {}, False, V.FAIL, ["deadline passed"], B(), ()),
    # Retries spend the failure budget, overall and per cause.
    (
        "crash/first-retry",
        C.CRASH,
        E(J.FAILED, 1),
        B(),
        {},
        False,
        V.RETRY,
        ["crash: retry 1/2"],
        B(1, {"crash": 1}),
        (),
    ),
    (
        "crash/last-retry",
        C.CRASH,
        E(J.FAILED, 1),
        B(1, {"crash": 1}, 4, 2),
        {},
        False,
        V.RETRY,
        ["crash: retry 2/2"],
        B(2, {"crash": 2}, 4, 2),
        (),
    ),
    (
        "crash/budget-exhausted",
        C.CRASH,
        E(J.FAILED, 1),
        B(2, {"oom": 2}),
        {},
        False,
        V.FAIL,
        ["retry budget exhausted (2/2)", "last ending: crash"],
        B(2, {"oom": 2}),
        (),
    ),
    (
        "timeout/signal-acted-on-no-note",
        C.CHECKPOINTED,
        E(
            J.TIMEOUT,
            checkpoint_advanced=True,
            checkpoint_signal_sent=True,
            checkpoint_signal_at=60.0,
            checkpoints_known=True,
            checkpoint_after_signal=True,
        ),
        B(),
        {},
        False,
        V.CONTINUE,
        ["checkpointed: continuing"],
        B(0, {}, 1, 0),
        (),
    ),
    (
        "timeout/no-retries-allowed",
        C.TIMEOUT,
        E(J.TIMEOUT),
        B(),
        {"num_job_retries_on_failure": 0},
        False,
        V.FAIL,
        ["retry budget exhausted (0/0)", "timeout"],
        B(),
        (),
    ),
    (
        "timeout/retry",
        C.TIMEOUT,
        E(J.TIMEOUT),
        B(),
        {},
        False,
        V.RETRY,
        ["timeout: retry 1/2"],
        B(1, {"timeout": 1}),
        (),
    ),
    # A hang at the wall limit spends the failure budget and says which rank and section.
    (
        "hang/retry",
        C.HANG,
        E(J.TIMEOUT, hung=HUNG),
        B(),
        {},
        False,
        V.RETRY,
        ["hang: retry 1/2", "rank 1 (node n2) hung in section 'step'"],
        B(1, {"hang": 1}),
        (),
    ),
    (
        "hang/budget-exhausted",
        C.HANG,
        E(J.TIMEOUT, hung=HUNG),
        B(),
        {"cause_budgets": {C.HANG: 0}},
        False,
        V.FAIL,
        ["retry budget for hang exhausted (0/0)", HUNG],
        B(),
        (),
    ),
    # The checkpoint signal went out and no checkpoint followed: the reason says so.
    (
        "timeout/signal-not-acted-on",
        C.TIMEOUT,
        E(J.TIMEOUT, checkpoint_signal_sent=True, checkpoint_signal_at=0.0, checkpoints_known=True),
        B(),
        {},
        False,
        V.RETRY,
        [
            "timeout: retry 1/2",
            "checkpoint signal sent at 1970-01-01 00:00:00 UTC, not acted "
            "on: no checkpoint after it",
        ],
        B(1, {"timeout": 1}),
        (),
    ),
    (
        "checkpointed/signal-not-acted-on",
        C.CHECKPOINTED,
        E(
            J.TIMEOUT,
            checkpoint_advanced=True,
            checkpoint_signal_sent=True,
            checkpoint_signal_at=60.0,
            checkpoints_known=True,
        ),
        B(),
        {},
        False,
        V.CONTINUE,
        ["checkpointed: continuing", "sent at 1970-01-01 00:01:00 UTC, not acted on"],
        B(0, {}, 1, 0),
        (),
    ),
    (
        "no-heartbeats/note",
        C.CRASH,
        E(J.FAILED, 1, heartbeats=False),
        B(),
        {},
        False,
        V.RETRY,
        ["crash: retry 1/2", "no heartbeats", "only by 300s without CPU use"],
        B(1, {"crash": 1}),
        (),
    ),
    (
        "preempted/retry",
        C.PREEMPTED,
        E(J.PREEMPTED),
        B(1, {"crash": 1}),
        {},
        False,
        V.RETRY,
        ["preempted: retry 2/2"],
        B(2, {"crash": 1, "preempted": 1}),
        (),
    ),
    (
        "oom/retry",
        C.OOM,
        E(J.OUT_OF_MEMORY),
        B(),
        {},
        False,
        V.RETRY,
        ["oom: retry 1/2"],
        B(1, {"oom": 1}),
        (),
    ),
    (
        "per-cause/exhausted",
        C.NODE_FAIL,
        NODE_FAIL_E,
        B(1, {"node_fail": 1}),
        {"num_job_retries_on_failure": 5, "cause_budgets": {C.NODE_FAIL: 1}},
        False,
        V.FAIL,
        ["retry budget for node_fail exhausted (1/1)"],
        B(1, {"node_fail": 1}),
        (("n2", "node_fail under the run"),),
    ),
    (
        "per-cause/other-cause-still-retried",
        C.CRASH,
        E(J.FAILED, 1),
        B(1, {"node_fail": 1}),
        {"num_job_retries_on_failure": 5, "cause_budgets": {C.NODE_FAIL: 1}},
        False,
        V.RETRY,
        ["crash: retry 2/5"],
        B(2, {"node_fail": 1, "crash": 1}),
        (),
    ),
    (
        "per-cause/zero",
        C.OOM,
        E(J.OUT_OF_MEMORY),
        B(),
        {"cause_budgets": {C.OOM: 0}},
        False,
        V.FAIL,
        ["retry budget for oom exhausted (0/0)"],
        B(),
        (),
    ),
    (
        "per-cause/under-cap",
        C.PREEMPTED,
        E(J.PREEMPTED),
        B(2, {"preempted": 2}),
        {"num_job_retries_on_failure": 10, "cause_budgets": {C.PREEMPTED: 3}},
        False,
        V.RETRY,
        ["preempted: retry 3/10"],
        B(3, {"preempted": 3}),
        (),
    ),
    (
        "per-cause/overall-cap-first",
        C.CRASH,
        E(J.FAILED, 1),
        B(1, {"crash": 1}),
        {"num_job_retries_on_failure": 1, "cause_budgets": {C.CRASH: 5}},
        False,
        V.FAIL,
        ["retry budget exhausted (1/1)"],
        B(1, {"crash": 1}),
        (),
    ),
    # Continuations spend no failure budget; they stop when the checkpoint step stalls.
    (
        "checkpointed/progress",
        C.CHECKPOINTED,
        CKPT_PROGRESS,
        B(1, {"crash": 1}),
        {},
        False,
        V.CONTINUE,
        ["checkpointed: continuing"],
        B(1, {"crash": 1}, 1, 0),
        (),
    ),
    (
        "checkpointed/progress-resets-stall",
        C.CHECKPOINTED,
        CKPT_PROGRESS,
        B(0, {}, 5, 2),
        {},
        False,
        V.CONTINUE,
        ["checkpointed"],
        B(0, {}, 6, 0),
        (),
    ),
    (
        "checkpointed/first-stall",
        C.CHECKPOINTED,
        CKPT_KNOWN,
        B(0, {}, 3, 0),
        {},
        False,
        V.CONTINUE,
        ["checkpointed: continuing"],
        B(0, {}, 4, 1),
        (),
    ),
    (
        "checkpointed/second-stall",
        C.CHECKPOINTED,
        CKPT_KNOWN,
        B(2, {"crash": 2}, 4, 1),
        {},
        False,
        V.CONTINUE,
        ["checkpointed: continuing"],
        B(2, {"crash": 2}, 5, 2),
        (),
    ),
    (
        "checkpointed/stalled-out",
        C.CHECKPOINTED,
        CKPT_KNOWN,
        B(0, {}, 4, 2),
        {},
        False,
        V.FAIL,
        ["no checkpoint progress over 3 continuations"],
        B(0, {}, 4, 3),
        (),
    ),
    (
        "checkpointed/stalled-out-k1",
        C.CHECKPOINTED,
        CKPT_KNOWN,
        B(),
        {"max_stalled_continuations": 1},
        False,
        V.FAIL,
        ["no checkpoint progress over 1 continuations"],
        B(0, {}, 0, 1),
        (),
    ),
    (
        "checkpointed/exhausted-failure-budget-still-continues",
        C.CHECKPOINTED,
        CKPT_PROGRESS,
        B(2, {"crash": 2}),
        {},
        False,
        V.CONTINUE,
        ["continuing"],
        B(2, {"crash": 2}, 1, 0),
        (),
    ),
    # Exclusions.
    (
        "exclude/node-fail-down-nodes",
        C.NODE_FAIL,
        NODE_FAIL_E,
        B(),
        {},
        False,
        V.RETRY,
        ["node_fail: retry 1/2"],
        B(1, {"node_fail": 1}),
        (("n2", "node_fail under the run"),),
    ),
    (
        "exclude/node-fail-nothing-down",
        C.NODE_FAIL,
        E(J.NODE_FAIL, nodes=("n1", "n2")),
        B(),
        {},
        False,
        V.RETRY,
        ["node_fail"],
        B(1, {"node_fail": 1}),
        (),
    ),
    (
        "exclude/boot-fail-whole-allocation",
        C.BOOT_FAIL,
        E(J.BOOT_FAIL, nodes=("n1", "n2")),
        B(),
        {},
        False,
        V.RETRY,
        ["boot_fail: retry 1/2"],
        B(1, {"boot_fail": 1}),
        (("n1", "boot_fail under the run"), ("n2", "boot_fail under the run")),
    ),
    (
        "exclude/boot-fail-down-nodes-only",
        C.BOOT_FAIL,
        E(J.BOOT_FAIL, nodes=("n1", "n2"), down_nodes=("n1",)),
        B(),
        {},
        False,
        V.RETRY,
        ["boot_fail"],
        B(1, {"boot_fail": 1}),
        (("n1", "boot_fail under the run"),),
    ),
    (  # exit 16: every node of the attempt, not only the one that asked (issue 30)
        "exclude/resume-elsewhere-every-node",
        C.RESUME_ELSEWHERE,
        E(J.FAILED, 16, nodes=("n1", "n3"), suspect_node="n3"),
        B(),
        {},
        False,
        V.CONTINUE,
        ["exit 16", "disambiguation run on other nodes", "no retry spent"],
        B(0, {"resume_elsewhere": 1}),
        (("n1", "result validation (exit 16)"), ("n3", "result validation (exit 16)")),
    ),
    (
        "exclude/resume-elsewhere-second",
        C.RESUME_ELSEWHERE,
        E(J.FAILED, 16, nodes=("n1",)),
        B(0, {"resume_elsewhere": 1}),
        {},
        False,
        V.RETRY,
        ["resume_elsewhere: retry 1/2", "disambiguation run on other nodes"],
        B(1, {"resume_elsewhere": 2}),
        (("n1", "result validation (exit 16)"),),
    ),
    (
        "exclude/crash-never",
        C.CRASH,
        E(J.FAILED, 1, nodes=("n1",), down_nodes=("n1",), suspect_node="n1"),
        B(),
        {},
        False,
        V.RETRY,
        ["crash"],
        B(1, {"crash": 1}),
        (),
    ),
    (
        "exclude/disabled-node-fail",
        C.NODE_FAIL,
        NODE_FAIL_E,
        B(),
        {"exclude_failed_nodes": False},
        False,
        V.RETRY,
        ["node_fail"],
        B(1, {"node_fail": 1}),
        (),
    ),
    (
        "exclude/disabled-boot-fail",
        C.BOOT_FAIL,
        E(J.BOOT_FAIL, nodes=("n1",)),
        B(),
        {"exclude_failed_nodes": False},
        False,
        V.RETRY,
        ["boot_fail"],
        B(1, {"boot_fail": 1}),
        (),
    ),
    (
        "exclude/disabled-resume-elsewhere",
        C.RESUME_ELSEWHERE,
        E(J.FAILED, 16, suspect_node="n3"),
        B(),
        {"exclude_failed_nodes": False},
        False,
        V.RETRY,
        ["resume_elsewhere"],
        B(1, {"resume_elsewhere": 1}),
        (),
    ),
    (
        "exclude/kept-when-budget-exhausted",
        C.NODE_FAIL,
        NODE_FAIL_E,
        B(2, {"crash": 2}),
        {},
        False,
        V.FAIL,
        ["retry budget exhausted (2/2)", "node_fail"],
        B(2, {"crash": 2}),
        (("n2", "node_fail under the run"),),
    ),
]


@pytest.mark.parametrize(
    "cause,ending,budget,overrides,cancel,verdict,words,after,exclude",
    [pytest.param(*row[1:], id=row[0]) for row in DECIDE_ROWS],
)
def test_decide(cause, ending, budget, overrides, cancel, verdict, words, after, exclude):
    before = B(
        budget.job_retries_used,
        budget.cause_counts,
        budget.continuations,
        budget.stalled_continuations,
    )
    d = decide(cause, ending, budget, FtSettings(**overrides), cancel)
    assert isinstance(d, Decision)
    assert (d.verdict, d.cause) == (verdict, cause)
    for word in words:
        assert word in d.reason
    assert d.budget == after
    assert d.exclude == exclude
    assert budget == before  # the budget passed in is never changed in place


# ------------------------------------------------------------------- result validation
VALIDATION = "result validation (exit 16)"
SIXTEEN = E(J.FAILED, 16, nodes=("n1", "n2"), rank_outcomes=("resume_elsewhere",))
SEVENTEEN = E(J.FAILED, 17, nodes=("n3", "n4"), rank_outcomes=("failed_validation",))
FLAGGED = (("n1", VALIDATION), ("n2", VALIDATION))
# (id, cause, ending, budget, settings, verdict, words, budget after, flagged, disambiguate,
#  clear the validation flags)
VALIDATION_ROWS = [
    (
        "first-16-is-free",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(),
        {},
        V.CONTINUE,
        ["exit 16", "result validation", "disambiguation run on other nodes", "no retry spent"],
        B(0, {"resume_elsewhere": 1}),
        FLAGGED,
        True,
        False,
    ),
    (
        "first-16-free-even-with-the-budget-spent",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(2, {"crash": 2}),
        {},
        V.CONTINUE,
        ["no retry spent"],
        B(2, {"crash": 2, "resume_elsewhere": 1}),
        FLAGGED,
        True,
        False,
    ),
    (
        "second-16-spends-the-budget",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(0, {"resume_elsewhere": 1}),
        {},
        V.RETRY,
        ["resume_elsewhere: retry 1/2", "disambiguation run on other nodes"],
        B(1, {"resume_elsewhere": 2}),
        FLAGGED,
        True,
        False,
    ),
    (
        "second-16-budget-exhausted",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(2, {"crash": 1, "resume_elsewhere": 2}),
        {},
        V.FAIL,
        ["retry budget exhausted (2/2)", "resume_elsewhere"],
        B(2, {"crash": 1, "resume_elsewhere": 2}),
        FLAGGED,
        False,
        False,
    ),
    (  # the free one is outside the per-cause cap: a cap of 1 allows one paid re-run
        "second-16-cause-cap-counts-paid-ones",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(0, {"resume_elsewhere": 1}),
        {"cause_budgets": {"resume_elsewhere": 1}},
        V.RETRY,
        ["retry 1/2"],
        B(1, {"resume_elsewhere": 2}),
        FLAGGED,
        True,
        False,
    ),
    (
        "third-16-cause-cap-reached",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(1, {"resume_elsewhere": 2}),
        {"cause_budgets": {"resume_elsewhere": 1}},
        V.FAIL,
        ["retry budget for resume_elsewhere exhausted (1/1)"],
        B(1, {"resume_elsewhere": 2}),
        FLAGGED,
        False,
        False,
    ),
    (
        "16-with-no-other-nodes",
        C.RESUME_ELSEWHERE,
        dataclasses.replace(SIXTEEN, elsewhere=False),
        B(),
        {},
        V.FAIL,
        ["no other nodes to re-run on", "not retried"],
        B(),
        FLAGGED,
        False,
        False,
    ),
    (  # a site that never flags nodes: exit 16 is an ordinary retry, no context
        "16-without-node-exclusion",
        C.RESUME_ELSEWHERE,
        SIXTEEN,
        B(),
        {"exclude_failed_nodes": False},
        V.RETRY,
        ["resume_elsewhere: retry 1/2"],
        B(1, {"resume_elsewhere": 1}),
        (),
        False,
        False,
    ),
    (
        "17-after-a-disambiguation-run",
        C.FAILED_VALIDATION,
        SEVENTEEN,
        B(0, {"resume_elsewhere": 1}),
        {},
        V.FAIL,
        ["the result reproduced on different hardware", "the model's, not the machine's"],
        B(0, {"resume_elsewhere": 1}),
        (),
        False,
        True,
    ),
    (
        "17-without-a-disambiguation-run",
        C.FAILED_VALIDATION,
        SEVENTEEN,
        B(),
        {},
        V.FAIL,
        ["result validation failed (exit 17): not retried"],
        B(),
        (),
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    "cause,ending,budget,overrides,verdict,words,after,flagged,again,clear",
    [pytest.param(*row[1:], id=row[0]) for row in VALIDATION_ROWS],
)
def test_result_validation_policy(
    cause, ending, budget, overrides, verdict, words, after, flagged, again, clear
):
    s = FtSettings(**overrides)
    assert classify(ending, s) is cause
    d = decide(cause, ending, budget, s)
    assert (d.verdict, d.cause) == (verdict, cause)
    for word in words:
        assert word in d.reason, d.reason
    assert d.budget == after
    assert d.exclude == flagged
    assert (d.disambiguate, d.clear_validation_flags) == (again, clear)


def test_a_cancel_wins_over_result_validation():
    for cause, ending in ((C.RESUME_ELSEWHERE, SIXTEEN), (C.FAILED_VALIDATION, SEVENTEEN)):
        d = decide(cause, ending, B(0, {"resume_elsewhere": 1}), DEFAULT, cancel_requested=True)
        assert d.verdict is V.CANCEL and not d.exclude and not d.clear_validation_flags


@pytest.mark.parametrize(
    "nodes,usable,needed,room",
    [
        (("n1", "n2"), ("n1", "n2", "n3", "n4"), 2, True),
        (("n1", "n2"), ("n1", "n2", "n3"), 2, False),  # n1 or n2 would come back
        (("n1",), ("n1",), 1, False),  # one node in all
        (("n1", "n2"), ("n3",), 1, True),  # the attempt's nodes are down: elsewhere anyway
    ],
)
def test_room_elsewhere(nodes, usable, needed, room):
    assert room_elsewhere(nodes, usable, needed) is room
    if room:  # then flagging the attempt's nodes keeps every one of them out
        assert set(nodes) & set(usable) <= set(plan_exclusions(list(nodes), usable, needed))


def test_the_disambiguation_context_follows_an_exit_16():
    ctx = disambiguation("resume_elsewhere", 3, ["n1", "n2"], 40, DEFAULT)
    assert ctx == Disambiguation(attempt=3, nodes=("n1", "n2"), step=40)
    assert disambiguation("crash", 3, ["n1"], 40, DEFAULT) is None
    assert disambiguation(None, 0, [], None, DEFAULT) is None
    off = FtSettings(exclude_failed_nodes=False)
    assert disambiguation("resume_elsewhere", 3, ["n1"], 40, off) is None


def test_no_note_when_the_signal_was_acted_on_or_the_ranks_beat():
    e = E(
        J.TIMEOUT,
        checkpoint_advanced=True,
        checkpoint_signal_sent=True,
        checkpoint_signal_at=60.0,
        checkpoints_known=True,
        checkpoint_after_signal=True,
    )
    assert decide(C.CHECKPOINTED, e, B(), DEFAULT).reason == "checkpointed: continuing"


def test_the_reason_says_the_script_does_not_handle_the_checkpoint_signal():
    e = E(
        J.TIMEOUT,
        None,
        signal=9,
        checkpoint_signal_sent=True,
        checkpoint_signal_at=60.0,
        checkpoints_known=False,
        signal_withheld="USR2",
    )
    d = decide(classify(e, DEFAULT), e, B(), DEFAULT)
    assert (d.verdict, d.budget) == (V.CONTINUE, B(cont=1, stalled=1))  # heartbeats: judged
    plain = dataclasses.replace(e, heartbeats=False)  # no rank agent: its progress not seen
    assert decide(C.CHECKPOINTED, plain, B(), DEFAULT).budget == B(cont=1, stalled=0)
    assert d.reason == (
        "checkpointed: continuing; the script does not handle SIGUSR2: left "
        "to the wall limit, continued from its last checkpoint"
    )
    known = dataclasses.replace(e, checkpoints_known=True)  # and none newer: a timeout
    d = decide(classify(known, DEFAULT), known, B(), DEFAULT)
    assert d.verdict is V.RETRY and "no checkpoint since the last" in d.reason
    assert "not acted on" not in d.reason  # it never reached the script


def test_hang_defaults_are_on_and_setup_checkpointing_and_recovery_keep_their_own_limits():
    s = FtSettings(section_timeouts={"step": 60, "setup": None})
    want = {"setup": None, "checkpointing": 1800, RECOVERY_SECTION: 1800, "step": 60}
    assert s.section_timeouts == want
    assert (
        FtSettings(
            out_of_section_timeout=None, initial_timeout=None, hang_warmup_steps=None
        ).out_of_section_timeout
        is None
    )  # None: off
    with pytest.raises(ValueError, match="must be > 0"):
        FtSettings(section_timeouts={"step": 0})


def test_decide_table_covers_every_cause_and_verdict():
    assert {row[1] for row in DECIDE_ROWS} == set(Cause) - {Cause.STRAGGLER}  # straggler_move
    assert {row[6] for row in DECIDE_ROWS} == set(Verdict)


def test_default_policy_end_to_end():
    """Two retries spend the default budget (the third failure ends the run); the
    continuations in between spend nothing."""
    s, budget, verdicts = DEFAULT, Budget(), []
    for e in [
        E(J.FAILED, 1),
        CKPT_PROGRESS,
        E(J.NODE_FAIL, down_nodes=("n1",)),
        CKPT_PROGRESS,
        E(J.FAILED, 1),
    ]:
        d = decide(classify(e, s), e, budget, s)
        verdicts.append(d.verdict)
        budget = d.budget
    assert verdicts == [V.RETRY, V.CONTINUE, V.RETRY, V.CONTINUE, V.FAIL]
    assert budget == B(2, {"crash": 1, "node_fail": 1}, 2, 0)


def test_progress_in_a_retried_attempt_resets_the_stall_count():
    s = FtSettings(max_stalled_continuations=2)
    budget = Budget()
    for e in [CKPT, E(J.FAILED, 1, checkpoint_advanced=True), CKPT]:
        d = decide(classify(e, s), e, budget, s)
        budget = d.budget
    assert d.verdict is V.CONTINUE


# ---------------------------------------------------------------------- simulated runs

NODES = ("n1", "n2", "n3", "n4")
OUTCOMES = (
    "finished",
    "checkpointed",
    "user_error",
    "resume_elsewhere",
    "failed_validation",
    "do_not_retry",
    "killed",
    "failed",
    "teardown_failed",
    "disk_full",
)
EXIT_CODES = (0, 1, 16, 17, 93, 137, None)
RETRYABLE_CAUSES = sorted(RETRYABLE, key=lambda c: c.value)


def rarely(one_in: int = 4) -> st.SearchStrategy[bool]:
    return st.integers(0, one_in - 1).map(lambda n: n == 0)


@st.composite
def endings(draw) -> Ending:
    nodes = tuple(draw(st.lists(st.sampled_from(NODES), unique=True, max_size=4)))
    down = (
        tuple(draw(st.lists(st.sampled_from(nodes), unique=True)))
        if (nodes and draw(rarely()))
        else ()
    )
    return Ending(
        state=draw(st.sampled_from(list(JobState))),
        exit_code=draw(st.sampled_from(EXIT_CODES)),
        signal=draw(st.sampled_from((None, None, 9, 15))),
        requeued_by_scheduler=draw(rarely()),
        nodes=nodes,
        down_nodes=down,
        rank_outcomes=tuple(draw(st.lists(st.sampled_from(OUTCOMES), max_size=3))),
        checkpoint_signal_sent=draw(st.booleans()),
        checkpoint_advanced=draw(st.booleans()),
        finished_marker=draw(rarely(10)),
        suspect_node=draw(st.none() | st.sampled_from(NODES)),
        signal_withheld=draw(st.sampled_from((None, None, "USR2"))),
        elsewhere=draw(st.booleans()),
    )


@st.composite
def ft_settings(draw) -> FtSettings:
    return FtSettings(
        num_job_retries_on_failure=draw(st.integers(0, 6)),
        cause_budgets=draw(st.dictionaries(st.sampled_from(RETRYABLE_CAUSES), st.integers(0, 6))),
        max_stalled_continuations=draw(st.integers(1, 5)),
        user_error_exit_codes=tuple(
            draw(st.lists(st.sampled_from((1, 2, 137)), unique=True, max_size=2))
        ),
        exclude_failed_nodes=draw(st.booleans()),
    )


def decide_each(
    endings_: list[Ending], s: FtSettings, cancel_from: int | None, stop: bool
) -> list[Decision]:
    """The daemon's loop over a run's endings: classify, decide, carry the budget on. With
    `stop`, a run whose verdict is terminal is never acted on again."""
    budget, decisions = Budget(), []
    for i, e in enumerate(endings_):
        cancel = cancel_from is not None and i >= cancel_from
        d = decide(classify(e, s), e, budget, s, cancel)
        decisions.append(d)
        budget = d.budget
        if stop and d.verdict in TERMINAL:
            break
    return decisions


@settings(max_examples=300, deadline=None)
@given(st.lists(endings(), min_size=1, max_size=25), ft_settings(), st.none() | st.integers(0, 30))
def test_simulated_runs_keep_their_budgets(endings_, s, cancel_from):
    decisions = decide_each(endings_, s, cancel_from, stop=True)
    cap = s.num_job_retries_on_failure
    previous = Budget()
    for i, d in enumerate(decisions):
        b = d.budget
        assert b.job_retries_used <= cap  # (a)
        # the first disambiguation run after exit 16 is counted, not charged (issue 30)
        free = int(s.exclude_failed_nodes and b.cause_counts.get(C.RESUME_ELSEWHERE.value, 0) > 0)
        for cause, cause_cap in s.cause_budgets.items():  # (b)
            charged = b.cause_counts.get(cause.value, 0)
            assert charged - (free if cause is C.RESUME_ELSEWHERE else 0) <= cause_cap
        assert sum(b.cause_counts.values()) == b.job_retries_used + free  # (c)
        assert set(b.cause_counts) <= {c.value for c in RETRYABLE}
        if d.verdict is V.CONTINUE and d.cause is C.RESUME_ELSEWHERE:  # (d) the free one
            assert b.job_retries_used == previous.job_retries_used
            assert b.continuations == previous.continuations
            assert previous.cause_counts.get(C.RESUME_ELSEWHERE.value, 0) == 0
            assert b.cause_counts[C.RESUME_ELSEWHERE.value] == 1 and d.disambiguate
        elif d.verdict is V.CONTINUE:  # (d)
            assert b.job_retries_used == previous.job_retries_used
            assert b.continuations == previous.continuations + 1
            assert b.stalled_continuations < s.max_stalled_continuations
            assert d.cause is C.CHECKPOINTED
        elif d.verdict is V.RETRY:
            assert b.job_retries_used == previous.job_retries_used + 1
            assert b.continuations == previous.continuations
            assert d.cause in RETRYABLE
        else:
            assert b.job_retries_used == previous.job_retries_used
        if d.verdict is V.COMPLETE:
            assert d.cause is C.FINISHED
        cancel_requested = cancel_from is not None and i >= cancel_from
        if d.cause is C.FINISHED:  # a finished run is COMPLETED, cancelled or not
            assert d.verdict is V.COMPLETE
        else:
            assert (d.verdict is V.CANCEL) == (cancel_requested or d.cause is C.CANCELLED)
        if d.exclude:
            assert s.exclude_failed_nodes
            assert d.cause in (C.NODE_FAIL, C.BOOT_FAIL, C.RESUME_ELSEWHERE)
        previous = b
    # (e) a terminal run is never acted on again: the loop stops at the first terminal
    # verdict, and what it decided up to there is what deciding every ending would give.
    unstopped = decide_each(endings_, s, cancel_from, stop=False)
    terminal = [i for i, d in enumerate(unstopped) if d.verdict in TERMINAL]
    if terminal:
        assert len(decisions) == terminal[0] + 1
        assert decisions[-1].verdict in TERMINAL
    else:
        assert len(decisions) == len(endings_)
    assert decisions == unstopped[: len(decisions)]
    assert all(d.verdict in (V.RETRY, V.CONTINUE) for d in decisions[:-1])


@st.composite
def checkpointed_endings(draw, advanced: bool = False, known: bool = True) -> Ending:
    """The forms of "checkpointed, continue me" classify recognises; `known`: the run
    reports its checkpoints and heartbeats (the rank agent; a wall limit without a newer
    checkpoint is then a timeout), else a plain script."""
    base = draw(
        st.sampled_from(
            [
                E(J.COMPLETED, 0, checkpoint_signal_sent=True),
                E(J.COMPLETED, 0, rank_outcomes=("checkpointed",)),
                E(J.TIMEOUT, 0, rank_outcomes=("checkpointed", "checkpointed")),
                E(J.TIMEOUT, 0, checkpoint_signal_sent=True),
                E(J.PREEMPTED, 0, rank_outcomes=("checkpointed",)),
                E(J.REQUEUED, None, requeued_by_scheduler=True, rank_outcomes=("checkpointed",)),
            ]
        )
    )
    e = dataclasses.replace(
        base, checkpoint_advanced=advanced, checkpoints_known=known, heartbeats=known
    )
    assume(classify(e, DEFAULT) is C.CHECKPOINTED)
    return e


@settings(max_examples=200, deadline=None)
@given(st.lists(checkpointed_endings(), min_size=12, max_size=12), ft_settings(), st.integers(0, 6))
def test_continuations_without_progress_stop_after_max_stalled(endings_, s, used):
    """(f) Only continuations, never any checkpoint progress: the run fails at exactly the
    max_stalled_continuations-th one, without spending the failure budget."""
    k = s.max_stalled_continuations
    budget, verdicts = Budget(job_retries_used=used), []
    for e in endings_:
        assert classify(e, s) is C.CHECKPOINTED
        d = decide(C.CHECKPOINTED, e, budget, s)
        verdicts.append(d.verdict)
        budget = d.budget
        if d.verdict in TERMINAL:
            break
    assert verdicts == [V.CONTINUE] * (k - 1) + [V.FAIL]
    assert budget == Budget(used, {}, k - 1, k)  # the failing one is no continuation
    assert f"no checkpoint progress over {k} continuations" in d.reason


@settings(max_examples=100, deadline=None)
@given(st.lists(checkpointed_endings(known=False), min_size=12, max_size=12), ft_settings())
def test_continuations_of_a_run_whose_checkpoints_are_not_seen_are_never_judged_stalled(
    endings_, s
):
    """A plain script (no rank agent: no heartbeats, no progress file) that saves on the
    checkpoint signal: the daemon cannot see its progress, so no continuation counts as
    stalled and a long run is continued past max_stalled_continuations wall limits."""
    budget = Budget()
    for e in endings_:
        d = decide(classify(e, s), e, budget, s)
        assert d.verdict is V.CONTINUE, d
        budget = d.budget
    assert budget == Budget(0, {}, len(endings_), 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(1, 5))
def test_stall_count_is_consecutive_continuations_without_progress(progress, k):
    s = FtSettings(max_stalled_continuations=k)
    budget, stalled, verdicts, expected = Budget(), 0, [], []
    for advanced in progress:
        e = Ending(
            JobState.COMPLETED,
            0,
            rank_outcomes=("checkpointed",),
            checkpoint_advanced=advanced,
            checkpoints_known=True,
        )
        d = decide(classify(e, s), e, budget, s)
        budget = d.budget
        verdicts.append(d.verdict)
        stalled = 0 if advanced else stalled + 1
        expected.append(V.FAIL if stalled >= k else V.CONTINUE)
        assert budget.stalled_continuations == stalled
        if d.verdict is V.FAIL:
            break
    assert verdicts == expected[: len(verdicts)]
    assert budget.job_retries_used == 0


# ------------------------------------------------------------------------ plan_exclusions

NODE_NAMES = [f"n{i}" for i in range(10)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(NODE_NAMES), max_size=15),
    st.lists(st.sampled_from(NODE_NAMES), max_size=12),
    st.integers(0, 12),
)
def test_plan_exclusions_properties(flagged, usable, needed):
    chosen = plan_exclusions(flagged, usable, needed)
    usable_set = set(usable)
    assert set(chosen) <= set(flagged)
    assert len(set(chosen)) == len(chosen)
    assert list(chosen) == sorted(chosen)
    assert set(flagged) - usable_set <= set(chosen)  # unusable flagged nodes: always
    left = usable_set - set(chosen)
    if len(usable_set) >= needed:
        assert len(left) >= needed
    else:
        assert not (set(chosen) & usable_set)  # never a usable node when already short
    # Usable nodes go in newest flag first, as many as the spare allows.
    spare = max(0, len(usable_set) - needed)
    newest_usable = list(dict.fromkeys(n for n in flagged if n in usable_set))
    assert set(chosen) & usable_set == set(newest_usable[:spare])
    assert plan_exclusions(list(flagged), list(reversed(usable)), needed) == chosen


@pytest.mark.parametrize(
    "flagged,usable,needed,expected",
    [
        pytest.param([], ["n1", "n2"], 1, (), id="nothing-flagged"),
        pytest.param(["n3", "n1"], ["n1", "n2", "n3"], 1, ("n1", "n3"), id="room-for-all"),
        pytest.param(["n3", "n1"], ["n1", "n2", "n3"], 2, ("n3",), id="newest-first"),
        pytest.param(["n1", "n3"], ["n1", "n2", "n3"], 2, ("n1",), id="newest-first-other-order"),
        pytest.param(["n3", "n1"], ["n1", "n2", "n3"], 3, (), id="no-spare"),
        pytest.param(["n9", "n3"], ["n1", "n3"], 2, ("n9",), id="unusable-always-excluded"),
        pytest.param(["n3", "n3", "n1"], ["n1", "n2", "n3"], 1, ("n1", "n3"), id="duplicates"),
        pytest.param(["n1"], ["n1"], 5, (), id="short-already"),
        pytest.param(["b", "a"], [], 0, ("a", "b"), id="sorted-output"),
    ],
)
def test_plan_exclusions_examples(flagged, usable, needed, expected):
    assert plan_exclusions(flagged, usable, needed) == expected


# ---------------------------------------------------------------------- next_poll_interval


@settings(max_examples=500, deadline=None)
@given(
    now=st.floats(0, 1e7),
    since_change=st.none() | st.floats(-5, 1000),
    offsets=st.lists(st.floats(-100, 5000), max_size=4),
    previous=st.floats(0, 200),
    min_job_age=st.floats(0, 2000),
)
def test_next_poll_interval_properties(now, since_change, offsets, previous, min_job_age):
    last_change = None if since_change is None else now - since_change
    deadlines = [now + o for o in offsets]
    i = next_poll_interval(
        now,
        last_change=last_change,
        deadlines=deadlines,
        previous=previous,
        min_job_age_s=min_job_age,
    )
    assert 0.2 <= i <= 60
    if min_job_age / 3 >= 1:
        assert i <= min_job_age / 3
    for d in deadlines:
        if d - now >= 0.2:
            assert i <= d - now  # never wakes up after an upcoming deadline
        else:
            assert i == 0.2  # due now, passed, or closer than the shortest sleep
    if not deadlines and last_change is not None and now - last_change < 30:
        assert i == 1.0
    if not deadlines and (last_change is None or now - last_change >= 30):
        assert i >= min(previous, 60, max(1.0, min_job_age / 3))  # backs off, never shrinks


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, 1060.0),  # defaults: exclude_stragglers, reports every 60 s
        ({"straggler_report_interval_s": 3}, 1003.0),
        (
            {
                "exclude_stragglers": False,
                "stop_if_straggler": True,
                "straggler_report_interval_s": 5,
            },
            1005.0,
        ),
        ({"exclude_stragglers": False}, None),  # nothing would act on a report
        ({"use_launcher": False, "straggler_report_interval_s": 3}, None),  # no report written
    ],
)
def test_straggler_look_again(settings, expected):
    assert straggler_look_again(FtSettings(**settings), 1000.0) == expected


def test_next_poll_interval_backs_off_to_the_ceiling():
    seen, i = [], 0.2
    for _ in range(10):
        i = next_poll_interval(
            1000.0, last_change=None, deadlines=(), previous=i, min_job_age_s=300
        )
        seen.append(i)
    assert seen == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0]


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        pytest.param({"last_change": 990.0}, 1.0, id="recent-change"),
        pytest.param({"last_change": 970.0}, 60.0, id="change-30s-ago"),
        pytest.param({"last_change": 1005.0}, 1.0, id="change-in-the-future"),
        pytest.param({"deadlines": [1003.5]}, 3.5, id="upcoming-deadline"),
        pytest.param({"deadlines": [1000.1]}, 0.2, id="deadline-closer-than-shortest-sleep"),
        pytest.param({"deadlines": [1000.0]}, 0.2, id="deadline-now"),
        pytest.param({"deadlines": [900.0]}, 0.2, id="deadline-passed"),
        pytest.param({"deadlines": [5000.0]}, 60.0, id="far-deadline"),
        pytest.param({"min_job_age_s": 60}, 20.0, id="short-min-job-age"),
        pytest.param({"min_job_age_s": 2}, 1.0, id="tiny-min-job-age-floor"),
        pytest.param({"min_job_age_s": 0}, 1.0, id="min-job-age-zero"),
        pytest.param({"previous": 0.0}, 1.0, id="previous-zero"),
    ],
)
def test_next_poll_interval_examples(kwargs, expected):
    args = {"last_change": None, "deadlines": (), "previous": 40.0, "min_job_age_s": 300, **kwargs}
    assert next_poll_interval(1000.0, **args) == pytest.approx(expected)


# ---------------------------------------------------------------------------- FtSettings


def test_settings_defaults():
    s = FtSettings()
    assert s.model_dump() == {
        "num_job_retries_on_failure": 2,
        "num_in_job_restarts": 0,
        "preempt_time": 60,
        "checkpoint_signal": "USR2",
        "signal_backstop": True,
        "cause_budgets": {},
        "max_stalled_continuations": 3,
        "user_error_exit_codes": (),
        "exclude_failed_nodes": True,
        "transient_faults_to_flag": 2,
        "node_exclusion_ttl_s": 86400,
        "node_exclusion_max_ttl_s": 604800,
        "use_launcher": True,
        "section_timeouts": {"setup": 1800, "checkpointing": 1800, "recovery": 1800},
        "out_of_section_timeout": 300,
        "initial_timeout": 1800,
        "hang_warmup_steps": 20,
        "grace_s": 120,
        "straggler_report_interval_s": 60,
        "straggler_threshold": None,  # the rule's: 0.75, or 0.9 recovering live with spares
        "straggler_windows": 3,
        "straggler_reference": "best",
        "exclude_stragglers": True,
        "stop_if_straggler": False,
        "peer_timeout_s": 20,
        "launcher_start_timeout_s": 180.0,
        "spare_nodes": 0,
        "live_recovery": False,
        "checkpoint_interval": "auto",
        "checkpoint_save_prior_s": 60,
        "failure_rate_prior": 5,
        "failure_prior_node_days": 1000,
        "memory_tier_coverage": 0.5,
        "checkpoint_sharing": "private",
        "health_check": True,
        "health_timeout_s": 5.0,
        "health_min_write_mb_s": 1.0,
        "health_min_free_memory_mb": 256.0,
        "health_min_free_disk_mb": 256.0,
        "health_min_gpu_free_mb": 256.0,
        "health_min_bandwidth_ratio": 0.1,
        "health_dirs": (),
        "health_command": None,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"num_job_retries_on_failure": -1}, id="negative-retries"),
        pytest.param({"num_in_job_restarts": -1}, id="negative-in-job-restarts"),
        pytest.param({"preempt_time": -5}, id="negative-preempt-time"),
        pytest.param({"max_stalled_continuations": 0}, id="zero-stalled-continuations"),
        pytest.param({"node_exclusion_ttl_s": 0}, id="zero-exclusion-ttl"),
        pytest.param({"transient_faults_to_flag": -1}, id="negative-transient-faults"),
        pytest.param({"checkpoint_signal": ""}, id="signal-empty"),
        pytest.param({"checkpoint_signal": "SIG"}, id="signal-prefix-only"),
        pytest.param({"checkpoint_signal": "USR-1"}, id="signal-dash"),
        pytest.param({"checkpoint_signal": "USR 1"}, id="signal-space"),
        pytest.param({"checkpoint_signal": "USR2;reboot"}, id="signal-shell"),
        pytest.param({"checkpoint_signal": "B:USR2@90"}, id="signal-sbatch-syntax"),
        pytest.param({"cause_budgets": {"finished": 1}}, id="budget-finished"),
        pytest.param({"cause_budgets": {"checkpointed": 1}}, id="budget-checkpointed"),
        pytest.param({"cause_budgets": {"user_error": 1}}, id="budget-user-error"),
        pytest.param({"cause_budgets": {"failed_validation": 1}}, id="budget-exit-17"),
        pytest.param({"cause_budgets": {"do_not_retry": 0}}, id="budget-exit-93"),
        pytest.param({"cause_budgets": {"deadline": 1}}, id="budget-deadline"),
        pytest.param({"cause_budgets": {"cancelled": 1}}, id="budget-cancelled"),
        pytest.param({"cause_budgets": {"node_fail": -1}}, id="budget-negative"),
        pytest.param({"cause_budgets": {"no_such_cause": 1}}, id="budget-unknown-cause"),
        pytest.param({"retries": 3}, id="unknown-setting"),
        pytest.param({"straggler_threshold": 0}, id="straggler-threshold-zero"),
        pytest.param({"straggler_threshold": 1.5}, id="straggler-threshold-above-one"),
        pytest.param({"straggler_windows": 0}, id="straggler-windows-zero"),
        pytest.param({"straggler_report_interval_s": 0}, id="straggler-interval-zero"),
        pytest.param({"straggler_reference": "mean"}, id="straggler-reference-unknown"),
    ],
)
def test_settings_reject(kwargs):
    with pytest.raises(ValidationError):
        FtSettings(**kwargs)


@pytest.mark.parametrize(
    "raw,name",
    [
        ("SIGUSR1", "USR1"),
        ("USR1", "USR1"),
        ("sigusr2", "USR2"),
        ("term", "TERM"),
        ("SIGINT", "INT"),
        ("10", "USR1"),
    ],
)
def test_settings_signal_name_is_normalised(raw, name):
    assert FtSettings(checkpoint_signal=raw).checkpoint_signal == name


@pytest.mark.parametrize("raw", ["NOTASIGNAL", "USR3"])
def test_settings_reject_unknown_signal_names(raw):
    with pytest.raises(ValidationError):
        FtSettings(checkpoint_signal=raw)


def test_settings_budgets_for_every_retryable_cause():
    s = FtSettings(cause_budgets={c.value: 1 for c in RETRYABLE})
    assert s.cause_budgets == {c: 1 for c in RETRYABLE}
    assert all(isinstance(c, Cause) for c in s.cause_budgets)


def test_settings_are_frozen():
    s = FtSettings()
    with pytest.raises(ValidationError):
        s.num_job_retries_on_failure = 5  # type: ignore[misc]


# --------------------------------------------------------------- checkpoint signal timing


@pytest.mark.parametrize(
    "preempt,save,lead,warned",
    [
        pytest.param(60, None, 60.0, False, id="no-save-measured"),
        pytest.param(60, 0.0, 60.0, False, id="instant-save"),
        pytest.param(60, 27.5, 60.0, False, id="save-exactly-fits"),
        pytest.param(60, 27.6, 60.2, True, id="save-just-too-long"),
        pytest.param(60, 40.0, 85.0, True, id="save-longer-than-half-the-lead"),
        pytest.param(120, 100.0, 205.0, True, id="save-longer-than-lead"),
        pytest.param(0, None, 0.0, False, id="zero-preempt-no-save"),
        pytest.param(0, 0.0, 5.0, True, id="zero-preempt-instant-save"),
        pytest.param(600, 10.0, 600.0, False, id="generous-lead"),
    ],
)
def test_checkpoint_lead(preempt, save, lead, warned):
    got, warning = checkpoint_lead(preempt, save)
    assert isinstance(got, float)
    assert got == pytest.approx(lead)
    assert got >= preempt
    if warned:
        assert warning is not None
        assert "too short" in warning and "preempt_time" in warning
        assert f"{lead:.0f}s before the limit" in warning
    else:
        assert warning is None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3600), st.none() | st.floats(0, 3600))
def test_checkpoint_lead_leaves_twice_the_save_plus_margin(preempt, save):
    lead, warning = checkpoint_lead(preempt, save)
    assert lead >= preempt
    if save is not None:
        assert lead >= 2 * save + 5
    assert (warning is None) == (lead == preempt)


@pytest.mark.parametrize(
    "start,limit,lead,now,due",
    [
        pytest.param(None, 3600, 60, 1e9, False, id="not-started"),
        pytest.param(0.0, None, 60, 1e9, False, id="no-time-limit"),
        pytest.param(None, None, 60, 1e9, False, id="neither"),
        pytest.param(100.0, 3600, 60, 3639.9, False, id="just-before"),
        pytest.param(100.0, 3600, 60, 3640.0, True, id="exactly-due"),
        pytest.param(100.0, 3600, 60, 3700.0, True, id="at-the-limit"),
        pytest.param(100.0, 3600, 60, 9999.0, True, id="past-the-limit"),
        pytest.param(100.0, 3600, 0, 3699.9, False, id="zero-lead-before-limit"),
        pytest.param(100.0, 3600, 0, 3700.0, True, id="zero-lead-at-limit"),
        pytest.param(100.0, 60, 205, 100.0, True, id="lead-longer-than-limit"),
        pytest.param(100.0, 0, 0, 100.0, True, id="zero-limit"),
        pytest.param(0.0, 3600, 60, 0.0, False, id="start-at-epoch"),
    ],
)
def test_signal_due(start, limit, lead, now, due):
    assert signal_due(start, limit, lead, now) is due


# ---------------------------------------------------------------------------- stragglers

REPORT = {
    "attempt": 1,
    "threshold": 0.75,
    "persistent_nodes": ["n2", "n3"],
    "scores": [
        {"rank": 0, "node": "n1", "relative": 1.0, "individual": 1.0},
        {"rank": 2, "node": "n2", "relative": 0.41, "individual": 0.9},
        {"rank": 3, "node": "n2", "relative": 0.6, "individual": 0.5},
    ],
}


@pytest.mark.parametrize(
    "report,attempt,overrides,flagged,expected",
    [
        pytest.param(REPORT, 1, {}, (), ["n2", "n3"], id="persistent-nodes"),
        pytest.param(REPORT, 1, {}, ("n3",), ["n2"], id="already-flagged-skipped"),
        pytest.param(REPORT, 2, {}, (), [], id="report-of-another-attempt"),
        pytest.param(None, 1, {}, (), [], id="no-report"),
        pytest.param({**REPORT, "persistent_nodes": []}, 1, {}, (), [], id="none-persistent"),
        pytest.param(REPORT, 1, {"exclude_stragglers": False}, (), [], id="off"),
        pytest.param(
            REPORT,
            1,
            {"exclude_stragglers": False, "stop_if_straggler": True},
            (),
            ["n2", "n3"],
            id="stop-implies-flagging",
        ),
        pytest.param(
            {**REPORT, "persistent_nodes": ["n2", 7, None]},
            1,
            {},
            (),
            ["n2"],
            id="malformed-entries-ignored",
        ),
    ],
)
def test_straggler_flags(report, attempt, overrides, flagged, expected):
    found = straggler_flags(report, attempt, FtSettings(**overrides), flagged)
    assert [node for node, _ in found] == expected
    reasons = dict(found)
    if "n2" in reasons:  # the worst score of the node's ranks is named
        assert "straggler" in reasons["n2"] and "0.41" in reasons["n2"]


STOP = FtSettings(stop_if_straggler=True)


@pytest.mark.parametrize(
    "new,allocation,exclusions,budget,settings,moves",
    [
        pytest.param(["n2"], ["n1", "n2"], ["n2"], Budget(), STOP, True, id="move"),
        pytest.param(["n2"], ["n1", "n2"], ["n2"], Budget(), FtSettings(), False, id="off"),
        pytest.param(["n3"], ["n1", "n2"], ["n3"], Budget(), STOP, False, id="not-in-allocation"),
        pytest.param(["n2"], ["n1", "n2"], [], Budget(), STOP, False, id="cannot-be-excluded"),
        pytest.param(
            ["n2"],
            ["n1", "n2"],
            ["n2"],
            Budget(cause_counts={"straggler": 1}),
            FtSettings(stop_if_straggler=True, cause_budgets={"straggler": 1}),
            False,
            id="straggler-budget-spent",
        ),
        pytest.param(
            ["n2"],
            ["n1", "n2"],
            ["n2"],
            Budget(job_retries_used=2),
            STOP,
            True,
            id="failure-budget-spent-still-moves",
        ),
    ],
)
def test_straggler_move(new, allocation, exclusions, budget, settings, moves):
    d = straggler_move(new, allocation, exclusions, budget, settings)
    assert (d is not None) is moves
    if d is not None:
        assert d.verdict is Verdict.CONTINUE and d.cause is Cause.STRAGGLER
        assert d.budget.job_retries_used == budget.job_retries_used  # not a failure
        assert d.budget.cause_counts["straggler"] == budget.cause_counts.get("straggler", 0) + 1
        assert "n2" in d.reason


@given(
    st.lists(st.sampled_from(["n1", "n2", "n3", "n4"]), max_size=4),
    st.lists(st.sampled_from(["n1", "n2", "n3", "n4"]), min_size=1, max_size=4),
    st.integers(0, 4),
)
def test_straggler_moves_are_bounded_by_the_nodes(flags, allocation, cap):
    """Each move needs a newly flagged node of the allocation that will be excluded, and the
    straggler budget caps the count: a sequence of moves never exceeds either bound."""
    s = FtSettings(stop_if_straggler=True, cause_budgets={"straggler": cap})
    budget, excluded, moves = Budget(), set(), 0
    for node in flags:
        if node in excluded:
            continue  # already flagged: straggler_flags does not name it again
        excluded.add(node)
        d = straggler_move([node], allocation, excluded, budget, s)
        if d is not None:
            budget, moves = d.budget, moves + 1
    assert moves <= min(cap, len(set(allocation)))


# ---------------------------------------------------------------------------- flag_ttl
DAY = 86400.0


@pytest.mark.parametrize(
    ("previous", "now", "expected"),
    [
        pytest.param(None, 100 * DAY, DAY, id="first-flag"),
        pytest.param((0.0, DAY), 1.5 * DAY, 2 * DAY, id="again-soon-after-expiry-doubles"),
        pytest.param((0.0, DAY), 0.5 * DAY, 2 * DAY, id="again-while-flagged-doubles"),
        pytest.param((0.0, DAY), 6 * DAY, 2 * DAY, id="again-within-a-week-doubles"),
        pytest.param((0.0, DAY), 8 * DAY + 1, DAY, id="behaved-for-a-week-starts-over"),
        pytest.param((0.0, 2 * DAY), 3 * DAY, 4 * DAY, id="keeps-doubling"),
        pytest.param((0.0, 4 * DAY), 5 * DAY, 7 * DAY, id="capped"),
        pytest.param((0.0, 7 * DAY), 8 * DAY, 7 * DAY, id="stays-at-the-cap"),
        pytest.param((0.0, None), 5 * DAY, None, id="no-expiry-stays"),
        pytest.param((0.0, 60.0), 120.0, 2 * DAY, id="short-manual-flag-counts-as-the-base"),
    ],
)
def test_flag_ttl_escalates_for_repeat_offenders(previous, now, expected):
    assert flag_ttl(previous, now, FtSettings()) == expected


def test_flag_ttl_without_escalation_when_the_cap_is_the_base():
    s = FtSettings(node_exclusion_ttl_s=DAY, node_exclusion_max_ttl_s=DAY)
    assert flag_ttl((0.0, DAY), 1.5 * DAY, s) == DAY
    assert flag_ttl((0.0, DAY), 2.5 * DAY, s) == DAY


@given(st.lists(st.floats(0, 30 * DAY), max_size=20))
def test_flag_ttl_stays_within_base_and_cap(gaps):
    s, previous, now = FtSettings(), None, 0.0
    for gap in gaps:
        now += gap
        ttl = flag_ttl(previous, now, s)
        assert ttl is not None and s.node_exclusion_ttl_s <= ttl <= s.node_exclusion_max_ttl_s
        previous = (now, now + ttl)


# ------------------------------------------------------------------ stragglers with spares
@pytest.mark.parametrize(
    "stragglers, gone, spares, expected",
    [
        (["n2"], [], 1, True),  # node rank 1 steps out, the spare takes its place
        (["n2", "n3"], [], 1, False),  # two would leave, one spare
        (["n2", "n3"], [], 2, True),
        (["n3"], [1], 1, False),  # the only spare is taken already
        (["n1"], [], 2, False),  # the batch host never steps out
        (["n2"], [], 0, False),  # no spares: the job moves as before
        (["n9"], [], 1, True),  # not in the allocation: nobody to replace, nothing to move
    ],
)
def test_spares_take_stragglers_while_the_one_rule_says_spare(stragglers, gone, spares, expected):
    allocation = ["n1", "n2", "n3", "n4"]
    assert spares_take_stragglers(stragglers, allocation, gone, spares) is expected


def test_a_failed_ranks_words_are_in_the_reason_of_the_endings_they_explain():
    said = "rank 3 (n2): RuntimeError: CUDA error: an illegal memory access"
    crash = decide(C.CRASH, E(J.FAILED, 1, error=said), Budget(), DEFAULT)
    assert crash.reason == f"crash: retry 1/2; {said}"
    lost = decide(C.NODE_FAIL, E(J.NODE_FAIL, error=said), Budget(), DEFAULT)
    assert said not in lost.reason  # a survivor's error after a lost node says nothing
