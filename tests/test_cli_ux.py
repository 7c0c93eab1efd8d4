"""What a user meets at the command line: naming runs, lost nodes, tables that fit the
terminal, help that teaches, node names (issue 12, items 6, 7, 8, 10, 11)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from rich.console import Console

from ftslurm import __version__
from ftslurm.backends import pyslurm_backend
from ftslurm.backends.mock import MockConfig, MockScheduler
from ftslurm.backends.slurm_cli import parse
from ftslurm.cli import nodes as nodes_cli
from ftslurm.cli import report as report_cli
from ftslurm.cli import status as status_cli
from ftslurm.cli import submit as submit_cli
from ftslurm.cli.main import app, main
from ftslurm.core.inject import parse_injections
from ftslurm.core.types import NodeInfo, NodeState
from ftslurm.daemon import service
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import Attempt, NodeFlag, Run, RunState
from ftslurm.daemon.store import Store
from ftslurm.errors import FtslurmError
from ftslurm.report.notes import fmt_time, lost_node_notes

from .conftest import wait_for

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    return tmp_path / "home"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def header(run_id: str, attempt: int, job_id: str) -> str:
    return f"=== ftslurm run {run_id} attempt {attempt}: job {job_id} ===\n"


def add_run(
    home: Path,
    run_id: str,
    name: str = "train",
    state: RunState = RunState.COMPLETED,
    attempts: int = 2,
    nodes: tuple[str, ...] = ("n1", "n2"),
    attempt_state: str = "COMPLETED",
) -> Run:
    """A run with `attempts` attempts (jobs 100, 101, ...) and their output files."""
    t0 = 1_000_000.0
    run_dir = home / "runs" / run_id
    (run_dir / "logs").mkdir(parents=True)
    ended = state.is_terminal
    run = Run(
        run_id=run_id,
        name=name,
        state=state,
        created_at=t0,
        spec={
            "run_dir": str(run_dir),
            "backend": "mock",
            "mock_home": os.environ["FTSLURM_MOCK_HOME"],
        },
        settings={"num_job_retries_on_failure": 3},
        ended_at=t0 + 1000 * attempts if ended else None,
    )
    with Store(home) as store:
        store.add_run(run)
        for k in range(attempts):
            job = str(100 + k)
            last = k == attempts - 1
            store.add_attempt(
                Attempt(
                    run_id=run_id,
                    attempt=k,
                    state=attempt_state if last else "NODE_FAIL",
                    job_id=job,
                    nodes=list(nodes),
                    submitted_at=t0 + 1000 * k,
                    start=t0 + 1000 * k + 10,
                    end=t0 + 1000 * (k + 1) if ended or not last else None,
                    exit_code=0 if ended and last else None,
                )
            )
            (run_dir / "logs" / f"job-{job}.out").write_text(
                header(run_id, k, job) + f"output of attempt {k}\n"
            )
    return run


# ------------------------------------------------------------------ 6. naming a run
def test_logs_by_prefix_prints_the_runs_output(capsys, home):
    add_run(home, "d779d72089")
    code, out, err = cli(capsys, "logs", "d77")
    assert code == 0, err
    assert "output of attempt 1" in out
    code, out, err = cli(capsys, "logs", "d77", "--attempt", "0")
    assert code == 0, err
    assert "output of attempt 0" in out and "attempt 1" not in out


def test_report_by_prefix_equals_report_by_full_id(capsys, home):
    add_run(home, "d779d72089")
    code, full, err = cli(capsys, "report", "d779d72089", "--json")
    assert code == 0, err
    code, short, err = cli(capsys, "report", "d77", "--json")
    assert code == 0, err
    assert json.loads(short) == json.loads(full)
    assert {e["attempt"] for e in json.loads(full)["timeline"]} >= {0, 1}


def test_a_run_is_named_by_its_unique_name(capsys, home):
    add_run(home, "d779d72089", name="gpt-small")
    add_run(home, "a1b2c3d4e5", name="bert")
    code, out, err = cli(capsys, "status", "gpt-small", "--json")
    assert code == 0, err
    assert json.loads(out)["run_id"] == "d779d72089"
    code, out, _ = cli(capsys, "logs", "bert")
    assert code == 0 and "output of attempt 1" in out


def test_an_ambiguous_name_or_prefix_lists_the_candidates(capsys, home):
    add_run(home, "d779d72089", name="train")
    add_run(home, "d77aaaaaaa", name="train")
    for ref in ("train", "d77"):
        code, out, err = cli(capsys, "logs", ref)
        assert code != 0 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), err
        assert "d779d72089" in lines[0] and "d77aaaaaaa" in lines[0]


def test_an_unknown_run_is_a_one_line_error(capsys, home):
    add_run(home, "d779d72089")
    for command in ("status", "wait", "logs", "report", "cancel"):
        code, _, err = cli(capsys, command, "zzz")
        assert code != 0 and err.startswith("Error: no run 'zzz'"), (command, err)
        assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ 7. node names
@pytest.mark.parametrize("name", ["", "  ", "n1 n2", "n1\x07", "n\n1", "n[1-", "n1;rm"])
def test_nodes_add_refuses_blank_and_odd_names(capsys, home, name):
    code, _, err = cli(capsys, "nodes", "add", name)
    assert code != 0 and err.startswith("Error: ") and len(err.strip().splitlines()) == 1
    with Store(home) as store:
        assert store.node_flags(time.time()) == []


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


def test_nodes_add_expands_a_hostlist(capsys, home, daemon):
    code, out, err = cli(capsys, "nodes", "add", "n[1-3]", "--reason", "bad fans")
    assert (code, out) == (0, "n[1-3] excluded\n"), err  # applied when it says so
    with Store(home) as store:
        assert sorted(f.node for f in store.node_flags(time.time())) == ["n1", "n2", "n3"]
        assert {f.reason for f in store.node_flags()} == {"bad fans"}
    code, out, err = cli(capsys, "nodes", "remove", "n[1-2]")
    assert (code, out) == (0, "n[1-2] no longer excluded\n"), err
    with Store(home) as store:
        assert [f.node for f in store.node_flags(time.time())] == ["n3"]
        assert store.pending_requests() == []
        assert [e.kind for e in store.events()] == ["nodes_add", "nodes_remove"]
    code, _, err = cli(capsys, "nodes", "remove", "n[3-4]")  # n4 is not on the list
    assert code != 0 and err == "Error: n4 not on the exclusion list\n"
    with Store(home) as store:
        assert [f.node for f in store.node_flags()] == ["n3"]  # refused whole
        assert store.pending_requests() == []


def test_nodes_add_without_a_daemon_is_a_recorded_request(capsys, home, monkeypatch):
    def cannot_start(_home, timeout_s=15.0):  # type: ignore[no-untyped-def]
        raise FtslurmError("the daemon exited at once (code 1); see daemon.log")

    monkeypatch.setattr(service, "start", cannot_start)
    code, out, err = cli(capsys, "nodes", "add", "n[1-2]", "--ttl", "600")
    assert code == 0, err
    assert out == (
        "n[1-2]: exclusion recorded; the daemon applies it on its next cycle, "
        "once it runs (the daemon exited at once (code 1); see daemon.log)\n"
    )
    with Store(home) as store:
        assert store.node_flags() == []  # the command wrote no flag itself
        (request,) = store.pending_requests()
    code, out, err = cli(capsys, "nodes")
    assert "1 node request(s) not applied yet" in err and "n1" not in out
    with Store(home) as store:
        Reconciler(store, lambda _kind: None).cycle()  # the daemon's next cycle
        flags = store.node_flags(time.time())
        assert [f.node for f in flags] == ["n1", "n2"]
        assert flags[0].expires_at == pytest.approx(request.created_at + 600)
        assert store.get_request(request.request_id).result == {"added": ["n1", "n2"]}


def test_the_cli_writes_no_run_state_itself():
    """The daemon is the one writer of runs, attempts and node flags: no command calls the
    store's transitions (they write requests, the cancel flag, or a new run)."""
    import ast

    transitions = {"update_run", "update_attempt", "flag_node", "unflag_node"}
    found = []
    for path in sorted((REPO / "ftslurm" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = getattr(node, "attr", None) or getattr(node, "id", None)
            if name in transitions:
                found.append(f"{path.name}:{node.lineno} {name}")
    assert not found, found


# ------------------------------------------------------------------ 8. a silent node
def test_slurm_config_gives_slurmd_timeout():
    facts = parse.parse_config((DATA / "scontrol_show_config_22.05.txt").read_text())
    assert facts.slurmd_timeout_s == 10
    assert parse.parse_config("MinJobAge = 300 sec\n").slurmd_timeout_s == 300


def test_sinfo_star_means_not_responding():
    # sinfo -h -N -o '%N|%t|%E' as Slurm prints a node whose slurmd stopped answering
    nodes = {n.name: n for n in parse.parse_sinfo_nodes("n1|mix|none\nn2|mix*|none\n")}
    assert nodes["n1"].responding
    assert not nodes["n2"].responding and nodes["n2"].state is NodeState.MIXED
    assert nodes["n2"].not_responding_since is None  # sinfo does not say since when


def test_pyslurm_states_and_facts_carry_the_same():
    node = SimpleNamespace(name="n2", state="MIXED+NOT_RESPONDING", reason=None)
    info = pyslurm_backend.node_info_from_pyslurm(node)
    assert not info.responding and info.state is NodeState.MIXED
    facts = pyslurm_backend.facts_from_pyslurm(SimpleNamespace(slurmd_timeout=120), "23.02")
    assert facts.slurmd_timeout_s == 120


def test_mock_reports_a_failed_node_as_not_responding_until_slurmd_timeout(tmp_path):
    clock = [1000.0]
    mock = MockScheduler(
        tmp_path / "mock", MockConfig(slurmd_timeout_s=300), clock=lambda: clock[0]
    )
    assert mock.cluster_facts().slurmd_timeout_s == 300
    mock.fail_node("n2")
    clock[0] = 1010.0
    n2 = next(n for n in mock.nodes() if n.name == "n2")
    assert not n2.responding and n2.state is not NodeState.DOWN
    assert n2.not_responding_since == 1000.0
    clock[0] = 1301.0
    n2 = next(n for n in mock.nodes() if n.name == "n2")
    assert n2.state is NodeState.DOWN and n2.not_responding_since is None


def test_lost_node_notes_say_when_the_scheduler_will_notice():
    since = datetime(2026, 3, 1, 12, 0, 3).timestamp()
    infos = [
        NodeInfo("n1", NodeState.MIXED, "mix"),
        NodeInfo("n2", NodeState.MIXED, "mix*", not_responding_since=since),
        NodeInfo("n3", NodeState.IDLE, "idle*"),
    ]
    notes = lost_node_notes(["n1", "n2", "n3"], infos, 300, since + 10)
    assert notes[0] == (
        "n2 not responding since 12:00:03; the scheduler declares it down "
        "at about 12:05:03 (SlurmdTimeout 300 s)"
    )
    assert notes[1].startswith("n3 not responding;") and "300 s" in notes[1]
    assert len(notes) == 2
    assert lost_node_notes(["n1"], infos, 300, since) == []


class CountingMock:
    """The mock scheduler, counting the calls `status` makes."""

    def __init__(self, home: Path) -> None:
        self.mock, self.calls = MockScheduler(home), []

    def nodes(self):
        self.calls.append("nodes")
        return self.mock.nodes()

    def cluster_facts(self):
        self.calls.append("cluster_facts")
        return self.mock.cluster_facts()


def test_status_says_a_node_of_a_running_attempt_stopped_answering(capsys, home, monkeypatch):
    mock_home = Path(os.environ["FTSLURM_MOCK_HOME"])
    backend = CountingMock(mock_home)
    monkeypatch.setattr(status_cli, "create_backend", lambda kind, where=None: backend)
    add_run(
        home,
        "d779d72089",
        state=RunState.RUNNING,
        attempts=1,
        nodes=("n1", "n2"),
        attempt_state="RUNNING",
    )
    add_run(
        home,
        "a1b2c3d4e5",
        state=RunState.RUNNING,
        attempts=1,
        nodes=("n3",),
        attempt_state="RUNNING",
    )
    backend.mock.fail_node("n2")
    failed_at = next(n for n in backend.mock.nodes() if n.name == "n2").not_responding_since
    code, out, err = cli(capsys, "status")
    assert code == 0, err
    since = datetime.fromtimestamp(failed_at).strftime("%H:%M:%S")
    at = datetime.fromtimestamp(failed_at + 300).strftime("%H:%M:%S")
    assert (
        f"run d779d72089: n2 not responding since {since}; the scheduler declares it "
        f"down at about {at} (SlurmdTimeout 300 s)"
    ) in " ".join(out.split())
    assert "a1b2c3d4e5:" not in out  # its node answers
    assert backend.calls.count("nodes") == 1  # one call for both runs on this backend
    code, out, _ = cli(capsys, "status", "d77", "--json")
    assert code == 0 and any("n2 not responding" in n for n in json.loads(out)["notes"])


def test_status_asks_no_scheduler_when_no_run_is_active(capsys, home, monkeypatch):
    def no_backend(*_args, **_kwargs):
        raise AssertionError("status asked a scheduler")

    monkeypatch.setattr(status_cli, "create_backend", no_backend)
    add_run(home, "d779d72089")
    code, _, err = cli(capsys, "status")
    assert code == 0, err


def test_a_dry_run_node_failure_warns_once_about_slurmd_timeout(capsys, tmp_path):
    mock = MockScheduler(tmp_path / "mock", MockConfig(slurmd_timeout_s=300))
    submit_cli._warn_injections(parse_injections(("crash@10s", "hang@20s")), mock)
    assert capsys.readouterr().err == ""
    submit_cli._warn_injections(parse_injections(("node_fail@30s", "crash@10s")), mock)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "node_fail@30" in err and "SlurmdTimeout (300 s)" in err
    assert "--slurmd-timeout" in err  # how to shorten it


# ------------------------------------------------------------------ 10. tables that fit
def render(monkeypatch, capsys, width: int, *argv: str) -> str:
    con = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    for module in (status_cli, nodes_cli, report_cli):
        monkeypatch.setattr(module, "console", con)
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    return con.export_text()


def long_run(home: Path) -> None:
    add_run(
        home,
        "f50c1d2e3a",
        name="a-rather-long-training-run-name",
        attempts=3,
        nodes=("n1", "n2", "n3", "n4"),
    )
    with Store(home) as store:
        run = store.get_run("f50c1d2e3a")
        run.reason = "completed after 2 node failures and one continuation at the time limit"
        store.update_run(run)


@pytest.mark.parametrize("width", [80, 200])
def test_status_tables_fit_the_terminal_with_full_ids(monkeypatch, capsys, home, width):
    long_run(home)
    for argv in (("status",), ("status", "f50")):
        text = render(monkeypatch, capsys, width, *argv)
        lines = text.splitlines()
        table_lines = [line for line in lines if set(line) & set("│┃┏└┡")]
        assert table_lines and all(len(line) <= width for line in table_lines), text
        assert any("f50c1d2e3a" in line for line in lines), text
        assert "…" not in text, text  # nothing cut, ids least of all
        assert "n[1-4]" in text and "n1,n2" not in text, text
    if width == 200:
        assert "ckpt step" in render(monkeypatch, capsys, width, "status")


def test_status_fits_columns_from_the_environment(home):
    add_run(home, "f50c1d2e3a", name="a-rather-long-training-run-name")
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "ftslurm", "status"],
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "f50c1d2e3a" in out and "…" not in out
    assert max(len(line) for line in out.splitlines() if "│" in line) <= 80


def test_times_show_the_date_when_not_today(monkeypatch, capsys, home):
    now = time.time()
    with Store(home) as store:
        store.flag_node(
            NodeFlag(
                node="n2",
                reason="hung ranks",
                since=now,
                expires_at=now + 86400,
                run_id="f50c1d2e3a",
            )
        )
    text = render(monkeypatch, capsys, 80, "nodes")
    tomorrow = datetime.fromtimestamp(now + 86400)
    assert tomorrow.strftime("%Y-%m-%d %H:%M:%S") in text, text
    assert datetime.fromtimestamp(now).strftime("%Y-%m-%d") not in text  # today: time only
    assert "f50c1d2e3a" in text


def test_fmt_time_is_pure_in_now():
    t = datetime(2026, 3, 1, 19, 21, 31).timestamp()
    assert fmt_time(t, t + 60) == "19:21:31"
    assert fmt_time(t, t + 86400) == "2026-03-01 19:21:31"
    assert fmt_time(None, t) == "-"


# ------------------------------------------------------------------ 11. help that teaches
def walk(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


def test_every_option_of_every_command_has_help_and_a_default():
    missing = []
    for path, command in walk(typer.main.get_command(app)):
        for param in command.params:
            if param.param_type_name != "option":
                continue
            help_text = (param.help or "").strip()
            flag = getattr(param, "is_flag", False)
            shown = param.show_default is not False and param.default is not None
            if not help_text or not (
                flag or shown or "default" in help_text.lower() or help_text.startswith("Refused")
            ):
                missing.append(f"{' '.join(path)} {'/'.join(param.opts)}")
    assert missing == []


def test_version_option(capsys):
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip() == __version__
    code, out, _ = cli(capsys, "version")
    assert code == 0 and out.strip() == __version__


def test_script_arguments_without_double_dash_get_a_hint(capsys, home, tmp_path):
    code, out, err = cli(capsys, "submit", str(tmp_path / "train.py"), "--lr", "3e-4")
    assert code == 2 and out == ""
    assert "No such option" in err
    assert "put the script's own arguments after `--`" in err
    assert not (home / "runs").exists()  # nothing recorded, nothing submitted


def test_other_usage_errors_get_no_hint(capsys):
    code, _, err = cli(capsys, "status", "--bogus")
    assert code == 2 and "No such option" in err and "after `--`" not in err


def test_logs_follow_prints_each_new_attempt_until_the_run_ends(home):
    run = add_run(home, "d779d72089", state=RunState.RUNNING, attempts=1, attempt_state="RUNNING")
    logs = Path(run.spec["run_dir"]) / "logs"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftslurm", "logs", "-f", run.run_id],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: "output of attempt 0" in "".join(out), 30, "attempt 0's output")
        with Store(home) as store:
            first = store.latest_attempt(run.run_id)
            first.state, first.end = "NODE_FAIL", time.time()
            store.update_attempt(first)
            store.add_attempt(
                Attempt(run_id=run.run_id, attempt=1, state="RUNNING", job_id="101", nodes=["n3"])
            )
        (logs / "job-101.out").write_text(header(run.run_id, 1, "101") + "attempt 1 starts\n")
        wait_for(lambda: "attempt 1 starts" in "".join(out), 30, "attempt 1's output")
        assert proc.poll() is None  # still following: the run goes on
        with (logs / "job-101.out").open("a") as f:
            f.write("attempt 1 ends\n")
        with Store(home) as store:
            done = store.get_run(run.run_id)
            done.state, done.ended_at = RunState.COMPLETED, time.time()
            store.update_run(done)
        assert proc.wait(timeout=30) == 0
        reader.join(timeout=10)
        text = "".join(out)
        assert text.index("output of attempt 0") < text.index("attempt 1 starts")
        assert text.rstrip().endswith("attempt 1 ends")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------ where the checkpoints go
def test_checkpoints_default_to_the_sites_scratch_and_never_silently_to_home(tmp_path):
    from ftslurm.daemon.submission import make_spec
    from ftslurm.recipe import Recipe

    run_dir = tmp_path / "state" / "runs" / "r1"

    def where(env: dict[str, str], **recipe: str) -> tuple[str, str]:
        spec = make_spec(
            Recipe(command=["train"], **recipe),
            run_dir=run_dir,
            backend="mock",
            workdir=str(tmp_path),
            environ=env,
        )
        return spec["checkpoint_dir"], spec["checkpoint_dir_from"]

    assert where({"SCRATCH": "/scratch/u"}) == ("/scratch/u/ftslurm/r1/checkpoints", "$SCRATCH")
    assert where({"SCRATCH": "/scratch/u", "FTSLURM_SCRATCH": "/fast"}) == (
        "/fast/ftslurm/r1/checkpoints",
        "$FTSLURM_SCRATCH",
    )
    assert where({}) == (str(run_dir / "checkpoints"), "the state directory")
    assert where({"SCRATCH": "/scratch/u"}, checkpoint_dir="ck") == (
        str(tmp_path / "ck"),
        "the recipe",
    )
    # the state directory under the home directory: a warning; elsewhere, none
    home_spec = {
        "checkpoint_dir_from": "the state directory",
        "checkpoint_dir": str(Path.home() / ".local" / "x" / "checkpoints"),
    }
    warning = submit_cli._checkpoints_at_home(home_spec)
    assert warning and "under your home directory" in warning and "$SCRATCH" in warning
    assert submit_cli._checkpoints_at_home({**home_spec, "checkpoint_dir": "/scratch/x"}) is None
    assert submit_cli._checkpoints_at_home({**home_spec, "checkpoint_dir_from": "$SCRATCH"}) is None


def test_status_shows_where_a_runs_checkpoints_go(capsys, home):
    run = add_run(home, "d779d72089")
    with Store(home) as store:
        stored = store.get_run(run.run_id)
        assert stored is not None
        spec = {
            **stored.spec,
            "checkpoint_dir": "/scratch/u/ftslurm/d779d72089/checkpoints",
            "checkpoint_dir_from": "$SCRATCH",
        }
        store.update_run(replace(stored, spec=spec))
    (Path(stored.spec["run_dir"]) / "progress.json").write_text('{"checkpoint_step": 10}')
    code, out, err = cli(capsys, "status", "d77")
    assert code == 0, err
    assert "checkpoints in: /scratch/u/ftslurm/d779d72089/checkpoints (from $SCRATCH)" in " ".join(
        out.split()
    ), out
    code, out, _ = cli(capsys, "status", "d77", "--json")
    assert json.loads(out)["checkpoint_dir_from"] == "$SCRATCH"
