"""`ftslurm.daemon.step`: the reconcile loop's decisions as a table (pure, no scheduler)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftslurm.core.cadence import FailureHistory
from ftslurm.core.contract import Disambiguation
from ftslurm.core.leases import Lease, Seen, never_started, never_started_at, observe
from ftslurm.core.settings import FtSettings
from ftslurm.core.types import JobInfo, JobState
from ftslurm.daemon import step as core
from ftslurm.daemon.records import Attempt, AttemptState, NodeFlag, Run, RunState, tag
from ftslurm.report.notes import validation_text

NOW = 10_000.0
NODES = {"n1": True, "n2": True, "n3": True, "n4": True}


def run(**kw) -> Run:
    """A run; its periodic checkpoints off unless `settings` say (their own tests below)."""
    settings = {"checkpoint_interval": "off", **kw.pop("settings", {})}
    base = Run(
        run_id="r",
        name="r",
        state=RunState.RUNNING,
        created_at=0.0,
        spec={"options": {"nodes": 2, "exclude": []}, "run_dir": "/nowhere"},
        settings=FtSettings(**settings).model_dump(mode="json"),
    )
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
    kw.setdefault("history", FailureHistory())
    return core.Facts(**kw)


def kinds(intents) -> list[str]:
    return [type(i).__name__ for i in intents]


def test_a_step_asks_for_what_it_lacks_and_nothing_else():
    assert core.step(attempt(AttemptState.SUBMITTING), None, run(), core.Facts(), NOW) == [
        core.Need(frozenset({"cancel"}))
    ]
    assert core.step(
        attempt(AttemptState.SUBMITTING), None, run(), core.Facts(cancel_requested=False), NOW
    ) == [core.Need(frozenset({"found"}))]
    assert core.step(attempt(), info(JobState.FAILED), run(), core.Facts(), NOW) == [
        core.Need(frozenset({"cancel", "files", "nodes", "previous"}))
    ]


@pytest.mark.parametrize(
    "facts, want",
    [
        (known(trusted=True), [core.Submit(())]),
        (known(found=()), [core.Submit(())]),
        (
            known(
                trusted=True,
                flags=(
                    NodeFlag("n3", "node_fail", NOW - 5, NOW + 5),
                    NodeFlag("n4", "old", 0.0, NOW - 1),
                ),
            ),
            [core.Submit(("n3",))],
        ),
        (known(cancel_requested=True), [core.Finish(RunState.CANCELLED, "cancelled by the user")]),
    ],
)
def test_submitting(facts, want):
    assert core.step(attempt(AttemptState.SUBMITTING), None, run(), facts, NOW) == want


def test_submitting_adopts_the_newest_job_carrying_its_tag():
    found = (info(JobState.RUNNING), replace(info(JobState.PENDING), job_id="12"))
    (adopt,) = core.step(attempt(AttemptState.SUBMITTING), None, run(), known(found=found), NOW)
    assert isinstance(adopt, core.Adopt) and adopt.job.job_id == "12"


REQ = dict(state=AttemptState.REQUEUING, n=1, restart_count=1)


@pytest.mark.parametrize(
    "observed, facts, want",
    [
        # Slurm has not counted the requeue yet: requeue it (held) once it has ended
        (info(JobState.FAILED), known(), ["Requeue"]),
        (info(JobState.COMPLETING), known(), []),
        # held and pending: exclusions, release, start now, then recorded
        (
            info(JobState.PENDING, restart_count=1),
            known(),
            ["SetExclusions", "Release", "StartNow", "Requeued", "Changed"],
        ),
        # back already (a daemon released it and died before recording that)
        (info(JobState.RUNNING, restart_count=1), known(), ["Requeued", "Changed"]),
        # cancel asked for meanwhile: the held job is cancelled, an ended one ends the run
        (info(JobState.PENDING, restart_count=1), known(cancel_requested=True), ["Cancel"]),
        (info(JobState.FAILED), known(cancel_requested=True), ["Finish"]),
        # the scheduler refused the requeue of a forgotten job: submit afresh (trusted)
        (info(JobState.COMPLETED), known(requeue_refused=True), ["Record", "Trust"]),
        (info(JobState.PENDING), known(requeue_refused=True), []),
    ],
)
def test_requeuing(observed, facts, want):
    assert kinds(core.step(attempt(**REQ), observed, run(), facts, NOW)) == want


def test_a_requeue_sets_the_flagged_nodes_with_the_spec_exclusions():
    flags = (NodeFlag("n3", "node_fail", NOW - 5, None),)
    r = run(spec={"options": {"nodes": 2, "exclude": ["n9"]}, "run_dir": "/nowhere"})
    out = core.step(
        attempt(**REQ), info(JobState.PENDING, restart_count=1), r, known(flags=flags), NOW
    )
    assert out[0] == core.SetExclusions("7", ("n3", "n9")) and out[3] == core.Requeued(("n3", "n9"))


def test_a_fresh_submission_after_a_refused_requeue_gets_its_own_tag_and_no_job():
    out = core.step(
        attempt(**REQ), info(JobState.COMPLETED), run(), known(requeue_refused=True), NOW
    )
    fresh = out[0].attempt
    assert (fresh.state, fresh.job_id, fresh.restart_count, fresh.tag) == (
        AttemptState.SUBMITTING,
        None,
        0,
        tag("r", 1),
    )


def test_watch_records_the_start_and_the_recovery_latency():
    prev = replace(attempt(state=AttemptState.NODE_FAIL), failure_seen_at=NOW - 30)
    a = attempt(AttemptState.PENDING, n=1)
    out = core.step(
        a,
        info(JobState.RUNNING, start_time=NOW - 1),
        run(state=RunState.PENDING),
        known(previous=prev),
        NOW,
    )
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
    out = core.step(
        attempt(start=NOW), observed, run(settings={"exclude_stragglers": False}), known(), NOW
    )
    assert out == [core.Wake(NOW + 3600 - 60)]


def test_a_cancel_request_cancels_a_watched_job():
    out = core.step(attempt(), info(JobState.RUNNING), run(cancel_requested=True), known(), NOW)
    assert out == [core.Cancel("7")]


STRAGGLER = {
    "attempt": 0,
    "persistent_nodes": ["n2"],
    "threshold": 0.75,
    "scores": [{"node": "n2", "relative": 0.4, "individual": 0.5}],
}


def test_a_persistent_straggler_is_flagged_and_with_stop_the_job_moves_off_it():
    files = core.RunFiles(straggler_report=STRAGGLER)
    observed = info(JobState.RUNNING, start_time=NOW - 10)
    flag_only = core.step(attempt(start=NOW - 10), observed, run(), known(files=files), NOW)
    assert kinds(flag_only)[:2] == ["FlagNode", "Event"] and "NewAttempt" not in kinds(flag_only)
    r = run(settings={"stop_if_straggler": True})
    moved = core.step(attempt(start=NOW - 10), observed, r, known(files=files), NOW)
    nxt = next(i.attempt for i in moved if isinstance(i, core.NewAttempt))
    assert (nxt.attempt, nxt.state, nxt.job_id, nxt.restart_count) == (
        1,
        AttemptState.REQUEUING,
        "7",
        1,
    )
    assert "Signal" not in kinds(moved)


def test_with_a_spare_left_a_straggler_is_only_flagged_and_its_launcher_steps_out():
    """`stop_if_straggler` moves the job, but not while a spare can take the straggler's
    place inside it: the node is flagged, the launchers swap; no requeue."""
    files = core.RunFiles(straggler_report=STRAGGLER)
    observed = info(JobState.RUNNING, start_time=NOW - 10)
    r = run(settings={"stop_if_straggler": True, "spare_nodes": 1})
    out = core.step(attempt(start=NOW - 10), observed, r, known(files=files), NOW)
    assert kinds(out)[:2] == ["FlagNode", "Event"] and out[0].node == "n2"
    assert out[1].data["recovery"] == "spare"
    assert not of(out, core.NewAttempt) and not of(out, core.Record)


@pytest.mark.parametrize(
    "spares, benched_rank, report",
    [
        (1, 2, STRAGGLER),  # the only spare went to another node that stepped out
        (1, None, {**STRAGGLER, "persistent_nodes": ["n1"]}),  # the batch host is the straggler
    ],
)
def test_without_a_spare_for_it_a_straggler_moves_the_job_as_before(spares, benched_rank, report):
    benched = (
        ()
        if benched_rank is None
        else ({"node_rank": benched_rank, "node": "n3", "why": "hang", "attempt": 0},)
    )
    files = core.RunFiles(straggler_report=report, benched=benched, launchers_read=True)
    a = replace(
        attempt(start=NOW - 10), nodes=["n1", "n2", "n3"], lost_nodes=["n3"] if benched else []
    )
    observed = info(JobState.RUNNING, start_time=NOW - 10, nodes=("n1", "n2", "n3"))
    r = run(settings={"stop_if_straggler": True, "spare_nodes": spares})
    out = core.step(a, observed, r, known(files=files), NOW)
    assert of(out, core.NewAttempt), kinds(out)
    assert "recovery" not in next(e for e in of(out, core.Event) if e.kind == "straggler").data


@pytest.mark.parametrize(
    "observed, files, facts_kw, run_state, nxt_state",
    [
        # a node failure, the job still known to the controller: requeue the same job
        (info(JobState.NODE_FAIL), core.RunFiles(), {}, None, AttemptState.REQUEUING),
        # known only from accounting: it cannot be requeued, submit afresh
        (
            info(JobState.FAILED, from_accounting=True),
            core.RunFiles(),
            {},
            None,
            AttemptState.SUBMITTING,
        ),
        # Slurm requeued it itself: the next attempt is the same job, counted
        (
            info(JobState.PENDING, restart_count=1),
            core.RunFiles(),
            {},
            None,
            AttemptState.REQUEUING,
        ),
        (
            info(JobState.COMPLETED),
            core.RunFiles(finished_marker=True),
            {},
            RunState.COMPLETED,
            None,
        ),
        (info(JobState.FAILED, exit_code=93), core.RunFiles(), {}, RunState.FAILED, None),
        # a cancel request wins over a retry
        (
            info(JobState.NODE_FAIL),
            core.RunFiles(),
            {"cancel_requested": True},
            RunState.CANCELLED,
            None,
        ),
    ],
)
def test_an_ending(observed, files, facts_kw, run_state, nxt_state):
    out = core.step(attempt(start=NOW - 50), observed, run(), known(files=files, **facts_kw), NOW)
    updates = [i.run for i in out if isinstance(i, core.UpdateRun)]
    new = [i.attempt for i in out if isinstance(i, core.NewAttempt)]
    assert updates[-1].state is (run_state or RunState.RUNNING)
    assert [a.state for a in new] == ([nxt_state] if nxt_state else [])
    ended = [i for i in out if isinstance(i, core.Event) and i.kind == "ended"]
    assert len(ended) == 1


def test_an_ending_flags_the_down_node_for_the_ttl():
    out = core.step(
        attempt(start=NOW - 50),
        info(JobState.NODE_FAIL),
        run(),
        known(usable={**NODES, "n2": False}),
        NOW,
    )
    flags = [i for i in out if isinstance(i, core.FlagNode)]
    assert [(f.node, f.ttl_s) for f in flags] == [("n2", FtSettings().node_exclusion_ttl_s)]


# ------------------------------------------------------------------ a lost node (peers)
def lost_report(rank: int = 1, node: str = "n2", attempt_no: int = 0, **kw) -> dict:
    """A launcher's peer-loss report (ftslurm.agent.peers): node `node` silent for 21 s."""
    return {
        "lost_node_rank": rank,
        "lost_node": node,
        "last_heard": NOW - 25.0,
        "lease_time": NOW - 25.0,
        "silent_s": 21.0,
        "peer_timeout_s": 20.0,
        "reported_by": "n1" if node != "n1" else "n2",
        "reported_by_node_rank": 0,
        "time": NOW - 4.0,
        "job_id": "7",
        "attempt": attempt_no,
        **kw,
    }


