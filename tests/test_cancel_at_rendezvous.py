"""No signal is lost in any phase of the per-node launcher, end to end (CLI, daemon,
scheduler, launchers; the issue: ranks started, and trained, after `cancel` had replied; a
signal that came during the rendezvous was dropped).

- A stop (`cancel`: the scheduler continues every task and sends it SIGTERM, as Slurm
  does) that comes before the ranks exist means they never start: the launchers end on
  their own (none killed at KillWait), stopped. One that comes while the ranks are being
  started, or while they run, reaches every rank that started, which ends on it.
- The checkpoint signal (SIGUSR2, as `scancel -s USR2` sends it) is remembered until the
  ranks exist and delivered to them then: they agree on a step, checkpoint and ask to
  continue, and the next attempt resumes from that step to the end.

Forced timing: the first attempt's launchers are held at a phase and the signal comes there:
- "start", "imports", "rendezvous", "ranks", "spawn": they stop themselves there
  (`launch_io.pause_for_tests`, set for attempt 0 only by the job's setup line): in
  `ftslurm.agent.launch.main` before their own handlers (signals only recorded); then
  inside the import of torch's agent (`ftslurm.agent.elastic`; still only recording: the
  test once stopped them there itself as soon as they caught SIGTERM, and on a loaded
  machine lost the race to the rendezvous); with handlers and leases in place, before
  node rank 0 publishes its endpoint; and in `ftslurm.agent.elastic.Agent._start_workers`:
  the rendezvous done, before the last look for a stop; after it, while the ranks are
  being started;
- "join": node rank 1's launcher stopped by the test (SIGSTOP) as soon as its first
  handlers are in place (`ftslurm.agent.boot`), node rank 0's publishes
  its endpoint and waits for it in torch's rendezvous join;
- "running": not held; the signal comes once rank 0 trains.
A 2-node run, but for "ranks" and "spawn": a launcher held after the rendezvous holds the
other's too (node rank 0's hosts its store), so one node there. Every phase on the mock
scheduler for a stop, two of them for the checkpoint signal (see MOCK_CASES); "start",
"join" and "running" on the real cluster (`slurm`, see SLURM_PHASES).
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

from .conftest import proc_state
from .daemon_scenarios import RECIPE, Cli, daemon_cli, ended, job_log

# Each rank leaves a mark as its first act (it started), then trains (examples/recipe.py).
TRAIN = f"""
import os, runpy, sys
marks = sys.argv.pop(1)
open(os.path.join(marks, f"rank-{{os.environ['RANK']}}-{{os.getpid()}}"), "w").close()
sys.argv[0] = {str(RECIPE)!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""

PHASES = ["imports", "start", "rendezvous", "join", "ranks", "spawn", "running"]
NO_RANK_YET = (
    "imports",
    "start",
    "rendezvous",
    "join",
    "ranks",
)  # a stop there: no rank ever starts
KILL_WAIT_S = 60  # the mock's: a launcher killed at KillWait writes no node report


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


def gone(pid: int) -> bool:
    return proc_state(pid) in ("?", "Z")


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


def hold(run_dir: str, phase: str, nodes: list[int], deadline: float) -> dict[int, int]:
    """The launchers of attempt 0 with these node ranks, stopped at `phase`: by the test as
    soon as they catch SIGTERM ("join"), or by themselves (in "imports", inside the import
    of torch's agent: a test of the test's own speed lost the race on a loaded machine)."""
    held: dict[int, int] = {}
    while len(held) < len(nodes):
        assert time.monotonic() < deadline, f"launchers held at {phase}: {held}"
        for node_rank, pid in launcher_pids(run_dir).items():
            if node_rank in held or node_rank not in nodes:
                continue
            if phase != "join":
                if proc_state(pid) == "T":
                    held[node_rank] = pid
            elif signal.SIGTERM in (caught_signals(pid) or ()):
                os.kill(pid, signal.SIGSTOP)
                held[node_rank] = pid
        time.sleep(0.02)
    for pid in held.values():  # stopped: a stop takes effect asynchronously
        while proc_state(pid) not in ("T", "?"):
            assert time.monotonic() < deadline, "a launcher did not stop"
            time.sleep(0.01)
    return held


def signal_at(cli: Cli, tmp_path: Path, phase: str, sig: int, backend: str, *args: str) -> None:
    """The signal (`sig`: SIGTERM by `cancel`, or SIGUSR2 through the scheduler) comes while
    the launchers of the run's first attempt are at `phase`; the run ends as it must."""
    marks = tmp_path / "marks"
    marks.mkdir()
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    steps = 100000 if sig == signal.SIGTERM else 200 if phase == "running" else 20
    nodes = 1 if phase in ("ranks", "spawn") else 2
    pause = phase if phase in ("imports", "start", "rendezvous", "ranks", "spawn") else ""
    setup = f'if [ "${EnvName.ATTEMPT.value}" = 0 ]; then export {PAUSE_ENV}={pause}; fi'
    ckpt = tmp_path / "ckpt"
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(train)!r}, {str(marks)!r}, "
        f"'--steps', '{steps}', '--step-time', '0.05', '--ckpt-every', '100000', "
        f"'--no-memory-tier'], nodes={nodes}, ntasks_per_node=1, setup=({setup!r},))\n"
    )
    out = cli.submit(
        *args, "--retries", "0", "-t", "10", "--checkpoint-dir", str(ckpt), str(recipe)
    )
    run_id = out["run_id"]
    run_dir = cli.status(run_id)["run_dir"]
    run = RunDir(run_dir)
    deadline = time.monotonic() + 180
    held: dict[int, int] = {}
    try:
        if phase == "running":  # rank 0 trains (after the process group formed)
            while "starts at step 0" not in job_log(run):
                assert time.monotonic() < deadline, "the training did not start"
                time.sleep(0.05)
            launchers = launcher_pids(run_dir)
        else:
            held = hold(run_dir, phase, [1] if phase == "join" else list(range(nodes)), deadline)
            if phase == "join":  # node rank 0's launcher published its endpoint and waits
                while not run.rendezvous(0, 0).exists():
                    assert time.monotonic() < deadline, "node 0's launcher did not publish"
                    time.sleep(0.05)
            elif phase in ("imports", "start", "rendezvous"):
                assert not run.rendezvous(0, 0).exists(), "node 0's launcher published already"
            assert not list(marks.iterdir()), "a rank started"
            launchers = launcher_pids(run_dir)
        assert len(launchers) == nodes, launchers
        job = cli.status(run_id)["attempts"][0]["job_id"]
        if sig == signal.SIGTERM:
            done = cli("cancel", run_id)  # the scheduler continues the tasks, with SIGTERM
            cancelled = time.monotonic()
            assert "cancel requested" in done.stdout, done.stdout
        else:
            cli("scheduler", "signal", job, signal.Signals(sig).name[3:], "--backend", backend)
            while held and not all(signal_pending(pid, sig) for pid in held.values()):
                assert time.monotonic() < deadline, "the signal did not reach the launchers"
                time.sleep(0.05)
            assert all(proc_state(pid) == "T" for pid in held.values())  # still held there
    finally:
        for pid in held.values():  # never left stopped, whatever failed
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    if sig == signal.SIGTERM:
        s = cli.wait_for(run_id, ended, 120, "the run to end")
        assert s["state"] == "CANCELLED", s
        deadline = time.monotonic() + 120
        while not all(gone(pid) for pid in launchers.values()):
            assert time.monotonic() < deadline, "the launchers did not end"
            time.sleep(0.1)
        # each launcher ended on its own (one killed at KillWait writes no node report)
        took = time.monotonic() - cancelled
        missing = [n for n in range(nodes) if not run.node_report(0, n).exists()]
        assert not missing, (
            f"no node report of {missing}, {took:.0f} s after the cancel:\n{job_log(run)}"
        )
        reports = [json.loads(run.node_report(0, n).read_text()) for n in range(nodes)]
        if phase in NO_RANK_YET:
            assert not list(marks.iterdir()), "ranks started after the cancel"
            for report in reports:
                assert (report["outcome"], report["signal"]) == ("stopped", "SIGTERM"), report
            return
        for rank in range(nodes):  # the stop reached every rank that started: it ended on it
            path = run.rank_report(0, rank)  # (a rank killed at the grace deadline has none)
            if not path.exists():  # its wrapper ended before its handlers: no rank started
                assert not list(marks.glob(f"rank-{rank}-*")), f"rank {rank} started"
                continue
            report = json.loads(path.read_text())
            assert report["checkpoint_signal_at"] is not None, report
        return
    s = cli.wait_for(run_id, ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert s["attempts"][0]["cause"] == "checkpointed", s
    assert s["continuations"] == 1 and s["job_retries_used"] == 0, s
    for node_rank in range(nodes):
        report = json.loads(run.node_report(0, node_rank).read_text())
        assert report["outcome"] == "checkpointed", report
    log = job_log(run)  # both attempts
    saved = re.findall(r"checkpointed at step (\d+) on request", log)
    resumed = re.findall(r"starts at step (\d+) \(attempt 1,", log)
    assert len(saved) == 1 and resumed == saved, log  # (rank 0 says it) from that step
    assert json.loads((ckpt / "final.json").read_text())["step"] == steps


@pytest.fixture
def mock(tmp_path) -> Iterator[Cli]:
    """A state directory and a mock cluster of their own; KillWait 60 s: a launcher that
    ended before it ended on its own."""
    config = tmp_path / "mock.json"
    config.write_text(json.dumps({"kill_wait_s": KILL_WAIT_S}))
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


SIGNALS = {"cancel": signal.SIGTERM, "checkpoint": signal.SIGUSR2}
# On the mock, the checkpoint signal (two attempts, 30-50 s each) only in torch's join and
# while the ranks are being started: at the phases before (tests/test_launch.py, on one
# launcher: `test_a_checkpoint_signal_before_the_ranks_start_reaches_them_once_they_do`
# and the rendezvous and import pauses) and while they train (every checkpoint of the
# daemon's scenarios), the launcher does the same whichever scheduler sent it.
MOCK_CASES = [(p, "cancel") for p in PHASES] + [("join", "checkpoint"), ("spawn", "checkpoint")]


@pytest.mark.timeout(600)  # a checkpoint: two attempts, each importing torch
@pytest.mark.parametrize("phase, what", MOCK_CASES)
def test_a_signal_at_each_launcher_phase_is_never_lost_on_the_mock(mock, tmp_path, phase, what):
    signal_at(mock, tmp_path, phase, SIGNALS[what], "mock", "--dry-run")


# On the real cluster, three phases: before the launcher's own handlers ("start": Slurm's
# signal reaches a process that only records it), in torch's join with a peer node stopped
# ("join"), and while the ranks train ("running"). The phases between them differ only in
# the launcher's own code, the same under both schedulers and tested on the mock; each
# costs the real cluster's lane about a minute.
SLURM_PHASES = ["start", "join", "running"]


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", SIGNALS)
@pytest.mark.parametrize("phase", SLURM_PHASES)
def test_a_signal_at_each_launcher_phase_is_never_lost_on_slurm(cluster_cli, tmp_path, phase, what):
    signal_at(cluster_cli, tmp_path, phase, SIGNALS[what], "slurm")
