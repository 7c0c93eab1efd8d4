"""A lost node on the mock with its default SlurmdTimeout (300 s): the launchers' report
makes the daemon replace the job well inside 2 minutes (the scenario of
test_lost_node_slurm.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ftslurm.backends.mock import MockScheduler

from .daemon_scenarios import Cli
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
def test_a_lost_node_is_replaced_well_before_the_mocks_slurmd_timeout(cli, tmp_path,
                                                                      node_rank):  # fmt: skip
    mock = MockScheduler(tmp_path / "mock")
    assert mock.cluster_facts().slurmd_timeout_s == 300
    a_lost_node_is_replaced_by_a_fresh_job(cli, tmp_path, mock.fail_node, node_rank,
                                           "--dry-run")  # fmt: skip
