"""Runs no daemon serves say so (issue 26 item 10): `status` of runs that have not ended
adds one line when no daemon serves them, and a Ctrl-C on `submit` says whether the run
was recorded (and will be submitted) or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.cli import submit as submit_cli
from ftslurm.cli.main import main
from ftslurm.cli.submit import PAUSE_ENV
from ftslurm.daemon.records import Attempt, Run, RunState
from ftslurm.daemon.store import Store

from .conftest import wait_for
from .daemon_scenarios import Cli, write_train


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    return tmp_path / "home"


def add_run(home: Path, run_id: str, state: RunState) -> None:
    with Store(home) as store, store.transaction():
        store.add_run(
            Run(
                run_id=run_id,
                name=run_id,
                state=state,
                created_at=1_000_000.0,
                spec={"run_dir": str(home / "runs" / run_id)},
                settings={},
            )
        )
        store.add_attempt(Attempt(run_id, 0, "SUBMITTING"))


def test_status_says_when_no_daemon_serves_runs_that_have_not_ended(home, capsys):
    add_run(home, "r1", RunState.PENDING)
    assert main(["status"]) == 0
    out, err = capsys.readouterr()
    assert "r1" in out
    (line,) = err.splitlines()
    assert line.startswith("warning: no daemon serves ") and "run r1 " in line
    assert "`ftslurm daemon start`" in line
    assert main(["status", "--json", "r1"]) == 0  # stderr: the JSON stays clean
    assert "no daemon serves" in capsys.readouterr().err


def test_status_of_ended_runs_says_nothing_of_the_daemon(home, capsys):
    add_run(home, "r1", RunState.COMPLETED)
    assert main(["status"]) == 0
    assert capsys.readouterr().err == ""


def test_an_interrupt_before_the_run_is_recorded_says_nothing_was(home):
    submit_cli._SUBMITTING.update(home=home, run_id="r-not-there")
    add_run(home, "other", RunState.PENDING)
    note = submit_cli.interrupted_submit()
    assert note == ("interrupted before the run was recorded: nothing was recorded or submitted")
    assert submit_cli.interrupted_submit() is None  # said once


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    c = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    yield c
    c.stop_daemon()
    c("mock", "destroy", check=False)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_ctrl_c_on_submit_after_recording_says_the_run_will_be_submitted(cli, tmp_path):
    """Forced timing: `submit` holds itself (SIGSTOP) right after recording the run; a
    Ctrl-C then ends it with 130 and one line naming the run, which a daemon submits."""
    train = write_train(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftslurm", "submit", "--dry-run", "-t", "10", str(train)],
        env=dict(cli.env, **{PAUSE_ENV: "1"}),
        cwd=cli.cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: proc.poll() is not None or _stopped(proc.pid), 60, "submit to pause")
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    (run,) = Store(cli.home).list_runs()
    assert proc.returncode == 130 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(
        f"interrupted: run {run.run_id} is recorded and a daemon will "
        "submit it once one runs (`ftslurm daemon start`)"
    ), err
    assert f"`ftslurm cancel {run.run_id}`" in line
