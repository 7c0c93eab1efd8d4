"""Properties of `ftslurm.daemon.step` over generated attempts, observations and facts."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ftslurm.core.cadence import FailureHistory
from ftslurm.core.settings import FtSettings
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import step as core
from ftslurm.daemon.records import Attempt, AttemptState, NodeFlag, Run, RunState, tag

NOW = 50_000.0
NODES = ("n1", "n2", "n3", "n4")
STARTS = (
    core.Submit,
    core.Adopt,
    core.Release,
    core.StartNow,
    core.NewAttempt,
    core.Signal,
    core.Requeue,
)

outcomes = st.sampled_from(
    ["checkpointed", "finished", "failed", "resume_elsewhere", "restarts_exhausted"]
)
files = st.builds(
    core.RunFiles,
    progress=st.one_of(st.just({}), st.builds(lambda s: {"checkpoint_step": s}, st.integers(0, 5))),
    rank_reports=st.lists(
        st.builds(lambda o, n: {"outcome": o, "node": n}, outcomes, st.sampled_from(NODES)),
        max_size=2,
    ).map(tuple),
    finished_marker=st.booleans(),
)
observations = st.builds(
    lambda state, restarts, code, acct, start: JobInfo(
        job_id="7",
        state=state,
        observed_at=NOW,
        exit_code=code,
        nodes=NODES[:2],
        restart_count=restarts,
        from_accounting=acct,
        start_time=start,
        time_limit_s=600,
    ),
    st.sampled_from([s for s in JobState if s is not JobState.UNKNOWN]),
    st.integers(0, 3),
    st.one_of(st.none(), st.sampled_from([0, 1, 16, 17, 74, 75, 93])),
    st.booleans(),
    st.one_of(st.none(), st.just(NOW - 300)),
)


@st.composite
def runs(draw) -> Run:
    retries = draw(st.integers(0, 3))
    used = draw(st.integers(0, retries))
    ft = FtSettings(num_job_retries_on_failure=retries, stop_if_straggler=draw(st.booleans()))
    return Run(
        run_id="r",
        name="r",
        state=draw(st.sampled_from([RunState.PENDING, RunState.RUNNING])),
        created_at=0.0,
        spec={"options": {"nodes": 2, "exclude": []}, "run_dir": "/x"},
        settings=ft.model_dump(mode="json"),
        job_retries_used=used,
        continuations=draw(st.integers(0, 3)),
        cancel_requested=draw(st.booleans()),
    )


@st.composite
def attempts(draw) -> Attempt:
    state = draw(
        st.sampled_from(
            [
                s
                for s in AttemptState
                if s not in (AttemptState.NEVER_SUBMITTED, AttemptState.UNKNOWN)
            ]
        )
    )
    n = draw(st.integers(0, 3))
    return Attempt(
        "r",
        n,
        state,
        job_id=None if state is AttemptState.SUBMITTING else "7",
        tag=tag("r", n),
        restart_count=draw(st.integers(0, 2)),
        nodes=list(NODES[:2]),
    )


def facts_for(draw_files: core.RunFiles, cancel: bool, down: bool, refused: bool) -> core.Facts:
    return core.Facts(
        cancel_requested=cancel,
        trusted=True,
        found=(),
        files=draw_files,
        usable={n: not (down and n == "n2") for n in NODES},
        previous_known=True,
        requeue_refused=refused,
        history=FailureHistory(2, 100.0),
    )


def ended(a: Attempt, info: JobInfo) -> bool:
    return a.state not in (AttemptState.SUBMITTING, AttemptState.REQUEUING) and (
        info.state.is_terminal or info.restart_count > a.restart_count
    )


@settings(max_examples=400, deadline=None)
@given(runs(), attempts(), observations, files, st.booleans(), st.booleans(), st.booleans())
def test_one_step(run, a, info, run_files, cancel, down, refused):
    facts = facts_for(run_files, cancel, down, refused)
    out = core.step(a, info, run, facts, NOW)
    assert not any(isinstance(i, core.Need) for i in out)  # it had every fact
    new = [i.attempt for i in out if isinstance(i, core.NewAttempt)]
    assert all(x.attempt > a.attempt for x in new) and len(new) <= 1
    # a submission only for an attempt that has no job yet
    if any(isinstance(i, (core.Submit, core.Adopt)) for i in out):
        assert a.state is AttemptState.SUBMITTING and a.job_id is None
    # the budget never goes negative, nor past its cap by spending
    cap = FtSettings(**run.settings).num_job_retries_on_failure
    for r in (i.run for i in out if isinstance(i, core.UpdateRun)):
        assert 0 <= r.job_retries_used <= max(cap, run.job_retries_used)
        assert r.job_retries_used >= run.job_retries_used
        assert r.continuations >= run.continuations >= 0
        assert all(v >= 0 for v in r.cause_counts.values())
    # a cancel request always wins: nothing starts again, an ended attempt ends the run
    if cancel or run.cancel_requested:
        assert not [i for i in out if isinstance(i, STARTS)], out
    if ended(a, info):
        # exactly one of: finish (the run ends), retry or continue (one next attempt)
        verdicts = [
            i.data["verdict"] for i in out if isinstance(i, core.Event) and i.kind == "ended"
        ]
        assert len(verdicts) == 1
        final = [i.run for i in out if isinstance(i, core.UpdateRun)][-1]
        if verdicts[0] in ("retry", "continue"):
            assert len(new) == 1 and not final.state.is_terminal
        else:
            assert not new and final.state.is_terminal
        if cancel or run.cancel_requested:  # cancelled, unless the training had finished
            assert final.state in (RunState.CANCELLED, RunState.COMPLETED)


@settings(max_examples=200, deadline=None)
@given(runs(), st.lists(st.tuples(observations, files, st.booleans()), min_size=1, max_size=12))
def test_no_attempt_is_submitted_twice(run, looks):
    """Steps applied one after another, whatever the scheduler shows: each attempt gets at
    most one submission, and attempt numbers only grow."""
    run = replace(run, cancel_requested=False)
    a = Attempt("r", 0, AttemptState.SUBMITTING, tag=tag("r", 0))
    submitted: list[int] = []
    for info, run_files, refused in looks:
        info = replace(info, restart_count=max(info.restart_count, a.restart_count - 1))
        out = core.step(a, info, run, facts_for(run_files, False, False, refused), NOW)
        for i in out:
            if isinstance(i, (core.Submit, core.Adopt)):
                submitted.append(a.attempt)
                a = replace(a, job_id="7", state=AttemptState.PENDING)
            elif isinstance(i, core.Record) and i.attempt.attempt == a.attempt:
                a = i.attempt
            elif isinstance(i, core.NewAttempt):
                assert i.attempt.attempt > a.attempt
                a = i.attempt
            elif isinstance(i, core.UpdateRun):
                run = i.run
            elif isinstance(i, core.Requeued):
                a = replace(a, state=AttemptState.PENDING)
        if run.state.is_terminal or any(isinstance(i, core.Finish) for i in out):
            break
    assert len(submitted) == len(set(submitted)), submitted


# ------------------------------------------------------------------------- quiet attempts
def _split(intents: list[core.Intent]) -> tuple[list[core.Intent], list[float]]:
    """The intents but the look wakes, and the look wakes' times."""
    return (
        [i for i in intents if not (isinstance(i, core.Wake) and i.look)],
        [i.at for i in intents if isinstance(i, core.Wake) and i.look],
    )


