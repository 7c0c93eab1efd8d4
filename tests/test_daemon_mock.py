"""The daemon end to end on the mock scheduler: `ftslurm submit --dry-run` and friends.

The same scenarios run on the real local cluster in test_daemon_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockScheduler
from ftslurm.backends.mock.store import MockStore
from ftslurm.core.contract import HUNG_NODE_REPORTS, RunDir
from ftslurm.daemon.records import SUBMITTING, Run, RunState, new_run_record
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.fsutil import read_json
from ftslurm.recipe import load_recipe

from .daemon_scenarios import (
    Cli,
    ended,
    hang_is_caught_in_the_first_attempt,
    rank_process,
    recipe_file,
    straggler_is_moved_off,
    straggler_is_not_taken_for_hung,
    wait_trained,
    write_train,
)

pytestmark = pytest.mark.slow  # end-to-end daemon scenarios: about 10 minutes in all

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    c = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    # Slurm's behaviour with shorter settings (KillWait 5 s instead of 30 s) keeps it quick.
    config = tmp_path / "mock.json"
    config.write_text('{"kill_wait_s": 5}')
    c("mock", "up", "--config", str(config), "--slurmd-timeout", "2", "--min-job-age", "60")
    yield c
    c.stop_daemon()
    c("mock", "destroy", check=False)


def mock_jobs(tmp_path) -> dict:
    """Every job the mock cluster has numbered (its ids start at a random first id), as
    the scheduler reports each now."""
    scheduler = MockScheduler(tmp_path / "mock")
    with MockStore(tmp_path / "mock").transaction() as state:
        first, last = state.config.first_job_id or 1, state.next_job_id
    return scheduler.query([str(i) for i in range(first, last)])


def test_node_failure_is_retried_on_other_nodes_with_the_failed_node_excluded(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit(
        "--dry-run",
        "-N",
        "2",
        "--retries",
        "2",
        "--inject",
        "node_fail@2",
        str(train),
        "--",
        "40",
        "0.1",
        "5",
    )
    s = cli.wait_for(out["run_id"], ended, 180, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"][0], s["attempts"][1]
    assert first["cause"] == "node_fail"
    failed = set(first["nodes"]) - set(second["nodes"])
    assert failed and failed <= set(s["excluded_nodes"])
    assert s["job_retries_used"] == 1
    # Requeued by the mock's verdict, or moved to a fresh job (the failed node excluded)
    # when the surviving launcher reported it first: one job of the run at a time either way.
    if second["job_id"] != first["job_id"]:
        assert not mock_jobs(tmp_path)[first["job_id"]].state.is_active  # the old one ended
    events = Store(cli.home).events(out["run_id"])
    recovered = [e for e in events if e.kind == "recovered"]
    assert recovered and recovered[0].data["latency_s"] < 30  # no 120 s requeue delay


def test_wall_limit_after_a_checkpoint_continues_from_that_step(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit(
        "--dry-run",
        "-t",
        "0:30",
        "--preempt-time",
        "10",
        "--retries",
        "0",
        str(train),
        "--",
        "300",
        "0.1",
        "1000",
    )
    # 30 s of steps against 20 s an attempt before the signal, less each attempt's start
    # (the launcher's and the rank's imports: up to 6 s under a load of 8 on 2 cores, where
    # a 12 s limit left the steps about one second an attempt)
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert s["continuations"] >= 1 and s["job_retries_used"] == 0
    assert s["attempts"][0]["cause"] == "checkpointed"
    log = cli("logs", out["run_id"], "--attempt", "1").stdout
    step = s["attempts"] and json.loads(
        (tmp_path / "home" / "runs" / out["run_id"] / "progress.json").read_text()
    )
    assert "starts at step 0" not in log  # the continuation resumed from the checkpoint
    assert step["finished"] is True and step["step"] == 300


# A plain script: no signal handler; it keeps its own progress in a file and resumes from it.
PLAIN = """import sys, time
from pathlib import Path
done = Path(sys.argv[1])
step = int(done.read_text()) if done.exists() else 0
while step < 100000:
    step += 1
    done.write_text(str(step))
    time.sleep(0.1)
