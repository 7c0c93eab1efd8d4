"""A run cancelled while its launchers are still at the rendezvous: no rank ever starts
(issue: ranks started, and trained, after `cancel` had replied). And the checkpoint signal
at the rendezvous: remembered, it reaches the ranks once they start (`CHECKPOINT_AT_...`).

Forced timing, end to end (CLI, daemon, scheduler, launchers): both launchers of a
2-node run are stopped (SIGSTOP) as soon as their first handlers are in place, before node
rank 0's launcher published its rendezvous endpoint, so no rank can start anywhere; then
the run is cancelled. The scheduler continues every task and sends it SIGTERM, as Slurm does: the
launchers must end on their own, stopped, and start no rank. On the mock scheduler, and
on the real cluster (`slurm`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.agent.launch_io import PAUSE_ENV
from ftslurm.agent.sigmask import caught_signals
from ftslurm.core.contract import EnvName, RunDir

from .daemon_scenarios import Cli, daemon_cli, ended

# The training: leaves a mark as its first act (a rank started), then trains for long.
TRAIN = r"""
import os, sys, time
open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}-{os.getpid()}"), "w").close()
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(3000):
    dist.all_reduce(torch.ones(1)); time.sleep(0.1)
"""


def launcher_pids(run_dir: str) -> dict[int, int]:
    """Node rank -> pid of the launchers of the run now on this machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[1:3] != [b"-m", b"ftslurm.agent.launch"]:
                continue
            env = dict(
                item.split(b"=", 1)
                for item in (entry / "environ").read_bytes().split(b"\0")
                if b"=" in item
            )
        except OSError:
            continue
        if env.get(EnvName.RUN_DIR.value.encode()) == run_dir.encode():
            found[int(env.get(b"SLURM_NODEID", b"0"))] = int(entry.name)
    return found


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "?"


def hold_launchers(run_dir: str, nodes: int, timeout: float) -> dict[int, int]:
    """SIGSTOP each launcher of the run as soon as its first handlers are in place (it
    catches SIGTERM: `ftslurm.agent.boot`), until all `nodes` are held."""
    deadline = time.monotonic() + timeout
    held: dict[int, int] = {}
    while len(held) < nodes:
        assert time.monotonic() < deadline, f"launchers held: {held}"
        for node_rank, pid in launcher_pids(run_dir).items():
            if node_rank not in held and signal.SIGTERM in (caught_signals(pid) or ()):
                os.kill(pid, signal.SIGSTOP)
                held[node_rank] = pid
        time.sleep(0.01)
    for pid in held.values():  # stopped: a stop takes effect asynchronously
        while proc_state(pid) not in ("T", "?"):
            assert time.monotonic() < deadline, "a launcher did not stop"
            time.sleep(0.01)
    return held


