"""One scenario suite, two backends: the mock scheduler must behave as the real Slurm does.

Each test runs against `mock` (MockScheduler with its controller), `slurm` (the Slurm
CLI backend on the real local 22.05 cluster) and, when that cluster is wanted, `slurm-24.11`
(the same backend on the Slurm 24.11 cluster; conftest's CLUSTER_PARAMS). Where they
differ, the test fails and the fix goes into the mock (or, between releases, the backend).
Durations that are cluster settings (requeue delay, KillWait, time limits) come from the
harness, so the mock can use shorter ones; the behaviour asserted is the same.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockConfig, MockScheduler, procs
from ftslurm.backends.mock import controller as mock_controller
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend
from ftslurm.backends.slurm_cli.parse import expand_nodes
from ftslurm.core.types import JobOptions, JobState, NodeState, SignalTarget
from ftslurm.errors import InvalidJobId

from .conftest import (
    CLUSTER_PARAMS,
    SECOND_ID,
    in_state,
    nodes_kept_healthy,
    use_cluster,
    wait_file,
    wait_job,
)

SLEEP = "#!/bin/bash\nsleep 600\n"


@dataclass
class Harness:
    name: str
    backend: SchedulerBackend
    fail_node: Callable[[str], object]
    revive_node: Callable[[str], object]
    requeue_delay_s: float
    short_limit: str  # a time limit the test can wait out
    short_limit_s: float
    warn_before_s: int
    node_fail_timeout_s: float
    min_job_age_s: float


@pytest.fixture(params=["mock", *CLUSTER_PARAMS])
def harness(request, tmp_path, monkeypatch) -> Iterator[Harness]:
    monkeypatch.chdir(tmp_path)
    if request.param == "mock":
        home = tmp_path / "mockcluster"
        config = MockConfig(requeue_delay_s=8, kill_wait_s=5, slurmd_timeout_s=3, min_job_age_s=5)
        backend = MockScheduler(home, config)
        stop = threading.Event()
        thread = threading.Thread(target=mock_controller.run, args=(home, 0.1, stop))
        thread.start()
        yield Harness(
            "mock",
            backend,
            backend.fail_node,
            backend.revive_node,
            requeue_delay_s=8,
            short_limit="0:20",
            short_limit_s=20,
            warn_before_s=10,
            node_fail_timeout_s=20,
            min_job_age_s=5,
        )
        for job in backend.active_jobs():  # the ids start at a random first id
            backend.cancel(job.job_id)
        stop.set()
        thread.join()
        for job_dir in backend.store.jobs_dir.glob("*"):  # what ignored SIGTERM is left
            procs.reap(job_dir)
        return
    with nodes_kept_healthy(use_cluster(request, request.param, monkeypatch)) as cluster:
        backend = SlurmCliBackend(CommandRunner(timeout_s=30))
        yield Harness(
            request.param,
            backend,
            cluster.fail_node,
            cluster.revive_node,
            requeue_delay_s=120,
            short_limit="1",
            short_limit_s=60,
            warn_before_s=50,
            node_fail_timeout_s=90,
            min_job_age_s=cluster.layout.min_job_age,
        )


@pytest.fixture
def submitted(harness) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for job in ids:
        with contextlib.suppress(InvalidJobId):  # aged out of the controller: nothing to do
            harness.backend.cancel(job)


def test_submit_and_complete(harness, submitted, tmp_path):
    out = tmp_path / "ran.txt"
    job = harness.backend.submit(
        f"#!/bin/bash\necho ran $SLURM_JOB_ID > {out}\n", JobOptions(name="conform")
    )
    submitted.append(job)
    info = wait_job(harness.backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert (info.state, info.exit_code, info.name) == (JobState.COMPLETED, 0, "conform")
    assert out.read_text().split() == ["ran", job]
    failed = harness.backend.submit("#!/bin/bash\nexit 7\n", JobOptions())
    submitted.append(failed)
    info = wait_job(harness.backend, failed, lambda i: i.state.is_terminal, 60, "the end")
    assert (info.state, info.exit_code) == (JobState.FAILED, 7)


def test_two_node_job_places_one_task_on_each_of_two_distinct_nodes(harness, submitted, tmp_path):
    out = tmp_path / "tasks.txt"
    script = (
        f"#!/bin/bash\nsrun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME "
        f"$SLURM_JOB_NUM_NODES' >> {out}\n"
    )
    job = harness.backend.submit(script, JobOptions(nodes=2, ntasks_per_node=1))
    submitted.append(job)
    info = wait_job(harness.backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert info.state is JobState.COMPLETED
    rows = sorted(line.split() for line in out.read_text().splitlines())
    assert [r[0] for r in rows] == ["0", "1"] and {r[2] for r in rows} == {"2"}
    assert {r[1] for r in rows} == set(info.nodes) and len(set(info.nodes)) == 2


def test_srun_wait_ends_the_step_that_long_after_its_first_task_ended(harness, submitted, tmp_path):
    """`srun --wait=S`: S seconds after the first task of a step ends, Slurm terminates the
    tasks left (here one that would run for 10 minutes), and the step and the job end."""
    d = tmp_path
    task = (
        f'if [ "$SLURM_PROCID" = 0 ]; then exit 0; fi; echo started > {d}/waiting; '
        f"for i in $(seq 600); do sleep 1; done; echo ran-on > {d}/done"
    )
    script = f"#!/bin/bash\nsrun --wait=2 bash -c '{task}'\necho \"srun $?\" > {d}/rc\n"
    job = harness.backend.submit(script, JobOptions(nodes=2, ntasks_per_node=1, time_limit="15"))
    submitted.append(job)
    info = wait_job(
        harness.backend, job, lambda i: i.state.is_terminal, 120, "the step to be ended by --wait"
    )
    assert (d / "waiting").exists() and not (d / "done").exists()
    assert (d / "rc").read_text().split()[0] == "srun", info
    assert info.state in (JobState.COMPLETED, JobState.FAILED), info


def test_requeue_waits_the_delay_and_start_now_skips_it(harness, submitted, measurements):
    backend = harness.backend
    fast = backend.submit(SLEEP, JobOptions(name="fast"))
    slow = backend.submit(SLEEP, JobOptions(name="slow"))
    submitted += [fast, slow]
    for job in (fast, slow):
        wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    begin = time.monotonic()
    backend.requeue(fast)
    backend.requeue(slow)
    # Slurm shows the job PENDING at once and fills in its reason at its next pass
    info = wait_job(
        backend,
        fast,
        lambda i: i.state is JobState.PENDING and bool(i.reason),
        30,
        "PENDING with a reason",
    )
    assert (info.restart_count, info.reason) == (1, "BeginTime")
    backend.start_now(fast)
    wait_job(backend, fast, in_state(JobState.RUNNING), 10, "RUNNING soon after start-now")
    measurements.record(
        f"{harness.name}_requeue_to_running_with_start_now_s", time.monotonic() - begin
    )
    assert backend.query([slow])[slow].state is JobState.PENDING
    info = wait_job(
        backend,
        slow,
        in_state(JobState.RUNNING),
        harness.requeue_delay_s + 60,
        "RUNNING after the requeue delay",
    )
    waited = time.monotonic() - begin
    measurements.record(f"{harness.name}_requeue_to_running_without_start_now_s", waited)
    assert waited >= harness.requeue_delay_s * 0.5 and info.restart_count == 1


def test_a_held_requeue_counts_the_restart_while_the_job_is_still_completing(harness, submitted):
    """The daemon's move off a straggler relies on this: right after `requeue --hold` of a
    running job whose processes ignore SIGTERM, Restarts is already 1 and the job COMPLETING
    (until KillWait ends it); then it is PENDING, held, until released."""
    backend = harness.backend
    job = backend.submit("#!/bin/bash\ntrap '' TERM\nsleep 600 & wait\nsleep 600\n", JobOptions())
    submitted.append(job)
    wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    backend.requeue(job, hold=True)
    info = backend.query([job])[job]
    assert (info.state, info.restart_count) == (JobState.COMPLETING, 1)
    info = wait_job(backend, job, lambda i: i.state is JobState.PENDING, 60, "PENDING")
    assert (info.restart_count, info.reason) == (1, "job requeued in held state")


def test_excluded_nodes_are_honoured_by_the_next_placement(harness, submitted):
    backend = harness.backend
    job = backend.submit(SLEEP, JobOptions(hold=True))
    submitted.append(job)
    assert backend.query([job])[job].reason == "JobHeldUser"
    backend.update_excluded_nodes(job, ["n1", "n2", "n3"])
    backend.release(job)
    info = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    assert info.nodes == ("n4",)


def test_node_failure_requeues_the_job_and_names_the_node(harness, submitted):
    backend = harness.backend
    job = backend.submit(SLEEP, JobOptions(nodes=2))
    submitted.append(job)
    running = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    victim = running.nodes[1]
    harness.fail_node(victim)
    # Slurm shows the requeued job COMPLETING (restart count already 1) while the surviving
    # node cleans up; wait for where it settles.
    after = wait_job(
        backend,
        job,
        lambda i: (
            i.state is JobState.NODE_FAIL
            or (i.restart_count >= 1 and i.state is not JobState.COMPLETING)
        ),
        harness.node_fail_timeout_s,
        "NODE_FAIL or the requeue",
    )
    assert after.state in (JobState.NODE_FAIL, JobState.PENDING, JobState.REQUEUED)
    node = {n.name: n for n in backend.nodes()}[victim]
    assert node.state is NodeState.DOWN and node.reason == "Not responding"
    assert not node.responding
    if isinstance(backend, SlurmCliBackend):  # accounting keeps the failed run and its nodes
        history = backend.runner.run(
            ["sacct", "-X", "-D", "-P", "-n", "-j", job, "-o", "State,NodeList"], budget_s=10
        )
        state, nodes = history.splitlines()[0].split("|")
        assert state == "NODE_FAIL" and victim in expand_nodes(nodes)
    harness.revive_node(victim)
    deadline = time.monotonic() + 60
    while {n.name: n for n in backend.nodes()}[victim].state is NodeState.DOWN:
        assert time.monotonic() < deadline, f"{victim} did not come back"
        time.sleep(0.5)


def test_wall_limit_ends_in_timeout_after_the_warning_signal(harness, submitted, tmp_path):
    mark = tmp_path / "warned.txt"
    script = f"""#!/bin/bash
