"""`status`, `watch`, `wait` and `submit` as a user meets them (issue 25 items 6, 14, 15,
17): the checkpoint step while a run runs, continuations, names, the order of runs, notes
said once, `--active`, `wait`'s result on stdout."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockConfig, MockScheduler
from ftslurm.cli import runs as runs_cli
from ftslurm.core.inject import parse_injections
from ftslurm.daemon import service
from ftslurm.daemon.records import NodeFlag, RunState
from ftslurm.daemon.store import Store
from ftslurm.fsutil import write_json_atomic

from .conftest import wait_for
from .test_cli_ux import add_run, cli


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    return tmp_path / "home"


@pytest.fixture
def daemon(home):
    """The daemon of `home`, served in this process (stopped afterwards)."""
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(home,), kwargs={"stop": stop})
    thread.start()
    try:
        wait_for(lambda: service.running_pid(home) is not None, timeout=30,
                 what="the daemon to serve")  # fmt: skip
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def test_status_json_shows_the_checkpoint_the_script_told_of_while_running(capsys, home):
    run = add_run(home, "d779d72089", state=RunState.RUNNING,
                  attempts=1, attempt_state="RUNNING")  # fmt: skip
    assert run.last_checkpoint_step is None  # the daemon records it at an attempt's end
    write_json_atomic(Path(run.spec["run_dir"]) / "progress.json",
                      {"step": 180, "checkpoint_step": 175})  # fmt: skip
    code, out, err = cli(capsys, "status", "d77", "--json")
    assert code == 0, err
    assert json.loads(out)["last_checkpoint_step"] == 175
    code, out, err = cli(capsys, "status", "--json")
    assert json.loads(out)[0]["last_checkpoint_step"] == 175
    with Store(home) as store:
        assert store.get_run("d779d72089").last_checkpoint_step is None  # nothing written


# ------------------------------------------------------------ the mock: items 8 and 16
def test_a_short_slurmd_timeout_gets_no_hint_to_shorten_it(capsys, tmp_path):
    for timeout, hinted in ((3, False), (20, False), (300, True)):
        mock = MockScheduler(tmp_path / f"mock{timeout}", MockConfig(slurmd_timeout_s=timeout))
        runs_cli._warn_injections(parse_injections(("node_fail@10s",)), mock)
        err = capsys.readouterr().err
        assert f"SlurmdTimeout ({timeout} s)" in err
        assert ("--slurmd-timeout" in err) is hinted, err


def test_a_dry_runs_first_line_names_the_mocks_slurmd_timeout(capsys, home, tmp_path,
                                                              monkeypatch):  # fmt: skip
    mock = MockScheduler(tmp_path / "mock", MockConfig(slurmd_timeout_s=7))
    monkeypatch.setattr(runs_cli, "create_backend", lambda kind, where=None: mock)
    monkeypatch.setattr(runs_cli, "_await_submission",
                        lambda store, home, run_id: (None, "the daemon will submit it"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/bash\necho training\n")
    code, out, err = cli(capsys, "submit", "--dry-run", "--inject", "node_fail@5s",
                         "train.sh")  # fmt: skip
    assert code == 0, err
    first = err.splitlines()[0]
    assert "mock cluster" in first and "SlurmdTimeout 7 s" in first, err
    assert "--slurmd-timeout" not in err  # 7 s is short already


def test_mock_reset_brings_nodes_back_and_clears_their_exclusions(capsys, home, daemon,
                                                                  tmp_path):  # fmt: skip
    mock = MockScheduler(tmp_path / "mock", MockConfig())
    mock.fail_node("n2")
    mock.fail_node("n3")
    now = time.time()
    with Store(home) as store:
        for node in ("n2", "n3"):
            store.flag_node(NodeFlag(node=node, reason="node_fail", since=now,
                                     expires_at=now + 86400))  # fmt: skip
        store.flag_node(NodeFlag(node="gpu7", reason="by hand", since=now, expires_at=None))
    assert sum(not n.responding for n in mock.nodes()) == 2
    code, out, err = cli(capsys, "mock", "reset")
    assert code == 0, err
    assert "n[2-3] back up" in out and "n[2-3] no longer excluded" in out, out
    assert all(n.responding and n.state.usable for n in mock.nodes())
    with Store(home) as store:
        assert [f.node for f in store.node_flags()] == ["gpu7"]  # not a node of the mock
    code, out, err = cli(capsys, "mock", "reset")
    assert code == 0 and "every node was up" in out and "no exclusions" in out, out