def lost_files(*reports: dict, **kw) -> core.RunFiles:
    return core.RunFiles(lost=reports, **kw)


def of(intents, kind):  # type: ignore[no-untyped-def]
    return [i for i in intents if isinstance(i, kind)]


def test_a_peer_report_ends_the_attempt_at_once_and_a_fresh_job_follows():
    """Spare-less: the attempt ends as a node failure while its job still runs, the node is
    flagged, the detection recorded with its latency, and the next attempt is a fresh
    submission (not a requeue: a requeued job waits for the lost node until SlurmdTimeout)."""
    r = run(settings={"num_job_retries_on_failure": 3})
    out = core.step(
        attempt(), info(JobState.RUNNING), r, known(files=lost_files(lost_report())), NOW
    )
    assert not of(out, core.Cancel)  # the next attempt's step cancels it, before submitting
    (flag,) = of(out, core.FlagNode)
    assert flag.node == "n2"
    (lost,) = [e for e in of(out, core.Event) if e.kind == "node_lost"]
    assert lost.data == {
        "attempt": 0,
        "job_id": "7",
        "node": "n2",
        "node_rank": 1,
        "recovery": "new_job",
        "source": "peer",
        "reported_by": "n1",
        "last_heard": NOW - 25.0,
        "time": NOW - 4.0,
        "detection_s": 21.0,
    }
    (ended,) = of(out, core.Record)
    assert ended.attempt.state is AttemptState.NODE_FAIL and ended.attempt.cause == "node_fail"
    assert ended.attempt.lost_nodes == ["n2"] and ended.attempt.failure_seen_at == NOW
    assert "n2 lost: reported by n1 after 21 s" in ended.attempt.reason
    assert "Slurm had not noticed yet" in ended.attempt.reason
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.job_retries_used == 1 and upd.run.cause_counts == {"node_fail": 1}
    (nxt,) = of(out, core.NewAttempt)
    assert (nxt.attempt.attempt, nxt.attempt.state, nxt.attempt.job_id) == (
        1,
        AttemptState.SUBMITTING,
        None,
    )
    assert of(out, core.Trust) == [core.Trust(1)]


