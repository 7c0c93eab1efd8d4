"""The command line's last-resort handler (`ftslurm.cli.main.main`): a closed stdout ends
quietly, an unexpected error is one line and a hint, never two tracebacks, whichever click
(typer's own copy or the click package) the exception comes from (issue 25 item 5, issue
26 item 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ftslurm.cli import status as status_cli
from ftslurm.cli.main import main
from ftslurm.daemon.records import Attempt, Run, RunState
from ftslurm.daemon.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    return tmp_path / "home"


def add_runs(home: Path, n: int) -> str:
    """`n` ended runs; the first has a 2 MB job output. Returns its id."""
    with Store(home) as store, store.transaction():
        for i in range(n):
            run_id = f"r{i:09d}"
            run_dir = home / "runs" / run_id
            (run_dir / "logs").mkdir(parents=True)
            store.add_run(
                Run(
                    run_id=run_id,
                    name=f"train-{i}",
                    state=RunState.COMPLETED,
                    created_at=1_000_000.0 + i,
                    spec={"run_dir": str(run_dir)},
                    settings={},
                    ended_at=1_000_100.0 + i,
                )
            )
            store.add_attempt(
                Attempt(
                    run_id,
                    0,
                    "COMPLETED",
                    job_id=str(100 + i),
                    nodes=["n1"],
                    start=1_000_001.0,
                    end=1_000_099.0,
                )
            )
    first = "r000000000"
    text = f"=== ftslurm run {first} attempt 0: job 100 ===\n" + "x" * 99 + "\n"
    (home / "runs" / first / "logs" / "job-100.out").write_text(text * 20_000)
    return first


def closing_reader(argv: tuple[str, ...], read: int) -> tuple[int, str]:
    """ftslurm ARGV with a reader that reads `read` bytes and closes the pipe (`head -c 1`
    reads one; 0: a reader gone before ftslurm writes), ftslurm having more to write than
    the pipe holds: ftslurm's exit status and its stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftslurm", *argv], env=env, stdout=w, stderr=subprocess.PIPE
        )
    finally:
        os.close(w)
    try:
        if read:
            assert len(os.read(r, read)) == read
        os.close(r)  # ftslurm's next write finds no reader
        r = -1
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        return proc.wait(timeout=120), err
    finally:
        if r >= 0:
            os.close(r)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("read", [0, 1])
@pytest.mark.parametrize("command", ["logs", "status"])
def test_a_closed_stdout_ends_quietly(home, command, read):
    """The reader closes (at once, or after one byte as `head -c 1`) while ftslurm still
    writes (2 MB of job output, a table of 1000 runs: more than a pipe holds): no
    traceback, exit 0, as Unix tools end quietly."""
    first = add_runs(home, 1000 if command == "status" else 1)
    code, err = closing_reader((command, *([first] if command == "logs" else [])), read)
    assert err == "" and code == 0, err


def test_an_unexpected_error_is_one_line_and_a_hint(home, capsys, monkeypatch):
    def broken():  # type: ignore[no-untyped-def]
        raise KeyError("n99")

    monkeypatch.setattr(status_cli, "_store", broken)
    code = main(["status"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert lines == [
        "Error: unexpected KeyError: 'n99'",
        "Hint: this is a bug in ftslurm; `ftslurm --debug status` shows the traceback to report",
    ], err
    code = main(["--debug", "status"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("Traceback") == 1 and "KeyError: 'n99'" in err


@pytest.mark.parametrize(
    "raised, code, said",
    [
        (click.exceptions.Abort(), 1, "Aborted!"),
        (click.exceptions.UsageError("no such thing"), 2, "no such thing"),
        (click.exceptions.Exit(3), 3, None),
        (KeyboardInterrupt(), 130, None),
    ],
)
def test_click_package_exceptions_are_handled_as_typers(
    home, capsys, monkeypatch, raised, code, said
):
    """Exceptions of the click package (what typer before 0.22 raises) and of typer's own
    copy are handled alike."""

    def raising():  # type: ignore[no-untyped-def]
        raise raised

    monkeypatch.setattr(status_cli, "_store", raising)
    assert main(["status"]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unexpected" not in err
    if said:
        assert said in err


# ------------------------------------------------------------ help (issue 25 item 18)
def help_of(capsys, monkeypatch, width: int, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def walk(command, path=()):  # type: ignore[no-untyped-def]
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


def test_help_texts_wrap_at_the_terminals_width_not_the_docstrings(capsys, monkeypatch):
    import typer

    from ftslurm.cli.main import app, readable

    for path, command in walk(readable(typer.main.get_command(app))):
        texts = [command.help or ""] + [p.help or "" for p in command.params]
        assert not [t for t in texts if "\n" in t.replace("\n\n", "")], path
    out = help_of(capsys, monkeypatch, 300)
    line = next(x for x in out.splitlines() if "│ status " in x)
    assert "stopped answering." in line, out  # one line: no break where the docstring had one


def test_help_placeholders_read_as_words(capsys, monkeypatch):
    import typer

    from ftslurm.cli.main import app

    for path, command in walk(typer.main.get_command(app)):
        if getattr(command, "hidden", False) or hasattr(command, "commands"):
            continue
        out = help_of(capsys, monkeypatch, 120, *path)
        assert not any(
            x in out for x in ("{", "<int", "<str", "<bool", "<float", "<path", "<list", "<file")
        ), (path, out)
    assert "Usage: ftslurm submit [OPTIONS] RECIPE [ARGS]..." in help_of(
        capsys, monkeypatch, 120, "submit"
    )
    assert "Usage: ftslurm report [OPTIONS] RUN " in help_of(capsys, monkeypatch, 120, "report")
    assert "--retries                INTEGER" in help_of(capsys, monkeypatch, 120, "submit")


def test_submit_help_is_grouped(capsys, monkeypatch):
    out = help_of(capsys, monkeypatch, 120, "submit")
    order = [
        out.index(title)
        for title in ("Retries and recovery", "Checkpoints", "sbatch's flags", "dry run")
    ]
    assert order == sorted(order), out
    assert order[0] < out.index("--retries") < order[1] < out.index("--preempt-time")
    assert order[2] < out.index("--partition") < order[3] < out.index("--inject")


def test_the_double_dash_hint_only_after_the_recipe(capsys, home, tmp_path):
    script = str(tmp_path / "train.py")
    for argv, hinted in (
        (["submit", script, "--lr", "3e-4"], True),
        (["submit", "-N", "2", "-t", "10", script, "--lr=3e-4"], True),
        (["submit", "--lr", "3e-4", script], False),
        (["submit", "-N", "2", "--bogus", script], False),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "No such option" in err
        assert ("after `--`" in err) is hinted, (argv, err)