trap 'echo warned $(date +%s) >> {mark}' USR1
while true; do sleep 1 & wait $!; done
"""
    job = harness.backend.submit(
        script, JobOptions(time_limit=harness.short_limit, signal=f"B:USR1@{harness.warn_before_s}")
    )
    submitted.append(job)
    running = wait_job(harness.backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    assert running.time_limit_s == harness.short_limit_s
    info = wait_job(
        harness.backend,
        job,
        lambda i: i.state.is_terminal,
        harness.short_limit_s + 90,
        "the wall limit",
    )
    assert info.state is JobState.TIMEOUT
    warned = wait_file(mark, lambda t: "warned" in t, 5, "the warning signal")
    assert int(warned.split()[1]) < info.end_time


def test_signals_reach_steps_or_the_batch_shell(harness, submitted, tmp_path: Path):
    script = f"""#!/bin/bash
trap 'echo batch-USR1 >> {tmp_path}/batch.txt' USR1
trap 'echo batch-USR2 >> {tmp_path}/batch.txt' USR2
srun bash -c 'trap "echo step-USR2-$SLURM_PROCID >> {tmp_path}/step.txt" USR2
              trap "echo step-USR1-$SLURM_PROCID >> {tmp_path}/step.txt" USR1
              echo ready >> {tmp_path}/ready.txt
              while true; do sleep 0.1; done' &
