"""One mock cluster, several processes: CLI calls, a controller, restarts of either."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockConfig, MockScheduler, procs
from ftslurm.backends.mock.controller import controller_pid
from ftslurm.core.types import JobOptions, JobState
from ftslurm.procutil import NOT_RUNNING, stat_fields

from .conftest import wait_job


def cli(home: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FTSLURM_MOCK_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "ftslurm", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
    )


@pytest.fixture
def home(tmp_path) -> Path:
    home = tmp_path / "mock"
    yield home
    cli(home, "mock", "destroy", cwd=tmp_path)
    deadline = time.monotonic() + 10
    while controller_pid(home) if home.exists() else None:
        assert time.monotonic() < deadline, "the mock controller did not stop"
        time.sleep(0.1)


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        time.sleep(0.1)


def test_submit_in_one_process_query_in_another(home, tmp_path):
    assert cli(home, "mock", "up", "--nodes", "2", cwd=tmp_path).returncode == 0
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'\n")
    out = cli(
        home,
        "scheduler",
        "submit",
        str(script),
        "-N",
        "2",
        "--backend",
        "mock",
        "--json",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job_id"]

    def done() -> bool:
        res = cli(home, "scheduler", "query", job, "--backend", "mock", "--json", cwd=tmp_path)
        return json.loads(res.stdout)[job]["state"] == "COMPLETED"

    wait_until(done, 30, "COMPLETED seen from another process")
    lines = sorted((tmp_path / f"slurm-{job}.out").read_text().splitlines())
    assert lines == ["0 n1", "1 n2"]


def test_the_controller_moves_time_without_any_client(home, tmp_path):
    assert cli(home, "mock", "up", cwd=tmp_path).returncode == 0
    beat = tmp_path / "beat"
    scheduler = MockScheduler(home)
    job = scheduler.submit(
        f"#!/bin/bash\nwhile true; do date +%s.%N > {beat}; sleep 0.2; done\n",
        JobOptions(time_limit="0:03", workdir=str(tmp_path)),
    )
    wait_until(beat.exists, 10, "the job to start")

    # No scheduler call from here on: only the controller can end the job at its limit.
    def stopped() -> bool:
        text = beat.read_text().strip()  # empty while the job rewrites it
        return bool(text) and time.time() - float(text) > 2

    wait_until(stopped, 30, "the job's heartbeat to stop")
    info = scheduler.query([job])[job]
    assert info.state is JobState.TIMEOUT
    assert info.end_time - info.start_time < 5, "ended at its limit, not when we looked"


def test_state_and_jobs_survive_a_controller_restart(home, tmp_path):
    assert cli(home, "mock", "up", cwd=tmp_path).returncode == 0
    scheduler = MockScheduler(home)
    go = tmp_path / "go"
    job = scheduler.submit(
        f"#!/bin/bash\nwhile [ ! -e {go} ]; do sleep 0.1; done\nexit 4\n",
        JobOptions(workdir=str(tmp_path)),
    )
    wait_job(scheduler, job, lambda i: i.state is JobState.RUNNING, 10, "RUNNING")
    pid = controller_pid(home)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: controller_pid(home) is None, 10, "the controller to die")
    go.touch()  # the job ends while no controller runs
    assert cli(home, "mock", "up", cwd=tmp_path).returncode == 0  # a new controller
    assert controller_pid(home) not in (None, pid)
    info = wait_job(MockScheduler(home), job, lambda i: i.state.is_terminal, 10, "the end")
    assert (info.state, info.exit_code) == (JobState.FAILED, 4)


def test_mock_cli_errors_are_one_line(home, tmp_path):
    assert cli(home, "mock", "status", cwd=tmp_path).stderr.startswith("Error: no mock cluster")
    bad = tmp_path / "bad.json"
    bad.write_text('{"kill_wait_s": "soon"}')
    res = cli(home, "mock", "up", "--config", str(bad), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert res.stderr.startswith("Error: bad mock config: kill_wait_s")
    assert cli(home, "mock", "up", cwd=tmp_path).returncode == 0
    res = cli(home, "mock", "fail-node", "n9", cwd=tmp_path)
    assert res.returncode == 2 and "unknown node 'n9'" in res.stderr


def test_config_applies_to_new_clusters_only(tmp_path):
    home = tmp_path / "direct"
    MockScheduler(home, MockConfig(min_job_age_s=7))
    assert MockScheduler(home, MockConfig(min_job_age_s=99)).cluster_facts().min_job_age_s == 7


def test_a_relaunched_job_is_not_ended_by_the_wrapper_of_its_previous_run(tmp_path):
    """A node failure kills a run; the requeued run starts in the same job folder at once.
    The first run's jobwrap must neither record its exit for the new run nor kill its
    steps (it used to, a moment after the relaunch, and the new run "failed" with exit 0)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = dict(os.environ)
    out = str(tmp_path / "out.txt")
    procs.launch_batch(
        job_dir, "#!/bin/bash\nsleep 60\n", env, str(tmp_path), out, out, kill_wait_s=0.5
    )
    wait_until(
        lambda: procs.batch_alive(job_dir) and (job_dir / "shell.json").exists(),
        10,
        "the first run",
    )
    procs.kill_job(job_dir)  # the batch shell dies; its jobwrap would write exit.json next
    procs.launch_batch(
        job_dir, "#!/bin/bash\nsleep 1.5\nexit 7\n", env, str(tmp_path), out, out, kill_wait_s=0.5
    )
    wait_until(lambda: procs.exit_status(job_dir) is not None, 15, "the second run's end")
    assert procs.exit_status(job_dir) == (7, None)


def _group_members(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (pid and command line)."""
    members = []
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] not in NOT_RUNNING:
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                members.append(f"{entry} {cmd.decode(errors='replace')}")
    return members


def test_a_cancelled_job_that_lost_a_node_leaves_no_srun_behind(tmp_path):
    """A 2-node step loses a node, then the job is cancelled (SIGTERM to everything, as the
    model's cancel does): the batch shell dies at once, while its srun, which forwards the
    SIGTERM, still waits for the lost node's verdict. As Slurm kills every process of a job
    whose batch script ended, jobwrap kills that srun too (it used to wait forever, until
    something reaped the job's folder)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = dict(os.environ, SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="2")
    out = str(tmp_path / "out.txt")
    script = "#!/bin/bash\nsrun -N 2 sleep 600\n"
    procs.launch_batch(job_dir, script, env, str(tmp_path), out, out, kill_wait_s=0.5)
    try:
        step = job_dir / "steps" / "0.json"
        wait_until(lambda: len((procs.read_json(step) or {}).get("tasks", [])) == 2, 20, "the step")
        pgid = procs.read_json(job_dir / "shell.json")["pgid"]
        assert any("mock.srun" in m for m in _group_members(pgid)), _group_members(pgid)
        procs.kill_node(job_dir, "n2", batch_host="n1")
        procs.signal_steps(job_dir, signal.SIGTERM)
        procs.signal_batch(job_dir, signal.SIGTERM)
        wait_until(lambda: procs.exit_status(job_dir) is not None, 20, "the batch's end")
        assert procs.exit_status(job_dir) == (0, signal.SIGTERM)
        # killed before exit.json was written; a moment for the killed srun to be reaped
        deadline = time.monotonic() + 5
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_members(pgid)
    finally:
        procs.reap(job_dir)
