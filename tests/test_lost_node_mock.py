"""A lost node on the mock with its default SlurmdTimeout (300 s): the launchers' report
makes the daemon replace the job well inside 2 minutes (the scenario of
test_lost_node_slurm.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ftslurm.backends.mock import MockScheduler
from ftslurm.core.settings import FtSettings
from ftslurm.daemon.store import Store

from .daemon_scenarios import RECIPE, Cli
from .test_lost_node_slurm import a_lost_node_is_replaced_by_a_fresh_job


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    c = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    config = tmp_path / "mock.json"
    config.write_text('{"kill_wait_s": 5}')  # SlurmdTimeout stays Slurm's default, 300 s
    c("mock", "up", "--config", str(config), "--min-job-age", "60")
    yield c
    c.stop_daemon()
    c("mock", "destroy", check=False)


@pytest.mark.parametrize("node_rank", [1, 0], ids=["other-node", "batch-host"])
def test_a_lost_node_is_replaced_well_before_the_mocks_slurmd_timeout(cli, tmp_path, node_rank):
    mock = MockScheduler(tmp_path / "mock")
    assert mock.cluster_facts().slurmd_timeout_s == 300
    a_lost_node_is_replaced_by_a_fresh_job(cli, tmp_path, mock.fail_node, node_rank, "--dry-run")


@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "no-launcher"])
def test_a_one_node_jobs_lost_node_is_acted_on_within_the_peer_timeout(cli, tmp_path, launcher):
    """A job of one node has no peer to tell of its loss, with the launcher or without
    (`use_launcher=False`: the task wrapper keeps the lease): the daemon judges the node's
    lease itself and runs a fresh job without the node, long before the mock's
    SlurmdTimeout (300 s)."""
    mock = MockScheduler(tmp_path / "mock")
    assert mock.cluster_facts().slurmd_timeout_s == 300
    ckpt = tmp_path / "ckpt"
    recipe = tmp_path / "one.py"
    recipe.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[{sys.executable!r}, {str(RECIPE)!r}, '--steps', "
        f"'100000', '--step-time', '0.1', '--checkpoint-dir', {str(ckpt)!r}], nodes=1, "
        f"ntasks_per_node=1, time='10', num_job_retries_on_failure=1, "
        f"use_launcher={launcher!r})\n"
    )
    run_id = cli.submit("--dry-run", str(recipe))["run_id"]
    s = cli.wait_for(
        run_id,
        lambda s: s["attempts"][-1]["state"] == "RUNNING" and any(ckpt.glob("*.json")),
        120,
        "the first checkpoint",
    )
    victim = s["attempts"][0]["nodes"][0]
    mock.fail_node(victim)
    # the peer timeout (20 s) and a few seconds; the old daemon waited for Slurm's 300 s
    s = cli.wait_for(
        run_id,
        lambda s: len(s["attempts"]) > 1,
        FtSettings().peer_timeout_s + 60,
        "the daemon to act on the silent lease",
    )
    first = s["attempts"][0]
    assert first["cause"] == "node_fail" and "Slurm had not noticed yet" in first["reason"], s
    (lost,) = [e.data for e in Store(cli.home).events(run_id) if e.kind == "node_lost"]
    assert (lost["source"], lost["node"]) == ("daemon", victim), lost
    cli("cancel", run_id)
