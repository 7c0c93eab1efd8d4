"""The virtual-clock mock: job models on the same Slurm state machine, time by events."""

from __future__ import annotations

import pytest

from ftslurm.backends.mock import MockConfig
from ftslurm.backends.mock.virtual import JobModel, VirtualCluster, simulate_campaign
from ftslurm.core.types import JobOptions, JobState

JOB = JobModel(work_s=10_000, checkpoint_interval_s=1_000, checkpoint_cost_s=10, restart_cost_s=100)


def test_job_model_arithmetic():
    assert JOB.finish_after(10_000) == 100 + 10_000 + 9 * 10
    assert JOB.saved_after(100 + 1_010 * 3 + 5, 10_000) == 3_000
    assert JOB.computed_after(100 + 1_010 * 3 + 500, 10_000) == 3_500
    assert JOB.saved_after(50, 10_000) == 0 and JOB.computed_after(50, 10_000) == 0


def test_an_undisturbed_job_completes_at_the_modelled_time():
    stats = simulate_campaign(nodes=4, spare_nodes=0, days=1, job=JOB, failures_per_node_day=0)
    assert stats.completed and stats.attempts == 1
    assert stats.wall_s == pytest.approx(JOB.finish_after(10_000))
    assert stats.productive_s == pytest.approx(10_000) and stats.lost_s == 0
    assert stats.by_ending == {"COMPLETED": 1}


def test_node_failure_loses_at_most_one_interval_and_waits_detection_and_requeue_delay():
    cfg = MockConfig(slurmd_timeout_s=300, requeue_delay_s=120)
    cluster = VirtualCluster(cfg.model_copy(update={"nodes": cfg.nodes}))
    job = cluster.submit(JobOptions(nodes=2), JOB)
    cluster.at(3_000, lambda: cluster.fail_node("n2"))
    cluster.run(until=2_900)
    assert cluster.st.jobs[job].state is JobState.RUNNING
    cluster.run(until=3_000 + 300 + 121)
    assert cluster.st.jobs[job].restart_count == 1
    assert cluster.st.jobs[job].nodes == ["n1", "n3"]  # n2 is down
    assert cluster.stats.lost_s == pytest.approx(3_000 - 100 - 2 * 1_010)
    assert cluster.remaining[job] == pytest.approx(8_000)


def test_a_job_whose_ranks_died_with_a_node_ends_at_once_when_cancelled():
    """Its run ended with the node; cancelled before Slurm notices, what is left stops at
    once and its nodes go to the next job (it used to wait for exits that never came)."""
    from ftslurm.backends.mock import model

    cluster = VirtualCluster(MockConfig(slurmd_timeout_s=300))
    job = cluster.submit(JobOptions(nodes=2), JOB)
    cluster.at(3_000, lambda: cluster.fail_node("n2"))
    cluster.run(until=3_010)
    assert cluster.st.jobs[job].state is JobState.RUNNING and job not in cluster.runs
    cluster.act(model.cancel(cluster.st, job, cluster.now))
    after = cluster.submit(JobOptions(nodes=3, exclude=["n2"]), JOB)
    cluster.run(until=3_011)
    assert cluster.st.jobs[job].state is JobState.CANCELLED
    assert cluster.st.jobs[after].state is JobState.RUNNING


def test_wall_limit_with_checkpoint_signal_continues_without_losing_work():
    stats = simulate_campaign(
        nodes=2, spare_nodes=0, days=2, job=JOB, failures_per_node_day=0, time_limit_s=3_000
    )
    assert stats.completed and stats.by_ending.get("TIMEOUT", 0) >= 3
    assert stats.lost_s > 0  # no warning signal asked for: work since the checkpoint is lost


def test_warning_signal_checkpoints_and_exits_for_a_continuation():
    cluster = VirtualCluster(MockConfig())
    cluster.submit(JobOptions(nodes=1, time_limit="50:00", signal="USR1@200"), JOB)
    ends: list[JobState] = []
    cluster.on_end = lambda jid, state: (ends.append(state), cluster.remaining.pop(jid))
    cluster.run(until=5_000)
    assert ends == [JobState.COMPLETED]  # exited 0 after the checkpoint, before the limit
    assert cluster.stats.lost_s == 0
    assert cluster.stats.productive_s == pytest.approx(JOB.computed_after(2_800, 10_000))


