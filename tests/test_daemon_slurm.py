"""The daemon end to end on the real local Slurm cluster (the scenarios of
test_daemon_mock.py, with real slurmd failures and real wall limits)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from ftslurm.backends.slurm_cli import SlurmCliBackend
from ftslurm.daemon.records import SUBMITTING, new_run_record
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.recipe import load_recipe

from .daemon_scenarios import Cli, daemon_cli, ended, write_train

pytestmark = pytest.mark.slurm


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path)


def test_node_failure_is_retried_on_other_nodes_with_the_failed_node_excluded(
    cli, healthy_nodes, tmp_path, measurements
):
    train = write_train(tmp_path)
    out = cli.submit("-N", "2", "--retries", "2", str(train), "--", "600", "0.1", "10")
    s = cli.wait_for(
        out["run_id"],
        lambda s: (
            s["attempts"][-1]["state"] == "RUNNING"
            and (tmp_path / "home" / "runs" / out["run_id"] / "progress.json").exists()
        ),
        60,
        "the first attempt to checkpoint",
    )
    victim = s["attempts"][0]["nodes"][1]
    healthy_nodes.fail_node(victim)
    s = cli.wait_for(
        out["run_id"],
        lambda s: len(s["attempts"]) > 1 and s["attempts"][1]["state"] == "RUNNING",
        120,
        "the retry to run",
    )
    assert s["attempts"][0]["cause"] == "node_fail", s
    assert victim not in s["attempts"][1]["nodes"]
    assert victim in s["excluded_nodes"]
    assert s["job_retries_used"] == 1
    cli.wait_for(
        out["run_id"],
        lambda s: "starts at step" in cli("logs", out["run_id"], "--attempt", "1").stdout,
        30,
        "the retry's output",
    )
    log = cli("logs", out["run_id"], "--attempt", "1").stdout
    assert "starts at step 0" not in log  # resumed from the checkpoint
    cli("cancel", out["run_id"])
    s = cli.wait_for(out["run_id"], ended, 60, "the cancel")
    assert s["state"] == "CANCELLED"
    events = Store(cli.home).events(out["run_id"])
    latency = next(e.data["latency_s"] for e in events if e.kind == "recovered")
    measurements.record("daemon_node_failure_recovery_s", latency)
    assert latency < 60  # Slurm's own requeue alone waits ~120 s before it may start


def test_wall_limit_after_a_checkpoint_continues_from_that_step(cli, tmp_path, measurements):
    train = write_train(tmp_path)
    recipe = tmp_path / "recipe.py"  # form (b): a Recipe; Slurm's backstop off, to time ours
    recipe.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(train)!r}, '300', '0.1', "
        "'1000'], time='1', preempt_time=40, num_job_retries_on_failure=0, "
        "signal_backstop=False)\n"
    )
    out = cli.submit(str(recipe))
    s = cli.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert s["continuations"] >= 1 and s["job_retries_used"] == 0
    assert s["attempts"][0]["cause"] == "checkpointed"
    resumed = cli("logs", out["run_id"], "--attempt", "1").stdout
    assert "starts at step 0" not in resumed and "starts at step" in resumed
    progress = json.loads(
        (tmp_path / "home" / "runs" / out["run_id"] / "progress.json").read_text()
    )
    assert progress["finished"] and progress["step"] == 300
    signal = next(e for e in Store(cli.home).events(out["run_id"]) if e.kind == "checkpoint_signal")
    measurements.record("daemon_checkpoint_signal_error_s", signal.time - signal.data["due"])
    assert 0 <= signal.time - signal.data["due"] < 2


def test_budget_exhausted_fails_with_the_reason(cli, tmp_path):
    train = write_train(tmp_path)
    out = cli.submit("--retries", "1", str(train), "--", "50", "0.01", "5", "3")
    s = cli.wait_for(out["run_id"], ended, 90, "the run to fail")
    assert s["state"] == "FAILED" and "retry budget exhausted (1/1)" in s["reason"]
    assert cli("wait", out["run_id"], check=False).returncode == 1


def test_daemon_killed_after_submission_adopts_the_job(cli, tmp_path):
    train = write_train(tmp_path)
    store = Store(cli.home)
    recipe = load_recipe(train, ["20", "0.05", "5"])
    run_dir = cli.home / "runs" / "adopt2"
    (run_dir / "logs").mkdir(parents=True)
    spec = make_spec(recipe, run_dir=run_dir, backend="slurm", workdir=str(tmp_path))
    run, attempt = new_run_record("adopt2", "adopt", spec, recipe.settings(), time.time())
    store.add_run(run)
    store.add_attempt(attempt)
    script, options = build_attempt("adopt2", spec, run.settings, 0, ())
    job_id = SlurmCliBackend().submit(script, options)  # then the "crash"
    assert store.latest_attempt("adopt2").state == SUBMITTING
    cli("daemon", "start")
    s = cli.wait_for("adopt2", ended, 90, "the adopted run to end")
    assert s["state"] == "COMPLETED"
    assert [a["job_id"] for a in s["attempts"]] == [job_id]


def test_injected_crash_on_a_real_cluster_is_retried_and_fires_once(cli, tmp_path):
    """In-job injections work on real Slurm: the task wrapper kills rank 1 at 3 s, the
    daemon classifies the crash and retries; the retry is not crashed again."""
    train = write_train(tmp_path)
    out = cli.submit(
        "-N", "2", "--retries", "1", "--inject", "crash@3:1", str(train), "--", "80", "0.1", "10"
    )
    s = cli.wait_for(out["run_id"], ended, 120, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["crash", "finished"]
    report = json.loads(
        (tmp_path / "home" / "runs" / out["run_id"] / "attempts" / "0" / "rank-1.json").read_text()
    )
    assert report["injected"] == ["crash@3:1"] and report["outcome"] == "killed"