def test_a_report_already_acted_on_is_not_acted_on_again():
    a = attempt(lost_nodes=["n2"])
    out = core.step(a, info(JobState.RUNNING), run(), known(files=lost_files(lost_report())), NOW)
    assert not of(out, core.Record) and not of(out, core.FlagNode) and not of(out, core.Event)


def test_a_report_of_another_attempt_is_not_this_ones():
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(),
        known(files=lost_files(lost_report(attempt_no=3))),
        NOW,
    )
    assert not of(out, core.Record)


def test_a_report_seen_while_the_job_is_completing_is_acted_on():
    """The survivors exit at once; Slurm keeps the job COMPLETING on the dead node."""
    a = attempt(state=AttemptState.COMPLETING)
    out = core.step(
        a, info(JobState.COMPLETING), run(), known(files=lost_files(lost_report())), NOW
    )
    assert [i.attempt.state for i in of(out, core.NewAttempt)] == [AttemptState.SUBMITTING]


def test_the_next_attempt_cancels_the_lost_job_before_it_submits():
    """Also after a crash between recording and cancelling: the step of the submission
    intent cancels the old job first (a repeat is harmless)."""
    prev = replace(attempt(), state=AttemptState.NODE_FAIL, cause="node_fail", lost_nodes=["n2"])
    a = attempt(AttemptState.SUBMITTING, n=1)
    assert core.step(a, None, run(), core.Facts(cancel_requested=False, trusted=True), NOW) == [
        core.Need(frozenset({"previous"}))
    ]
    flags = (NodeFlag("n2", "lost (peer report)", NOW, NOW + 3600),)
    out = core.step(a, None, run(), known(trusted=True, previous=prev, flags=flags), NOW)
    assert out == [core.Cancel("7"), core.Submit(("n2",))]
    out = core.step(a, None, run(), known(found=(), previous=prev, flags=flags), NOW)
    assert out == [core.Cancel("7"), core.Submit(("n2",))]  # restarted daemon, nothing found
    found = (replace(info(JobState.PENDING), job_id="8"),)
    assert kinds(core.step(a, None, run(), known(found=found, previous=prev), NOW)) == ["Adopt"]
    assert core.step(
        a, None, run(), known(trusted=True, previous=prev, cancel_requested=True), NOW
    ) == [core.Cancel("7"), core.Finish(RunState.CANCELLED, core.CANCELLED_BY_USER)]
    other = replace(prev, lost_nodes=[])  # an ordinary ending: nothing to cancel
    assert core.step(a, None, run(), known(trusted=True, previous=other), NOW) == [core.Submit(())]


def test_with_a_spare_the_job_runs_on_and_the_node_is_flagged():
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=lost_files(lost_report())),
        NOW,
    )
    assert kinds(out) == ["FlagNode", "Event", "Record", "Changed"]
    assert out[1].data["recovery"] == "spare"
    assert out[2].attempt.state is AttemptState.RUNNING and out[2].attempt.lost_nodes == ["n2"]


@pytest.mark.parametrize(
    "role, spares, left",
    [
        ("spare", 1, 0),  # an idle spare lost: none left
        ("warm_spare", 2, 1),
        ("active", 2, 1),
    ],
)
def test_the_lost_nodes_event_says_its_role_and_the_spares_left(role, spares, left):
    """The loss report's role (what the lost node's lease said) reaches the `node_lost`
    event with the spares left after it: `status` and `report` tell a spare that restarted
    no one from a swap."""
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": spares}),
        known(files=lost_files(lost_report(role=role))),
        NOW,
    )
    (lost,) = [e for e in of(out, core.Event) if e.kind == "node_lost"]
    assert (lost.data["role"], lost.data["spares_remaining"]) == (role, left)
    assert lost.data["recovery"] == "spare"


def test_the_batch_host_lost_needs_a_new_job_even_with_a_spare():
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=lost_files(lost_report(rank=0, node="n1"))),
        NOW,
    )
    assert [e.data["recovery"] for e in of(out, core.Event) if e.kind == "node_lost"] == ["new_job"]
    assert of(out, core.NewAttempt)


def test_a_benched_node_is_flagged_and_uses_a_spare():
    benched = {"node_rank": 1, "node": "n2", "why": "hang", "time": NOW - 1, "attempt": 0}
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=core.RunFiles(benched=(benched,))),
        NOW,
    )
    assert kinds(out) == ["FlagNode", "Event", "Record", "Changed"]
    assert out[0].reason == "benched: hang" and out[1].kind == "node_benched"


