"""The Slurm CLI backend against the real local 4-node cluster (no fakes)."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest

from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend
from ftslurm.core.types import JobOptions, JobState, NodeState, SignalTarget
from ftslurm.errors import ConfigError, InvalidJobId, InvalidPartition

from .conftest import in_state, wait_file, wait_job

SLEEP = "#!/bin/bash\nsleep 600\n"


def test_submit_query_cancel_round_trip(backend, jobs):
    job = backend.submit(SLEEP, JobOptions(name="roundtrip", comment="ftslurm:run=r1:attempt=0"))
    jobs.append(job)
    info = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    assert info.name == "roundtrip"
    assert info.comment == "ftslurm:run=r1:attempt=0"
    assert len(info.nodes) == 1 and info.start_time is not None and info.source == "squeue"
    backend.cancel(job)
    info = wait_job(backend, job, in_state(JobState.CANCELLED), 30, "CANCELLED")
    assert info.state.is_terminal and info.end_time is not None
    backend.cancel(job)  # cancelling an ended job again is not an error


def test_two_node_job_runs_one_task_on_each_of_two_distinct_nodes(backend, jobs, tmp_path):
    out = tmp_path / "hosts.txt"
    script = f"#!/bin/bash\nsrun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME' >> {out}\n"
    job = backend.submit(script, JobOptions(nodes=2, ntasks_per_node=1, workdir=str(tmp_path)))
    jobs.append(job)
    info = wait_job(backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert info.state is JobState.COMPLETED and info.exit_code == 0
    lines = sorted(out.read_text().split("\n")[:-1])
    assert [ln.split()[0] for ln in lines] == ["0", "1"]
    hosts = {ln.split()[1] for ln in lines}
    assert len(hosts) == 2 and hosts == set(info.nodes)


def test_exit_code_and_signal_are_reported(backend, jobs):
    failed = backend.submit("#!/bin/bash\nexit 3\n", JobOptions())
    killed = backend.submit("#!/bin/bash\nkill -9 $$\n", JobOptions())
    jobs += [failed, killed]
    a = wait_job(backend, failed, lambda i: i.state.is_terminal, 60, "the end")
    b = wait_job(backend, killed, lambda i: i.state.is_terminal, 60, "the end")
    assert (a.state, a.exit_code, a.signal) == (JobState.FAILED, 3, None)
    assert (b.state, b.signal) == (JobState.FAILED, 9)


def test_requeue_then_start_now_runs_within_10s_and_without_waits_the_requeue_delay(
    backend, jobs, measurements
):
    fast = backend.submit(SLEEP, JobOptions(name="requeue-fast"))
    slow = backend.submit(SLEEP, JobOptions(name="requeue-slow"))
    jobs += [fast, slow]
    for job in (fast, slow):
        wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    requeued_at = time.monotonic()
    backend.requeue(fast)
    backend.requeue(slow)
    info = wait_job(backend, fast, lambda i: i.state is JobState.PENDING and i.restart_count == 1,
                    30, "PENDING after requeue")  # fmt: skip
    assert info.reason == "BeginTime"
    backend.start_now(fast)
    wait_job(backend, fast, in_state(JobState.RUNNING), 10, "RUNNING within 10 s of start-now")
    measurements.record("requeue_to_running_with_start_now_s", time.monotonic() - requeued_at)
    info = wait_job(backend, slow, in_state(JobState.RUNNING), 200, "RUNNING after the delay")
    waited = time.monotonic() - requeued_at
    measurements.record("requeue_to_running_without_start_now_s", waited)
    assert waited > 60, "Slurm's requeue delay (~120 s) should have applied"
    assert info.restart_count == 1


def test_excluded_nodes_of_a_pending_job_are_honoured(backend, jobs, slurm_cluster):
    job = backend.submit(SLEEP, JobOptions(nodes=1, hold=True, name="exclude"))
    jobs.append(job)
    wait_job(backend, job, in_state(JobState.PENDING), 30, "PENDING (held)")
    backend.update_excluded_nodes(job, ["n1", "n2", "n3"])
    assert backend.describe(job)["ExcNodeList"] == "n[1-3]"
    backend.release(job)
    info = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    assert info.nodes == ("n4",)


def test_failing_a_node_reports_node_fail_or_requeue_naming_the_node(
    backend, jobs, healthy_nodes
):
    job = backend.submit(SLEEP, JobOptions(nodes=2, name="nodefail"))
    jobs.append(job)
    running = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    victim = running.nodes[1]
    assert healthy_nodes.fail_node(victim), "nothing was killed"
    after = wait_job(backend, job, lambda i: i.state is JobState.NODE_FAIL or i.restart_count >= 1,
                     90, "NODE_FAIL or requeue")  # fmt: skip
    assert after.state in (JobState.NODE_FAIL, JobState.PENDING, JobState.REQUEUED)
    down = {n.name: n for n in backend.nodes()}
    assert down[victim].state is NodeState.DOWN and not down[victim].responding
    assert down[victim].reason == "Not responding"
    # Accounting keeps the failed run, with the nodes it had.
    history = backend.runner.run(["sacct", "-X", "-D", "-P", "-n", "-j", job,
                                  "-o", "State,NodeList"], budget_s=10)  # fmt: skip
    first_run = history.splitlines()[0].split("|")
    assert first_run[0] == "NODE_FAIL" and victim in backend_nodes(first_run[1])


def backend_nodes(text: str) -> tuple[str, ...]:
    from ftslurm.backends.slurm_cli.parse import expand_nodes

    return expand_nodes(text)


@pytest.mark.slow
def test_one_minute_wall_limit_reports_timeout(backend, jobs):
    job = backend.submit(SLEEP, JobOptions(time_limit="1", name="walllimit"))
    jobs.append(job)
    running = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    assert running.time_limit_s == 60
    info = wait_job(backend, job, lambda i: i.state.is_terminal, 150, "the wall limit")
    assert info.state is JobState.TIMEOUT


def test_signals_reach_steps_or_batch_shell(backend, jobs, tmp_path):
    script = f"""#!/bin/bash
