"""The pre-flight health check on the real local cluster (issue 30, item 0): one node whose
checkpoint staging directory cannot be written.

The local cluster's four nodes share this machine's file system, so "one node's checkpoint
directory is unwritable" is made the way a site has it: a node-local staging folder per node
(the `health_dirs` setting, `{node}` replaced by the node's name, as sites stage checkpoints
on node-local disks before they go to the shared file system), and node n2's is a read-only
mount (the cluster's fault control `read_only_dir`: a bind mount remounted `ro`, writes fail
with EROFS for root as for anyone, as a node-local disk gone read-only; permission bits
would not stop a job run as root). The launcher on n2 must fail
its check before the rendezvous, the daemon flag n2 with the check's words, and the run go on
in a job without n2 that completes, no retry spent."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.runfiles import read_reports

from .daemon_scenarios import Cli, daemon_cli, ended, plain, write_train

pytestmark = pytest.mark.slurm

BAD = "n2"  # a job of 2 nodes on the idle cluster is placed on n1 and n2


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


@pytest.fixture
def staging(healthy_nodes, tmp_path) -> Iterator[Path]:
    """`<tmp>/staging/<node>` for every node, n2's a read-only mount (unmounted after)."""
    root = tmp_path / "staging"
    for node in healthy_nodes.layout.node_names:
        (root / node).mkdir(parents=True)
    bad = root / BAD
    healthy_nodes.read_only_dir(bad)
    try:
        with pytest.raises(OSError):
            (bad / "probe").write_text("x")  # read-only for everyone
        yield root
    finally:
        healthy_nodes.read_only_dir(bad, read_only=False)


def test_a_node_whose_staging_directory_is_read_only_is_flagged_and_left_out(
    cli, staging, tmp_path
):
    train = [sys.executable, str(write_train(tmp_path)), "40", "0.05", "10"]
    recipe = tmp_path / "health.py"
    recipe.write_text(
        "import ftslurm\n"
        f"recipe = ftslurm.Recipe(command={train!r}, nodes=2, num_job_retries_on_failure=0, "
        f"health_dirs=({str(staging / '{node}')!r},))\n"
    )
    out = cli.submit(str(recipe))
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"][:2]
    assert BAD in first["nodes"], f"Slurm placed the first job elsewhere: {first['nodes']}"
    assert first["cause"] == "unhealthy", first
    assert BAD not in second["nodes"], second
    (report,) = read_reports(RunDir(s["run_dir"]), Kind.UNHEALTHY, 0)
    assert (report.node, report.check) == (BAD, "checkpoint_dir")
    assert str(staging / BAD) in report.detail and "Read-only file system" in report.detail
    assert s["flagged_nodes"] == {BAD: report.words}, s
    assert s["job_retries_used"] == 0, s
    shown = plain(cli("status", s["run_id"]).stdout)
    assert f"{BAD}: health check failed: checkpoint_dir" in shown, shown