while true; do wait; done
"""
    backend = harness.backend
    job = backend.submit(script, JobOptions(nodes=2, ntasks_per_node=1))
    submitted.append(job)
    wait_file(tmp_path / "ready.txt", lambda t: t.count("ready") == 2, 60, "both tasks ready")
    backend.signal(job, "USR2", SignalTarget.STEPS)
    steps = wait_file(tmp_path / "step.txt", lambda t: t.count("USR2") == 2, 30, "USR2 in steps")
    assert sorted(steps.split()) == ["step-USR2-0", "step-USR2-1"]
    backend.signal(job, "USR1", SignalTarget.BATCH)
    wait_file(tmp_path / "batch.txt", lambda t: "batch-USR1" in t, 30, "USR1 in the batch shell")
    assert "USR2" not in (tmp_path / "batch.txt").read_text()
    assert "USR1" not in (tmp_path / "step.txt").read_text()
    assert backend.query([job])[job].state is JobState.RUNNING


def test_finished_jobs_leave_the_controller_after_min_job_age_and_accounting_keeps_them(
    harness, submitted
):
    backend = harness.backend
    assert backend.cluster_facts().min_job_age_s == harness.min_job_age_s
    before = time.time()
    tag = f"ftslurm:aged-{uuid.uuid4().hex[:8]}:0"
    job = backend.submit("#!/bin/bash\nexit 0\n", JobOptions(name="aged|x", comment=tag))
    submitted.append(job)
    info = wait_job(backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert (info.state, info.from_accounting) == (JobState.COMPLETED, False)
    assert [j.job_id for j in backend.find_jobs(tag)] == [job]  # the controller has it
    # Slurm purges every 60 s at most: allow MinJobAge plus one purge period and slack.
    aged = wait_job(
        backend,
        job,
        lambda i: i.from_accounting,
        harness.min_job_age_s + 90,
        "the job to age out",
        interval=2,
    )
    assert (aged.state, aged.exit_code, aged.name) == (JobState.COMPLETED, 0, "aged|x")
    # How the daemon adopts a job it submitted but had not recorded, once it is forgotten:
    assert backend.find_jobs(tag) == []  # the controller alone no longer knows it
    found = backend.find_jobs(tag, since=before)  # accounting does
    assert [(j.job_id, j.state, j.comment) for j in found] == [(job, JobState.COMPLETED, tag)]
    assert backend.find_jobs(tag + "x", since=before) == []


def test_a_no_kill_job_survives_a_lost_node_and_runs_new_steps_on_the_others(
    harness, submitted, tmp_path
):
    """`sbatch --no-kill` (observed on Slurm 22.05: tests/data/nokill_22.05.txt). A node that
    is not the batch host dies under two steps spanning both nodes: once it is declared down
    the job is still RUNNING on the other node alone; the plain step is ended (its surviving
    task killed, srun 137),
    the `srun --no-kill` step's surviving task runs on to its end (srun 0), and a new
    one-node step runs on the surviving node.

    Slurm 24.11 does the same, but its srun exits 1 for both steps (the plain step's
    surviving task killed, "Force Terminated StepId"; the `--no-kill` step's ran to its end):
    a step that lost a node is not a success there. The mock follows 22.05."""
    d = tmp_path
    task = (
        f'echo "$0 $SLURM_PROCID $SLURMD_NODENAME" >> {d}/ready; '
        f'while [ ! -e {d}/release ]; do sleep 0.2; done; echo "$0 $SLURM_PROCID" >> {d}/done'
    )
    script = f"""#!/bin/bash
echo $SLURMD_NODENAME > {d}/batch_host
srun --overlap bash -c '{task}' plain & plain=$!
srun --overlap --no-kill bash -c '{task}' nokill & nokill=$!
wait $plain; echo "plain $?" >> {d}/rc
wait $nokill; echo "nokill $?" >> {d}/rc
srun --overlap -N1 -n1 bash -c 'echo $SLURMD_NODENAME' > {d}/after; echo "after $?" >> {d}/rc
"""
    backend = harness.backend
    job = backend.submit(
        script, JobOptions(nodes=2, ntasks_per_node=1, no_kill=True, time_limit="5")
    )
    submitted.append(job)
    wait_file(d / "ready", lambda t: len(t.splitlines()) == 4, 60, "both steps' tasks")
    running = backend.query([job])[job]
    batch_host = (d / "batch_host").read_text().strip()
    assert running.state is JobState.RUNNING and batch_host in running.nodes
    (victim,) = [n for n in running.nodes if n != batch_host]
    survivor = batch_host
    harness.fail_node(victim)
    try:
        rc = wait_file(
            d / "rc", lambda t: "plain" in t, harness.node_fail_timeout_s, "the plain step to end"
        )
        plain_rc = rc.split()[1]  # (the no-kill step may have ended as well by now)
        assert plain_rc == ("1" if harness.name == SECOND_ID else "137")
        info = backend.query([job])[job]
        assert (info.state, info.nodes, info.restart_count) == (JobState.RUNNING, (survivor,), 0)
        assert {n.name: n for n in backend.nodes()}[victim].state is NodeState.DOWN
        (d / "release").touch()
        rc = wait_file(d / "rc", lambda t: "after" in t, 60, "the no-kill step and a new step")
        nokill_rc = "1" if harness.name == SECOND_ID else "0"
        assert rc.split() == ["plain", plain_rc, "nokill", nokill_rc, "after", "0"]
        # the surviving task of the --no-kill step ran to its end; the plain step's did not
        assert (d / "done").read_text().split() == ["nokill", str(_rank_of(d, survivor))]
        assert (d / "after").read_text().split() == [survivor]
        info = wait_job(backend, job, lambda i: i.state.is_terminal, 60, "the end")
        assert (info.state, info.restart_count) == (JobState.COMPLETED, 0)
    finally:
        harness.revive_node(victim)


def _rank_of(d: Path, node: str) -> int:
    """The rank the steps' task on `node` had (the same in both steps)."""
    ranks = {
        int(r)
        for _, r, n in (line.split() for line in (d / "ready").read_text().splitlines())
        if n == node
    }
    (rank,) = ranks
    return rank
