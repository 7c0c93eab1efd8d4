"""The session-end check of tests/conftest.py (`left_behind`): a test that leaves a daemon
or a mock controller running fails the run, which names the test's folder and stops them;
a test that stops what it started passes. Checked on an inner pytest session."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

INNER = """
import os, subprocess, sys
from ftslurm.daemon import service


def cli(*args, **env):
    subprocess.run([sys.executable, "-m", "ftslurm", *args], check=True, capture_output=True,
                   env={**os.environ, **env}, timeout=60)


def test_stops_what_it_starts(tmp_path):
    service.start(tmp_path / "home")
    service.stop(tmp_path / "home")


def test_leaves_a_daemon_and_a_controller(tmp_path):
    service.start(tmp_path / "home")
    cli("mock", "up", FTSLURM_MOCK_HOME=str(tmp_path / "mock"))
"""


def _alive(pid: int) -> bool:
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def test_a_process_a_test_left_running_fails_the_run_and_is_stopped(tmp_path: Path) -> None:
    inner = tmp_path / "inner_tests"
    inner.mkdir()
    (inner / "test_inner.py").write_text(INNER)
    env = {
        **{k: v for k, v in os.environ.items() if k != "FTSLURM_TEST_SUMMARY"},  # outer's
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "FTSLURM_TEST_LEAK_GRACE_S": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--basetemp",
            str(tmp_path / "base"),
            str(inner),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 passed" in out, out  # the tests themselves passed: the leak fails the run
    left = re.findall(r"^(\S[^\n]*?) pid (\d+), of the test folder (\S+)$", out, re.M)
    assert sorted(what for what, _, _ in left) == ["daemon", "mock controller"], out
    assert {Path(folder).name for _, _, folder in left} == {"test_leaves_a_daemon_and_a_con0"}, out
    for _, pid, _ in left:
        assert not _alive(int(pid)), f"pid {pid} still runs"


@pytest.mark.slow
def test_the_daemon_fixtures_teardown_cancels_the_runs_and_leaves_no_daemon(tmp_path: Path):
    """`daemon_cli` (the real-cluster suites' fixture) after a test that left a run active:
    the run is cancelled and then the daemon stopped (it cancelled after stopping the
    daemon, and the cancel started a new one, left running: issue 25, item 9)."""
    from ftslurm.daemon import service

    from .daemon_scenarios import daemon_cli

    mock = {"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        "import sys\nimport ftslurm\nrecipe = ftslurm.Recipe(command=["
        "sys.executable, '-c', 'import time; time.sleep(120)'], "
        "use_launcher=False)\n"
    )
    fixture = daemon_cli(tmp_path, **mock)
    cli = next(fixture)
    cli("mock", "up")
    try:
        out = cli.submit("--dry-run", str(recipe))
        cli.wait_for(
            out["run_id"], lambda s: s["attempts"][-1]["state"] == "RUNNING", 60, "the job to run"
        )
        next(fixture, None)  # the teardown
        assert service.running_pid(cli.home) is None
        assert cli.summary(out["run_id"])["state"] == "CANCELLED"
    finally:
        cli.stop_daemon()
        cli("mock", "destroy", check=False)
