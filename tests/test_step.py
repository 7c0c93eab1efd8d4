"""`ftslurm.daemon.step`: the reconcile loop's decisions as a table (pure, no scheduler)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftslurm.core.settings import FtSettings
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import step as core
from ftslurm.daemon.records import Attempt, AttemptState, NodeFlag, Run, RunState, tag

NOW = 10_000.0
NODES = {"n1": True, "n2": True, "n3": True, "n4": True}


def run(**kw) -> Run:
    base = Run(run_id="r", name="r", state=RunState.RUNNING, created_at=0.0,
               spec={"options": {"nodes": 2, "exclude": []}, "run_dir": "/nowhere"},
               settings=FtSettings(**kw.pop("settings", {})).model_dump(mode="json"))
    return replace(base, **kw)


def attempt(state: AttemptState = AttemptState.RUNNING, **kw) -> Attempt:
    kw.setdefault("job_id", None if state is AttemptState.SUBMITTING else "7")
    return Attempt("r", kw.pop("n", 0), state, tag=tag("r", 0), nodes=["n1", "n2"], **kw)


def info(state: JobState, **kw) -> JobInfo:
    kw.setdefault("nodes", ("n1", "n2"))
    return JobInfo(job_id="7", state=state, observed_at=NOW, **kw)


def known(**kw) -> core.Facts:
    """Facts with everything read (nothing left to ask for)."""
    kw.setdefault("cancel_requested", False)
    kw.setdefault("usable", NODES)
    kw.setdefault("files", core.RunFiles())
    kw.setdefault("previous_known", True)
    return core.Facts(**kw)


def kinds(intents) -> list[str]:
    return [type(i).__name__ for i in intents]


def test_a_step_asks_for_what_it_lacks_and_nothing_else():
    assert core.step(attempt(AttemptState.SUBMITTING), None, run(), core.Facts(), NOW) == [
        core.Need(frozenset({"cancel"}))]
    assert core.step(attempt(AttemptState.SUBMITTING), None, run(),
                     core.Facts(cancel_requested=False), NOW) == [
        core.Need(frozenset({"found"}))]  # fmt: skip
    assert core.step(attempt(), info(JobState.FAILED), run(), core.Facts(), NOW) == [
        core.Need(frozenset({"cancel", "files", "nodes", "previous"}))]


@pytest.mark.parametrize("facts, want", [
    (known(trusted=True), [core.Submit(())]),
    (known(found=()), [core.Submit(())]),
    (known(trusted=True, flags=(NodeFlag("n3", "node_fail", NOW - 5, NOW + 5),
                                NodeFlag("n4", "old", 0.0, NOW - 1))), [core.Submit(("n3",))]),
    (known(cancel_requested=True), [core.Finish(RunState.CANCELLED, "cancelled by the user")]),
])  # fmt: skip
def test_submitting(facts, want):
    assert core.step(attempt(AttemptState.SUBMITTING), None, run(), facts, NOW) == want


def test_submitting_adopts_the_newest_job_carrying_its_tag():
    found = (info(JobState.RUNNING), replace(info(JobState.PENDING), job_id="12"))
    (adopt,) = core.step(attempt(AttemptState.SUBMITTING), None, run(), known(found=found), NOW)
    assert isinstance(adopt, core.Adopt) and adopt.job.job_id == "12"


REQ = dict(state=AttemptState.REQUEUING, n=1, restart_count=1)


@pytest.mark.parametrize("observed, facts, want", [
    # Slurm has not counted the requeue yet: requeue it (held) once it has ended
    (info(JobState.FAILED), known(), ["Requeue"]),
    (info(JobState.COMPLETING), known(), []),
    # held and pending: exclusions, release, start now, then recorded
    (info(JobState.PENDING, restart_count=1), known(),
     ["SetExclusions", "Release", "StartNow", "Requeued", "Changed"]),
    # back already (a daemon released it and died before recording that)
    (info(JobState.RUNNING, restart_count=1), known(), ["Requeued", "Changed"]),
    # cancel asked for meanwhile: the held job is cancelled, an ended one ends the run
    (info(JobState.PENDING, restart_count=1), known(cancel_requested=True), ["Cancel"]),
    (info(JobState.FAILED), known(cancel_requested=True), ["Finish"]),
    # the scheduler refused the requeue of a forgotten job: submit afresh (trusted)
    (info(JobState.COMPLETED), known(requeue_refused=True), ["Record", "Trust"]),
    (info(JobState.PENDING), known(requeue_refused=True), []),
])  # fmt: skip
def test_requeuing(observed, facts, want):
    assert kinds(core.step(attempt(**REQ), observed, run(), facts, NOW)) == want


def test_a_requeue_sets_the_flagged_nodes_with_the_spec_exclusions():
    flags = (NodeFlag("n3", "node_fail", NOW - 5, None),)
    r = run(spec={"options": {"nodes": 2, "exclude": ["n9"]}, "run_dir": "/nowhere"})
    out = core.step(attempt(**REQ), info(JobState.PENDING, restart_count=1), r,
                    known(flags=flags), NOW)  # fmt: skip
    assert out[0] == core.SetExclusions("7", ("n3", "n9")) and out[3] == core.Requeued(
        ("n3", "n9"))


def test_a_fresh_submission_after_a_refused_requeue_gets_its_own_tag_and_no_job():
    out = core.step(attempt(**REQ), info(JobState.COMPLETED), run(),
                    known(requeue_refused=True), NOW)  # fmt: skip
    fresh = out[0].attempt
    assert (fresh.state, fresh.job_id, fresh.restart_count, fresh.tag) == (
        AttemptState.SUBMITTING, None, 0, tag("r", 1))


def test_watch_records_the_start_and_the_recovery_latency():
    prev = replace(attempt(state=AttemptState.NODE_FAIL), failure_seen_at=NOW - 30)
    a = attempt(AttemptState.PENDING, n=1)
    out = core.step(a, info(JobState.RUNNING, start_time=NOW - 1), run(state=RunState.PENDING),
                    known(previous=prev), NOW)  # fmt: skip
    assert kinds(out)[:4] == ["Record", "Changed", "UpdateRun", "Event"]
    assert out[2].run.state is RunState.RUNNING
    assert out[3] == core.Event("recovered", {"attempt": 1, "job_id": "7", "latency_s": 30.0})


def test_the_checkpoint_signal_is_recorded_before_it_is_sent_and_sent_once():
    observed = info(JobState.RUNNING, start_time=NOW - 100, time_limit_s=130)
    out = core.step(attempt(start=NOW - 100), observed, run(), known(), NOW)
    assert kinds(out)[-3:] == ["Record", "Signal", "Wake"]
    assert out[-2] == core.Signal("7", "USR2") and out[-3].attempt.checkpoint_signal_at == NOW
    again = core.step(out[-3].attempt, observed, run(), known(), NOW + 1)
    assert "Signal" not in kinds(again)


def test_a_signal_not_due_yet_asks_to_be_woken_when_it_is():
    observed = info(JobState.RUNNING, start_time=NOW, time_limit_s=3600)
    out = core.step(attempt(start=NOW), observed, run(settings={"exclude_stragglers": False}),
                    known(), NOW)  # fmt: skip
    assert out == [core.Wake(NOW + 3600 - 60)]


def test_a_cancel_request_cancels_a_watched_job():
    out = core.step(attempt(), info(JobState.RUNNING), run(cancel_requested=True), known(), NOW)
    assert out == [core.Cancel("7")]


STRAGGLER = {"attempt": 0, "persistent_nodes": ["n2"], "threshold": 0.75,
             "scores": [{"node": "n2", "relative": 0.4, "individual": 0.5}]}


def test_a_persistent_straggler_is_flagged_and_with_stop_the_job_moves_off_it():
    files = core.RunFiles(straggler_report=STRAGGLER)
    observed = info(JobState.RUNNING, start_time=NOW - 10)
    flag_only = core.step(attempt(start=NOW - 10), observed, run(), known(files=files), NOW)
    assert kinds(flag_only)[:2] == ["FlagNode", "Event"] and "NewAttempt" not in kinds(flag_only)
    r = run(settings={"stop_if_straggler": True})
    moved = core.step(attempt(start=NOW - 10), observed, r, known(files=files), NOW)
    nxt = next(i.attempt for i in moved if isinstance(i, core.NewAttempt))
    assert (nxt.attempt, nxt.state, nxt.job_id, nxt.restart_count) == (
        1, AttemptState.REQUEUING, "7", 1)
    assert "Signal" not in kinds(moved)


@pytest.mark.parametrize("observed, files, facts_kw, run_state, nxt_state", [
    # a node failure, the job still known to the controller: requeue the same job
    (info(JobState.NODE_FAIL), core.RunFiles(), {}, None, AttemptState.REQUEUING),
    # known only from accounting: it cannot be requeued, submit afresh
    (info(JobState.FAILED, from_accounting=True), core.RunFiles(), {}, None,
     AttemptState.SUBMITTING),
    # Slurm requeued it itself: the next attempt is the same job, counted
    (info(JobState.PENDING, restart_count=1), core.RunFiles(), {}, None, AttemptState.REQUEUING),
    (info(JobState.COMPLETED), core.RunFiles(finished_marker=True), {}, RunState.COMPLETED, None),
    (info(JobState.FAILED, exit_code=93), core.RunFiles(), {}, RunState.FAILED, None),
    # a cancel request wins over a retry
    (info(JobState.NODE_FAIL), core.RunFiles(), {"cancel_requested": True},
     RunState.CANCELLED, None),
])  # fmt: skip
def test_an_ending(observed, files, facts_kw, run_state, nxt_state):
    out = core.step(attempt(start=NOW - 50), observed, run(), known(files=files, **facts_kw), NOW)
    updates = [i.run for i in out if isinstance(i, core.UpdateRun)]
    new = [i.attempt for i in out if isinstance(i, core.NewAttempt)]
    assert updates[-1].state is (run_state or RunState.RUNNING)
    assert [a.state for a in new] == ([nxt_state] if nxt_state else [])
    ended = [i for i in out if isinstance(i, core.Event) and i.kind == "ended"]
    assert len(ended) == 1


def test_an_ending_flags_the_down_node_for_the_ttl():
    out = core.step(attempt(start=NOW - 50), info(JobState.NODE_FAIL), run(),
                    known(usable={**NODES, "n2": False}), NOW)  # fmt: skip
    flags = [i for i in out if isinstance(i, core.FlagNode)]
    assert [(f.node, f.ttl_s) for f in flags] == [("n2", FtSettings().node_exclusion_ttl_s)]