def test_a_spent_budget_fails_the_run_and_cancels_the_job_first():
    r = run(settings={"num_job_retries_on_failure": 1}, job_retries_used=1)
    out = core.step(
        attempt(), info(JobState.RUNNING), r, known(files=lost_files(lost_report())), NOW
    )
    assert isinstance(out[0], core.Cancel) and out[0].job_id == "7"
    assert not of(out, core.NewAttempt)
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.state is RunState.FAILED
    assert "n2 lost" in upd.run.reason and "retry budget exhausted" in upd.run.reason


def test_a_job_ended_with_a_lost_report_is_a_node_failure_not_a_crash():
    """The survivors died of the loss (exit 1): node_fail, the node excluded, a fresh job."""
    out = core.step(
        attempt(),
        info(JobState.FAILED, exit_code=1),
        run(),
        known(files=lost_files(lost_report())),
        NOW,
    )
    (rec,) = of(out, core.Record)
    assert rec.attempt.cause == "node_fail" and rec.attempt.lost_nodes == ["n2"]
    assert [f.node for f in of(out, core.FlagNode)] == ["n2"]
    assert [e.data["source"] for e in of(out, core.Event) if e.kind == "node_lost"] == ["peer"]
    (nxt,) = of(out, core.NewAttempt)
    assert nxt.attempt.state is AttemptState.SUBMITTING


def test_slurms_verdict_first_is_recorded_with_its_latency_from_the_last_lease():
    """NODE_FAIL before any report: as before (Slurm requeued it: the requeue path), plus
    a `node_lost` event from Slurm with the time since the node's last lease."""
    lease = {"node_rank": 1, "node": "n2", "pid": 1, "seq": 9, "time": NOW - 40.0}
    out = core.step(
        attempt(),
        info(JobState.PENDING, restart_count=1),
        run(),
        known(usable={**NODES, "n2": False}, files=core.RunFiles(leases=(lease,))),
        NOW,
    )
    (lost,) = [e for e in of(out, core.Event) if e.kind == "node_lost"]
    assert (lost.data["source"], lost.data["node"], lost.data["detection_s"]) == (
        "slurm",
        "n2",
        40.0,
    )
    (nxt,) = of(out, core.NewAttempt)
    assert nxt.attempt.state is AttemptState.REQUEUING  # nothing else changes


@pytest.mark.parametrize(
    "listed", [("n1",), ("n3", "n4")], ids=["survivors-completing", "already-elsewhere"]
)
def test_a_requeue_for_a_lost_node_is_a_node_failure_whatever_slurm_lists_now(listed):
    """Slurm requeues a job whose node it declared down and lists only the survivors while
    they complete (seen on the real cluster: COMPLETING, Restarts=1, NodeList=n1), then the
    next allocation: the ending is judged on the nodes the attempt ran on."""
    out = core.step(
        attempt(start=NOW - 600),
        info(JobState.COMPLETING, restart_count=1, nodes=listed),
        run(),
        known(
            usable={**NODES, "n2": False},
            files=core.RunFiles(rank_reports=({"rank": 1, "node": "n1", "outcome": "failed"},)),
        ),
        NOW,
    )
    (ended,) = [e for e in of(out, core.Event) if e.kind == "ended"]
    assert ended.data["cause"] == "node_fail", ended.data
    assert [(f.node) for f in of(out, core.FlagNode)] == ["n2"]
    assert [e.data["source"] for e in of(out, core.Event) if e.kind == "node_lost"] == ["slurm"]
    (record,) = [r.attempt for r in of(out, core.Record) if r.attempt.attempt == 0]
    assert record.nodes == ["n1", "n2"]


def test_a_new_round_of_ranks_is_recorded_as_an_in_job_restart():
    rnd = {
        "round": 1,
        "started_at": NOW - 2,
        "first_step_at": None,
        "why": "n2 lost",
        "lost": ["n2"],
        "attempt": 0,
    }
    a = attempt(lost_nodes=["n2"])
    out = core.step(
        a,
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=lost_files(lost_report(), rounds=(rnd,))),
        NOW,
    )
    assert out == [core.Need(frozenset({"node_reports"}))]  # live launchers all done?
    out = core.step(
        a,
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=lost_files(lost_report(), rounds=(rnd,), launchers_read=True)),
        NOW,
    )
    (rec,) = of(out, core.Record)
    assert rec.attempt.in_job_restarts == 1
    assert [e.data["round"] for e in of(out, core.Event) if e.kind == "in_job_restart"] == [1]
    a = replace(a, in_job_restarts=1)
    out = core.step(
        a,
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=lost_files(lost_report(), rounds=(rnd,), launchers_read=True)),
        NOW,
    )
    assert not of(out, core.Record)


def node_report(rank: int, node: str, outcome: str = "finished", code: int = 0) -> dict:
    return {
        "node_rank": rank,
        "node": node,
        "outcome": outcome,
        "exit_code": code,
        "ended_at": NOW - 5,
    }


def test_a_spare_run_whose_live_launchers_are_done_ends_without_waiting_for_slurm():
    """With --no-kill the step (and the job) waits for the dead node's task until Slurm
    marks the node down (SlurmdTimeout): the run is over when every live launcher has
    reported, and the stuck job is cancelled once that is recorded."""
    a = replace(attempt(lost_nodes=["n2"]), nodes=["n1", "n2", "n3"])
    r = run(settings={"spare_nodes": 1})
    job = info(JobState.RUNNING, nodes=("n1", "n2", "n3"))
    done = (node_report(0, "n1"), node_report(2, "n3"))
    files = lost_files(lost_report(), node_reports=done[:1], launchers_read=True)
    out = core.step(a, job, r, known(files=files), NOW)
    assert not of(out, core.Record) and not of(out, core.Cancel)  # n3 still runs
    files = lost_files(lost_report(), node_reports=done, launchers_read=True, finished_marker=True)
    out = core.step(a, job, r, known(files=files), NOW)
    (rec,) = of(out, core.Record)
    assert rec.attempt.cause == "finished" and rec.attempt.state is AttemptState.COMPLETED
    assert of(out, core.UpdateRun)[-1].run.state is RunState.COMPLETED
    assert kinds(out)[-1] == "Cancel" and out[-1] == core.Cancel("7")  # after the records
    # checkpointed (75 from every live node): it goes on in a fresh job, not a requeue of
    # the stuck one, whose cancel comes again before the submission (`_lost_job`)
    done = (node_report(0, "n1", "checkpointed", 75), node_report(2, "n3", "checkpointed", 75))
    files = lost_files(lost_report(), node_reports=done, launchers_read=True)
    out = core.step(a, job, r, known(files=files), NOW)
    (nxt,) = of(out, core.NewAttempt)
    assert nxt.attempt.state is AttemptState.SUBMITTING and out[-1] == core.Cancel("7")
    assert of(out, core.Record)[0].attempt.cause == "checkpointed"


