"""`status`, `watch`, `wait` and `submit` as a user meets them (issue 25 items 6, 14, 15,
17): the checkpoint step while a run runs, continuations, names, the order of runs, notes
said once, `--active`, `wait`'s result on stdout."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from ftslurm.backends.mock import MockConfig, MockScheduler
from ftslurm.cli import status as status_cli
from ftslurm.cli import submit as submit_cli
from ftslurm.cli.main import main
from ftslurm.core.cadence import Cadence
from ftslurm.core.inject import parse_injections
from ftslurm.daemon import service
from ftslurm.daemon.records import NodeFlag, RunState
from ftslurm.daemon.store import Store
from ftslurm.fsutil import write_json_atomic

from .conftest import wait_for
from .test_cli_ux import add_run, cli, render


@pytest.fixture
def home(tmp_path, monkeypatch) -> Iterator[Path]:
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    yield tmp_path / "home"
    if (tmp_path / "mock").exists():  # `status` asked the mock: its controller stops too
        main(["mock", "destroy"])


@pytest.fixture
def daemon(home):
    """The daemon of `home`, served in this process (stopped afterwards)."""
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(home,), kwargs={"stop": stop})
    thread.start()
    try:
        wait_for(
            lambda: service.running_pid(home) is not None, timeout=30, what="the daemon to serve"
        )
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def test_status_json_shows_the_checkpoint_the_script_told_of_while_running(capsys, home):
    run = add_run(home, "d779d72089", state=RunState.RUNNING, attempts=1, attempt_state="RUNNING")
    assert run.last_checkpoint_step is None  # the daemon records it at an attempt's end
    write_json_atomic(
        Path(run.spec["run_dir"]) / "progress.json", {"step": 180, "checkpoint_step": 175}
    )
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
        submit_cli._warn_injections(parse_injections(("node_fail@10s",)), mock)
        err = capsys.readouterr().err
        assert f"SlurmdTimeout ({timeout} s)" in err
        assert ("--slurmd-timeout" in err) is hinted, err


def test_a_dry_runs_first_line_names_the_mocks_slurmd_timeout(capsys, home, tmp_path, monkeypatch):
    mock = MockScheduler(tmp_path / "mock", MockConfig(slurmd_timeout_s=7))
    monkeypatch.setattr(submit_cli, "create_backend", lambda kind, where=None: mock)
    monkeypatch.setattr(
        submit_cli,
        "_await_submission",
        lambda store, home, run_id: (None, "the daemon will submit it"),
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/bash\necho training\n")
    code, out, err = cli(capsys, "submit", "--dry-run", "--inject", "node_fail@5s", "train.sh")
    assert code == 0, err
    (first,) = out.splitlines()  # the one line a dry run prints on stdout
    assert "on the mock cluster in" in first and "(SlurmdTimeout 7 s)" in first, out
    assert "--slurmd-timeout" not in err  # 7 s is short already
    code, out, err = cli(capsys, "submit", "--dry-run", "--json", "train.sh")
    assert code == 0 and json.loads(out)["slurmd_timeout_s"] == 7, err


def test_mock_reset_brings_nodes_back_and_clears_their_exclusions(capsys, home, daemon, tmp_path):
    mock = MockScheduler(tmp_path / "mock", MockConfig())
    mock.fail_node("n2")
    mock.fail_node("n3")
    now = time.time()
    with Store(home) as store:
        for node in ("n2", "n3"):
            store.flag_node(
                NodeFlag(node=node, reason="node_fail", since=now, expires_at=now + 86400)
            )
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


# ------------------------------------------------------------ 14. continuations
def ended_as(
    home: Path, run_id: str, attempt: int, cause: str, verdict: str, exit_code: int
) -> None:
    with Store(home) as store:
        a = store.attempts(run_id)[attempt]
        store.update_attempt(
            replace(
                a,
                state="FAILED",
                exit_code=exit_code,
                cause=cause,
                reason="checkpointed: continuing",
            )
        )
        store.append_event(
            run_id, "ended", {"attempt": attempt, "cause": cause, "verdict": verdict}, time.time()
        )


def test_a_continuation_reads_as_one_not_as_failed(monkeypatch, capsys, home):
    add_run(home, "d779d72089", attempts=2)
    ended_as(home, "d779d72089", 0, "checkpointed", "continue", 75)
    text = render(monkeypatch, capsys, 200, "status", "d77")
    row = next(line for line in text.splitlines() if line.startswith("│ 0 "))
    assert "CONTINUED" in row and "FAILED" not in row, text
    code, out, _ = cli(capsys, "status", "d77", "--json")
    first = json.loads(out)["attempts"][0]
    assert first["continuation"] is True and first["state"] == "FAILED"  # Slurm's, kept
    # a continuation failed for making no checkpoint progress is no continuation
    ended_as(home, "d779d72089", 0, "checkpointed", "fail", 75)
    text = render(monkeypatch, capsys, 200, "status", "d77")
    row = next(line for line in text.splitlines() if line.startswith("│ 0 "))
    assert "CONTINUED" not in row and "FAILED" in row, text


# ------------------------------------------------------------ 15. the same --name
def submit(capsys, tmp_path, monkeypatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(
        submit_cli,
        "_await_submission",
        lambda store, home, run_id: (None, "the daemon will submit it"),
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/bash\necho training\n")
    return cli(capsys, "submit", "-t", "10", *argv, "train.sh")


def test_a_name_an_active_run_has_is_refused(capsys, home, tmp_path, monkeypatch):
    add_run(
        home, "d779d72089", name="gpt", state=RunState.RUNNING, attempts=1, attempt_state="RUNNING"
    )
    code, out, err = submit(capsys, tmp_path, monkeypatch, "--name", "gpt")
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith(
        "Error: --name 'gpt': active run d779d72089 (RUNNING)"
    ), err
    with Store(home) as store:
        assert len(store.list_runs()) == 1  # nothing recorded


def test_a_name_is_free_again_once_its_run_ended_and_names_the_active_run(
    capsys, home, tmp_path, monkeypatch
):
    add_run(home, "d779d72089", name="gpt")  # COMPLETED
    code, out, err = submit(capsys, tmp_path, monkeypatch, "--name", "gpt")
    assert code == 0 and "Warning" not in err, err
    with Store(home) as store:
        new = next(r for r in store.list_runs() if r.run_id != "d779d72089")
    code, out, err = cli(capsys, "status", "gpt", "--json")
    assert code == 0 and json.loads(out)["run_id"] == new.run_id, err


def test_a_default_name_an_active_run_has_is_a_warning(capsys, home, tmp_path, monkeypatch):
    add_run(
        home,
        "d779d72089",
        name="train.sh",
        state=RunState.RUNNING,
        attempts=1,
        attempt_state="RUNNING",
    )
    code, out, err = submit(capsys, tmp_path, monkeypatch)
    assert code == 0, err
    assert "Warning: active run d779d72089 (RUNNING) is also named 'train.sh'" in err
    assert "recorded" in out


# ------------------------------------------------------------ 17. status, watch, wait
NO_HEARTBEATS = (
    "the ranks wrote no heartbeats (no rank agent): hangs are detected only by 600s without CPU use"
)


def three_runs(home: Path) -> None:
    add_run(home, "a000000001", name="done")
    add_run(
        home,
        "b000000002",
        name="queued",
        state=RunState.PENDING,
        attempts=1,
        attempt_state="PENDING",
    )
    add_run(
        home,
        "c000000003",
        name="training",
        state=RunState.RUNNING,
        attempts=1,
        attempt_state="RUNNING",
    )


def test_status_lists_running_runs_first_and_active_ones_alone(capsys, home, monkeypatch):
    three_runs(home)
    code, out, _ = cli(capsys, "status", "--json")
    assert [s["run_id"] for s in json.loads(out)] == ["c000000003", "b000000002", "a000000001"]
    code, out, _ = cli(capsys, "status", "--active", "--json")
    assert [s["run_id"] for s in json.loads(out)] == ["c000000003", "b000000002"]
    text = render(monkeypatch, capsys, 200, "status", "--active")
    assert "submitted" in text and "a000000001" not in text
    assert text.index("c000000003") < text.index("b000000002")


def test_the_no_heartbeats_note_is_said_once(monkeypatch, capsys, home):
    for run_id in ("a000000001", "b000000002"):
        add_run(home, run_id)
        with Store(home) as store:
            run = store.get_run(run_id)
            store.update_run(replace(run, reason=f"training finished; {NO_HEARTBEATS}"))
            a = store.attempts(run_id)[-1]
            store.update_attempt(replace(a, reason=f"training finished; {NO_HEARTBEATS}"))
    for argv in (("status",), ("status", "a00")):
        text = " ".join(render(monkeypatch, capsys, 200, *argv).split())
        assert text.count("wrote no heartbeats") == 1, text
        assert f"note: {NO_HEARTBEATS}" in text and "training finished" in text


def test_checkpoint_lines_only_for_runs_that_use_them(monkeypatch, capsys, home, tmp_path):
    run = add_run(home, "d779d72089", state=RunState.RUNNING, attempts=1, attempt_state="RUNNING")
    folder = tmp_path / "ckpt"
    cadence = Cadence(
        interval_s=600.0,
        how="tuned",
        save_s=20.0,
        mtbf_s=86400.0,
        rate_per_1000=1.0,
        node_days=1.0,
        live_coverage=0.87,
    )
    with Store(home) as store:
        stored = store.get_run(run.run_id)
        store.update_run(
            replace(
                stored,
                spec={
                    **stored.spec,
                    "checkpoint_dir": str(folder),
                    "checkpoint_dir_from": "$SCRATCH",
                },
            )
        )
        store.append_event(run.run_id, "cadence", cadence.to_json(), time.time())
    text = render(monkeypatch, capsys, 200, "status", "d77")  # a plain script: neither
    assert "checkpoints in" not in text and "checkpoints:" not in text, text
    write_json_atomic(
        Path(run.spec["run_dir"]) / "progress.json", {"step": 50, "checkpoint_step": 40}
    )
    text = render(monkeypatch, capsys, 200, "status", "d77")  # the rank agent: both
    assert "checkpoints in: " in text and "checkpoints: checkpoint every" in text, text
    assert "live recovery serves ~87% of node failures" in " ".join(text.split()), text


def test_watch_fits_80x24_with_the_active_runs_first():
    summaries = []
    for i in range(30):
        state = "RUNNING" if i >= 27 else "COMPLETED"
        summaries.append(
            {
                "run_id": f"r{i:09d}",
                "name": f"a-long-run-name-{i}",
                "state": state,
                "created_at": 1_000_000.0 + i,
                "job_retries_used": 0,
                "job_retries_max": 2,
                "continuations": 0,
                "last_checkpoint_step": None,
                "reason": None if state == "RUNNING" else f"training finished; {NO_HEARTBEATS}",
                "attempts": [
                    {
                        "attempt": 0,
                        "job_id": str(100 + i),
                        "state": state,
                        "nodes": ["n1", "n2"],
                        "continuation": False,
                    }
                ],
            }
        )
    summaries = summaries[27:] + summaries[:27]  # as `ordered` lists them
    con = Console(width=80, height=24, file=io.StringIO(), record=True, color_system=None)
    con.print(status_cli.watch_view(summaries, 80, 24, 1_000_100.0))
    lines = con.export_text().splitlines()
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert all(f"r{i:09d}" in text for i in (27, 28, 29)), text  # every running run
    assert "more run(s) not shown" in text and text.count("wrote no heartbeats") == 1


def test_wait_prints_its_result_on_stdout(capsys, home):
    add_run(home, "d779d72089")
    code, out, err = cli(capsys, "wait", "d77")
    assert (code, out, err) == (0, "run d779d72089 COMPLETED\n", "")


@pytest.mark.parametrize(
    "spec,expected",
    [
        ({"backend": "slurm"}, ("slurm", None)),
        ({"backend": "auto", "mock_home": None}, ("auto", None)),
        ({"backend": "mock", "mock_home": "/clusters/m1"}, ("mock", "/clusters/m1")),
        ({"backend": "mock", "mock_home": None}, ("mock", None)),  # the default mock
    ],
)
def test_a_runs_backend_key_reads_back_as_create_backends_kind_and_home(spec, expected):
    from ftslurm.backends import split_backend_key
    from ftslurm.daemon.submission import backend_key

    assert split_backend_key(backend_key(spec)) == expected


def test_one_module_parses_a_backend_key():
    """The commands and the daemon read a run's backend through `split_backend_key`: the
    CLI once parsed it three ways."""
    import ast

    package = Path(status_cli.__file__).resolve().parent.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "backends" / "__init__.py":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("partition", "split")
                and isinstance(n.func.value, ast.Name)
                and "key" in n.func.value.id
                and [getattr(a, "value", None) for a in n.args] == [":"]
            ):
                found.append(f"{path.relative_to(package.parent)}:{n.lineno}")
            if (
                isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "create_backend"
                and any(
                    isinstance(s, ast.Constant) and s.value in ("backend", "mock_home")
                    for a in n.args
                    for s in ast.walk(a)
                )
                and not any(isinstance(a, ast.Constant) and a.value == "mock" for a in n.args)
            ):
                found.append(f"{path.relative_to(package.parent)}:{n.lineno}")
    assert not found, "use ftslurm.backends.split_backend_key:\n" + "\n".join(found)
