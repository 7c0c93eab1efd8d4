"""The mock scheduler's state machine, driven with explicit times (no processes, no clock)."""

from __future__ import annotations

import signal

import pytest

from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import (
    KillJob,
    KillNode,
    Launch,
    MockConfig,
    MockState,
    NodeDown,
    Signal,
)
from ftslurm.core.types import JobOptions, JobState, NodeState, SignalTarget
from ftslurm.errors import (
    ConfigError,
    InvalidJobId,
    InvalidPartition,
    JobStateConflict,
    SchedulerRejected,
)

T0 = 1_000.0


def cluster(**config) -> MockState:
    return MockState.create(MockConfig(**config))


def start(st: MockState, now: float = T0, **options) -> str:
    job = model.submit(st, "#!/bin/bash\ntrue\n", JobOptions(**options), now)
    return job


def test_submit_then_schedule_launches_fifo_on_free_cpus():
    st = cluster()
    a = start(st, nodes=2, ntasks_per_node=2)  # both CPUs of two nodes
    b = start(st, nodes=3)  # needs 3 nodes: only 2 free
    c = start(st, nodes=1)  # fits: simple backfill lets it pass b
    effects = model.advance(st, T0, {})
    assert effects == [Launch(a), Launch(c)]
    assert st.jobs[a].nodes == ["n1", "n2"] and st.jobs[c].nodes == ["n3"]
    assert st.jobs[b].state is JobState.PENDING and st.jobs[b].reason == "Resources"


def test_a_job_waiting_for_nodes_is_no_timed_event():
    """Only another event frees nodes: its past eligible time must not be due again and
    again (a controller sleeping until it would spin)."""
    st = cluster()
    start(st, nodes=4, ntasks_per_node=2, time_limit="10")
    blocked = start(st, nodes=1)
    model.advance(st, T0, {})
    assert st.jobs[blocked].reason == "Resources"
    assert model.next_event_time(st) == T0 + 600  # the running job's limit, not T0


def test_exit_status_decides_completed_or_failed():
    st = cluster()
    ok, bad, killed = (start(st) for _ in range(3))
    model.advance(st, T0, {})
    model.advance(st, T0 + 5, {ok: (0, None), bad: (3, None), killed: (0, 9)})
    assert st.jobs[ok].state is JobState.COMPLETED
    assert (st.jobs[bad].state, st.jobs[bad].exit_code) == (JobState.FAILED, 3)
    assert (st.jobs[killed].state, st.jobs[killed].signal) == (JobState.FAILED, 9)


def test_time_limit_sends_warning_then_term_then_kill_and_ends_in_timeout():
    st = cluster(kill_wait_s=30)
    job = start(st, time_limit="1", signal="B:USR1@20")
    model.advance(st, T0, {})
    assert model.next_event_time(st) == T0 + 40
    assert model.advance(st, T0 + 39, {}) == []
    assert model.advance(st, T0 + 40, {}) == [Signal(job, signal.SIGUSR1, SignalTarget.BATCH)]
    effects = model.advance(st, T0 + 60, {})
    assert effects == [
        Signal(job, signal.SIGCONT, SignalTarget.ALL),
        Signal(job, signal.SIGTERM, SignalTarget.ALL),
    ]
    assert st.jobs[job].state is JobState.COMPLETING
    assert model.advance(st, T0 + 90, {}) == [KillJob(job)]
    model.advance(st, T0 + 91, {job: (0, 9)})
    assert st.jobs[job].state is JobState.TIMEOUT


def test_requeue_waits_the_delay_unless_started_now():
    st = cluster(requeue_delay_s=120)
    job = start(st)
    model.advance(st, T0, {})
    model.requeue(st, job, False, T0 + 10)
    model.advance(st, T0 + 11, {job: (0, 15)})
    info = model.query(st, [job], T0 + 11)[job]
    assert (info.state, info.restart_count, info.reason) == (JobState.PENDING, 1, "BeginTime")
    assert model.advance(st, T0 + 100, {}) == []
    model.start_now(st, job, T0 + 100)
    assert model.advance(st, T0 + 100, {}) == [Launch(job)]


def test_requeue_delay_expires_by_itself():
    st = cluster(requeue_delay_s=120)
    job = start(st)
    model.advance(st, T0, {})
    model.requeue(st, job, False, T0)
    model.advance(st, T0, {job: (0, 15)})
    assert model.next_event_time(st) == T0 + 121
    assert model.advance(st, T0 + 121, {}) == [Launch(job)]


def test_requeue_hold_then_release():
    st = cluster()
    job = start(st)
    model.advance(st, T0, {})
    model.requeue(st, job, True, T0)
    model.advance(st, T0, {job: (0, 15)})
    model.start_now(st, job, T0)
    assert model.advance(st, T0 + 1, {}) == [] and st.jobs[job].reason == model.REQUEUE_HELD
    model.release(st, job)
    assert model.advance(st, T0 + 1, {}) == [Launch(job)]


