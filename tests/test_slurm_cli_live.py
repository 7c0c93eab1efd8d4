"""The Slurm CLI backend against the real local 4-node cluster (no fakes).

Every test runs against each wanted Slurm release (ids `slurm` for 22.05, `slurm-24.11`):
the module's `slurm_cluster` is parametrized, and conftest's `backend`, `jobs` and
`healthy_nodes` follow it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend
from ftslurm.core.contract import EnvName
from ftslurm.core.types import JobOptions, JobState
from ftslurm.errors import ConfigError, InvalidJobId, InvalidPartition
from ftslurm.localcluster import LocalCluster
from ftslurm.templates import render_job_script

from .conftest import CLUSTER_PARAMS, in_state, use_cluster, wait_job

SLEEP = "#!/bin/bash\nsleep 600\n"


@pytest.fixture(params=CLUSTER_PARAMS)
def slurm_cluster(request, monkeypatch) -> LocalCluster:
    """This module's tests run on every wanted release; clients reach the one selected."""
    return use_cluster(request, request.param, monkeypatch)


def test_submit_query_cancel_round_trip(slurm_cluster, backend, jobs):
    job = backend.submit(SLEEP, JobOptions(name="roundtrip", comment="ftslurm:run=r1:attempt=0"))
    jobs.append(job)
    info = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    assert info.name == "roundtrip"
    assert info.comment == "ftslurm:run=r1:attempt=0"
    assert len(info.nodes) == 1 and info.start_time is not None and not info.from_accounting
    backend.cancel(job)
    # The job stays COMPLETING until its node's slurmd reports its processes gone: within
    # KillWait (SIGTERM, then SIGKILL) once that slurmd answers. A fully loaded CI machine
    # once took more than 30 s.
    ending_s = slurm_cluster.layout.kill_wait + 30
    info = wait_job(backend, job, in_state(JobState.CANCELLED), ending_s, "CANCELLED")
    assert info.state.is_terminal and info.end_time is not None
    backend.cancel(job)  # cancelling an ended job again is not an error


def test_exit_code_and_signal_are_reported(backend, jobs):
    failed = backend.submit("#!/bin/bash\nexit 3\n", JobOptions())
    killed = backend.submit("#!/bin/bash\nkill -9 $$\n", JobOptions())
    jobs += [failed, killed]
    a = wait_job(backend, failed, lambda i: i.state.is_terminal, 60, "the end")
    b = wait_job(backend, killed, lambda i: i.state.is_terminal, 60, "the end")
    assert (a.state, a.exit_code, a.signal) == (JobState.FAILED, 3, None)
    assert (b.state, b.signal) == (JobState.FAILED, 9)


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
    backend = SlurmCliBackend(
        CommandRunner(timeout_s=15), query_budget_s=2.0, action_budget_s=120.0
    )
    job = backend.submit(SLEEP, JobOptions(name="outage"))
    jobs.append(job)
    wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")

    slurm_cluster.stop_controller()
    stopped_at = time.monotonic()
    restarter = threading.Timer(20.0, slurm_cluster.start_controller)
    restarter.start()
    try:
        during = backend.query([job])[job]
        assert during.state is JobState.UNKNOWN and not during.from_accounting
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


def test_in_job_injections_reach_the_job_and_cluster_side_ones_are_refused(backend, jobs, tmp_path):
    out = tmp_path / "inject.txt"
    job = backend.submit(
        f"#!/bin/bash\necho $FTSLURM_INJECT > {out}\n",
        JobOptions(inject=("crash@5:1", "straggler@0:n2*3")),
    )
    jobs.append(job)
    wait_job(backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert out.read_text().strip() == "crash@5:1,straggler@0:n2*3"
    before = backend.runner.commands
    with pytest.raises(ConfigError, match="node_fail can only be injected on the mock"):
        backend.submit(SLEEP, JobOptions(inject=("node_fail@30",)))
    assert backend.runner.commands == before


def test_cluster_facts(backend, slurm_cluster):
    facts = backend.cluster_facts()
    assert facts.accounting is True
    assert facts.min_job_age_s == slurm_cluster.layout.min_job_age
    assert facts.version.startswith(("22.", "23.", "24.", "25.", "26."))


def test_sbatch_reads_the_rendered_header_and_the_new_flags(backend, jobs, tmp_path):
    """The #SBATCH quoting and the flags `submit` passes on, read by real sbatch: the script
    is submitted with no command-line flags, so everything comes from its header."""
    name = 'a b\'c\\d #e "f" $(g)'
    options = JobOptions(
        name=name,
        nodes=1,
        ntasks_per_node=1,
        time_limit="UNLIMITED",
        comment="x # y",
        extra={
            "mem": "10M",
            "exclusive": None,
            "mail-type": "NONE",
            "nodelist": "n2",
            "no-kill": None,
        },
    )
    script = render_job_script(["true"], options, run_id="r1", attempt=0, setup=[])
    job = backend.submit(script, JobOptions())
    jobs.append(job)
    info = wait_job(backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert info.state is JobState.COMPLETED
    assert (info.name, info.comment, info.nodes) == (name, "x # y", ("n2",))


def test_the_cluster_runs_a_while_with_another_slurmd_timeout(slurm_cluster):
    def shown() -> str:
        out = subprocess.run(
            ["scontrol", "show", "config"],
            capture_output=True,
            text=True,
            env=slurm_cluster.env(),
            check=True,
        ).stdout
        return next(
            line.split("=")[1].strip()
            for line in out.splitlines()
            if line.startswith("SlurmdTimeout")
        )

    with slurm_cluster.slurmd_timeout(300):
        assert shown() == "300 sec"
    assert shown() == f"{slurm_cluster.layout.slurmd_timeout} sec"


def test_a_failed_node_loses_its_memory_tier_and_only_its_own(
    backend, healthy_nodes, jobs, tmp_path
):
    # (`jobs` after `healthy_nodes`: the job is cancelled before the node is revived, which
    # then takes seconds instead of the ~50 s of a revived slurmd meeting a running job)
    """Every node of the local cluster shares one host's /dev/shm: `fail-node` wipes the
    memory checkpoint areas of that node (under the base its job processes had), as a real
    node's memory would be lost, and leaves the other nodes' alone."""
    base = tmp_path / "shm"
    # The variable comes with the job's environment, not from an `export` in the script: a
    # shell's `export` never reaches /proc/<pid>/environ, so a job seen RUNNING before its
    # script reached `exec` would show no base to wipe.
    job = backend.submit(
        "#!/bin/bash\nexec sleep 600\n",
        JobOptions(name="memory", env={EnvName.MEMORY_DIR.value: str(base)}),
    )
    jobs.append(job)
    (node,) = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING").nodes
    other = next(n for n in healthy_nodes.layout.node_names if n != node)
    for n in (node, other):
        (base / "r1" / n).mkdir(parents=True)
        (base / "r1" / n / "shard-0-step-5.pt").write_bytes(b"state")
    assert healthy_nodes.fail_node(node)
    assert not (base / "r1" / node).exists()
    assert (base / "r1" / other / "shard-0-step-5.pt").read_bytes() == b"state"