def test_a_straggler_flagged_then_benched_is_flagged_once():
    """The straggler report flagged it; its bench record then must not flag it again (a
    second flag so soon would count it a repeat offender and double its exclusion)."""
    benched = {"node_rank": 1, "node": "n2", "why": "straggler", "time": NOW - 1, "attempt": 0}
    flags = (NodeFlag("n2", "straggler", NOW - 60, NOW + 3600),)
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=core.RunFiles(benched=(benched,)), flags=flags),
        NOW,
    )
    assert not of(out, core.FlagNode)
    assert [e.kind for e in of(out, core.Event)] == ["node_benched"]
    out = core.step(
        attempt(),
        info(JobState.RUNNING),
        run(settings={"spare_nodes": 1}),
        known(files=core.RunFiles(benched=(benched,))),
        NOW,
    )  # not flagged yet
    assert [f.node for f in of(out, core.FlagNode)] == ["n2"]


def test_the_signal_lead_covers_an_asynchronous_saves_background_write():
    """An asynchronous save blocks 6 s, then writes 60 s in the background; the job waits for
    that write before it exits, so the lead must cover both (2 x 66 + 5 s, not 60 s)."""
    observed = info(JobState.RUNNING, start_time=NOW, time_limit_s=3600)
    r = run(settings={"exclude_stragglers": False})
    progress = {"max_checkpoint_save_s": 6.0, "max_checkpoint_write_s": 60.0}
    out = core.step(
        attempt(start=NOW), observed, r, known(files=core.RunFiles(progress=progress)), NOW
    )
    assert core.Wake(NOW + 3600 - (2 * 66 + 5)) in out
    sync = core.step(
        attempt(start=NOW),
        observed,
        r,
        known(files=core.RunFiles(progress={"max_checkpoint_save_s": 6.0})),
        NOW,
    )
    assert core.Wake(NOW + 3600 - 60) in sync


def launcher_failed(node_rank: int = 1, node: str = "n2", **kw) -> dict:
    """A launcher's report that it failed before its ranks started (ftslurm.agent.launch)."""
    return {
        "node_rank": node_rank,
        "node": node,
        "job_id": "7",
        "attempt": 0,
        "error": "RendezvousTimeoutError: the rendezvous timed out",
        "phase": "rendezvous",
        "exit_code": 1,
        "time": NOW - 1.0,
        **kw,
    }


def test_a_launcher_failed_before_its_ranks_started_ends_the_running_attempt_at_once():
    """The job still runs (the other launchers wait at the rendezvous): the attempt ends
    now as a failure whose reason starts with the launcher's error, the next attempt is a
    fresh job, and the old one is cancelled once that is recorded."""
    r = run(settings={"num_job_retries_on_failure": 2})
    files = core.RunFiles(
        launchers_failed=(
            launcher_failed(time=NOW - 0.5),
            launcher_failed(0, "n1", error="a later one"),
        )
    )
    out = core.step(attempt(), info(JobState.RUNNING), r, known(files=files), NOW)
    (ended,) = of(out, core.Record)
    assert ended.attempt.state is AttemptState.FAILED and ended.attempt.cause == "crash"
    assert ended.attempt.reason.startswith(
        "a launcher failed before its ranks started (node n1, node rank 0, in the "
        "rendezvous): a later one; "
    )  # the first by time
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.reason == ended.attempt.reason and upd.run.job_retries_used == 1
    (event,) = [e for e in of(out, core.Event) if e.kind == "ended"]
    assert event.data["reason"] == ended.attempt.reason
    assert event.data["launcher_failed"]["node"] == "n1"
    (nxt,) = of(out, core.NewAttempt)
    assert (nxt.attempt.state, nxt.attempt.job_id) == (AttemptState.SUBMITTING, None)
    assert of(out, core.Cancel) == [core.Cancel("7")]


def test_a_launcher_failure_of_another_job_or_after_a_loss_is_not_this_attempts():
    files = core.RunFiles(launchers_failed=(launcher_failed(job_id="6"),))
    out = core.step(attempt(), info(JobState.RUNNING), run(), known(files=files), NOW)
    assert not of(out, core.Record) and not of(out, core.Cancel)
    files = core.RunFiles(launchers_failed=(launcher_failed(),))
    out = core.step(
        attempt(lost_nodes=["n2"]),
        info(JobState.RUNNING),
        run(),
        known(files=files, previous=None),
        NOW,
    )
    assert not of(out, core.NewAttempt)


def test_an_ending_after_a_launcher_failed_says_so_first_in_its_reason():
    files = core.RunFiles(launchers_failed=(launcher_failed(),), launchers_read=True)
    out = core.step(attempt(), info(JobState.FAILED, exit_code=1), run(), known(files=files), NOW)
    (ended,) = of(out, core.Record)
    assert ended.attempt.reason.startswith(
        "a launcher failed before its ranks started "
        "(node n2, node rank 1, in the rendezvous): "
        "RendezvousTimeoutError"
    ), ended.attempt.reason


def _batch(lease: bool) -> Seen:
    """The batch host's lease as the daemon watches it: read a second ago, or never since
    the watch began 1000 s ago."""
    seen = Seen(0, NOW - 1000)
    return observe(seen, Lease(0, "n1", 1, 1, NOW - 1), NOW - 1, NOW - 1) if lease else seen