def test_a_preemption_on_demand_terms_the_job_then_requeues_it_or_ends_it_preempted():
    """`ftslurm mock preempt JOB`: as the `preempt` injection, at the moment asked for."""
    st = cluster(requeue_delay_s=120, kill_wait_s=30)
    job = start(st)
    model.advance(st, T0, {})
    effects = model.preempt(st, job, T0 + 5)
    assert Signal(job, signal.SIGTERM, SignalTarget.ALL) in effects
    assert st.jobs[job].kill_at == T0 + 35  # SIGKILL after KillWait
    model.advance(st, T0 + 6, {job: (0, 15)})
    info = model.query(st, [job], T0 + 6)[job]
    assert (info.state, info.restart_count) == (JobState.PENDING, 1)  # PreemptMode=REQUEUE
    with pytest.raises(JobStateConflict, match="not running"):
        model.preempt(st, job, T0 + 7)  # pending: nothing to preempt
    st = cluster(preempt_requeue=False)
    job = start(st)
    model.advance(st, T0, {})
    model.preempt(st, job, T0 + 1)
    model.advance(st, T0 + 2, {job: (0, 15)})
    assert model.query(st, [job], T0 + 2)[job].state is JobState.PREEMPTED
    with pytest.raises(InvalidJobId):
        model.preempt(st, "999", T0)


def test_exclusion_only_on_pending_jobs_and_honoured():
    st = cluster()
    job = start(st, hold=True)
    model.update_excluded_nodes(st, job, ["n1", "n2", "n3"])
    model.release(st, job)
    model.advance(st, T0, {})
    assert st.jobs[job].nodes == ["n4"]
    with pytest.raises(JobStateConflict):
        model.update_excluded_nodes(st, job, ["n4"])


def test_node_failure_is_noticed_after_slurmd_timeout_and_requeues():
    st = cluster(slurmd_timeout_s=10)
    job = start(st, nodes=2)
    model.advance(st, T0, {})
    assert model.fail_node(st, "n2", T0 + 5) == [KillNode(job, "n2")]
    assert model.advance(st, T0 + 14, {}) == []
    assert [n.raw_state for n in model.node_infos(st)][1] == "mix*"
    effects = model.advance(st, T0 + 15, {})
    assert effects[0] == KillJob(job)
    info = model.query(st, [job], T0 + 15)[job]
    assert (info.state, info.restart_count) == (JobState.PENDING, 1)
    down = model.node_infos(st)[1]
    assert (down.state, down.reason, down.responding) == (NodeState.DOWN, "Not responding", False)
    model.revive_node(st, "n2")
    assert model.node_infos(st)[1].state is NodeState.IDLE


def test_a_node_failure_aimed_at_a_node_the_cluster_lacks_changes_nothing():
    """Issue 26 item 4: `node_fail@3:n99` once made every mock operation raise KeyError and
    the controller die; `submit` refuses it now, and a job that carries one (recorded
    before) runs on untouched."""
    st = cluster()
    job = start(st, nodes=1, inject=("node_fail@3:n99",))
    model.advance(st, T0, {})
    model.advance(st, T0 + 5, {})
    assert model.query(st, [job], T0 + 5)[job].state is JobState.RUNNING
    assert all(n.responding for n in model.node_infos(st))


def test_node_failure_without_requeue_ends_in_node_fail():
    st = cluster(slurmd_timeout_s=10)
    job = start(st, requeue=False)
    model.advance(st, T0, {})
    model.fail_node(st, "n1", T0)
    model.advance(st, T0 + 10, {})
    assert st.jobs[job].state is JobState.NODE_FAIL


def test_a_no_kill_job_shrinks_to_its_other_nodes_and_runs_on():
    """As Slurm 22.05 (tests/data/nokill_22.05.txt): the job stays RUNNING, the lost node
    leaves its node list once declared down, the steps are told; a new job may not use it."""
    st = cluster(slurmd_timeout_s=10)
    job = start(st, nodes=3, no_kill=True)
    model.advance(st, T0, {})
    assert st.jobs[job].nodes == ["n1", "n2", "n3"]
    assert model.fail_node(st, "n2", T0 + 5) == [KillNode(job, "n2")]
    assert model.advance(st, T0 + 14, {}) == []  # not yet declared down: nothing changes
    assert model.query(st, [job], T0 + 14)[job].nodes == ("n1", "n2", "n3")
    assert model.advance(st, T0 + 15, {}) == [NodeDown(job, "n2")]
    info = model.query(st, [job], T0 + 15)[job]
    assert (info.state, info.nodes, info.restart_count) == (JobState.RUNNING, ("n1", "n3"), 0)
    assert model.node_infos(st)[1].state is NodeState.DOWN
    model.fail_node(st, "n3", T0 + 20)  # a second loss: the job shrinks again
    assert model.advance(st, T0 + 30, {}) == [NodeDown(job, "n3")]
    assert st.jobs[job].nodes == ["n1"]
    model.advance(st, T0 + 40, {job: (0, None)})  # the batch script ends as it chooses
    assert st.jobs[job].state is JobState.COMPLETED


