"""An ordinary user on the real local cluster (Slurm 22.05).

`make test` runs the main suite as an unprivileged user: root is Slurm's super user and
skips every permission check, so only a user's run shows what a user may do. These tests
pin down the user's side: the requests the daemon makes on its own jobs are allowed, what
needs Slurm's operator fails in one line that says so, and the cluster's fault controls
reach root only through the operator's door (sudo). They are skipped when run as root.
"""

from __future__ import annotations

import pytest

from ftslurm.backends.slurm_cli import CommandRunner
from ftslurm.core.types import JobOptions, JobState
from ftslurm.errors import OperatorNeeded
from ftslurm.localcluster import ClusterError, LocalCluster
from ftslurm.localcluster.users import OPERATOR_ENV

from .conftest import UNPRIVILEGED, in_state, wait_job

pytestmark = pytest.mark.skipif(not UNPRIVILEGED, reason="shows a user's rights; run as root")


def test_a_user_moves_its_own_running_job_off_a_node(backend, jobs):
    """What the daemon does to move a run off a bad node, as the job's owner: requeue held,
    exclude the node, release, start now. The job runs again elsewhere, same id."""
    job = backend.submit("#!/bin/bash\nsleep 600\n", JobOptions(name="as-user"))
    jobs.append(job)
    first = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING")
    backend.requeue(job, hold=True)
    wait_job(backend, job, in_state(JobState.PENDING), 60, "PENDING after requeuehold")
    backend.update_excluded_nodes(job, first.nodes)
    backend.release(job)
    backend.start_now(job)
    again = wait_job(backend, job, in_state(JobState.RUNNING), 30, "RUNNING again")
    assert not set(again.nodes) & set(first.nodes), (first.nodes, again.nodes)


def test_what_needs_the_operator_fails_in_one_line_that_says_so(slurm_cluster):
    runner = CommandRunner(timeout_s=30)
    node = slurm_cluster.layout.node_names[0]
    slurm_cluster.wait_nodes_idle([node], timeout=60)  # an earlier test's job may be ending
    with pytest.raises(OperatorNeeded) as err:
        runner.run(
            ["scontrol", "update", f"nodename={node}", "state=drain", "reason=user"], budget_s=5
        )
    message = err.value.user_message()
    assert "operator" in message and "\n" not in message
    assert slurm_cluster.node_states()[node] == "idle"  # and nothing changed
    with pytest.raises(ClusterError, match="must be started as root"):
        LocalCluster(slurm_cluster.layout.root).up()


def test_fault_controls_reach_root_only_through_the_operator(slurm_cluster, monkeypatch):
    """A fault control run by a user goes through the operator command; refused there, it
    is a one-line error and nothing is killed."""
    monkeypatch.setenv(OPERATOR_ENV, "false")
    node = slurm_cluster.layout.node_names[-1]
    slurm_cluster.wait_nodes_idle([node], timeout=60)
    with pytest.raises(ClusterError) as err:
        slurm_cluster.fail_node(node)
    assert "fault control of the cluster's operator" in err.value.user_message()
    assert "\n" not in err.value.user_message()
    assert slurm_cluster.node_states()[node] == "idle"


def test_the_user_reads_the_slurm_daemons_logs(slurm_cluster):
    """A failing test shows the tail of slurmctld's and the slurmds' logs (conftest): Slurm
    creates them 0600 for root, so the cluster makes them first, readable."""
    names = ["slurmctld", *(f"slurmd-{node}" for node in slurm_cluster.layout.node_names)]
    for name in names:
        text = (slurm_cluster.layout.log_dir / f"{name}.log").read_text()
        assert "started" in text.lower(), (name, text[-500:])