@pytest.mark.parametrize(
    "lease, launched_at, state, lost, ends",
    [
        # the step started 181 s ago, no lease ever: its Python never ran
        (False, NOW - 181, JobState.RUNNING, [], True),
        (False, NOW - 179, JobState.RUNNING, [], False),  # not yet: a slow import of torch
        (True, NOW - 181, JobState.RUNNING, [], False),  # a lease was read: it started
        (False, None, JobState.RUNNING, [], False),  # no mark: the setup lines still run
        (False, NOW - 181, JobState.PENDING, [], False),  # not running
        (False, NOW - 181, JobState.RUNNING, ["n2"], False),  # a loss explains it
    ],
)
def test_a_launcher_that_never_started_ends_the_attempt_after_the_start_timeout(
    lease, launched_at, state, lost, ends
):
    """Node rank 0's launcher never wrote its lease within `launcher_start_timeout_s`
    (180 s by default) of the batch script's start of the step: the attempt ends now, its
    reason says the launcher never started on that node, the next attempt is a fresh job
    and the old one is cancelled; until then, a wake at the time it falls due."""
    files = core.RunFiles(batch_lease=_batch(lease), launched_at=launched_at)
    a = attempt(lost_nodes=lost) if lost else attempt()
    out = core.step(a, info(state), run(), known(files=files), NOW)
    if not ends:
        assert not of(out, core.NewAttempt) and not of(out, core.Cancel), out
        wakes = [w.at for w in of(out, core.Wake) if not w.look]
        due = launched_at + 180 if launched_at is not None else None
        if state is JobState.RUNNING and not lost and not lease and due is not None:
            assert due in wakes, out
        else:
            assert due not in wakes, out
        return
    (ended,) = of(out, core.Record)
    assert ended.attempt.state is AttemptState.FAILED, ended
    assert ended.attempt.reason.startswith(
        "the launcher never started on node n1 (node rank 0): no sign of it 180 s after "
        "the job's step started (launcher_start_timeout_s)"
    ), ended.attempt.reason
    (event,) = [e for e in of(out, core.Event) if e.kind == "ended"]
    assert event.data["launcher_failed"]["phase"] == "start"
    (nxt,) = of(out, core.NewAttempt)
    assert (nxt.attempt.state, nxt.attempt.job_id) == (AttemptState.SUBMITTING, None)
    assert of(out, core.Cancel) == [core.Cancel("7")]


def test_the_start_timeout_is_a_run_setting():
    files = core.RunFiles(batch_lease=_batch(False), launched_at=NOW - 31)
    r = run(settings={"launcher_start_timeout_s": 30})
    out = core.step(attempt(), info(JobState.RUNNING), r, known(files=files), NOW)
    assert of(out, core.Cancel) == [core.Cancel("7")]
    assert FtSettings().launcher_start_timeout_s == 180


@pytest.mark.parametrize(
    "seen, launched_at, now, verdict",
    [
        (Seen(0, 0.0), 100.0, 281.0, True),
        (Seen(0, 0.0), 100.0, 280.0, False),
        (
            observe(Seen(0, 0.0), Lease(0, "n1", 1, 1, 5.0, ended="failed"), 5.0, 5.0),
            0.0,
            1e9,
            False,
        ),
        (Seen(0, 0.0), None, 1e9, False),
        (None, 0.0, 1e9, False),
    ],
)
def test_never_started_is_a_pure_rule_of_the_lease_and_the_mark(seen, launched_at, now, verdict):
    assert never_started(seen, launched_at, now, 180.0) is verdict
    due = never_started_at(seen, launched_at, 180.0)
    assert due == (
        launched_at + 180.0
        if seen is not None and seen.lease is None and launched_at is not None
        else None
    )


def test_an_ending_records_the_injections_that_fired_so_no_later_job_repeats_them():
    """Issue 25: each injection fires once per run. Ended by a peer report (a fresh job
    follows) after running past node_fail@10, the run records it as fired; an attempt
    that ended before 10 s did not reach it; the crash its ranks report is recorded too,
    a straggler never (its node stays slow)."""
    spec = {**run().spec, "inject": ["node_fail@10", "crash@3:1", "straggler@1:0*2"]}
    r = run(spec=spec, settings={"num_job_retries_on_failure": 3})
    out = core.step(
        attempt(start=NOW - 30),
        info(JobState.RUNNING),
        r,
        known(files=lost_files(lost_report())),
        NOW,
    )
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.injected == ["node_fail@10"]
    # A requeued job whose ranks reported the crash, and which ran 5 s only
    reports = ({"rank": 1, "outcome": "killed", "injected": ["crash@3:1", "straggler@1:0*2"]},)
    out = core.step(
        attempt(start=NOW - 5),
        info(JobState.PENDING, restart_count=1),
        r,
        known(files=core.RunFiles(rank_reports=reports)),
        NOW,
    )
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.injected == ["crash@3:1"]
    # what fired before stays
    out = core.step(
        attempt(start=NOW - 5),
        info(JobState.FAILED, exit_code=1, end_time=NOW),
        replace(r, injected=["node_fail@10"]),
        known(),
        NOW,
    )
    assert of(out, core.UpdateRun)[-1].run.injected == ["node_fail@10"]


def test_the_reason_says_what_the_first_failed_rank_said():
    """Issue 25: a user error or a crash names the rank's exception in the reason."""
    reports = (
        {
            "rank": 1,
            "node": "n2",
            "outcome": "killed",
            "ended_at": NOW - 1,
            "error_line": "RuntimeError: peer closed the connection",
        },
        {
            "rank": 0,
            "node": "n1",
            "outcome": "user_error",
            "ended_at": NOW - 3,
            "error_line": "ModuleNotFoundError: No module named 'foo'",
        },
        {"rank": 2, "node": "n2", "outcome": "finished"},
    )
    assert core.first_error(reports) == "rank 0 (n1): ModuleNotFoundError: No module named 'foo'"
    assert core.first_error(reports[2:]) == ""
    out = core.step(
        attempt(start=NOW - 5),
        info(JobState.FAILED, exit_code=1, end_time=NOW),
        run(),
        known(files=core.RunFiles(rank_reports=reports)),
        NOW,
    )
    (rec,) = of(out, core.Record)
    assert rec.attempt.cause == "user_error"
    assert rec.attempt.reason == (
        "user error: it would fail the same way again; rank 0 (n1): "
        "ModuleNotFoundError: No module named 'foo'"
    )
    assert of(out, core.UpdateRun)[-1].run.reason == rec.attempt.reason


# ------------------------------------------------------------ result validation (16, 17)
def _rank_report(outcome: str, node: str, code: int) -> dict:
    return {"rank": 0, "node": node, "outcome": outcome, "exit_code": code}