"""


def test_a_script_without_a_handler_is_left_to_its_wall_limit_and_continued(cli, tmp_path):
    """The checkpoint signal (USR2, 10 s before a 15 s limit) would kill a script that does
    not catch it (exit 140, a crash) or, held, leave it to a timeout that spends the
    budget: it is withheld from the script, the wall limit ends the attempt, and the run
    goes on from the script's own last checkpoint, saying why."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    out = cli.submit(
        "--dry-run",
        "-t",
        "0:15",
        "--preempt-time",
        "10",
        "--retries",
        "0",
        str(script),
        "--",
        str(tmp_path / "step.txt"),
    )
    s = cli.wait_for(
        out["run_id"], lambda s: len(s["attempts"]) > 1 or ended(s), 120, "the first attempt to end"
    )
    cli("cancel", out["run_id"])
    a = s["attempts"][0]
    assert (a["state"], a["cause"]) == ("TIMEOUT", "checkpointed"), s
    assert s["job_retries_used"] == 0 and s["continuations"] == 1, s
    assert (
        "the script does not handle SIGUSR2: left to the wall limit, continued from its "
        "last checkpoint" in a["reason"]
    ), a["reason"]
    rank = read_json(RunDir(s["run_dir"]).rank_report(0, 0)) or {}
    assert rank.get("checkpoint_signal_withheld") == "USR2", rank
    assert rank.get("signal") != signal.SIGUSR2 and rank.get("exit_code") != 140, rank
    node = read_json(RunDir(s["run_dir"]).node_report(0, 0)) or {}
    assert node.get("checkpoint_signal_withheld_ranks") == [0], node
    assert int((tmp_path / "step.txt").read_text()) > 0