def test_a_month_of_2048_nodes_is_deterministic_per_seed():
    kwargs = dict(
        nodes=2048,
        spare_nodes=40,
        days=30,
        failures_per_node_day=3.79 / 1000,
        job=JobModel(
            work_s=25 * 86400, checkpoint_interval_s=1800, checkpoint_cost_s=60, restart_cost_s=300
        ),
    )
    a = simulate_campaign(seed=7, **kwargs)
    b = simulate_campaign(seed=7, **kwargs)
    assert (a.ettr, a.node_failures, a.attempts) == (b.ettr, b.node_failures, b.attempts)
    assert 150 < a.node_failures < 350  # ~3.79 per 1000 node-days
    assert 0.5 < a.ettr < 1.0


# ------------------------------------------------- two tiers and asynchronous saves
TIERED = JobModel(
    work_s=10_000,
    checkpoint_interval_s=1_000,
    checkpoint_cost_s=10,
    restart_cost_s=100,
    memory_interval_s=250,
    memory_cost_s=2,
    memory_restart_cost_s=40,
)
PERIOD = 4 * 250 + 3 * 2 + 10  # three memory saves, then one to disk


def test_two_tier_arithmetic_memory_every_segment_disk_every_fourth():
    assert TIERED.layout() == (250, 4) and TIERED.tiered and not JOB.tiered
    # one full period, two memory segments more, 100 s into the next
    computed, memory, disk = TIERED.positions(100 + PERIOD + 2 * 252 + 100, 10_000)
    assert (computed, memory, disk) == (1_600, 1_500, 1_000)
    assert TIERED.finish_after(10_000) == 100 + 10_000 + 9 * 10 + 30 * 2  # 39 saves, 9 disk
    assert TIERED.in_job_restart_cost_s == 40 and JOB.in_job_restart_cost_s == 100
    # one tier, unchanged: the memory position is the disk one
    assert JOB.positions(100 + 1_010 * 3 + 500, 10_000) == (3_500, 3_000, 3_000)


def test_an_in_job_restart_resumes_from_memory_a_new_allocation_from_disk():
    from ftslurm.backends.mock import model

    cluster = VirtualCluster(MockConfig(requeue_delay_s=0))
    job = cluster.submit(JobOptions(nodes=1), TIERED)
    at = 100 + PERIOD + 2 * 252 + 100  # memory holds 1500, disk 1000
    cluster.at(at, lambda: cluster.restart_in_job(job))
    cluster.run(until=at + 1)
    run = cluster.runs[job]
    assert run.remaining_at_start == 10_000 - 1_500  # from memory, not disk
    assert cluster._model(job, run).restart_cost_s == 40  # the cheaper restore
    assert cluster.memory_ahead_s(job) == 0  # taken up by the run
    assert cluster.stats.lost_s == 100  # only the work since the memory checkpoint
    # 20 s into the new run (its start-up not over) the job is requeued: a new allocation,
    # started at once (no requeue delay), from the disk checkpoint
    cluster.at(at + 20, lambda: cluster.act(model.requeue(cluster.st, job, False, cluster.now)))
    cluster.run(until=at + 21)
    run = cluster.runs[job]
    assert run.serial == 3 and run.remaining_at_start == 10_000 - 1_000
    assert run.rolled_back == 500  # memory was 500 s ahead of the disk: lost with it
    assert cluster._model(job, run).restart_cost_s == 100  # loads from disk
    assert cluster.stats.productive_s == 1_000 and cluster.stats.lost_s == 600


def test_an_asynchronous_save_floors_the_interval_and_counts_once_written():
    job = JobModel(
        work_s=10_000, checkpoint_interval_s=100, checkpoint_cost_s=5, restart_cost_s=0, write_s=300
    )
    assert job.layout() == (300, 1)  # the interval never shorter than the write
    assert job.positions(305 + 10, 10_000) == (310, 0, 0)  # snapshot taken, not yet written
    assert job.positions(305 + 300, 10_000) == (600, 300, 300)  # written
    assert job.exit_save_s == 305 and job.in_job_restart_cost_s == 0
    cluster = VirtualCluster(MockConfig())
    jid = cluster.submit(JobOptions(nodes=1), job)
    cluster.at(305 + 200, lambda: cluster.restart_in_job(jid))  # the write was cut short
    cluster.run(until=305 + 201)
    assert cluster.runs[jid].remaining_at_start == 10_000  # back to the start
    assert cluster.stats.lost_s == 500
