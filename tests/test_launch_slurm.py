"""The compute side on the real local cluster: 2 nodes x 2 ranks, gloo on CPU, the launcher
and rank agent under the daemon, with `examples/recipe.py` as the training."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.agent.peers import poll_interval
from ftslurm.core.contract import PEER_LOST_REPORTS, RunDir

from .conftest import wait_file
from .daemon_scenarios import (
    RECIPE,
    Cli,
    daemon_cli,
    ended,
    hang_is_caught_in_the_first_attempt,
    rank_process,
    recipe_file,
    straggler_is_moved_off,
    wait_trained,
)

pytestmark = pytest.mark.slurm


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


def log_of(cli: Cli, run_id: str, attempt: int) -> str:
    return cli("logs", run_id, "--attempt", str(attempt)).stdout


def test_a_killed_rank_is_restarted_in_job_and_resumes_from_the_checkpoint(cli, tmp_path):
    """Rank 3's process killed past step 60 (checkpoints every 10): its node restarts the
    ranks in-job and they resume from a checkpoint, not from nothing. (By the step: a
    crash 20 s from the rank's start once landed in a loaded start-up, before any
    checkpoint.)"""
    ckpt = tmp_path / "ckpt"
    out = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        "--in-job-restarts",
        "2",
        str(RECIPE),
        "--",
        "--steps",
        "500",
        "--step-time",
        "0.05",
        "--ckpt-every",
        "10",
        "--checkpoint-dir",
        str(ckpt),
    )
    run = RunDir(cli.status(out["run_id"])["run_dir"])
    wait_trained(run, 60, timeout=240)
    os.kill(rank_process(run, 3, nodes=2), signal.SIGKILL)
    s = cli.wait_for(out["run_id"], ended, 180, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert len(s["attempts"]) == 1  # no new job: restarted inside the allocation
    assert s["in_job_restarts_total"] >= 1
    log = log_of(cli, out["run_id"], 0)
    # rank 0's launcher may count the round as a membership change, not a restart of its own
    starts = [int(n) for n in re.findall(r"starts at step (\d+) \(attempt 0,", log)]
    assert len(starts) >= 2 and starts[0] == 0 and starts[1] > 0, log[-3000:]


def test_a_stopped_rank_is_detected_as_hung_and_restarted(cli, tmp_path):
    # The stop comes 12 s after the rank's start. On a loaded machine that may still be in
    # its start-up, or in a checkpoint's collective, whose default limits are 30 minutes:
    # every limit is short here, so the stop is caught wherever it lands.
    recipe = recipe_file(
        tmp_path,
        "hang",
        args=[
            "--steps",
            "300",
            "--step-time",
            "0.05",
            "--ckpt-every",
            "20",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        num_in_job_restarts=2,
        out_of_section_timeout=8.0,
        section_timeouts={"step": 8.0, "setup": 60.0, "checkpointing": 30.0},
        initial_timeout=60.0,
    )
    out = cli.submit("--inject", "hang@12:1", str(recipe))
    s = cli.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert len(s["attempts"]) == 1 and s["in_job_restarts_total"] >= 1
    run_dir = Path(s["run_dir"])
    hangs = [
        h
        for p in (run_dir / "attempts" / "0").glob("node-*.json")
        for h in json.loads(p.read_text())["hangs"]
    ]
    assert hangs and re.search(r"\(timeout (8|30|60)s\)", hangs[0]["reason"]), hangs
    fired = json.loads((run_dir / "attempts" / "fired-rank-1.json").read_text())
    assert fired == ["hang@12:1"]  # once: the restarted rank was not stopped again


def test_in_job_restarts_exhausted_make_the_daemon_retry_the_job(cli, tmp_path):
    out = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        "--in-job-restarts",
        "1",
        "--retries",
        "1",
        str(RECIPE),
        "--",
        "--steps",
        "100",
        "--fail-at-step",
        "5",
        "--fail-rank",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    s = cli.wait_for(out["run_id"], ended, 240, "the run to fail")
    assert s["state"] == "FAILED" and "retry budget exhausted (1/1)" in s["reason"]
    assert [a["cause"] for a in s["attempts"]] == ["crash", "crash"]
    assert [a["exit_code"] for a in s["attempts"]] == [74, 74]  # restarts exhausted
    assert all(a["in_job_restarts"] == 1 for a in s["attempts"])


def test_checkpoint_signal_saves_at_one_step_continues_and_matches_an_uninterrupted_run(
    cli, backend, tmp_path
):
    """The signal the daemon sends `preempt_time` before the wall limit, sent here once the
    training is under way (when the daemon sends it is tested in test_daemon_slurm.py): the
    run must not depend on how long four ranks take to start on a busy machine."""
    args = ["--steps", "300", "--step-time", "0.05", "--ckpt-every", "1000"]
    reference = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        str(RECIPE),
        "--",
        *args,
        "--checkpoint-dir",
        str(tmp_path / "ref"),
    )
    faulty = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        str(RECIPE),
        "--",
        *args,
        "--checkpoint-dir",
        str(tmp_path / "cont"),
    )
    progress = Path(cli.status(faulty["run_id"])["run_dir"]) / "progress.json"
    wait_file(
        progress,
        lambda text: bool(text) and json.loads(text).get("step", 0) >= 30,
        180,
        "training past step 30",
    )
    backend.signal(faulty["job_id"], "SIGUSR2")  # what the daemon sends, to every step
    for run in (reference, faulty):
        s = cli.wait_for(run["run_id"], ended, 240, "the runs to end")
        assert s["state"] == "COMPLETED", s
    assert s["continuations"] == 1 and s["attempts"][0]["cause"] == "checkpointed", s
    assert s["attempts"][0]["exit_code"] == 75  # the launcher's "continue me"
    assert s["attempts"][1]["job_id"] == faulty["job_id"]  # requeued, not resubmitted
    saved = re.findall(r"checkpointed at step (\d+) on request", log_of(cli, faulty["run_id"], 0))
    assert len(saved) == 1 and int(saved[0]) >= 30, saved  # rank 0 logs the agreed step
    assert f"starts at step {saved[0]} (attempt 1," in log_of(cli, faulty["run_id"], 1)
    ref = json.loads((tmp_path / "ref" / "final.json").read_text())
    cont = json.loads((tmp_path / "cont" / "final.json").read_text())
    assert cont == ref  # same step, same parameters, bit for bit


def test_a_straggler_node_is_reported_excluded_and_the_job_moved_off_it(cli, tmp_path):
    straggler_is_moved_off(cli, tmp_path)


def test_a_corrupted_newest_checkpoint_is_skipped_on_load(cli, tmp_path):
    """Checkpoints at steps 10, 20, 30; the newest is damaged; the next run on 2 x 2 ranks
    resumes from step 20 and ends with the parameters of a run never interrupted."""
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    args = ["--ckpt-every", "10", "--step-time", "0.01"]
    first = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        str(RECIPE),
        "--",
        "--steps",
        "30",
        *args,
        "--checkpoint-dir",
        str(ckpt),
    )
    reference = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        str(RECIPE),
        "--",
        "--steps",
        "50",
        *args,
        "--checkpoint-dir",
        str(ref),
    )
    assert cli.wait_for(first["run_id"], ended, 240, "the first run")["state"] == "COMPLETED"
    newest = ckpt / "step-0000000030.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the size still matches, the hash not
    newest.write_bytes(bytes(data))
    (ckpt / "final.json").unlink()
    again = cli.submit(
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        str(RECIPE),
        "--",
        "--steps",
        "50",
        *args,
        "--checkpoint-dir",
        str(ckpt),
    )
    for run in (again, reference):
        assert cli.wait_for(run["run_id"], ended, 240, "the runs")["state"] == "COMPLETED"
    log = log_of(cli, again["run_id"], 0)
    assert "starts at step 20" in log, log[-3000:]
    assert "step-0000000030" in log  # the warning names the checkpoint it skipped
    assert json.loads((ckpt / "final.json").read_text()) == json.loads(
        (ref / "final.json").read_text()
    )


def test_a_hung_rank_is_caught_in_the_first_attempt_without_configured_timeouts(cli, tmp_path):
    hang_is_caught_in_the_first_attempt(cli, tmp_path)


def test_a_killed_node_is_reported_lost_by_the_surviving_launcher(
    cli, healthy_nodes, tmp_path, measurements
):
    """2 nodes x 2 ranks; `fail-node` kills the second node (its slurmd, slurmstepd, the
    launcher and ranks): the batch host's launcher reports it within the peer timeout plus
    two polls, long before Slurm's verdict (SlurmdTimeout, then NODE_FAIL)."""
    timeout = 5.0
    recipe = recipe_file(
        tmp_path,
        "peers",
        args=[
            "--steps",
            "3000",
            "--step-time",
            "0.05",
            "--ckpt-every",
            "50",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        peer_timeout_s=timeout,
        num_job_retries_on_failure=0,
    )
    out = cli.submit(str(recipe))
    run = RunDir(cli.status(out["run_id"])["run_dir"])
    wait_file(
        run.progress,
        lambda text: bool(text) and json.loads(text).get("step", 0) >= 5,
        180,
        "training under way",
    )
    nodes = cli.status(out["run_id"])["attempts"][0]["nodes"]
    assert len(nodes) == 2 and run.peer_lease(0, 0).exists() and run.peer_lease(0, 1).exists()
    victim = nodes[1]
    before = time.time()
    healthy_nodes.fail_node(victim)
    killed_at = time.time()  # the node is dead by now: it died between `before` and here
    bound = timeout + 2 * poll_interval(timeout) + 10
    deadline = time.monotonic() + bound + 30  # room for a loaded machine; the bound is below
    while not (found := sorted(run.recovery(0).glob(PEER_LOST_REPORTS))):
        if time.monotonic() > deadline:
            pytest.fail(
                f"no peer-loss report {bound + 30:.0f}s after {victim} was killed; "
                f"run status: {cli.status(out['run_id'])}; job output:\n{_tail(run)}"
            )
        time.sleep(0.05)
    assert len(found) == 1, found
    report = json.loads(found[0].read_text())
    assert report["lost_node"] == victim, report
    assert report["reported_by"] == nodes[0] and report["job_id"] == out["job_id"]
    assert report["time"] - killed_at < bound, (report, _tail(run))
    measurements.record(
        "peer_loss_report_s (peer_timeout_s 5, from the kill's start)", report["time"] - before
    )
    cli("cancel", out["run_id"])


def _tail(run: RunDir, chars: int = 4000) -> str:
    """The end of the job's output files, for a failure message."""
    logs = sorted(run.logs.glob("*")) if run.logs.exists() else []
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)