def test_budget_exhausted_fails_with_the_reason_and_wait_exits_1(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit("--dry-run", "--retries", "1", str(train), "--", "50", "0.01", "5", "3")
    s = cli.wait_for(out["run_id"], ended, 120, "the run to fail")
    assert s["state"] == "FAILED"
    assert "retry budget exhausted (1/1)" in s["reason"]
    assert [a["cause"] for a in s["attempts"]] == ["crash", "crash"]
    assert cli("wait", out["run_id"], check=False).returncode == 1
    shown = cli("status", out["run_id"]).stdout
    assert "budget exhausted" in shown


def test_user_error_is_not_retried(cli, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_for_ftslurm\n")
    out = cli.submit("--dry-run", "--retries", "3", str(bad))
    s = cli.wait_for(out["run_id"], ended, 120, "the run to fail")
    assert s["state"] == "FAILED" and s["job_retries_used"] == 0
    assert s["attempts"][0]["cause"] == "user_error"
    # what failed, in the reason (issue 25): the rank's exception, in status and in wait
    said = "rank 0 (n1): ModuleNotFoundError: No module named 'no_such_module_for_ftslurm'"
    assert said in s["attempts"][0]["reason"] and said in s["reason"], s
    waited = cli("wait", out["run_id"], check=False)
    assert said in " ".join((waited.stdout + waited.stderr).split())  # as wrapped to 80


def test_a_rank_dying_of_enospc_ends_the_run_at_once_with_the_reason(cli, tmp_path):
    full = tmp_path / "full.py"
    full.write_text(
        "import errno, os\n"
        "raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/ckpt/step-9.pt')\n"
    )
    out = cli.submit("--dry-run", "--retries", "3", str(full))
    s = cli.wait_for(out["run_id"], ended, 120, "the run to fail")
    assert s["state"] == "FAILED" and s["job_retries_used"] == 0
    assert s["attempts"][0]["cause"] == "disk_full"
    assert "at /ckpt/step-9.pt: free space and resubmit" in s["attempts"][0]["reason"]


def test_wait_exit_codes(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit("--dry-run", str(train), "--", "100", "0.1", "10")
    assert cli("wait", out["run_id"], "--timeout", "1", check=False).returncode == 124
    assert cli("wait", out["run_id"], "--timeout", "60", check=False).returncode == 0
    out = cli.submit("--dry-run", str(train), "--", "1000", "0.1", "10")
    cli("cancel", out["run_id"])
    assert cli("wait", out["run_id"], "--timeout", "60", check=False).returncode == 1
    assert cli.status(out["run_id"])["state"] == "CANCELLED"


def test_daemon_killed_after_submission_adopts_the_job(cli, tmp_path):
    """The daemon dies between `sbatch` and recording the job id: the next daemon finds
    the job by its tag and adopts it; no attempt is submitted twice."""
    train = write_train(tmp_path)
    store = Store(cli.home)
    recipe = load_recipe(train, ["20", "0.05", "5"])
    run_dir = cli.home / "runs" / "adopt1"
    (run_dir / "logs").mkdir(parents=True)
    spec = make_spec(
        recipe, run_dir=run_dir, backend="mock", workdir=str(tmp_path), mock_home=tmp_path / "mock"
    )
    run, attempt = new_run_record("adopt1", "adopt", spec, recipe.settings(), time.time())
    store.add_run(run)
    store.add_attempt(attempt)
    script, options = build_attempt("adopt1", spec, run.settings, 0, ())
    job_id = MockScheduler(tmp_path / "mock").submit(script, options)  # then the "crash"
    assert store.latest_attempt("adopt1").state == SUBMITTING
    cli("daemon", "start")
    s = cli.wait_for("adopt1", ended, 120, "the adopted run to end")
    assert s["state"] == "COMPLETED"
    assert [a["job_id"] for a in s["attempts"]] == [job_id]
    assert len([j for j in mock_jobs(tmp_path).values() if j.comment == "ftslurm:adopt1:0"]) == 1


def test_daemon_sigkilled_mid_run_and_restarted_finishes_the_run(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit(
        "--dry-run", "-N", "2", "--inject", "node_fail@2", str(train), "--", "40", "0.1", "5"
    )
    pid = json.loads(cli("daemon", "status", "--json").stdout)["pid"]
    os.kill(pid, signal.SIGKILL)
    cli.wait_for(out["run_id"], lambda s: True, 5, "status")
    status = json.loads(cli("daemon", "status", "--json", check=False).stdout)
    assert not status["running"]
    cli("daemon", "start")
    s = cli.wait_for(out["run_id"], ended, 180, "the run to end")
    assert s["state"] == "COMPLETED"
    # Nothing was submitted twice: one job per attempt and no other job of the run (the
    # lost node is requeued in the same job, or, when the launchers' report reaches the
    # restarted daemon first, the run moves to one fresh job: which comes first is timing)
    ids = {a["job_id"] for a in s["attempts"]}
    assert len(ids) <= len(s["attempts"]) <= 2, s["attempts"]  # a requeue keeps its id
    tagged = {j for j, info in mock_jobs(tmp_path).items() if out["run_id"] in (info.comment or "")}
    assert tagged == ids, (tagged, s["attempts"])


@pytest.mark.parametrize(
    "args,message",
    [
        (["missing.py"], "recipe not found"),
        (["--retries", "-1", "TRAIN"], "num_job_retries_on_failure"),
        (["--inject", "explode@3", "TRAIN"], "inject"),
        (["--inject", "node_fail@3", "TRAIN"], "--dry-run"),
        (["-t", "soon", "TRAIN"], "time"),
    ],
)
def test_bad_input_is_one_line_and_submits_nothing(cli, tmp_path, args, message):
    train = write_train(tmp_path)
    args = [str(train) if a == "TRAIN" else a for a in args]
    proc = cli("submit", *args, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), proc.stderr
    assert message in lines[0]
    assert Store(cli.home).list_runs() == []
    assert all(j.state.value == "UNKNOWN" for j in mock_jobs(tmp_path).values())


def test_unknown_run_id_is_one_line(cli):
    for command in (["status", "nope"], ["wait", "nope"], ["cancel", "nope"], ["logs", "nope"]):
        proc = cli(*command, check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert "no run 'nope'" in proc.stderr


def test_a_run_is_named_by_a_unique_prefix_of_its_id(cli, tmp_path):
    train = write_train(tmp_path)
    first = cli.submit("--dry-run", str(train), "--", "--steps", "1")
    run_id = first["run_id"]
    assert cli.status(run_id[:4])["run_id"] == run_id
    Store(cli.home).add_run(
        Run(run_id[:4] + "zz", "other", RunState.COMPLETED, 1.0, spec={}, settings={})
    )
    proc = cli("status", run_id[:4], check=False)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0
    assert "ambiguous" in proc.stderr and run_id in proc.stderr
    assert cli.status(run_id[:6])["run_id"] == run_id


def test_print_script_submits_nothing(cli, tmp_path):
    train = write_train(tmp_path)
    proc = cli("submit", "--print-script", "-N", "2", "-t", "10", str(train))
    assert proc.stdout.startswith("#!/bin/bash")
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --signal=USR2@60" in proc.stdout
    short = cli("submit", "--print-script", "-t", "2", str(train)).stdout
    assert "--signal" not in short  # Slurm's early delivery could beat the ranks' handlers
    assert "ftslurm.agent.launch" in proc.stdout and "--nproc-per-node=1" in proc.stdout
    assert Store(cli.home).list_runs() == []


def test_injected_crash_is_retried_and_fires_once(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit(
        "--dry-run",
        "-N",
        "2",
        "--retries",
        "1",
        "--inject",
        "crash@2:1",
        str(train),
        "--",
        "60",
        "0.1",
        "10",
    )
    s = cli.wait_for(out["run_id"], ended, 180, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["crash", "finished"]


def test_a_straggler_node_is_excluded_and_the_job_moved_off_it(cli, tmp_path):
    straggler_is_moved_off(cli, tmp_path, "--dry-run")


def test_a_submitit_checkpointable_continues_through_the_daemon_and_reports_goodput(cli, tmp_path):
    """examples/submitit_recipe.py as it is: the daemon's checkpoint signal before the wall
    limit makes `checkpoint()` store a continuation, the next attempt resumes it and ends
    with the parameters of an uninterrupted run; `ftslurm report` accounts the wall time."""
    recipe = ROOT / "examples" / "submitit_recipe.py"
    ref = subprocess.run(
        [sys.executable, str(recipe), "--steps", "500", "--output-dir", str(tmp_path / "ref")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    # the signal 50 s after the start: past the start-up (imports; over 20 s with every core
    # busy), before the last step (50 s of steps)
    out = cli.submit(
        "--dry-run",
        "-t",
        "1:00",
        "--preempt-time",
        "10",
        "--retries",
        "0",
        str(recipe),
        "--",
        "--steps",
        "500",
        "--step-time",
        "0.1",
        "--output-dir",
        str(tmp_path / "out"),
    )
    s = cli.wait_for(out["run_id"], ended, 250, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert s["attempts"][0]["cause"] == "checkpointed" and s["job_retries_used"] == 0
    log = cli("logs", out["run_id"], "--attempt", "1").stdout
    assert "starting at step 0 " not in log and "starting at step" in log
    final = json.loads((tmp_path / "out" / "final.json").read_text())
    assert final == json.loads((tmp_path / "ref" / "final.json").read_text())
    report = json.loads(cli("report", out["run_id"], "--json").stdout)
    seconds = sum(v["seconds"] for v in report["breakdown"].values())
    assert seconds == pytest.approx(report["wall_s"], abs=0.5)
    assert 0 < report["goodput"] < 1 and report["breakdown"]["productive"]["seconds"] > 5


def test_a_hung_rank_is_caught_in_the_first_attempt_without_configured_timeouts(cli, tmp_path):
    hang_is_caught_in_the_first_attempt(cli, tmp_path, "--dry-run")


def test_a_threefold_straggler_is_not_taken_for_hung(cli, tmp_path):
    straggler_is_not_taken_for_hung(cli, tmp_path, "--dry-run")


def test_a_rank_hung_at_the_wall_limit_is_a_hang_not_a_checkpointed_ending(cli, tmp_path):
    """Hang detection turned off (running timeout None): rank 1 is stopped (SIGSTOP) once
    the training passed its first checkpoint, and the attempt sits hung until its wall
    limit (60 s; the checkpoint signal at 50 s, past a start-up of over 20 s with every
    core busy). It checkpointed before the hang, but it is a hang that spends the failure
    budget (here none), and the reason names the rank, its node and section, and the
    checkpoint signal that nobody acted on."""
    recipe = recipe_file(
        tmp_path,
        "hang-off",
        args=["--steps", "2000", "--step-time", "0.05", "--checkpoint-dir", str(tmp_path / "ckpt")],
        out_of_section_timeout=None,
        num_job_retries_on_failure=0,
        preempt_time=10,
    )
    out = cli.submit("--dry-run", "--inject", "timeout@60s", str(recipe))
    run = RunDir(cli.status(out["run_id"])["run_dir"])
    wait_trained(run, 25)
    os.kill(rank_process(run, 1, nodes=2), signal.SIGSTOP)
    s = cli.wait_for(out["run_id"], ended, 150, "the run to end")
    assert s["state"] == "FAILED", s
    a = s["attempts"][0]
    assert a["state"] == "TIMEOUT" and a["cause"] == "hang", a
    assert "retry budget exhausted (0/0); last ending: hang" in s["reason"], s["reason"]
    # The hang is a SIGSTOP at any moment: the rank stops inside its "step" section or
    # between two, so the reason names the section, or says it was outside any. The ranks
    # waiting on it in the all-reduce fall silent too: the reason names the rank silent
    # longest, which is a waiter when it beat last a few ms before the stopped rank did (the
    # same step); the stopped rank is always among those the launchers found hung.
    assert re.search(
        r"rank \d \(node n\d\) hung( in section '\w+')? when the job was told "
        r"to stop: .*(in section '\w+'|outside any section)",
        a["reason"],
    ), a["reason"]
    hung = [
        h.get("rank")
        for path in RunDir(s["run_dir"]).attempt(0).glob(HUNG_NODE_REPORTS)
        for h in (read_json(path) or {}).get("hung", [])
    ]
    assert 1 in hung, hung
    assert "checkpoint signal sent at" in a["reason"] and "not acted on" in a["reason"]
