"""The pre-flight health check end to end on the mock (issue 30, item 0): a node whose
launcher fails its check before the rendezvous is reported (`recovery/unhealthy-<n>.json`)
and flagged ("health check failed: <check>: <detail>"); without a spare the run goes on in a
job that excludes it, spending no failure budget; with a hot spare the spare takes its
place in the same job. Through the real CLI and daemon (`submit --dry-run`), `status` and
`report` included."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.runfiles import read_reports

from .daemon_scenarios import (
    RECIPE,
    Cli,
    daemon_cli_on_a_mock,
    ended,
    plain,
    write_train,
)

pytestmark = pytest.mark.slow  # daemon runs of short jobs on the mock


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    yield from daemon_cli_on_a_mock(tmp_path)


def _recipe(tmp_path: Path, command: list[str], **settings: object) -> Path:
    path = tmp_path / "health_recipe.py"
    path.write_text(
        "import ftslurm\n"
        f"recipe = ftslurm.Recipe(command={command!r}, "
        + ", ".join(f"{k}={v!r}" for k, v in settings.items())
        + ")\n"
    )
    return path


def _train(tmp_path: Path) -> list[str]:
    return [sys.executable, str(write_train(tmp_path)), "20", "0.02", "5"]


def _unhealthy(run_dir: str, attempt: int) -> list:
    return read_reports(RunDir(run_dir), Kind.UNHEALTHY, attempt)


def _moved_off(cli: Cli, out: dict, check: str, words: str) -> dict:
    """The run's first attempt ended on the node's failed check (flagged with it), and a
    second job elsewhere completed, no retry spent."""
    s = cli.wait_for(out["run_id"], ended, 150, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"][:2]
    assert first["cause"] == "unhealthy", first
    (report,) = _unhealthy(s["run_dir"], 0)
    assert report.check == check and report.node in first["nodes"] and not report.benched
    assert words in report.detail, report
    bad = report.node
    assert bad not in second["nodes"], s
    assert s["flagged_nodes"] == {bad: report.words}, s
    assert report.words.startswith(f"health check failed: {check}: ")
    assert s["job_retries_used"] == 0, s  # a health failure spends no failure budget
    shown = plain(cli("status", s["run_id"]).stdout)
    assert f"{bad}: health check failed: {check}" in shown, shown
    said = plain(cli("report", s["run_id"]).stdout)
    assert f"{bad} failed its health check ({check}" in said, said
    return s


def test_an_injected_unhealthy_node_is_flagged_and_the_run_completes_elsewhere(cli, tmp_path):
    recipe = _recipe(tmp_path, _train(tmp_path), nodes=2, num_job_retries_on_failure=1)
    out = cli.submit("--dry-run", "--inject", "unhealthy@0:n2", str(recipe))
    s = _moved_off(cli, out, "checkpoint_dir", "injected (unhealthy@0:n2)")
    assert len(s["attempts"]) == 2, s  # fired once: the next job's n-th node passes
    (report,) = _unhealthy(s["run_dir"], 0)
    assert report.node == "n2" and report.injected == "unhealthy@0:n2"
    assert json.loads(RunDir(s["run_dir"]).fired_unhealthy.read_text()) == ["unhealthy@0:n2"]


def test_a_site_command_that_fails_on_one_node_moves_the_run_off_it(cli, tmp_path):
    bad = tmp_path / "bad-node"
    # The site's check fails on the node that first ran it as node rank 1, from then on.
    command = (
        f'f={bad}; [ -s "$f" ] || '
        '{ [ "$SLURM_NODEID" = 1 ] && echo "$FTSLURM_HEALTH_NODE" > "$f"; }; '
        f'if grep -qx "$FTSLURM_HEALTH_NODE" "$f" 2>/dev/null; then echo "ECC errors"; exit 4; fi'
    )
    recipe = _recipe(
        tmp_path, _train(tmp_path), nodes=2, num_job_retries_on_failure=0, health_command=command
    )
    out = cli.submit("--dry-run", str(recipe))
    s = _moved_off(cli, out, "site", "exited 4: ECC errors")
    assert list(s["flagged_nodes"]) == [bad.read_text().strip()]


def test_with_a_hot_spare_the_spare_takes_the_unhealthy_nodes_place_in_the_same_job(cli, tmp_path):
    args = ["--steps", "30", "--step-time", "0.05", "--checkpoint-dir", str(tmp_path / "ckpt")]
    recipe = _recipe(
        tmp_path,
        [sys.executable, str(RECIPE), *args],
        nodes=2,
        spare_nodes=1,
        num_job_retries_on_failure=0,
        peer_timeout_s=5.0,
    )
    out = cli.submit("--dry-run", "--inject", "unhealthy@0:1", str(recipe))
    s = cli.wait_for(out["run_id"], ended, 150, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["job_id"] for a in s["attempts"]] == [out["job_id"]], s  # one job
    (attempt,) = s["attempts"]
    (report,) = _unhealthy(s["run_dir"], 0)
    assert report.benched and report.node_rank == 1 and report.node in attempt["nodes"]
    (benched,) = read_reports(RunDir(s["run_dir"]), Kind.BENCHED, 0)
    assert (benched.node, benched.why) == (report.node, "unhealthy")
    assert s["flagged_nodes"] == {report.node: report.words}, s
    nodes = {r.node: r for r in read_reports(RunDir(s["run_dir"]), Kind.NODE, 0)}
    assert nodes[report.node].outcome == "benched"
    spare = attempt["nodes"][2]
    assert nodes[spare].outcome == "finished", nodes  # the spare trained in its place
    assert (tmp_path / "ckpt" / "final.json").exists()
    shown = plain(cli("status", s["run_id"]).stdout)
    assert f"{report.node}: health check failed: checkpoint_dir" in shown, shown
