"""`ftslurm wait` on the mock, end to end: it returns within seconds of a run's end even
after the daemon has backed off (up to 60 s between cycles) and the job's end in the
scheduler lags its launchers' node reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ftslurm.core.contract import RunDir

from .daemon_scenarios import on_a_fresh_mock

pytestmark = pytest.mark.slow  # about 70 s: the training must outlast the daemon's floor

TRAIN_S = 45  # the daemon polls every second for 30 s after a change, then backs off
LAG_S = 5  # the batch script's end after the step's (an EXIT trap: a site's epilog)


def test_wait_returns_within_seconds_of_the_end_though_the_daemon_backed_off(tmp_path):
    recipe = tmp_path / "long_recipe.py"
    recipe.write_text(
        "import ftslurm\n"
        f"recipe = ftslurm.Recipe(time='5', command=[{sys.executable!r}, '-c', "
        f"'import time; time.sleep({TRAIN_S})'], setup=[\"trap 'sleep {LAG_S}' EXIT\"])\n"
    )
    with on_a_fresh_mock(tmp_path) as cli:
        out = cli.submit("--dry-run", "--retries", "0", str(recipe))
        waiting = subprocess.Popen(
            [sys.executable, "-m", "ftslurm", "wait", out["run_id"], "--timeout", "240"],
            env=cli.env,
            cwd=cli.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            said, errors = waiting.communicate(timeout=300)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.wait()
        returned = time.time()
        assert waiting.returncode == 0, (said, errors)
        assert "COMPLETED" in said, said
        s = cli.status(out["run_id"])
        report = json.loads(RunDir(s["run_dir"]).node_report(0, 0).read_text())
        assert report["outcome"] == "finished", report
    # The job ends LAG_S after the launcher's node report; the daemon, backed off to 16-60 s
    # between cycles by then, keeps looking every second until the scheduler says so.
    assert returned - report["ended_at"] < LAG_S + 7, (returned, report)