def test_a_no_kill_job_on_its_last_node_or_without_the_flag_ends_as_before():
    st = cluster(slurmd_timeout_s=10)
    one = start(st, nodes=1, no_kill=True)  # nothing left to shrink to
    plain = start(st, nodes=2)
    model.advance(st, T0, {})
    assert st.jobs[one].nodes == ["n1"] and st.jobs[plain].nodes == ["n1", "n2"]
    model.fail_node(st, "n1", T0)
    assert model.advance(st, T0 + 10, {})[:2] == [KillJob(one), KillJob(plain)]
    assert [st.jobs[j].restart_count for j in (one, plain)] == [1, 1]


def test_a_no_kill_job_that_loses_its_batch_host_runs_on_until_its_limit():
    """Slurm keeps such a job RUNNING on the nodes left, with no batch script, until it is
    cancelled or its time limit ends it; its vanished batch script ends nothing."""
    st = cluster(slurmd_timeout_s=10, kill_wait_s=5)
    job = start(st, nodes=2, no_kill=True, time_limit="2")
    model.advance(st, T0, {})
    model.fail_node(st, "n1", T0 + 5)  # the batch host
    # (the shell reports no ending while a node of the job is silent)
    assert model.advance(st, T0 + 15, {}) == [NodeDown(job, "n1")]
    model.advance(st, T0 + 20, {job: (None, None)})
    info = model.query(st, [job], T0 + 20)[job]
    assert (info.state, info.nodes) == (JobState.RUNNING, ("n2",))
    model.advance(st, T0 + 120, {})
    assert st.jobs[job].state is JobState.COMPLETING
    model.advance(st, T0 + 121, {job: (None, None)})
    assert st.jobs[job].state is JobState.TIMEOUT


def test_min_job_age_moves_ended_jobs_to_accounting():
    st = cluster(min_job_age_s=300)
    job = start(st)
    model.advance(st, T0, {})
    model.advance(st, T0 + 1, {job: (0, None)})
    assert model.query(st, [job], T0 + 2)[job].from_accounting is False
    model.advance(st, T0 + 301, {})
    info = model.query(st, [job], T0 + 301)[job]
    assert (info.state, info.from_accounting) == (JobState.COMPLETED, True)
    assert job not in st.jobs
    no_acct = cluster(min_job_age_s=300, accounting=False)
    other = start(no_acct)
    model.advance(no_acct, T0, {})
    model.advance(no_acct, T0 + 1, {other: (0, None)})
    model.advance(no_acct, T0 + 301, {})
    assert model.query(no_acct, [other], T0 + 301)[other].state is JobState.UNKNOWN


def test_find_jobs_asks_accounting_only_with_since_and_only_when_the_controller_has_none():
    st = cluster(min_job_age_s=300)
    job = start(st, comment="tag-a")
    other = start(st, T0 + 50, comment="tag-b")
    model.advance(st, T0, {})
    assert [j.job_id for j in model.find_jobs(st, "tag-a", None, T0)] == [job]
    model.advance(st, T0 + 1, {job: (0, None)})
    model.advance(st, T0 + 400, {other: (0, None)})
    model.advance(st, T0 + 301 + 400, {})
    assert model.find_jobs(st, "tag-a", None, T0 + 800) == []  # squeue forgot it
    found = model.find_jobs(st, "tag-a", T0, T0 + 800)
    assert [(j.job_id, j.from_accounting) for j in found] == [(job, True)]
    assert model.find_jobs(st, "tag-a", T0 + 10, T0 + 800) == []  # submitted before `since`
    assert [j.job_id for j in model.find_jobs(st, "tag-b", T0 + 10, T0 + 800)] == [other]


def test_cancel_pending_is_immediate_running_goes_through_term():
    st = cluster()
    running = start(st)
    held = start(st, hold=True)
    model.advance(st, T0, {})
    assert model.cancel(st, held, T0) == []
    assert st.jobs[held].state is JobState.CANCELLED
    assert Signal(running, signal.SIGTERM, SignalTarget.ALL) in model.cancel(st, running, T0)
    model.advance(st, T0 + 1, {running: (0, 15)})
    assert st.jobs[running].state is JobState.CANCELLED
    assert model.cancel(st, running, T0 + 2) == []  # idempotent


def test_errors_match_slurms():
    st = cluster()
    with pytest.raises(InvalidPartition):
        start(st, partition="nope")
    with pytest.raises(SchedulerRejected):
        start(st, nodes=5)
    with pytest.raises(ConfigError):
        start(st, time_limit="soon")
    with pytest.raises(ConfigError):
        start(st, signal="USR1@")
    with pytest.raises(InvalidJobId):
        model.cancel(st, "999", T0)
    job = start(st, hold=True)
    with pytest.raises(JobStateConflict):
        model.requeue(st, job, False, T0)
    with pytest.raises(JobStateConflict):
        model.send_signal(st, job, "USR1", SignalTarget.STEPS)


def test_state_round_trips_through_json():
    st = cluster()
    start(st, nodes=2, time_limit="5", signal="USR1@30", comment="c")
    model.advance(st, T0, {})
    again = MockState.model_validate_json(st.model_dump_json())
    assert again == st