@st.composite
def watched(draw):  # type: ignore[no-untyped-def]
    """A queued or running attempt seen as recorded, its run, facts and a time."""
    state = draw(st.sampled_from([JobState.PENDING, JobState.RUNNING]))
    settings_ = FtSettings(
        preempt_time=draw(st.sampled_from([0, 60, 300])),
        exclude_stragglers=draw(st.booleans()),
        stop_if_straggler=draw(st.booleans()),
        use_launcher=draw(st.booleans()),
        straggler_report_interval_s=draw(st.sampled_from([10.0, 60.0])),
    )
    run = Run(
        run_id="r",
        name="r",
        state=RunState.RUNNING,
        created_at=0.0,
        spec={"options": {"nodes": 1, "exclude": []}, "run_dir": "/nowhere"},
        settings=settings_.model_dump(mode="json"),
    )
    start = NOW - draw(st.sampled_from([10.0, 500.0, 3000.0]))
    signalled = draw(st.one_of(st.none(), st.just(NOW - 5.0)))
    running = state is JobState.RUNNING
    a = Attempt(
        "r",
        0,
        AttemptState.of(state),
        job_id="7",
        tag=tag("r", 0),
        nodes=["n1"] if running else [],
        start=start if running else None,
        checkpoint_signal_at=signalled,
    )
    info = JobInfo(
        job_id="7",
        state=state,
        observed_at=NOW,
        nodes=("n1",) if running else (),
        start_time=start if running else None,
        time_limit_s=draw(st.sampled_from([None, 600, 3600])),
    )
    flags = tuple(
        NodeFlag(n, "why", NOW - 100, draw(st.one_of(st.none(), st.floats(NOW - 50, NOW + 500))))
        for n in draw(st.lists(st.sampled_from(NODES), unique=True, max_size=3))
    )
    report = draw(
        st.one_of(
            st.none(),
            st.builds(
                lambda nodes: {"attempt": 0, "persistent_nodes": nodes, "threshold": 0.75},
                st.lists(st.sampled_from(NODES), max_size=2),
            ),
        )
    )
    progress = draw(
        st.one_of(
            st.just({}),
            st.builds(lambda s: {"max_checkpoint_save_s": s}, st.sampled_from([1.0, 100.0, 400.0])),
        )
    )
    facts = core.Facts(flags=flags, files=core.RunFiles(progress=progress, straggler_report=report))
    return a, info, run, facts


@settings(max_examples=400, deadline=None)
@given(watched(), st.floats(0, 1), st.sampled_from([0.2, 1.0, 60.0]))
def test_a_quiet_step_decides_the_same_until_its_deadline(case, fraction, interval):
    """The rule the shell's skipping relies on (step's module doc): a step that decided
    nothing but when to look again decides the same, with the look wakes moved on by the
    time passed, at any later time before its earliest non-look Wake and the next flag
    expiry, whatever the loop's poll interval."""
    a, info, run, facts = case
    first = core.step(a, info, run, facts, NOW)
    quiet = all(isinstance(i, core.Wake) for i in first)
    event(f"quiet: {quiet}")
    if not quiet:
        return
    due = min(
        [i.at for i in first if not i.look]
        + [f.expires_at for f in facts.flags if f.expires_at is not None and f.expires_at > NOW],
        default=NOW + 10_000,
    )
    later = NOW + fraction * (due - NOW) * 0.999
    again = core.step(
        a, replace(info, observed_at=later), run, replace(facts, poll_interval=interval), later
    )
    (kept, looks), (kept_again, looks_again) = _split(first), _split(again)
    assert kept_again == kept
    assert looks_again == pytest.approx([t + (later - NOW) for t in looks])
