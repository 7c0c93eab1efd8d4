"""The per-node launcher on one machine: in-job restarts, hang detection, the checkpoint
signal and exit codes, with real ranks (gloo on CPU) using the rank agent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftslurm.agent import launch
from ftslurm.agent.heartbeat import Beat, HeartbeatWriter, Timeouts, hang_reason, read_beat

TRAIN = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
from ftslurm.agent import rank as fta
dist.init_process_group("gloo")
agent = fta.init()
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
ckpt = os.path.join(os.environ["FTSLURM_CHECKPOINT_DIR"], "state.json")
steps, step_s = int(sys.argv[1]), float(sys.argv[2])
fail_at = int(os.environ.get("FAIL_AT", -1))
hang_at = int(os.environ.get("HANG_AT", -1))
always = os.environ.get("FAIL_EVERY_ROUND") == "1"
with agent.section("setup"):
    step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
print(f"rank {rank}/{world} round {restart} starts at {step}", flush=True)
while step < steps:
    with agent.section("step"):
        t = torch.ones(1); dist.all_reduce(t); time.sleep(step_s)
    step += 1
    agent.heartbeat(step)
    last = rank == world - 1
    if last and step == fail_at and (restart == 0 or always):
        os._exit(3)
    if last and step == hang_at and restart == 0:
        open(os.environ["HANG_MARK"], "w").write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    if step % 10 == 0 or agent.should_checkpoint():
        if rank == 0:
            with agent.section("checkpointing"):
                json.dump({"step": step}, open(ckpt + ".tmp", "w"))
                os.replace(ckpt + ".tmp", ckpt)
            agent.checkpoint_saved(step, 0.01)
        dist.barrier()
        if os.environ.get("ABORT_BEFORE_STOP") == str(rank) and agent.should_checkpoint():
            os.abort()  # dies after the save, before recording its stop
        if agent.should_stop():
            print(f"rank {rank} checkpointed at {step}", flush=True)
            if os.environ.get("ABORT_AFTER_STOP") == str(rank):
                # the stop of every rank is recorded; then this rank aborts in teardown
                for other in range(world):
                    path = os.path.join(os.environ["FTSLURM_RUN_DIR"], "attempts", "0",
                                        f"stopping-rank-{other}.json")
                    deadline = time.monotonic() + 60
                    while not os.path.exists(path) and time.monotonic() < deadline:
                        time.sleep(0.01)
                os.abort()
            agent.exit(0)
if rank == 0:
    agent.finished(step)
print(f"rank {rank} finished at {step}", flush=True)
agent.exit(0)
'''


def start(tmp_path: Path, *launch_args: str, steps: int = 40, step_s: float = 0.05,
          **env: str) -> subprocess.Popen:  # fmt: skip
    (tmp_path / "train.py").write_text(TRAIN)
    for name in ("run", "ckpt"):
        (tmp_path / name).mkdir(exist_ok=True)
    full_env = dict(os.environ, FTSLURM_RUN_DIR=str(tmp_path / "run"),
                    FTSLURM_CHECKPOINT_DIR=str(tmp_path / "ckpt"), MASTER_ADDR="127.0.0.1",
                    SLURM_JOB_ID=str(os.getpid() % 9000 + len(str(tmp_path)) * 13),
                    HANG_MARK=str(tmp_path / "hung_at"), **env)  # fmt: skip
    for key in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_RESTART_COUNT", "FTSLURM_ATTEMPT_BASE"):
        full_env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, "-m", "ftslurm.agent.launch", "--nproc-per-node", "2",
         "--monitor-interval", "0.2", *launch_args, "--", sys.executable,
         str(tmp_path / "train.py"), str(steps), str(step_s)],
        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def node_report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "attempts" / "0" / "node-0.json").read_text())


def test_a_crashed_rank_is_restarted_in_job_and_resumes_from_the_checkpoint(tmp_path):
    code, out = finish(start(tmp_path, "--max-restarts", "2", FAIL_AT="15"))
    assert code == launch.EXIT_FINISHED, out
    assert "round 1 starts at 10" in out  # the restarted ranks resumed from step 10
    assert "rank 0 finished at 40" in out and "rank 1 finished at 40" in out
    report = node_report(tmp_path)
    assert report["in_job_restarts"] == 1 and report["outcome"] == "finished"


def test_a_hung_rank_is_detected_within_its_timeout_and_restarted(tmp_path):
    proc = start(tmp_path, "--max-restarts", "2", "--section-timeouts",
                 '{"step": 2, "out_of_section": 2}', HANG_AT="15")  # fmt: skip
    code, out = finish(proc)
    assert code == launch.EXIT_FINISHED, out
    report = node_report(tmp_path)
    assert report["in_job_restarts"] == 1 and len(report["hangs"]) == 1
    hung_at = float((tmp_path / "hung_at").read_text())
    detected = report["hangs"][0]["time"] - hung_at
    # within the timeout plus one monitor interval (and a little scheduling slack)
    assert 2.0 <= detected < 2.0 + 0.2 + 3.0, detected  # slack for a loaded machine
    assert "round 1 starts at 10" in out


def test_restarts_exhausted_exit_with_the_documented_code(tmp_path):
    code, out = finish(start(tmp_path, "--max-restarts", "1", FAIL_AT="3",
                             FAIL_EVERY_ROUND="1"))  # fmt: skip
    assert code == launch.EXIT_RESTARTS_EXHAUSTED, out
    assert node_report(tmp_path)["outcome"] == "restarts_exhausted"


def test_sigterm_makes_every_rank_checkpoint_at_the_same_step_and_ask_to_continue(tmp_path):
    proc = start(tmp_path, "--grace", "30", steps=400)
    deadline = time.monotonic() + 60
    progress = tmp_path / "run" / "progress.json"
    while not (progress.exists() and json.loads(progress.read_text()).get("step", 0) >= 12):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == launch.EXIT_CONTINUE, out
    steps = re.findall(r"rank (\d) checkpointed at (\d+)", out)
    assert len(steps) == 2 and steps[0][1] == steps[1][1], out  # the same step on both ranks
    saved = json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"]
    assert saved == int(steps[0][1])
    assert node_report(tmp_path)["outcome"] == "checkpointed"


def sigterm_when_training(tmp_path: Path, proc: subprocess.Popen) -> tuple[int, str]:
    deadline = time.monotonic() + 60
    progress = tmp_path / "run" / "progress.json"
    while not (progress.exists() and json.loads(progress.read_text()).get("step", 0) >= 12):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    return finish(proc)


def rank_report(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / "run" / "attempts" / "0" / f"rank-{rank}.json").read_text())


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_a_rank_that_aborts_in_teardown_after_recording_its_save_still_checkpoints(
        tmp_path, restarts):  # fmt: skip
    # Forced timing: rank 1 waits until both ranks recorded their stop, then aborts
    # (SIGABRT, exit 134) as gloo's teardown does now and then.
    proc = start(tmp_path, "--grace", "30", "--max-restarts", restarts, steps=400,
                 ABORT_AFTER_STOP="1")  # fmt: skip
    code, out = sigterm_when_training(tmp_path, proc)
    assert code == launch.EXIT_CONTINUE, out
    assert "round 1" not in out  # a teardown abort is no reason for an in-job restart
    report = node_report(tmp_path)
    assert report["outcome"] == "checkpointed" and report["in_job_restarts"] == 0
    # (rank 0 may be listed too: torch elastic stops the other ranks on a failure)
    assert any(w.startswith("rank 1 died while tearing down (exit 134)")
               for w in report["teardown_failures"]), report  # fmt: skip
    saved = json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"]
    one = rank_report(tmp_path, 1)
    assert one["outcome"] == "teardown_failed" and one["signal"] == signal.SIGABRT
    assert one["saved_step"] == saved
    assert rank_report(tmp_path, 0)["outcome"] == "checkpointed"


def test_a_rank_that_dies_before_recording_its_save_is_a_failure(tmp_path):
    proc = start(tmp_path, "--grace", "30", steps=400, ABORT_BEFORE_STOP="1")
    code, out = sigterm_when_training(tmp_path, proc)
    assert code == 128 + signal.SIGABRT, out
    assert node_report(tmp_path)["outcome"] == "failed"
    assert rank_report(tmp_path, 1)["outcome"] == "killed"


def outcome(**kw):
    base = dict(succeeded=False, failures={}, ranks={0, 1}, stopped={}, signalled=True,
                finished=False, max_restarts=0)  # fmt: skip
    return launch.decide_outcome(**{**base, **kw})


CKPT = {0: "checkpointed", 1: "checkpointed"}


@pytest.mark.parametrize("kw,code,name,warned", [
    (dict(succeeded=True), 75, "checkpointed", False),
    (dict(succeeded=True, signalled=False), 0, "finished", False),
    (dict(succeeded=True, finished=True), 0, "finished", False),
    # the signal reached another node only: the ranks' records still say checkpointed
    (dict(succeeded=True, signalled=False, stopped=CKPT), 75, "checkpointed", False),
    # every rank recorded its save, then one aborted (134) or hung and was killed (137)
    (dict(failures={1: 134}, stopped=CKPT), 75, "checkpointed", True),
    (dict(failures={0: 137, 1: 134}, stopped=CKPT, signalled=False), 75, "checkpointed",
     True),
    (dict(failures={1: 134}, stopped=CKPT, max_restarts=3), 75, "checkpointed", True),
    (dict(failures={1: 134}, stopped={0: "finished", 1: "finished"}), 0, "finished", True),
    # one rank did not record its save: a failure
    (dict(failures={1: 134}, stopped={0: "checkpointed"}), 134, "failed", False),
    (dict(failures={1: 134}), 134, "failed", False),
    (dict(failures={1: 134}, stopped={0: "checkpointed"}, max_restarts=2), 74,
     "restarts_exhausted", False),
    (dict(failures={1: 134}, stopped=CKPT, ranks=set()), 134, "failed", False),
    # a named exit after the stop is meant
    (dict(failures={1: 93}, stopped=CKPT), 93, "do_not_retry", False),
    (dict(failures={0: 17, 1: 16}), 17, "failed_validation", False),
    (dict(failures={1: -6}), 1, "failed", False),
])  # fmt: skip
def test_decide_outcome(kw, code, name, warned):
    decided = outcome(**kw)
    assert (decided.code, decided.outcome, bool(decided.warnings)) == (code, name, warned)


def test_timeouts_are_tightened_from_what_earlier_attempts_observed():
    configured = Timeouts(sections={"step": 600.0, "setup": None, "eval": 4.0},
                          out_of_section=300.0)  # fmt: skip
    observed = [{"step": 0.5, "setup": 20.0, "eval": 3.0},
                {"step": 2.0, "out_of_section": 1.0, "checkpointing": 9.0}]
    t = launch.tightened(configured, observed, factor=3.0, floor_s=5.0)
    assert t.sections == {"step": 6.0, "setup": None,  # setup is never tightened
                          "eval": 4.0,  # never looser than configured
                          "checkpointing": 27.0}  # fmt: skip
    assert t.out_of_section == 5.0  # 3 x 1.0 raised to the floor
    assert launch.tightened(configured, [], 3.0) == configured


@pytest.mark.parametrize("beat,now,hung", [
    (Beat(None, "step", 100.0, 5, 90.0, 1), 105.0, False),
    (Beat(None, "step", 100.0, 5, 90.0, 1), 110.5, True),
    (Beat(100.0, None, None, 5, 90.0, 1), 104.0, False),
    (Beat(100.0, None, None, 5, 90.0, 1), 106.0, True),
    (Beat(None, "checkpointing", 100.0, 5, 90.0, 1), 10_000.0, False),  # None: infinite
    (Beat(None, None, None, None, 90.0, 1), 10_000.0, False),  # no initial timeout set
])  # fmt: skip
def test_hang_reason(beat, now, hung):
    timeouts = Timeouts(sections={"step": 10.0, "checkpointing": None}, out_of_section=5.0)
    assert (hang_reason(beat, timeouts, now) is not None) is hung


def test_heartbeat_record_round_trip(tmp_path):
    writer = HeartbeatWriter(tmp_path, 3)
    assert read_beat(tmp_path, 3).last_beat is None
    writer.open_section("my-section")
    beat = read_beat(tmp_path, 3)
    assert beat.section == "my-section" and beat.section_start is not None
    writer.close_section()
    writer.beat(42)
    beat = read_beat(tmp_path, 3)
    assert beat.section is None and beat.step == 42 and beat.pid == os.getpid()
    assert read_beat(tmp_path, 4) is None
