"""Each injected fault fires once per run, whichever way the run recovers from it (issue
25): the same job requeued, a fresh job after a lost node, or a hot spare in the job and
then a fresh job. On the mock (short scripts, no torch in the ranks), through the CLI and
the daemon as a user runs them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.daemon.store import Store

from .daemon_scenarios import Cli, ended

pytestmark = pytest.mark.slow  # end-to-end daemon scenarios: about 2.5 minutes in all

# A plain script: in the first attempt, a rank started a second time inside the attempt
# (the spare's round) fails at once, so the run moves to a fresh job; otherwise it sleeps
# SLEEP seconds (past the injection's time) and ends well.
SCRIPT = r"""
import os, sys, time
marks = sys.argv[1]
attempt, rank = os.environ.get("FTSLURM_ATTEMPT", "0"), os.environ.get("RANK", "0")
mark = os.path.join(marks, f"started-{attempt}-{rank}")
again = os.path.exists(mark)
open(mark, "a").close()
print(f"rank {rank} attempt {attempt} starts{' again' if again else ''}", flush=True)
if again and attempt == "0" and os.environ.get("FAIL_SECOND_START"):
    sys.exit(3)
time.sleep(float(sys.argv[2]))
"""


def _recipe(tmp_path: Path, sleep: float, **settings: object) -> Path:
    script, marks = tmp_path / "plain.py", tmp_path / "marks"
    script.write_text(SCRIPT)
    marks.mkdir(exist_ok=True)
    path = tmp_path / "recipe.py"
    path.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(script)!r}, {str(marks)!r}, "
        f"{str(sleep)!r}], ntasks_per_node=1, "
        + ", ".join(f"{k}={v!r}" for k, v in settings.items())
        + ")\n"
    )
    return path


def _mock_cli(tmp_path: Path, **config: int) -> Iterator[Cli]:
    cli = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    (tmp_path / "mock.json").write_text(
        json.dumps({"kill_wait_s": 2, "requeue_delay_s": 1, **config})
    )
    cli("mock", "up", "--config", str(tmp_path / "mock.json"))
    try:
        yield cli
    finally:
        cli.stop_daemon()
        cli("mock", "destroy", check=False)


@pytest.fixture
def quick_mock(tmp_path: Path) -> Iterator[Cli]:
    """A mock whose dead nodes are DOWN after 1 s: Slurm's verdict comes first."""
    yield from _mock_cli(tmp_path, slurmd_timeout_s=1)


@pytest.fixture
def slow_mock(tmp_path: Path) -> Iterator[Cli]:
    """A mock with Slurm's SlurmdTimeout (300 s): the launchers' peer report comes first."""
    yield from _mock_cli(tmp_path)


def _lost_events(cli: Cli, run_id: str) -> list[dict]:
    store = Store(cli.home)
    try:
        return [e.data for e in store.events(run_id) if e.kind == "node_lost"]
    finally:
        store.close()


@pytest.mark.parametrize("inject", ["node_fail@2", "crash@1"])
def test_a_requeued_job_does_not_fire_an_injection_again(quick_mock, tmp_path, inject):
    """The fault ends the first attempt (a node lost, or rank 0 killed) and the daemon
    requeues the same job (its restart count goes up): the second attempt runs past the
    injection's time and completes. One retry only: a second firing would fail the run.
    (This path held before issue 25 too, the mock and the ranks remembering what fired in
    the job; the run now records it as well, for any fresh job after it.)"""
    recipe = _recipe(tmp_path, 5, nodes=2, use_launcher=False)
    out = quick_mock.submit("--dry-run", "--retries", "1", "--inject", inject, str(recipe))
    s = quick_mock.wait_for(out["run_id"], ended, 150, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"]
    assert first["job_id"] == second["job_id"], s  # the same job, requeued
    assert second["end"] - second["start"] >= 4, s  # it ran past the injection's time
    assert Store(quick_mock.home).get_run(out["run_id"]).injected == [
        "node_fail@2" if inject.startswith("node") else "crash@1:0"
    ]


def test_a_fresh_job_after_a_lost_node_does_not_lose_a_node_again(slow_mock, tmp_path):
    """The issue's run: `--retries 1 -N 2 --inject node_fail@15`; the survivor's launcher
    reports the loss, the daemon moves the run to a fresh job, which runs past 15 s without
    losing a node (before: it lost one again, "retry budget exhausted", FAILED). (15 s: the
    launchers and ranks have started by then even on a loaded machine.)"""
    recipe = _recipe(tmp_path, 22, nodes=2, peer_timeout_s=2.0, num_in_job_restarts=0)
    out = slow_mock.submit("--dry-run", "--retries", "1", "--inject", "node_fail@15", str(recipe))
    s = slow_mock.wait_for(out["run_id"], ended, 180, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"]
    assert first["cause"] == "node_fail" and second["job_id"] != first["job_id"], s
    assert len(_lost_events(slow_mock, out["run_id"])) == 1
    assert len(s["excluded_nodes"]) == 1, s


def test_after_a_spare_took_a_lost_nodes_place_a_fresh_job_loses_no_node(slow_mock, tmp_path):
    """A spare takes the lost node's place inside the first job; the restarted ranks then
    fail, so the run goes on in a fresh job (the old one waits on its dead node): that job
    runs past the injection's time with all its nodes (before: a spare took a second lost
    node's place). (20 s: three launchers must be watching each other by then, a loss
    before a launcher's first lease waiting for the start timeout, minutes.)"""
    recipe = _recipe(
        tmp_path,
        27,
        nodes=2,
        spare_nodes=1,
        peer_timeout_s=2.0,
        num_in_job_restarts=0,
        env={"FAIL_SECOND_START": "1"},
    )
    out = slow_mock.submit("--dry-run", "--retries", "1", "--inject", "node_fail@20:1", str(recipe))
    s = slow_mock.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"]
    assert second["job_id"] != first["job_id"], s
    (lost,) = _lost_events(slow_mock, out["run_id"])
    assert lost["recovery"] == "spare" and lost["attempt"] == 0, lost
    assert len(s["excluded_nodes"]) == 1, s
