"""The daemon as a Slurm job (`ftslurm daemon submit`) on the real local cluster: no daemon
on the submitting host. Every "node" of the local cluster runs on this one host, so the
daemon's identity is its Slurm node name (SLURMD_NODENAME), as on a real cluster.

- Its node dies: Slurm requeues the daemon job, the new incarnation finds the dead one's
  lease silent and takes it over, and a run that was in flight completes with its one job.
- Its time limit nears: it submits its successor, hands over once the successor runs, and
  the successor serves on.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftslurm.daemon import as_job

from .conftest import wait_for
from .daemon_scenarios import RECIPE, Cli, daemon_cli, ended

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    c = next(daemon_cli(tmp_path))
    try:
        yield c
    finally:  # its daemon jobs (the first, a requeued one, a successor), then its runs
        subprocess.run(["scancel", "--name", as_job.DAEMON_JOB_NAME], check=False)
        for run in json.loads(c("status", "--json").stdout):
            if not ended(run):
                c("cancel", run["run_id"], check=False)


def daemon(cli: Cli) -> dict[str, Any]:
    return json.loads(cli("daemon", "status", "--json", check=False).stdout)


def requeued(job_id: str) -> bool:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return "JobState=PENDING" in out and "Restarts=1" in out


def serving_on(cli: Cli, unlike: str | None = None) -> str | None:
    d = daemon(cli)
    return d["host"] if d["running"] and d["host"] not in (None, unlike) else None


def test_a_daemon_job_whose_node_dies_is_requeued_and_adopts_the_run_in_flight(
    cli, healthy_nodes, tmp_path
):
    out = cli(
        "daemon",
        "submit",
        "-t",
        "20:00",
        "--handover",
        "300",
        "--lease-timeout",
        "5",
        "--sbatch-arg=--exclude=n1,n2",
    ).stdout
    assert "daemon job" in out
    first = wait_for(lambda: serving_on(cli), 60, "the daemon job to serve")
    job_id = daemon(cli)["job_id"]
    # a run on the two other nodes, submitted through the daemon job (none runs here)
    run = cli.submit(
        "--retries",
        "0",
        "-N",
        "2",
        "-x",
        "n3,n4",
        "-t",
        "10",
        str(RECIPE),
        "--",
        "--steps",
        "300",
        "--step-time",
        "0.2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    run_id = run["run_id"]
    s = cli.wait_for(
        run_id,
        lambda s: s["attempts"] and s["attempts"][0]["state"] == "RUNNING",
        120,
        "the run's job running",
    )
    run_job = s["attempts"][0]["job_id"]
    healthy_nodes.fail_node(first)  # the daemon job's node, with the daemon
    # Slurm declares the node down and requeues the daemon job; it would start after
    # Slurm's requeue delay (BeginTime, 121 s here): the test, as an operator could, lets it
    # start now to save those two minutes. It starts on the other free node and takes the
    # dead daemon's silent lease over.
    wait_for(lambda: requeued(job_id), 120, "Slurm to requeue the daemon job")
    subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)
    second = wait_for(
        lambda: serving_on(cli, unlike=first), 300, "the requeued daemon job to serve"
    )
    assert daemon(cli)["job_id"] == job_id  # the same job, requeued by Slurm
    s = cli.wait_for(run_id, ended, 300, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["job_id"] for a in s["attempts"]] == [run_job]  # adopted, not submitted again
    # every job Slurm ever ran for the run (accounting keeps the comment, the run's tag)
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,Comment", "-S", "now-1hour"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = [line.split("|")[0] for line in out.splitlines() if f"ftslurm:{run_id}:" in line]
    assert jobs == [run_job], out
    log = Path(cli.home, f"daemon-job-{job_id}.log").read_text()
    assert "took over the lease" in log and second != first, log[-2000:]


def test_a_daemon_job_hands_over_to_its_successor_before_its_time_limit(cli, tmp_path):
    cli("daemon", "submit", "-t", "2:00", "--handover", "60", "--lease-timeout", "5")
    wait_for(lambda: serving_on(cli), 60, "the daemon job to serve")
    first_job = daemon(cli)["job_id"]
    # at the handover signal (60 s before its limit) it submits its successor and, once
    # that one runs, releases the lease: the successor serves before the first one's limit
    wait_for(
        lambda: daemon(cli)["running"] and daemon(cli)["job_id"] not in (None, first_job),
        120,
        "the successor to serve",
    )
    successor = daemon(cli)["job_id"]
    assert as_job.recorded(cli.home)[0] == successor  # type: ignore[index]
    log = Path(cli.home, f"daemon-job-{first_job}.log").read_text()
    assert f"submitted the successor daemon job {successor}" in log, log[-2000:]
    assert "releasing the lease" in log, log[-2000:]
    # a run submitted now is served by the successor
    out = cli.submit(
        "--retries",
        "0",
        "-N",
        "1",
        "-t",
        "5",
        str(RECIPE),
        "--",
        "--steps",
        "20",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    s = cli.wait_for(out["run_id"], ended, 180, "the run to end")
    assert s["state"] == "COMPLETED", s