def test_exit_16_flags_the_attempts_nodes_and_a_fresh_job_re_runs_elsewhere():
    """The first 16 of a run: both nodes flagged (result validation, the usual TTL), no
    failure budget spent, a `validation` event, and the next attempt is a fresh submission
    (a requeued job would run the old script, without the disambiguation context)."""
    files = core.RunFiles(
        rank_reports=(_rank_report("resume_elsewhere", "n1", 16),), progress={"checkpoint_step": 40}
    )
    out = core.step(
        attempt(start=NOW - 50), info(JobState.FAILED, exit_code=16), run(), known(files=files), NOW
    )
    flags = of(out, core.FlagNode)
    assert [(f.node, f.reason, f.ttl_s) for f in flags] == [
        (n, "result validation (exit 16)", FtSettings().node_exclusion_ttl_s) for n in ("n1", "n2")
    ]
    (updated,) = [r for r in of(out, core.UpdateRun) if r.run.cause_counts]
    assert updated.run.job_retries_used == 0 and updated.run.cause_counts == {"resume_elsewhere": 1}
    (nxt,) = of(out, core.NewAttempt)
    assert nxt.attempt.state is AttemptState.SUBMITTING and nxt.attempt.job_id is None
    (event,) = [e for e in of(out, core.Event) if e.kind == "validation"]
    assert event.data["verdict"] == "disambiguate" and event.data["flagged"] == ["n1", "n2"]
    assert event.data["exit_code"] == 16


def test_the_next_submission_carries_the_disambiguation_context_and_excludes_the_nodes():
    prev = replace(
        attempt(AttemptState.FAILED, exit_code=16), cause="resume_elsewhere", nodes=["n1", "n2"]
    )
    flags = tuple(
        NodeFlag(n, "result validation (exit 16)", NOW - 5, NOW + 86400, "r") for n in ("n1", "n2")
    )
    a = Attempt("r", 1, AttemptState.SUBMITTING, tag=tag("r", 1))
    r = run(last_checkpoint_step=40)
    out = core.step(a, None, r, known(trusted=True, previous=prev, flags=flags), NOW)
    assert kinds(out) == ["Cancel", "Submit"]  # the old job first: harmless when it ended
    (submit,) = of(out, core.Submit)
    assert submit.exclude == ("n1", "n2")
    assert submit.disambiguate == Disambiguation(attempt=0, nodes=("n1", "n2"), step=40)
    # an ordinary retry carries none
    crashed = replace(prev, cause="crash")
    out = core.step(a, None, r, known(trusted=True, previous=crashed, flags=flags), NOW)
    assert of(out, core.Submit)[0].disambiguate is None


def test_a_second_16_spends_the_budget_and_re_runs_elsewhere_again():
    files = core.RunFiles(rank_reports=(_rank_report("resume_elsewhere", "n3", 16),))
    r = run(cause_counts={"resume_elsewhere": 1})
    a = replace(attempt(start=NOW - 50, n=1), nodes=["n3", "n4"])
    observed = info(JobState.FAILED, exit_code=16, nodes=("n3", "n4"))
    usable = {**NODES, "n5": True, "n6": True}
    out = core.step(a, observed, r, known(files=files, usable=usable), NOW)
    (updated,) = [u for u in of(out, core.UpdateRun) if u.run.job_retries_used]
    assert updated.run.job_retries_used == 1
    assert updated.run.cause_counts == {"resume_elsewhere": 2}
    assert [f.node for f in of(out, core.FlagNode)] == ["n3", "n4"]
    assert of(out, core.NewAttempt)[0].attempt.state is AttemptState.SUBMITTING


def test_a_16_with_no_other_nodes_fails_the_run_with_the_reason():
    files = core.RunFiles(rank_reports=(_rank_report("resume_elsewhere", "n1", 16),))
    usable = {"n1": True, "n2": True, "n3": True}  # the job needs 2: one of n1, n2 again
    out = core.step(
        attempt(start=NOW - 50),
        info(JobState.FAILED, exit_code=16),
        run(),
        known(files=files, usable=usable),
        NOW,
    )
    (ended,) = [u.run for u in of(out, core.UpdateRun) if u.run.state is RunState.FAILED]
    assert "no other nodes to re-run on" in (ended.reason or "")
    assert not of(out, core.NewAttempt)
    (event,) = [e for e in of(out, core.Event) if e.kind == "validation"]
    assert event.data["verdict"] == "fail"


def test_exit_17_after_a_disambiguation_run_fails_the_run_and_unflags_the_runs_nodes():
    """Only the run's own result-validation flags are removed: another run's, or a node
    flagged since for another reason, stay."""
    flags = (
        NodeFlag("n1", "result validation (exit 16)", NOW - 60, NOW + 86400, "r"),
        NodeFlag("n2", "result validation (exit 16)", NOW - 60, NOW + 86400, "r"),
        NodeFlag("n5", "result validation (exit 16)", NOW - 60, NOW + 86400, "other"),
        NodeFlag("n6", "node_fail under the run", NOW - 60, NOW + 86400, "r"),
    )
    files = core.RunFiles(rank_reports=(_rank_report("failed_validation", "n3", 17),))
    r = run(cause_counts={"resume_elsewhere": 1})
    a = replace(attempt(start=NOW - 50, n=1), nodes=["n3", "n4"])
    observed = info(JobState.FAILED, exit_code=17, nodes=("n3", "n4"))
    out = core.step(a, observed, r, known(files=files, flags=flags), NOW)
    assert of(out, core.UnflagNode) == [
        core.UnflagNode("n1", "result validation (exit 16)", "r"),
        core.UnflagNode("n2", "result validation (exit 16)", "r"),
    ]
    (ended,) = [u.run for u in of(out, core.UpdateRun) if u.run.state is RunState.FAILED]
    assert ended.reason is not None
    assert "the result reproduced on different hardware: the model's, not the machine's" in (
        ended.reason
    )
    assert not of(out, core.NewAttempt) and not of(out, core.FlagNode)
    (event,) = [e for e in of(out, core.Event) if e.kind == "validation"]
    assert event.data["verdict"] == "reproduced" and event.data["unflagged"] == ["n1", "n2"]


def test_exit_0_after_a_disambiguation_run_completes_and_the_flags_stay():
    flags = tuple(
        NodeFlag(n, "result validation (exit 16)", NOW - 60, NOW + 86400, "r") for n in ("n1", "n2")
    )
    r = run(cause_counts={"resume_elsewhere": 1})
    a = replace(attempt(start=NOW - 50, n=1), nodes=["n3", "n4"])
    observed = info(JobState.COMPLETED, exit_code=0, nodes=("n3", "n4"))
    out = core.step(a, observed, r, known(flags=flags), NOW)
    assert [u.run.state for u in of(out, core.UpdateRun)][-1] is RunState.COMPLETED
    assert not of(out, core.UnflagNode)
    assert not [e for e in of(out, core.Event) if e.kind == "validation"]