def cancel_at_the_rendezvous(cli: Cli, tmp_path: Path, *submit_args: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    out = cli.submit(
        *submit_args, "--retries", "0", "-N", "2", "-t", "10", str(train), "--", str(marks)
    )
    run_dir = cli.status(out["run_id"])["run_dir"]
    run = RunDir(run_dir)
    held = hold_launchers(run_dir, 2, 180)
    try:
        # Node rank 0's launcher has not published its endpoint: no rank can start yet.
        assert not run.rendezvous(0, 0).exists(), "node 0's launcher published already"
        assert not list(marks.iterdir())
        done = cli("cancel", out["run_id"])  # the scheduler continues them with SIGTERM
        assert "cancel requested" in done.stdout, done.stdout
        s = cli.wait_for(out["run_id"], ended, 120, "the run to end")
        assert s["state"] == "CANCELLED", s
        deadline = time.monotonic() + 120
        while any(proc_state(pid) != "?" and proc_state(pid) != "Z" for pid in held.values()):
            assert time.monotonic() < deadline, "the launchers did not end"
            time.sleep(0.1)
    finally:
        for pid in held.values():  # never left stopped, whatever failed
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    assert not list(marks.iterdir()), "ranks started after the cancel"
    for node_rank in (0, 1):  # each ended on its own (none was killed at KillWait), stopped
        report = json.loads(run.node_report(0, node_rank).read_text())
        assert (report["outcome"], report["signal"]) == ("stopped", "SIGTERM"), report


@pytest.fixture
def mock(tmp_path) -> Iterator[Cli]:
    """A state directory and a mock cluster of their own; KillWait 60 s: a launcher that
    ended before it ended on its own."""
    config = tmp_path / "mock.json"
    config.write_text(json.dumps({"kill_wait_s": 60}))
    cli = daemon_cli(tmp_path, FTSLURM_MOCK_HOME=str(tmp_path / "mock"))
    c = next(cli)
    c("mock", "up", "--config", str(config))
    try:
        yield c
    finally:
        try:
            next(cli, None)  # its runs cancelled, its daemon stopped
        finally:
            c("mock", "destroy", check=False)


@pytest.fixture
def cluster_cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


def test_a_run_cancelled_at_the_rendezvous_starts_no_rank_on_the_mock(mock, tmp_path):
    cancel_at_the_rendezvous(mock, tmp_path, "--dry-run")


@pytest.mark.slurm
def test_a_run_cancelled_at_the_rendezvous_starts_no_rank_on_slurm(cluster_cli, tmp_path):
    cancel_at_the_rendezvous(cluster_cli, tmp_path)


# The checkpoint signal at the rendezvous, end to end on the mock. The first attempt's
# launchers stop themselves (`launch_io.pause_for_tests`) with their handlers and leases in
# place, before node rank 0 publishes its endpoint; the job's setup line sets the pause
# for attempt 0 only, so the continuation runs freely.
RECIPE = Path(__file__).resolve().parent.parent / "examples" / "recipe.py"
PAUSE_THE_FIRST_ATTEMPT = (
    f'if [ "${EnvName.ATTEMPT.value}" = 0 ]; then export {PAUSE_ENV}=rendezvous; fi'
)


def signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits in `pid`'s pending set (process-wide or its main thread's)."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
    except OSError:
        return False
    bit = 1 << (sig - 1)
    return any(int(fields[k].strip(), 16) & bit for k in ("ShdPnd", "SigPnd"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # two attempts of a 2-node run, each importing torch
def test_a_checkpoint_signal_at_the_rendezvous_is_delivered_once_the_ranks_start_on_the_mock(
    mock, tmp_path
):
    """The scheduler sends the checkpoint signal (SIGUSR2, as `scancel -s USR2` would) to
    the job's tasks while both launchers of a 2-node run are at the rendezvous, no rank
    existing: the signal waits, pending, in both. Continued, they remember it, start the
    ranks and hand it to them: the ranks agree on a step, checkpoint and ask to continue,
    and the next attempt resumes from that step to the end: a continuation, not a lost
    signal (the old launcher dropped it and the ranks trained on) nor a failure."""
    steps = 60
    recipe = tmp_path / "rdv_recipe.py"
    recipe.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(RECIPE)!r}, '--steps', "
        f"'{steps}', '--step-time', '0.1', '--ckpt-every', '1000', '--no-memory-tier'], "
        f"nodes=2, ntasks_per_node=1, setup=({PAUSE_THE_FIRST_ATTEMPT!r},))\n"
    )
    ckpt = tmp_path / "ckpt"
    out = mock.submit(
        "--dry-run", "--retries", "0", "-t", "10", "--checkpoint-dir", str(ckpt), str(recipe)
    )
    run_id = out["run_id"]
    run_dir = mock.status(run_id)["run_dir"]
    run = RunDir(run_dir)
    deadline = time.monotonic() + 180
    held: dict[int, int] = {}
    try:
        while len(held) < 2:  # both launchers stopped themselves at the rendezvous
            assert time.monotonic() < deadline, f"launchers paused: {held}"
            held = {n: p for n, p in launcher_pids(run_dir).items() if proc_state(p) == "T"}
            time.sleep(0.05)
        assert not run.rendezvous(0, 0).exists(), "node 0's launcher published already"
        assert not list(run.attempt(0).glob("rank-*.json")), "a rank started"
        job = mock.status(run_id)["attempts"][0]["job_id"]
        mock("scheduler", "signal", job, "USR2", "--backend", "mock")
        while not all(signal_pending(pid, signal.SIGUSR2) for pid in held.values()):
            assert time.monotonic() < deadline, "the signal did not reach the launchers"
            time.sleep(0.05)
        assert all(proc_state(pid) == "T" for pid in held.values())  # still at the rendezvous
    finally:
        for pid in held.values():  # never left stopped, whatever failed
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    s = mock.wait_for(run_id, ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    first = s["attempts"][0]
    assert first["cause"] == "checkpointed", s
    assert s["continuations"] == 1 and s["job_retries_used"] == 0, s
    for node_rank in (0, 1):
        report = json.loads(run.node_report(0, node_rank).read_text())
        assert report["outcome"] == "checkpointed", report
    log = "".join(p.read_text() for p in sorted(run.logs.glob("job-*.out")))  # both attempts
    saved = re.findall(r"checkpointed at step (\d+) on request", log)
    resumed = re.findall(r"starts at step (\d+) \(attempt 1,", log)
    assert len(saved) == 1 and resumed == saved, log  # (rank 0 says it) from that step
    assert json.loads((ckpt / "final.json").read_text())["step"] == steps
