"""The per-node launcher on one machine: in-job restarts, hang detection, the checkpoint
signal and exit codes, with real ranks (gloo on CPU) using the rank agent."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ftslurm.agent import launch
from ftslurm.agent.heartbeat import (
    Beat,
    HeartbeatWriter,
    Pace,
    Timeouts,
    hang_reason,
    idle_reason,
    learned,
    observe_pace,
    read_beat,
    watch_cpu,
)
from ftslurm.core.contract import EnvName, ExitCode, HeartbeatDir, RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.runfiles import read_reports

from .conftest import proc_state

TRAIN = r"""
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
"""


def start(
    tmp_path: Path,
    *launch_args: str,
    steps: int = 40,
    step_s: float = 0.05,
    script: str = TRAIN,
    log: Path | None = None,
    entry: tuple[str, ...] = (),
    **env: str,
) -> subprocess.Popen:
    (tmp_path / "train.py").write_text(script)
    for name in ("run", "ckpt"):
        (tmp_path / name).mkdir(exist_ok=True)
    full_env = dict(
        os.environ,
        FTSLURM_RUN_DIR=str(tmp_path / "run"),
        FTSLURM_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        MASTER_ADDR="127.0.0.1",
        SLURM_JOB_ID=str(os.getpid() % 9000 + len(str(tmp_path)) * 13),
        HANG_MARK=str(tmp_path / "hung_at"),
        **env,
    )
    for key in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_RESTART_COUNT", "FTSLURM_ATTEMPT_BASE"):
        full_env.pop(key, None)
    return subprocess.Popen(
        [
            *(entry or (sys.executable, "-m", "ftslurm.agent.launch")),
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.2",
            *launch_args,
            "--",
            sys.executable,
            str(tmp_path / "train.py"),
            str(steps),
            str(step_s),
        ],
        env=full_env,
        stdout=log.open("w") if log else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def node_report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "attempts" / "0" / "node-0.json").read_text())


def test_a_crashed_rank_is_restarted_in_job_and_resumes_from_the_checkpoint(tmp_path):
    code, out = finish(start(tmp_path, "--max-restarts", "2", FAIL_AT="15"))
    assert code == ExitCode.FINISHED, out
    assert "round 1 starts at 10" in out  # the restarted ranks resumed from step 10
    assert "rank 0 finished at 40" in out and "rank 1 finished at 40" in out
    report = node_report(tmp_path)
    assert report["in_job_restarts"] == 1 and report["outcome"] == "finished"


def test_a_hung_rank_is_detected_within_its_timeout_and_restarted(tmp_path):
    proc = start(
        tmp_path,
        "--max-restarts",
        "2",
        "--section-timeouts",
        '{"step": 2, "out_of_section": 2}',
        HANG_AT="15",
    )
    code, out = finish(proc)
    assert code == ExitCode.FINISHED, out
    report = node_report(tmp_path)
    assert report["in_job_restarts"] == 1 and len(report["hangs"]) == 1
    hang = report["hangs"][0]
    # not before the timeout: the silence is measured from the rank's last heartbeat, which
    # it wrote a moment before the mark below (so the mark cannot bound it from below)
    silence = float(re.search(r"no sign of life for ([0-9.]+)s", hang["reason"])[1])
    assert silence >= 2.0, hang  # printed to 0.1 s
    # and soon after it: the timeout plus one monitor interval (slack for a loaded machine)
    detected = hang["time"] - float((tmp_path / "hung_at").read_text())
    assert detected < 2.0 + 0.2 + 3.0, detected
    assert "round 1 starts at 10" in out


PLAIN = r"""
import json, os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # no rank agent: no heartbeats, no sections
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
ckpt = os.path.join(os.environ["FTSLURM_CHECKPOINT_DIR"], "plain.json")
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
print(f"rank {rank} round {restart} starts at {step}", flush=True)
while step < 40:
    t = torch.ones(1); dist.all_reduce(t)
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:  # busy, as training is
        pass
    step += 1
    if rank == world - 1 and step == 15 and restart == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    if step % 10 == 0 and rank == 0:
        json.dump({"step": step}, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
    if step % 10 == 0:
        dist.barrier()
print(f"rank {rank} finished at {step}", flush=True)
"""


def launch_script(
    tmp_path: Path, source: str, nproc: int, timeouts: str, *args: str
) -> subprocess.Popen:
    """The launcher over `source` (a script of its own, not TRAIN), one in-job restart
    allowed, with these timeouts."""
    (tmp_path / "script.py").write_text(source)
    for name in ("run", "ckpt", "node-tmp"):
        (tmp_path / name).mkdir(exist_ok=True)
    env = dict(
        os.environ,
        FTSLURM_RUN_DIR=str(tmp_path / "run"),
        FTSLURM_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        MASTER_ADDR="127.0.0.1",
        TMPDIR=str(tmp_path / "node-tmp"),
        SLURM_JOB_ID=str(os.getpid() % 9000 + len(str(tmp_path)) * 13),
    )
    for key in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_RESTART_COUNT", "FTSLURM_ATTEMPT_BASE"):
        env.pop(key, None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ftslurm.agent.launch",
            f"--nproc-per-node={nproc}",
            "--monitor-interval",
            "0.2",
            "--max-restarts",
            "1",
            "--section-timeouts",
            timeouts,
            "--",
            sys.executable,
            str(tmp_path / "script.py"),
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_stopped_rank_of_a_script_without_heartbeats_is_seen_by_its_cpu_time(tmp_path):
    """A script that never calls the rank agent: the launcher's only evidence is CPU time;
    a rank that uses none for the running timeout is hung (the old launcher waited forever)."""
    code, out = finish(launch_script(tmp_path, PLAIN, 2, '{"out_of_section": 3}'))
    assert code == ExitCode.FINISHED, out
    report = node_report(tmp_path)
    assert report["in_job_restarts"] == 1 and report["heartbeats"] is False
    assert "no CPU use" in report["hangs"][0]["reason"]
    assert "timeout 3s" in report["hangs"][0]["reason"]
    assert "round 1 starts at 10" in out


def test_each_launcher_gets_a_heartbeat_folder_of_its_own_and_removes_it(tmp_path):
    """The folder between a launcher and its ranks is fresh and private (0700): one left by
    a killed launcher (same job id, node rank, even pid; perhaps another user's) in the
    node's temporary folder is never reused. It is gone once the launcher ends."""
    seen = tmp_path / "seen.txt"
    source = (
        "import os, stat\n"
        f"d = os.environ[{EnvName.HEARTBEAT_DIR.value!r}]\n"
        f"open({str(seen)!r}, 'w').write(d + ' ' + oct(stat.S_IMODE(os.stat(d).st_mode)))\n"
    )
    code, out = finish(launch_script(tmp_path, source, 1, "{}"))  # TMPDIR: tmp_path/node-tmp
    assert code == ExitCode.FINISHED, out
    folder, mode = seen.read_text().split()
    assert mode == "0o700"
    assert Path(folder).parent == tmp_path / "node-tmp"
    assert Path(folder).name.startswith("ftslurm-hb-") and not Path(folder).exists()


def test_restarts_exhausted_exit_with_the_documented_code(tmp_path):
    code, out = finish(start(tmp_path, "--max-restarts", "1", FAIL_AT="3", FAIL_EVERY_ROUND="1"))
    assert code == ExitCode.RESTARTS_EXHAUSTED, out
    assert node_report(tmp_path)["outcome"] == "restarts_exhausted"


def test_a_node_that_fails_its_health_check_before_an_in_job_restart_leaves_reported(tmp_path):
    """Issue 30: the health check runs again before each in-job restart's rendezvous (not
    only before the job's first). A rank crashes; the node's check, due 2 s into the job
    (`unhealthy@2`: the first check, at once, passed), fails before the restart: the
    launcher leaves with exit 1, its report names the check, and no second round starts."""
    code, out = finish(
        start(tmp_path, "--max-restarts", "1", FAIL_AT="3", FTSLURM_INJECT="unhealthy@2")
    )
    assert code == ExitCode.FAILED, out
    assert "health check passed" in out and "round 1 starts" not in out, out
    (record,) = read_reports(RunDir(tmp_path / "run"), Kind.UNHEALTHY, 0)
    assert record.injected == "unhealthy@2" and not record.benched
    assert record.words.startswith("health check failed: checkpoint_dir: "), record
    report = node_report(tmp_path)
    assert report["outcome"] == "unhealthy" and report["error"] == record.words, report


def test_sigterm_makes_every_rank_checkpoint_at_the_same_step_and_ask_to_continue(tmp_path):
    proc = start(tmp_path, "--grace", "30", steps=400)
    deadline = time.monotonic() + 60
    progress = tmp_path / "run" / "progress.json"
    while not (progress.exists() and json.loads(progress.read_text()).get("step", 0) >= 12):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == ExitCode.CONTINUE, out
    steps = re.findall(r"rank (\d) checkpointed at (\d+)", out)
    assert len(steps) == 2 and steps[0][1] == steps[1][1], out  # the same step on both ranks
    saved = json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"]
    assert saved == int(steps[0][1])
    assert node_report(tmp_path)["outcome"] == "checkpointed"


def test_a_checkpoint_signal_during_the_rendezvous_reaches_the_ranks_once_they_start(tmp_path):
    """Node 0's launcher waits in the rendezvous for node 1's (its lease is written, so its
    handlers are in place) when the checkpoint signal comes: there are no ranks to send it
    to yet. It is remembered: the ranks get it once they start, checkpoint and ask to
    continue, instead of training on to the end."""
    two = ("--nproc-per-node", "1", "--nnodes", "2", "--peer-timeout", "60")
    first = start(tmp_path, *two, "--node-rank", "0", steps=400)
    second = None
    try:
        lease = tmp_path / "run" / "attempts" / "0" / "peer-lease-0.json"
        deadline = time.monotonic() + 60
        while not lease.exists():
            assert time.monotonic() < deadline and first.poll() is None, "no launcher lease"
            time.sleep(0.05)
        first.send_signal(signal.SIGUSR2)
        second = start(tmp_path, *two, "--node-rank", "1", steps=400)
        code, out = finish(first)
        assert code == ExitCode.CONTINUE, out
        assert re.search(r"rank \d checkpointed at \d+", out), out
        assert finish(second)[0] == ExitCode.CONTINUE
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


# TRAIN that leaves a mark as its first act: a rank's command started.
MARKED = 'import os\nopen(os.environ["RANK_MARK"], "a").close()\n' + TRAIN


def at_pause(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the launcher stopped itself at its test pause (`launch.PAUSE_ENV`)."""
    deadline = time.monotonic() + timeout
    while proc_state(proc.pid) != "T":
        assert proc.poll() is None, f"the launcher ended before its pause: {proc.returncode}"
        assert time.monotonic() < deadline, "the launcher did not pause"
        time.sleep(0.02)


def signal_at_pause(proc: subprocess.Popen, sig: int) -> None:
    """The signal reaches the paused launcher exactly where it stopped, once continued."""
    at_pause(proc)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)


def kill_left(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()


ONE_RANK = ("--nproc-per-node", "1", "--max-restarts", "0")


@pytest.mark.parametrize(
    "phase, sig",
    [
        ("start", signal.SIGTERM),  # its first handlers only, before torch is imported
        ("rendezvous", signal.SIGTERM),  # its handlers and lease in place, before the rendezvous
        ("ranks", signal.SIGTERM),  # the rendezvous done, before the ranks are started
        ("ranks", signal.SIGINT),
    ],
)
def test_a_stop_before_the_ranks_start_means_they_never_do(tmp_path, phase, sig):
    """Forced timing: the launcher pauses at a phase, the stop reaches it there. No rank
    ever starts, and the launcher ends at once, stopped: exit 128 + the signal and a node
    report that says so (the old launcher started the ranks and let them train)."""
    mark = tmp_path / "rank-started"
    proc = start(
        tmp_path,
        *ONE_RANK,
        "--grace",
        "600",
        steps=100000,
        script=MARKED,
        RANK_MARK=str(mark),
        **{launch.PAUSE_ENV: phase},
    )
    try:
        signal_at_pause(proc, sig)
        code, out = finish(proc)
    finally:
        kill_left(proc)
    assert code == 128 + sig, out
    assert not mark.exists(), out
    assert not (tmp_path / "run" / "attempts" / "0" / "rank-0.json").exists()
    report = node_report(tmp_path)
    assert (report["outcome"], report["signal"], report["exit_code"]) == (
        "stopped",
        signal.Signals(sig).name,
        128 + sig,
    ), report
    assert "told to stop" in out and "Traceback" not in out, out


def test_a_stop_while_the_ranks_are_being_started_reaches_them(tmp_path):
    """The stop comes after the last look before the ranks start, while they are being
    started (no process ids yet): they get it once their wrappers are ready, instead of
    training on (the old launcher dropped it)."""
    proc = start(tmp_path, *ONE_RANK, "--grace", "600", steps=100000, **{launch.PAUSE_ENV: "spawn"})
    try:
        signal_at_pause(proc, signal.SIGTERM)
        code, out = finish(proc)
    finally:
        kill_left(proc)
    assert code != ExitCode.FINISHED and "finished at" not in out, out
    report = rank_report(tmp_path, 0)  # killed at its start, or stopped before, or saved
    assert report["outcome"] in ("killed", "stopped", "checkpointed"), report
    assert report["checkpoint_signal_at"] is not None, report


@pytest.mark.parametrize("phase", ["start", "ranks", "spawn"])  # rendezvous: above
def test_a_checkpoint_signal_before_the_ranks_start_reaches_them_once_they_do(tmp_path, phase):
    proc = start(tmp_path, "--nproc-per-node", "1", steps=100000, **{launch.PAUSE_ENV: phase})
    try:
        signal_at_pause(proc, signal.SIGUSR2)
        code, out = finish(proc)
    finally:
        kill_left(proc)
    assert code == ExitCode.CONTINUE, out
    assert re.search(r"rank 0 checkpointed at \d+", out), out
    assert node_report(tmp_path)["outcome"] == "checkpointed"


# The launcher as `python -m` runs it, stopped (SIGSTOP) while its module still imports,
# right after its first import (`ftslurm.agent.boot`): before `main` and its handlers.
PAUSED_IN_IMPORTS = r"""
import os, runpy, signal, sys
paused = []
def pause(event, args):
    if event == "import" and args[0] == "ftslurm.agent.spares" and not paused:
        paused.append(1)
        os.kill(os.getpid(), signal.SIGSTOP)
sys.addaudithook(pause)
sys.argv = ["launch", *sys.argv[1:]]
runpy._run_module_as_main("ftslurm.agent.launch")
"""


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_a_signal_while_the_launcher_still_imports_is_not_lost(tmp_path, sig):
    """Before `main` runs (its imports take a while): the checkpoint signal neither ends the
    launcher (its default action) nor is lost, it reaches the ranks once they start; a stop
    means they never start."""
    mark = tmp_path / "rank-started"
    proc = start(
        tmp_path,
        *ONE_RANK,
        steps=100000,
        script=MARKED,
        RANK_MARK=str(mark),
        entry=(sys.executable, "-c", PAUSED_IN_IMPORTS),
    )
    try:
        signal_at_pause(proc, sig)
        code, out = finish(proc)
    finally:
        kill_left(proc)
    if sig == signal.SIGTERM:
        assert code == 128 + sig and not mark.exists(), out
        assert node_report(tmp_path)["outcome"] == "stopped"
    else:
        assert code == ExitCode.CONTINUE, out
        assert re.search(r"rank 0 checkpointed at \d+", out), out


def test_a_stop_in_torchs_rendezvous_join_ends_it_at_once(tmp_path):
    """Node 0's launcher waits in torch's join for a node that never comes (up to the
    300 s rendezvous timeout): a stop there ends the join at once, and no rank starts."""
    log = tmp_path / "node-0.log"
    mark = tmp_path / "rank-started"
    proc = start(
        tmp_path,
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--peer-timeout",
        "600",
        script=MARKED,
        log=log,
        RANK_MARK=str(mark),
        LOGLEVEL="INFO",
    )  # torch elastic's own log says when it joins
    try:
        deadline = time.monotonic() + 120
        while "Rendezvous'ing worker group" not in log.read_text():  # the join begins
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)  # well within the join's own timeout
    finally:
        kill_left(proc)
    out = log.read_text()
    assert code == 128 + signal.SIGTERM, out
    assert not mark.exists()
    assert node_report(tmp_path)["outcome"] == "stopped"
    assert "Traceback" not in out, out


def test_a_host_stopped_before_it_published_its_endpoint_releases_the_others(tmp_path):
    """Node 0's launcher is told to stop before it publishes its rendezvous endpoint;
    node 1's, waiting for that endpoint and not signalled itself, sees node 0's lease end
    "stopped" and gives up at once instead of waiting out the rendezvous timeout."""
    from ftslurm.core.contract import RunDir

    run = RunDir(tmp_path / "run")
    mark = tmp_path / "rank-started"
    two = ("--nproc-per-node", "1", "--nnodes", "2", "--peer-timeout", "600")
    host = start(
        tmp_path,
        *two,
        "--node-rank",
        "0",
        script=MARKED,
        RANK_MARK=str(mark),
        **{launch.PAUSE_ENV: "rendezvous"},
    )
    other = None
    try:
        at_pause(host)
        other = start(tmp_path, *two, "--node-rank", "1", script=MARKED, RANK_MARK=str(mark))
        deadline = time.monotonic() + 120
        while not run.peer_lease(0, 1).exists():  # its handlers are in place, it waits
            assert other.poll() is None and time.monotonic() < deadline, "no lease"
            time.sleep(0.05)
        host.send_signal(signal.SIGTERM)
        host.send_signal(signal.SIGCONT)
        code, out = finish(host)
        assert code == 128 + signal.SIGTERM, out
        other_code = other.wait(timeout=60)  # well within the 300 s rendezvous timeout
        other_out = other.communicate()[0]
    finally:
        kill_left(host, other)
    assert other_code == ExitCode.FAILED, other_out
    gave_up = json.loads(run.node_report(0, 1).read_text())
    assert gave_up["outcome"] == "launcher_failed", gave_up
    assert "node rank 0) was told to stop" in gave_up["error"], gave_up
    assert not run.launcher_failed(0, 1).exists()  # news of a peer: not its own failure
    assert not mark.exists()


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
    tmp_path, restarts
):
    # Forced timing: rank 1 waits until both ranks recorded their stop, then aborts
    # (SIGABRT, exit 134) as gloo's teardown does now and then.
    proc = start(
        tmp_path, "--grace", "30", "--max-restarts", restarts, steps=400, ABORT_AFTER_STOP="1"
    )
    code, out = sigterm_when_training(tmp_path, proc)
    assert code == ExitCode.CONTINUE, out
    assert "round 1" not in out  # a teardown abort is no reason for an in-job restart
    report = node_report(tmp_path)
    assert report["outcome"] == "checkpointed" and report["in_job_restarts"] == 0
    # (rank 0 may be listed too: torch elastic stops the other ranks on a failure)
    assert any(
        w.startswith("rank 1 died while tearing down (exit 134)")
        for w in report["teardown_failures"]
    ), report
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
    base = dict(
        succeeded=False,
        failures={},
        ranks={0, 1},
        stopped={},
        signalled=True,
        finished=False,
        max_restarts=0,
    )
    return launch.decide_outcome(**{**base, **kw})


CKPT = {0: "checkpointed", 1: "checkpointed"}


@pytest.mark.parametrize(
    "kw,code,name,warned",
    [
        (dict(succeeded=True), 75, "checkpointed", False),
        (dict(succeeded=True, signalled=False), 0, "finished", False),
        (dict(succeeded=True, finished=True), 0, "finished", False),
        # the signal reached another node only: the ranks' records still say checkpointed
        (dict(succeeded=True, signalled=False, stopped=CKPT), 75, "checkpointed", False),
        # every rank recorded its save, then one aborted (134) or hung and was killed (137)
        (dict(failures={1: 134}, stopped=CKPT), 75, "checkpointed", True),
        (dict(failures={0: 137, 1: 134}, stopped=CKPT, signalled=False), 75, "checkpointed", True),
        (dict(failures={1: 134}, stopped=CKPT, max_restarts=3), 75, "checkpointed", True),
        (dict(failures={1: 134}, stopped={0: "finished", 1: "finished"}), 0, "finished", True),
        # one rank did not record its save: a failure
        (dict(failures={1: 134}, stopped={0: "checkpointed"}), 134, "failed", False),
        (dict(failures={1: 134}), 134, "failed", False),
        (
            dict(failures={1: 134}, stopped={0: "checkpointed"}, max_restarts=2),
            74,
            "restarts_exhausted",
            False,
        ),
        (dict(failures={1: 134}, stopped=CKPT, ranks=set()), 134, "failed", False),
        # a named exit after the stop is meant
        (dict(failures={1: 93}, stopped=CKPT), 93, "do_not_retry", False),
        (dict(failures={0: 17, 1: 16}), 17, "failed_validation", False),
        (dict(failures={1: -6}), 1, "failed", False),
        # the last round ended because a rank hung: the daemon counts a hang, not a crash
        (dict(failures={1: -9}, max_restarts=2, hung=True), 74, "hung", False),
        (dict(failures={1: -9}, hung=True), 1, "hung", False),
        (dict(failures={1: 93}, max_restarts=2, hung=True), 93, "do_not_retry", False),
    ],
)
def test_decide_outcome(kw, code, name, warned):
    decided = outcome(**kw)
    assert (decided.code, decided.outcome, bool(decided.warnings)) == (code, name, warned)


def test_timeouts_are_tightened_from_what_earlier_attempts_observed():
    configured = Timeouts(
        sections={"step": 600.0, "setup": None, "eval": 4.0}, out_of_section=300.0
    )
    observed = [
        {"step": 0.5, "setup": 20.0, "eval": 3.0},
        {"step": 2.0, "out_of_section": 1.0, "checkpointing": 9.0},
    ]
    t = launch.tightened(configured, observed, factor=3.0, floor_s=5.0)
    assert t.sections == {
        "step": 6.0,
        "setup": None,  # setup is never tightened
        "eval": 4.0,  # never looser than configured
        "checkpointing": 27.0,
    }
    assert t.out_of_section == 5.0  # 3 x 1.0 raised to the floor
    assert launch.tightened(configured, [], 3.0) == configured


@pytest.mark.parametrize(
    "beat,now,hung",
    [
        (Beat(None, "step", 100.0, 5, 90.0, 1), 105.0, False),
        (Beat(None, "step", 100.0, 5, 90.0, 1), 110.5, True),
        (Beat(100.0, None, None, 5, 90.0, 1), 104.0, False),
        (Beat(100.0, None, None, 5, 90.0, 1), 106.0, True),
        (Beat(None, "checkpointing", 100.0, 5, 90.0, 1), 10_000.0, False),  # None: infinite
        (Beat(None, None, None, None, 90.0, 1), 10_000.0, False),  # no initial timeout set
    ],
)
def test_hang_reason(beat, now, hung):
    timeouts = Timeouts(sections={"step": 10.0, "checkpointing": None}, out_of_section=5.0)
    assert (hang_reason(beat, timeouts, now) is not None) is hung


def test_a_section_without_its_own_limit_falls_under_the_running_timeout():
    timeouts = Timeouts(sections={"checkpointing": 600.0}, out_of_section=30.0)
    # in "compute" (no limit of its own) since 100, silent since 100: hung after 30 s
    assert hang_reason(Beat(100.0, "compute", 100.0, 5, 90.0, 1), timeouts, 129.0) is None
    why = hang_reason(Beat(100.0, "compute", 100.0, 5, 90.0, 1), timeouts, 131.0)
    assert why and "in section 'compute'" in why and "timeout 30s" in why
    # a checkpoint keeps its own, looser limit
    assert hang_reason(Beat(100.0, "checkpointing", 100.0, 5, 90.0, 1), timeouts, 600.0) is None
    # the running timeout off (None) means off
    off = Timeouts(sections={}, out_of_section=None)
    assert hang_reason(Beat(100.0, "compute", 100.0, 5, 90.0, 1), off, 1e6) is None


def beats(times: list[float], section: str | None = None) -> list[Beat]:
    """A rank's record at each step's heartbeat (step i at times[i])."""
    return [Beat(t, section, None, i, 0.0, 1) for i, t in enumerate(times)]


def paced(timeouts: Timeouts, records: list[Beat]) -> Pace:
    pace = Pace()
    for beat in records:
        pace = observe_pace(pace, beat, timeouts)
    return pace


def test_the_running_timeout_is_learned_from_the_pace_after_the_warm_up():
    t = Timeouts(sections={"checkpointing": 600.0}, out_of_section=300.0, warmup_steps=3)
    # slow first steps (warm-up: compilation, caches), then 0.5 s per step
    times = [0.0, 20.0, 40.0, 41.0, 41.5, 42.0, 42.5]
    pace = paced(t, beats(times))
    assert pace.longest == pytest.approx(0.5)  # the warm-up steps do not count
    assert learned(t, pace).out_of_section == 30.0  # 3 x 0.5 s, raised to the 30 s floor
    assert learned(t, pace, floor_s=1.0).out_of_section == pytest.approx(1.5)
    assert learned(t, paced(t, beats(times[:4]))) == t  # nothing learned before the warm-up
    # steps seen several at a time count per step
    few = [
        Beat(0.0, None, None, 0, 0.0, 1),
        Beat(10.0, None, None, 5, 0.0, 1),
        Beat(12.0, None, None, 9, 0.0, 1),
        Beat(14.0, None, None, 13, 0.0, 1),
    ]
    assert paced(t, few).longest == pytest.approx(0.5)
    # never looser than configured; off stays off
    assert learned(replace(t, out_of_section=20.0), pace).out_of_section == 20.0
    assert learned(replace(t, out_of_section=None), pace).out_of_section is None
    # no learning when warmup_steps is None
    assert paced(replace(t, warmup_steps=None), beats(times)).longest is None


def test_a_step_through_a_checkpoint_does_not_set_the_pace():
    t = Timeouts(sections={"checkpointing": 600.0}, out_of_section=300.0, warmup_steps=1)
    records = [
        *beats([0.0, 1.0, 2.0]),
        Beat(2.5, "checkpointing", 2.1, 2, 0.0, 1),
        Beat(60.0, None, None, 3, 0.0, 1),
        Beat(61.0, None, None, 4, 0.0, 1),
    ]
    assert paced(t, records).longest == pytest.approx(1.0)  # not the 58 s with the save


def test_a_straggler_slowed_threefold_is_not_taken_for_hung():
    """Steps of 0.1 s, then the node slows threefold (0.3 s a step): the learned timeout
    (30 s) is far above any silence of a rank that still makes progress."""
    t = Timeouts(sections={"checkpointing": 600.0}, out_of_section=300.0, warmup_steps=20)
    times = [0.1 * i for i in range(40)] + [3.9 + 0.3 * i for i in range(1, 40)]
    pace = Pace()
    for beat in beats(times):
        pace = observe_pace(pace, beat, t)
        limits = learned(t, pace)
        # looked at just before the next step's heartbeat: 0.3 s of silence at most
        assert hang_reason(beat, limits, beat.last_beat + 0.3) is None
    assert pace.longest == pytest.approx(0.3) and learned(t, pace).out_of_section == 30.0
    # stopped for good: caught once the learned timeout has passed, not after 300 s
    assert hang_reason(beats(times)[-1], learned(t, pace), times[-1] + 31.0)


def test_a_rank_without_heartbeats_is_hung_when_its_cpu_time_stands_still():
    watch = watch_cpu(None, 5.0, 0.0, window=1.0)
    for now, cpu in [(1.0, 5.5), (2.0, 6.0), (3.0, 6.5)]:  # busy: half a core
        watch = watch_cpu(watch, cpu, now, window=1.0)
    assert watch.busy_at == 3.0
    for now in (4.0, 5.0, 6.0, 7.0):  # stopped: no CPU at all
        watch = watch_cpu(watch, 6.5, now, window=1.0)
    assert idle_reason(watch, 3.0, 6.0) is None
    why = idle_reason(watch, 3.0, 7.0)
    assert why and "no CPU use for 4.0s" in why
    assert idle_reason(watch, None, 1e6) is None  # off
    # a sample within the window changes nothing
    assert watch_cpu(watch, 100.0, 7.5, window=1.0) == watch


def test_timeouts_left_out_get_the_defaults_and_null_is_off():
    t = launch.parse_timeouts(None)
    assert t == Timeouts(
        sections={"setup": 1800.0, "checkpointing": 1800.0, "recovery": 1800.0},
        out_of_section=300.0,
        initial=1800.0,
        warmup_steps=20,
    )
    t = launch.parse_timeouts(
        '{"step": 8, "out_of_section": null, "warmup_steps": null, "setup": null}'
    )
    assert t.sections == {"setup": None, "checkpointing": 1800.0, "recovery": 1800.0, "step": 8.0}
    assert t.out_of_section is None and t.warmup_steps is None and t.initial == 1800.0


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
    assert beat.beats
    assert read_beat(tmp_path, 4) is None


def test_a_record_attached_without_heartbeats_says_so_until_the_first_beat(tmp_path):
    writer = HeartbeatWriter(tmp_path, 0, beats=False)
    assert read_beat(tmp_path, 0).beats is False
    writer.beat(1)  # a first sign of life: judged by heartbeats from now on
    assert read_beat(tmp_path, 0).beats is True
    HeartbeatWriter(tmp_path, 1, beats=False).open_section("step")
    assert read_beat(tmp_path, 1).beats is True


QUIET = r"""
import os, sys, time
from ftslurm.agent import rank as fta
agent = fta.init(heartbeats=False)  # as a submitit callable: attached, never a heartbeat
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:  # busy, as training is
    pass
print("quiet rank done", flush=True)
"""


def test_a_rank_attached_without_heartbeats_is_not_taken_for_hung_by_the_initial_timeout(tmp_path):
    """A submitit callable attaches (its signal handlers are in place) but never beats: the
    initial timeout must not kill it; the launcher watches its CPU time instead."""
    code, out = finish(
        launch_script(tmp_path, QUIET, 1, '{"initial": 1, "out_of_section": 60}', "4")
    )
    assert code == ExitCode.FINISHED, out
    report = node_report(tmp_path)
    assert report["in_job_restarts"] == 0 and report["hangs"] == [], report
    assert report["heartbeats"] is False


SHORT_DDP = r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(5):
    t = torch.ones(1); dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def launchers(
    tmp_path: Path,
    node_ranks: tuple[int, ...],
    *launch_args: str,
    job: str = "4242",
    nnodes: int = 2,
) -> list[subprocess.Popen]:
    """Launchers of a job of `nnodes` nodes on this machine ("nodes" n0, n1, ...), without
    --rdzv-endpoint: node rank 0 binds a port and publishes it in the run directory."""
    (tmp_path / "ddp.py").write_text(SHORT_DDP)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    procs = []
    for node_rank in node_ranks:
        env = dict(
            os.environ,
            FTSLURM_RUN_DIR=str(tmp_path / "run"),
            SLURM_JOB_ID=job,
            SLURM_STEP_ID="0",
            FTSLURM_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
            MASTER_ADDR="127.0.0.1",
            SLURMD_NODENAME=f"n{node_rank}",
        )
        for key in (
            "SLURM_NNODES",
            "SLURM_NODEID",
            "SLURM_RESTART_COUNT",
            "FTSLURM_ATTEMPT_BASE",
            "FTSLURM_PEER_TIMEOUT_S",
        ):
            env.pop(key, None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ftslurm.agent.launch",
                    "--nproc-per-node=1",
                    f"--nnodes={nnodes}",
                    f"--node-rank={node_rank}",
                    "--monitor-interval=0.2",
                    "--peer-timeout=5",
                    *launch_args,
                    "--",
                    sys.executable,
                    str(tmp_path / "ddp.py"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def ended(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str]]:
    """Each launcher's exit code and output; every one still running afterwards is killed."""
    try:
        return [finish(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_the_launchers_meet_on_the_port_the_host_bound_though_the_jobs_port_is_taken(tmp_path):
    from ftslurm.core.contract import RunDir, rendezvous_port

    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # another process listens on the port the job id gives (or it is taken already)
        held.bind(("", rendezvous_port("4242", 0)))
        held.listen()
    except OSError:
        pass
    try:
        results = ended(launchers(tmp_path, (0, 1)))
    finally:
        held.close()
    assert [code for code, _ in results] == [0, 0], results
    record = json.loads(RunDir(tmp_path / "run").rendezvous(0, 0).read_text())
    assert record["port"] != rendezvous_port("4242", 0)
    assert record["job_id"] == "4242" and record["step_id"] == "0", record
    assert record["id"].startswith("ftslurm-4242-0-0-"), record  # a fresh id per launch


def test_a_launcher_alone_at_the_rendezvous_reports_its_timeout_and_exits_1(tmp_path):
    from ftslurm.core.contract import RunDir

    run = RunDir(tmp_path / "run")
    ((code, out),) = ended(launchers(tmp_path, (0,), "--rdzv-timeout=3"))
    assert code == ExitCode.FAILED, out
    failed = json.loads(run.launcher_failed(0, 0).read_text())
    assert failed["phase"] == "rendezvous" and "Timeout" in failed["error"], failed
    report = json.loads(run.node_report(0, 0).read_text())
    assert report["outcome"] == "launcher_failed" and report["error"] == failed["error"]
    assert "Error: the launcher failed before its ranks started" in out
    assert "Traceback" not in out, out


def test_a_launcher_failing_at_the_rendezvous_is_reported_and_its_peer_gives_up(tmp_path):
    from ftslurm.core.contract import RunDir

    run = RunDir(tmp_path / "run")
    run.rendezvous(0, 0).mkdir(parents=True)  # node 0 cannot publish its endpoint
    (host, peer) = ended(launchers(tmp_path, (0, 1)))
    assert host[0] == peer[0] == ExitCode.FAILED, (host, peer)
    failed = json.loads(run.launcher_failed(0, 0).read_text())
    assert "IsADirectoryError" in failed["error"], failed
    gave_up = json.loads(run.node_report(0, 1).read_text())
    assert gave_up["outcome"] == "launcher_failed", gave_up
    assert "the rendezvous host's launcher (node rank 0) failed" in gave_up["error"], gave_up
    assert not run.launcher_failed(0, 1).exists()  # news of a peer: not its own failure
    # the launchers watched each other from before the rendezvous
    assert run.peer_lease(0, 1).exists() and run.peer_lease(0, 0).exists()


@pytest.mark.parametrize(
    "bad, said",
    [
        ('--section-timeouts={"step": "soon"}', "ValueError"),  # fails in the launcher's setup
        ("--peer-timeout=0", "UsageError: --peer-timeout must be > 0"),  # a bad argument
    ],
    ids=["setup", "argument"],
)
def test_a_launcher_failing_before_the_rendezvous_is_reported_and_its_peer_gives_up(
    tmp_path, bad, said
):
    from ftslurm.core.contract import RunDir

    run = RunDir(tmp_path / "run")
    procs = launchers(tmp_path, (0,), bad) + launchers(tmp_path, (1,))
    # the peer gives up on news of the host's failure, not after its 300 s rendezvous timeout
    (host, peer) = ended(procs, timeout=60)
    assert host[0] == peer[0] == ExitCode.FAILED, (host, peer)
    failed = json.loads(run.launcher_failed(0, 0).read_text())
    assert failed["phase"] == "setup" and said in failed["error"], failed
    assert failed["job_id"] == "4242" and failed["attempt"] == 0, failed
    report = json.loads(run.node_report(0, 0).read_text())
    assert report["outcome"] == "launcher_failed" and report["error"] == failed["error"], report
    assert "Error: the launcher failed before its ranks started (setup)" in host[1], host
    assert "Traceback" not in host[1], host
    gave_up = json.loads(run.node_report(0, 1).read_text())
    assert "the rendezvous host's launcher (node rank 0) failed" in gave_up["error"], gave_up


def test_a_rank_whose_process_is_stopped_is_frozen_and_one_that_sleeps_is_not():
    """`launch_io.frozen`: what a launcher with spares says of a rank it judged hung (its
    hang claim). A rank's process stopped (SIGSTOP) waits on no peer; one asleep (as in a
    collective that waits on a peer) may be waiting on another node's hung rank."""
    from ftslurm.agent.launch_io import frozen

    wrapper = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"]
    )
    try:

        def child() -> int | None:
            kids = Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children").read_text().split()
            return int(kids[0]) if kids else None

        deadline = time.monotonic() + 20
        while child() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = child()
        assert rank is not None
        assert not frozen(wrapper.pid, 0.1)  # asleep
        os.kill(rank, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the stop lands (state T)
        while not frozen(wrapper.pid, 0.1) and time.monotonic() < deadline:
            pass
        assert frozen(wrapper.pid, 0.1)
        os.kill(rank, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while frozen(wrapper.pid, 0.1) and time.monotonic() < deadline:
            pass
        assert not frozen(wrapper.pid, 0.1)
        assert not frozen(wrapper.pid + 10**7, 0.0)  # gone: nothing frozen
    finally:
        for pid in (
            [
                int(p)
                for p in Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children")
                .read_text()
                .split()
            ]
            if wrapper.poll() is None
            else []
        ):
            os.kill(pid, signal.SIGKILL)
        wrapper.kill()
        wrapper.wait()


def test_a_wrappers_own_start_counts_as_the_ranks_cpu_until_the_script_runs():
    """`launch_io.cpu_seconds`, by which a rank without heartbeats is judged hung: while
    the wrapper has not started the script yet (its own Python start, slow under load),
    its own CPU counts, so a tight running limit does not judge a starting rank hung; once
    the script runs, only the processes below it count (the wrapper's polling does not)."""
    from ftslurm.agent.launch_io import cpu_seconds

    from .conftest import wait_for

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    alone = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(30)"])
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\ntime.sleep(0.3)\n"
         f"subprocess.run([sys.executable, '-c', {busy + 'time.sleep(30)'!r}])"]
    )  # fmt: skip
    try:
        wait_for(lambda: (cpu_seconds(alone.pid) or 0) >= 0.5, 30, "the busy process's CPU")
        # the parent's script below it: its CPU, not the parent's start
        wait_for(lambda: (cpu_seconds(parent.pid) or 0) >= 0.5, 30, "the script's CPU")
    finally:
        for p in (alone, parent):
            p.kill()
            p.wait()
    assert cpu_seconds(alone.pid) is None


def test_a_killed_launchers_folder_is_removed_by_the_next_launcher_and_no_other(tmp_path):
    """A launcher killed with SIGKILL leaves its node-local folder behind; the next launcher
    of the same user on the node removes it, but not one whose launcher still runs (held
    with SIGSTOP too) nor another kind of folder."""
    tmp = tmp_path / "node-tmp"
    tmp.mkdir()
    dead = subprocess.Popen(["sleep", "60"])
    dead.kill()
    dead.wait()
    held = subprocess.Popen(["sleep", "60"])
    os.kill(held.pid, signal.SIGSTOP)
    try:
        left = tmp / f"{HeartbeatDir.for_launcher(tmp, '77', 1, dead.pid).root.name}-ab_c9"
        running = tmp / f"{HeartbeatDir.for_launcher(tmp, '77', 0, held.pid).root.name}-x1"
        other = tmp / "ftslurm-hb-notes"
        for folder in (left, running, other):
            (folder / "logs").mkdir(parents=True)
        code, out = finish(launch_script(tmp_path, "pass", 1, "{}"))  # TMPDIR: node-tmp
        assert code == ExitCode.FINISHED, out
        assert not left.exists()
        assert running.exists() and other.exists()
        assert sorted(p.name for p in tmp.iterdir()) == sorted([running.name, other.name])
    finally:
        held.kill()
        held.wait()