def test_a_16_in_a_job_slurm_requeued_itself_cancels_it_for_the_fresh_one():
    """A preempted job that exited 16 and that Slurm requeued: the disambiguation run is a
    fresh job, so the requeued one is cancelled once the ending is recorded."""
    files = core.RunFiles(rank_reports=(_rank_report("resume_elsewhere", "n1", 16),))
    observed = info(JobState.PENDING, exit_code=16, restart_count=1)
    out = core.step(attempt(start=NOW - 50), observed, run(), known(files=files), NOW)
    assert of(out, core.NewAttempt)[0].attempt.state is AttemptState.SUBMITTING
    assert out[-1] == core.Cancel("7")


def test_a_cancelled_run_that_exited_16_records_no_validation():
    files = core.RunFiles(rank_reports=(_rank_report("resume_elsewhere", "n1", 16),))
    r = run(cancel_requested=True)
    out = core.step(
        attempt(start=NOW - 50), info(JobState.FAILED, exit_code=16), r, known(files=files), NOW
    )
    assert [u.run.state for u in of(out, core.UpdateRun)][-1] is RunState.CANCELLED
    assert not of(out, core.FlagNode) and not of(out, core.NewAttempt)
    assert not [e for e in of(out, core.Event) if e.kind == "validation"]


def _checks(node: str, attempt: int, rank: int, *verdicts: str) -> dict:
    """A rank's validation report with one event per verdict."""
    events = [{"step": 10 + i, "kind": "nan", "verdict": v} for i, v in enumerate(verdicts)]
    return {"rank": rank, "node": node, "attempt": attempt, "checks": 50, "events": events}


@pytest.mark.parametrize(
    "reports, settings, flags, flagged",
    [
        # two transient faults on n2's ranks, over two attempts: flagged, at the second
        (
            [_checks("n2", 0, 1, "transient"), _checks("n2", 1, 1, "transient")],
            {},
            (),
            ["n2"],
        ),
        # on two ranks of one node in one attempt: the node's count
        ([_checks("n1", 0, 0, "transient"), _checks("n1", 0, 1, "transient")], {}, (), ["n1"]),
        # one on each node: chance, nobody flagged
        ([_checks("n1", 0, 0, "transient"), _checks("n2", 0, 1, "transient")], {}, (), []),
        # other verdicts do not count (a re-run that reproduced, non-determinism, stats)
        ([_checks("n1", 0, 0, "persistent", "ok", "counted", "correct")], {}, (), []),
        # the setting: 3 needed; 0 never; nor without exclusions
        ([_checks("n1", 0, 0, "transient", "transient")], {"transient_faults_to_flag": 3}, (), []),
        ([_checks("n1", 0, 0, "transient")], {"transient_faults_to_flag": 1}, (), ["n1"]),
        ([_checks("n1", 0, 0, "transient", "transient")], {"transient_faults_to_flag": 0}, (), []),
        ([_checks("n1", 0, 0, "transient", "transient")], {"exclude_failed_nodes": False}, (), []),
        # flagged once by the run: not again at a later ending (its TTL would grow); another
        # run's flag, or one for another reason, does not count
        (
            [_checks("n1", 0, 0, "transient", "transient")],
            {},
            (NodeFlag("n1", "result validation: 2 x", NOW - 9, NOW + 9, "r"),),
            [],
        ),
        (
            [_checks("n1", 0, 0, "transient", "transient")],
            {},
            (NodeFlag("n1", "result validation: 2 x", NOW - 9, NOW + 9, "other"),),
            ["n1"],
        ),
    ],
)
def test_a_node_with_repeated_transient_result_faults_is_flagged_at_an_ending(
    reports, settings, flags, flagged
):
    """Issue 30: the transient faults the rank agents' re-runs found (a re-run that
    differed: the node computed wrong, then right) are counted per node over the run; at
    `transient_faults_to_flag` (2) the node is flagged for result validation when an attempt
    ends, and a `validation` event says so. The run itself goes on as it would."""
    r = run(settings=settings)
    files = core.RunFiles(validation=tuple(reports), finished_marker=True)
    out = core.step(
        attempt(start=NOW - 50),
        info(JobState.COMPLETED, exit_code=0),
        r,
        known(files=files, flags=flags),
        NOW,
    )
    assert [u.run.state for u in of(out, core.UpdateRun)][-1] is RunState.COMPLETED
    found = of(out, core.FlagNode)
    assert [f.node for f in found] == flagged
    events = [e for e in of(out, core.Event) if e.kind == "validation"]
    if not flagged:
        assert not events
        return
    n = sum(
        1
        for x in reports
        if x["node"] == flagged[0]
        for e in x["events"]
        if e["verdict"] == "transient"
    )
    assert found[0].reason == f"result validation: {n} transient result faults on its ranks"
    (event,) = events
    assert event.data["verdict"] == "flaky" and event.data["flagged"] == flagged
    assert validation_text(event.data) == (
        f"attempt 0 ended: nodes flagged (result validation): {flagged[0]}: {found[0].reason}"
    )


def test_an_ending_records_the_spoiled_results_its_ranks_report():
    """Issue 30: a nan or spike a rank's validation carried out (its report lists it) is
    recorded as fired, so no later job fires it again."""
    spec = {**run().spec, "inject": ["nan@3:1", "spike@2:0:persistent", "straggler@1:0*2"]}
    r = run(spec=spec, settings={"num_job_retries_on_failure": 3})
    reports = (
        {"rank": 1, "outcome": "killed", "injected": ["nan@3:1", "straggler@1:0*2"]},
        {"rank": 0, "outcome": "killed", "injected": ["spike@2:0:persistent"]},
    )
    out = core.step(
        attempt(start=NOW - 5),
        info(JobState.PENDING, restart_count=1),
        r,
        known(files=core.RunFiles(rank_reports=reports)),
        NOW,
    )
    (upd,) = of(out, core.UpdateRun)
    assert upd.run.injected == ["nan@3:1", "spike@2:0:persistent"]