trap 'echo batch-USR1 >> {tmp_path}/batch.txt' USR1
trap 'echo batch-USR2 >> {tmp_path}/batch.txt' USR2
srun bash -c 'trap "echo step-USR2-$SLURM_PROCID >> {tmp_path}/step.txt" USR2
              trap "echo step-USR1-$SLURM_PROCID >> {tmp_path}/step.txt" USR1
              echo ready >> {tmp_path}/ready.txt
              while true; do sleep 0.1; done' &
while true; do wait; done
"""
    job = backend.submit(script, JobOptions(nodes=2, ntasks_per_node=1, name="signals"))
    jobs.append(job)
    wait_file(tmp_path / "ready.txt", lambda t: t.count("ready") == 2, 60, "both tasks ready")

    backend.signal(job, "USR2", SignalTarget.STEPS)
    steps = wait_file(tmp_path / "step.txt", lambda t: t.count("USR2") == 2, 30, "USR2 in steps")
    assert sorted(steps.split()) == ["step-USR2-0", "step-USR2-1"]

    backend.signal(job, "SIGUSR1", SignalTarget.BATCH)
    wait_file(tmp_path / "batch.txt", lambda t: "batch-USR1" in t, 30, "USR1 in the batch shell")
    # Each target got only its own signal.
    assert "USR2" not in (tmp_path / "batch.txt").read_text()
    assert "USR1" not in (tmp_path / "step.txt").read_text()
    assert backend.query([job])[job].state is JobState.RUNNING


def _counting_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH whose Slurm clients log each call, then exec the real client."""
    shims = tmp_path / "shims"
    shims.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("squeue", "sacct", "scontrol", "sinfo", "sbatch", "scancel"):
        real = shutil.which(tool)
        assert real, f"{tool} missing"
        shim = shims / tool
        shim.write_text(f'#!/bin/sh\necho {tool} >> "{log}"\nexec {real} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}")
    return env, log


def test_one_query_of_50_jobs_issues_exactly_one_scheduler_command(tmp_path, backend, jobs):
    env, log = _counting_path(tmp_path)
    counted = SlurmCliBackend(CommandRunner(env=env))
    ids = [backend.submit(SLEEP, JobOptions(hold=True, name=f"many-{i}")) for i in range(50)]
    jobs.extend(ids)
    log.write_text("")
    result = counted.query(ids)
    assert log.read_text().split() == ["squeue"]
    assert counted.runner.commands == 1
    assert set(result) == set(ids)
    assert all(info.state is JobState.PENDING for info in result.values())


def test_a_huge_id_list_is_still_one_command(tmp_path, backend, jobs):
    env, log = _counting_path(tmp_path)
    counted = SlurmCliBackend(CommandRunner(env=env), max_jobs_arg_chars=1)
    ids = [backend.submit(SLEEP, JobOptions(hold=True)) for _ in range(3)]
    jobs.extend(ids)
    log.write_text("")
    result = counted.query(ids)
    assert log.read_text().split() == ["squeue"]
    assert [result[j].state for j in ids] == [JobState.PENDING] * 3


def test_controller_outage_is_retried_and_reads_meanwhile_are_unknown(
    slurm_cluster, jobs, measurements
):
    backend = SlurmCliBackend(CommandRunner(timeout_s=15), query_budget_s=2.0,
                              action_budget_s=120.0)  # fmt: skip
    job = backend.submit(SLEEP, JobOptions(name="outage"))
    jobs.append(job)
    wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")

    slurm_cluster.stop_controller()
    stopped_at = time.monotonic()
    restarter = threading.Timer(20.0, slurm_cluster.start_controller)
    restarter.start()
    try:
        during = backend.query([job])[job]
        assert during.state is JobState.UNKNOWN and during.source == "none"
        assert time.monotonic() - stopped_at < 20, "the read must not wait for the controller"
        # An action keeps trying (bounded, with backoff) and succeeds once it is back.
        nodes = backend.nodes()
        recovered_after = time.monotonic() - stopped_at
    finally:
        restarter.join()
    measurements.record("action_succeeded_after_controller_outage_s", recovered_after)
    assert recovered_after >= 19 and len(nodes) == 4
    assert backend.runner.commands > 3, "the action should have been retried"
    assert backend.query([job])[job].state is JobState.RUNNING


def test_bad_input_gets_a_one_line_error_and_submits_nothing(backend, tmp_path):
    before = backend.runner.commands
    with pytest.raises(ConfigError, match="malformed time limit '90 minutes'"):
        backend.submit(SLEEP, JobOptions(time_limit="90 minutes"))
    with pytest.raises(ConfigError, match="#!"):
        backend.submit("sleep 1\n", JobOptions())
    assert backend.runner.commands == before, "nothing may reach the scheduler"
    with pytest.raises(InvalidPartition) as err:
        backend.submit(SLEEP, JobOptions(partition="nosuchpartition"))
    assert "\n" not in str(err.value) and "partition" in str(err.value).lower()
    with pytest.raises(InvalidJobId):
        backend.requeue("999999")


def test_cluster_facts(backend, slurm_cluster):
    facts = backend.cluster_facts()
    assert facts.accounting is True
    assert facts.min_job_age_s == slurm_cluster.layout.min_job_age
    assert facts.version.startswith(("22.", "23.", "24.", "25.", "26."))
