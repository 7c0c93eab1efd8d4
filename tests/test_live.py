"""Live recovery (`ftslurm.agent.live`) with real rank processes of the example recipe on
gloo: the test hosts the coordinator store and plays the launcher (it restarts a crashed
rank alone, with FTSLURM_LIVE_REJOIN=1). The survivors keep their processes, the step the
fault interrupted runs again, and the run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ftslurm.agent import live, live_rules
from ftslurm.agent.live_rules import Fallback
from ftslurm.agent.task import free_port
from ftslurm.core.contract import EnvName, ExitCode, RunDir
from ftslurm.core.contract.reports import Kind, Progress
from ftslurm.report.notes import live_notes
from ftslurm.runfiles import read_report, read_reports

from .conftest import wait_for

pytestmark = pytest.mark.slow  # real rank processes: about a minute in all

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "recipe.py"
WORLD = 3
STEPS = 40


def recipe_args(ckpt: Path) -> list[str]:
    """The recipe's arguments in these tests (with live recovery)."""
    return [
        "--live",
        *("--steps", str(STEPS), "--ckpt-every", "10", "--step-time", "0.02"),
        *("--checkpoint-dir", str(ckpt)),
    ]


class Ranks:
    """`WORLD` ranks of the recipe around a coordinator store this process hosts."""

    def __init__(self, tmp: Path, *extra: str, pause: str | None = None) -> None:
        self.pause = pause  # the live group's test hook (PAUSE_ENV), first processes only
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=30),
        )
        self.tmp = tmp
        self.ckpt = tmp / "ckpt"
        self.args = [*recipe_args(self.ckpt), *extra]
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarted: list[int] = []

    def env(self, rank: int, rejoin: bool) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "FTSLURM_RUN_DIR"):
            env.pop(name, None)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="1",  # never used: the group forms over the coordinator store
            FTSLURM_MEMORY_DIR=str(self.tmp / "memory"),
            PYTHONUNBUFFERED="1",
        )
        env[EnvName.LIVE_STORE.value] = f"127.0.0.1:{self.store.port}"
        if rejoin:
            env[EnvName.LIVE_REJOIN.value] = "1"
        elif self.pause:
            env[live.PAUSE_ENV] = self.pause
        return env

    def start(self, rank: int, rejoin: bool = False) -> None:
        log = open(self.tmp / f"rank-{rank}-{len(self.restarted)}.log", "w")  # noqa: SIM115
        self.procs[rank] = subprocess.Popen(
            [sys.executable, str(RECIPE), *self.args],
            env=self.env(rank, rejoin),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def run(
        self,
        restart_alone: bool = True,
        timeout: float = 180,
        on_tick: Callable[[Ranks], None] | None = None,
    ) -> dict[int, int]:
        """Every rank to its end; a rank that fails is restarted alone (as the launcher
        does). `on_tick(self)` between looks. The ranks' exit codes."""
        for r in range(WORLD):
            self.start(r)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if on_tick is not None:
                    on_tick(self)
                codes = {r: p.poll() for r, p in self.procs.items()}
                for r, code in codes.items():
                    if code not in (None, 0) and restart_alone:
                        self.restarted.append(r)
                        self.start(r, rejoin=True)
                        codes[r] = None
                if all(c == 0 for c in codes.values()):
                    return codes
                if any(c not in (None, 0) for c in codes.values()):
                    return codes
                time.sleep(0.02)
            pytest.fail(f"the ranks did not end within {timeout:.0f}s:\n{self.logs()}")
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return {}

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("rank-*.log"))
        )

    def final(self) -> dict:
        return json.loads((self.ckpt / "final.json").read_text())


def state(pid: int) -> str | None:
    """A process's state letter (`T`: stopped, `Z`: a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stopped(pid: int) -> bool:
    """Whether the process stopped itself (SIGSTOP: state T)."""
    return state(pid) == "T"


def kill_when_paused(rank: int) -> Callable[[Ranks], None]:
    """An `on_tick` that SIGKILLs `rank`'s first process once it stopped at its pause."""

    def tick(ranks: Ranks) -> None:
        proc = ranks.procs[rank]
        if rank not in ranks.restarted and proc.poll() is None and stopped(proc.pid):
            proc.send_signal(signal.SIGKILL)

    return tick


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    ranks = Ranks(tmp_path_factory.mktemp("reference"))
    codes = ranks.run(restart_alone=False)
    assert codes == dict.fromkeys(range(WORLD), 0), ranks.logs()
    return ranks.final()


@pytest.mark.parametrize("victim", [0, 2])
def test_a_crashed_rank_restarted_alone_rejoins_the_survivors_bit_identically(
    tmp_path, reference, victim
):
    ranks = Ranks(tmp_path, "--fail-at-step", "25", "--fail-rank", str(victim))
    codes = ranks.run()
    assert codes == dict.fromkeys(range(WORLD), 0), ranks.logs()
    logs = ranks.logs()
    # The victim was restarted alone; a rank stuck in a collective with a peer that left it
    # may leave to be restarted too (gloo), but one rank kept its process all along and
    # recovered live: it handed the state over.
    assert ranks.restarted[0] == victim and len(set(ranks.restarted)) < WORLD, logs
    kept = set(range(WORLD)) - set(ranks.restarted)
    for r in kept:
        assert "live recovery: round 1 after" in (tmp_path / f"rank-{r}-0.log").read_text(), logs
    rejoined = next(tmp_path.glob(f"rank-{victim}-[1-9]*.log")).read_text()
    assert f"rank {victim} of {WORLD} starts at step 25" in rejoined, logs
    assert "from a live peer" in rejoined, logs
    assert ranks.final() == reference, logs


def test_without_a_coordinator_the_recipe_trains_as_a_plain_group(tmp_path, reference):
    """--live with no store to coordinate: a plain process group, the same result."""
    ranks = Ranks(tmp_path)
    port = free_port()
    coordinated = ranks.env

    def plain(rank: int, rejoin: bool) -> dict[str, str]:
        env = coordinated(rank, rejoin)
        del env[EnvName.LIVE_STORE.value]
        env["MASTER_PORT"] = str(port)
        return env

    ranks.env = plain  # type: ignore[method-assign]
    codes = ranks.run(restart_alone=False)
    assert codes == dict.fromkeys(range(WORLD), 0), ranks.logs()
    assert ranks.final() == reference


# A running limit (1 s) shorter than the restarted rank's start (a Python process importing
# torch): the others wait for it in the live group's recovery section, whose own limit
# applies; they are not judged hung.
@pytest.mark.parametrize("timeouts", [None, '{"out_of_section": 1}'], ids=["defaults", "tight"])
def test_under_the_launcher_a_crashed_rank_is_restarted_alone(tmp_path, reference, timeouts):
    """The launcher (one node, 3 ranks) restarts the rank that failed and only it: the
    others keep their processes, torch's agent store coordinates, one in-job restart is
    used, and the run ends bit-identical to an uninterrupted one."""
    out = crash_under_the_launcher(tmp_path, timeouts=timeouts)
    assert "restarted alone" in out, out[-6000:]
    assert out.count("rank 0 of 3 starts at step 0") == 1, out[-6000:]  # no world restart
    assert "rank 1 of 3 starts at step 25" in out and "from a live peer" in out, out[-6000:]
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final == reference, out[-6000:]
    report = json.loads((tmp_path / "run" / "attempts" / "0" / "node-0.json").read_text())
    assert report["in_job_restarts"] == 1 and report["outcome"] == "finished", report
    # the recovery's record: who sent the state to whom, the step run again, the times
    (record,) = read_reports(RunDir(tmp_path / "run"), Kind.LIVE, 0)
    assert record.receivers == [1] and record.state_from in (0, 2), record
    assert record.step == 25 and record.round == 1 and record.failed_round == 0, record
    assert record.detected_by in ("error", "restart") and record.why, record
    assert record.failed_at <= record.formed_at <= record.first_commit_at, record
    # the daemon is told: disk checkpoints spaced for what live recovery cannot serve
    progress = read_report(RunDir(tmp_path / "run").progress, Progress)
    assert progress is not None and progress.live_recovery, out[-6000:]


# ------------------------------------------------------------ a node's warm standby
def recipe_processes(launcher: int) -> list[tuple[int, dict[str, str]]]:
    """The recipe's processes below `launcher` (not their wrappers), each with the
    environment it started with."""
    from .conftest import descendants

    found = []
    for pid in descendants(launcher)[1:]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1].endswith(b"recipe.py"):
            pairs = (item.decode(errors="replace").partition("=") for item in raw if item)
            found.append((pid, {k: v for k, v in ((k, v) for k, _, v in pairs)}))
    return found


def standby_waits(tmp_path: Path, slot: int) -> bool:
    """The launcher's standby in `slot` waits for a rank (`HeartbeatDir.waiting`)."""
    return any((tmp_path / "tmp").glob(f"ftslurm-hb-*/waiting-{slot}"))


def stopped_recipe(launcher: int, slot: str | None) -> int | None:
    """A recipe process stopped at its pause: a rank the launcher started (`slot` None) or
    the standby started in `slot` (its LOCAL_RANK when it started)."""
    for pid, env in recipe_processes(launcher):
        standby = env.get(EnvName.LIVE_SPARE.value) == "1"
        mine = env.get("LOCAL_RANK") == slot if slot is not None else not standby
        if mine and stopped(pid):
            return pid
    return None


STANDBY_ENV = {EnvName.LIVE_RECOVERY.value: "1", live.PAUSE_ENV: "committed:1:20"}
TAKEN = "its place taken by the warm standby"


def standby_run(tmp_path: Path, steps: list[Callable[[int], bool]], pause: str = "") -> str:
    """`crash_under_the_launcher` with live recovery on (a warm standby beside the 3
    ranks) and rank 1 stopping itself after committing step 20; `steps` are carried out in
    order, each called every 0.1 s with the launcher's pid until it says it acted."""
    (tmp_path / "tmp").mkdir()
    env = {**STANDBY_ENV, "TMPDIR": str(tmp_path / "tmp")}
    if pause:
        env[live.PAUSE_ENV] += f",{pause}"
    todo = list(steps)

    def tick(launcher: int) -> None:
        if todo and todo[0](launcher):
            todo.pop(0)

    out = crash_under_the_launcher(tmp_path, fail_at=None, extra_env=env, on_tick=tick)
    assert not todo, f"{len(todo)} of the test's steps never came\n{out[-6000:]}"
    return out


def kill(pid: int | None) -> bool:
    if pid is None:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def ends_well(tmp_path: Path, out: str, reference: dict, restarts: int) -> list[Any]:
    """Bit-identical, rank 0 started once, `restarts` in-job restarts: the live records."""
    assert out.count("rank 0 of 3 starts at step 0") == 1, out[-6000:]  # no world restart
    assert json.loads((tmp_path / "ckpt" / "final.json").read_text()) == reference, out[-6000:]
    report = json.loads((tmp_path / "run" / "attempts" / "0" / "node-0.json").read_text())
    assert report["in_job_restarts"] == restarts and report["outcome"] == "finished", report
    return sorted(read_reports(RunDir(tmp_path / "run"), Kind.LIVE, 0), key=lambda r: r.round)


def test_a_standby_lost_while_it_waits_is_replaced_and_the_new_one_takes_the_place(
    tmp_path, reference
):
    """Forced timing: the first standby (slot 3) is killed while it waits; the launcher
    starts another (slot 4), restarting no rank; once it waits, rank 1 is killed and the
    new standby takes its place."""
    out = standby_run(
        tmp_path,
        [
            lambda launcher: (
                standby_waits(tmp_path, 3)
                and kill(
                    next(
                        (p for p, e in recipe_processes(launcher) if e.get("LOCAL_RANK") == "3"),
                        None,
                    )
                )
            ),
            lambda launcher: standby_waits(tmp_path, 4) and kill(stopped_recipe(launcher, None)),
        ],
    )
    assert "the warm standby exited" in out and out.count(TAKEN) == 1, out[-6000:]
    (record,) = ends_well(tmp_path, out, reference, restarts=1)
    assert record.standby == 1, record


def test_a_warm_standby_takes_a_crashed_ranks_place_then_a_second_crash_is_restarted_cold(
    tmp_path, reference
):
    """Forced timing: once the standby waits (its mark up), rank 1, stopped after step 20,
    is killed. The standby becomes rank 1 (its local rank too) and receives the state from
    a live peer, nobody else restarting; the recovery's record and `status` say a warm
    standby took the place. Then, as rank 1, it stops itself after step 30 and is killed
    while the next standby (slot 4) is still starting (stopped before it waits): that
    crash takes the cold path, a new process restarted alone. Both crashes use an in-job
    restart; the stopped standby is ended with the run, which ends bit-identical."""
    out = standby_run(
        tmp_path,
        [
            lambda launcher: standby_waits(tmp_path, 3) and kill(stopped_recipe(launcher, None)),
            lambda launcher: (
                stopped_recipe(launcher, "4") is not None and kill(stopped_recipe(launcher, "3"))
            ),
        ],
        pause="committed:1:30,standby:4",
    )
    assert out.count(TAKEN) == 1 and out.count("restarted alone") == 1, out[-6000:]
    assert re.search(r"rank 1 of 3 starts at step 2\d .*from a live peer", out), out[-6000:]
    first, second = ends_well(tmp_path, out, reference, restarts=2)
    assert first.standby == 1 and first.receivers == [1], first
    assert (
        "a warm standby took the crashed process's place" in live_notes([first], now=time.time())[0]
    )
    assert second.standby is None and second.receivers == [1], second


def test_a_sharded_state_falls_back_to_restoring_every_rank(tmp_path, reference):
    """The same crash with a state the script declares sharded (`attach(replicated=False)`,
    the recipe's --sharded): the restarted rank's part is held by no peer, so every rank
    gives up the live recovery (`SHARDED`, recorded) and the launcher restarts every rank
    from the last checkpoint (the memory tier); the run ends bit-identical all the same."""
    out = crash_under_the_launcher(tmp_path, "--sharded", "--fail-once")
    assert "a rank lacks its shard of a sharded state" in out, out[-6000:]
    starts = re.findall(r"rank 0 of 3 starts at step (\d+) .* from (.+)", out)
    assert starts[0] == ("0", "nothing") and starts[1][1] != "a live peer", out[-6000:]
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final == reference, out[-6000:]
    given_up = sorted(RunDir(tmp_path / "run").attempt(0).glob("recovery/live-*-given-up-*"))
    assert given_up, out[-6000:]
    # live recovery serves no fault of a sharded state: the daemon's cadence stays today's
    progress = read_report(RunDir(tmp_path / "run").progress, Progress)
    assert progress is not None and not progress.live_recovery, out[-6000:]


HSDP_SCRIPT = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from ftslurm.agent import live, live_rules

group = live.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
part, steps, fail_at = rank % 2, 40, int(sys.argv[2])
held = {"w": torch.zeros(4), "step": 0}  # this rank's part: it grows by part + 1 a step


def load(state):
    held.update(w=state["w"].clone(), step=state["step"])


group.attach(
    state=lambda: {"w": held["w"].clone(), "step": held["step"]},
    load=load,
    step=lambda: held["step"],
    shards=2,  # 2 replicas of 2 parts: rank r holds part r % 2
)
first = os.environ.get("FTSLURM_LIVE_REJOIN") != "1"
while held["step"] < steps:
    grad = torch.ones(1)
    if group.commit(lambda: dist.all_reduce(grad)):
        held["w"] += part + 1
        held["step"] += 1
    if rank == 1 and first and held["step"] == fail_at:
        os._exit(3)
    time.sleep(0.02)
out = {"part": part, "w": held["w"].tolist(), "step": held["step"]}
open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w").write(json.dumps(out))
os._exit(0)
"""


def test_a_part_of_a_state_sharded_over_replicas_comes_from_the_rank_holding_it(tmp_path):
    """HSDP: 4 ranks under the launcher, a state in 2 parts replicated across 2 groups of
    2 ranks (`attach(shards=2)`: rank r holds part r % 2, each part its own values). Rank 1
    crashes at step 25 and is restarted alone; its part comes from rank 3, the other
    replica's rank holding the same part (not rank 0, whose part differs), and every rank
    ends with its own part's values of an uninterrupted run."""
    script = tmp_path / "hsdp.py"
    script.write_text(HSDP_SCRIPT)
    for name in ("run", "out"):
        (tmp_path / name).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
    env.update(FTSLURM_RUN_DIR=str(tmp_path / "run"), MASTER_ADDR="127.0.0.1")
    launcher = [sys.executable, "-m", "ftslurm.agent.launch", "--nproc-per-node", "4"]
    proc = run_all_killed(
        [*launcher, "--max-restarts", "1", "--", sys.executable, str(script)]
        + [str(tmp_path / "out"), "25"],
        env=env,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and not proc.left, out[-6000:]
    assert "restarted alone" in out, out[-6000:]
    for rank in range(4):
        got = json.loads((tmp_path / "out" / f"rank-{rank}.json").read_text())
        assert got == {"part": rank % 2, "w": [40.0 * (rank % 2 + 1)] * 4, "step": 40}, got
    (record,) = read_reports(RunDir(tmp_path / "run"), Kind.LIVE, 0)
    assert record.state_from == 3 and record.receivers == [1], record


def test_a_replica_that_does_not_answer_in_time_falls_back_to_restarting_every_rank(
    tmp_path, reference
):
    """Forced timing: rank 1 fails at step 25 and is restarted alone; rank 0, which sends it
    the state, stops itself (SIGSTOP) after the state's size went out and before its bytes
    (the live group's "transfer" point): a replica that does not answer, not a lost one
    (its sockets stay open). After the handover timeout (3 s here) the receiver and rank 2
    give live recovery up (`NO_ANSWER`, recorded with the reason), and the launcher takes
    today's path: every rank restarted from the last checkpoint (the memory tier), the
    stopped process with them. The run ends bit-identical to an uninterrupted one."""
    out = crash_under_the_launcher(
        tmp_path,
        *("--fail-once", "--handover-timeout", "3"),
        extra_env={live.PAUSE_ENV: "transfer:0:25"},
    )
    assert "a replica did not answer in time" in out, out[-6000:]
    starts = re.findall(r"rank 0 of 3 starts at step (\d+) .* from (.+)", out)
    assert len(starts) == 2 and starts[1][1] != "a live peer", out[-6000:]  # every rank again
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final == reference, out[-6000:]
    given_up = [r for r in read_reports(RunDir(tmp_path / "run"), Kind.LIVE, 0) if r.given_up]
    assert {r.given_up for r in given_up} == {Fallback.NO_ANSWER.value}, given_up
    assert {r.rank for r in given_up} == {1, 2}, given_up  # the receiver and the survivor
    assert all("rank 0 sending the state" in (r.why or "") for r in given_up), given_up
    (note,) = live_notes(given_up, now=time.time())  # as `status` and `report` say it
    assert "a replica did not answer in time" in note and "every rank restarted" in note


def crash_under_the_launcher(
    tmp_path: Path,
    *recipe_extra: str,
    timeouts: str | None = None,
    extra_env: dict[str, str] | None = None,
    fail_at: int | None = 25,
    on_tick: Callable[[int], None] | None = None,
    code: int = 0,
) -> str:
    """The launcher (one node, 3 ranks, 2 in-job restarts) runs the recipe with --live;
    rank 1 fails at step `fail_at` (None: the test makes it fail, `on_tick(launcher pid)`
    runs every 0.1 s). Its output; the run must end with `code` (0: well), leaving no
    process of its own behind. Every process it started is killed at the end (a stopped
    one too)."""
    for name in ("run", "ckpt"):
        (tmp_path / name).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
    env.update(
        FTSLURM_RUN_DIR=str(tmp_path / "run"),
        FTSLURM_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        FTSLURM_MEMORY_DIR=str(tmp_path / "memory"),
        MASTER_ADDR="127.0.0.1",
        PYTHONUNBUFFERED="1",
        **(extra_env or {}),
    )
    proc = run_all_killed(
        [
            sys.executable,
            "-m",
            "ftslurm.agent.launch",
            "--nproc-per-node",
            str(WORLD),
            "--max-restarts",
            "2",
            "--monitor-interval",
            "0.2",
            *(("--section-timeouts", timeouts) if timeouts else ()),
            "--",
            sys.executable,
            str(RECIPE),
            *recipe_args(tmp_path / "ckpt"),
            *(("--fail-at-step", str(fail_at), "--fail-rank", "1") if fail_at else ()),
            *recipe_extra,
        ],
        env=env,
        timeout=240,
        on_tick=on_tick,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-6000:]
    assert not proc.left, (proc.left, out[-6000:])
    return out


def run_all_killed(
    cmd: list[str],
    env: dict[str, str],
    timeout: float,
    on_tick: Callable[[int], None] | None = None,
) -> Any:
    """`subprocess.run(cmd)` with its output (`on_tick(pid)` called every 0.1 s while it
    runs); every process below it (seen while it ran, told by its pid and start time)
    killed at the end, whatever happened: those still there when it ended are its `left`."""
    from .conftest import descendants

    def started(pid: int) -> str | None:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return None

    seen: dict[int, str | None] = {}
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                for pid in descendants(proc.pid)[1:]:
                    seen.setdefault(pid, started(pid))
                if on_tick is not None:
                    on_tick(proc.pid)
                time.sleep(0.1 if on_tick else 0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            left = []
            for pid, at in seen.items():
                if at is not None and started(pid) == at:  # the same process still
                    if state(pid) not in ("Z", None):  # a zombie is gone, not yet reaped
                        left.append(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        output.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, output.read(), "")
        done.left = left  # type: ignore[attr-defined]
        return done


@pytest.mark.parametrize(
    "point, victim",
    [
        pytest.param("reduced", 1, id="between-the-reduction-and-the-vote"),
        pytest.param("committed", 1, id="between-the-commit-and-the-optimizer-step"),
    ],
)
def test_a_rank_killed_at_the_worst_moment_of_a_step_leaves_every_rank_identical(
    tmp_path, reference, point, victim
):
    """Forced timing: the victim stops itself at `point` of step 25 and is killed there.
    Before its vote: nobody commits step 25, every rank runs it again. After the commit:
    the others applied it, the restarted rank receives the state with it. Either way the
    run ends as an uninterrupted one."""
    ranks = Ranks(tmp_path, pause=f"{point}:{victim}:25")
    codes = ranks.run(on_tick=kill_when_paused(victim))
    logs = ranks.logs()
    assert codes == dict.fromkeys(range(WORLD), 0), logs
    assert victim in ranks.restarted, logs
    assert ranks.final() == reference, logs


def live_launchers(tmp_path: Path, steps: int, **kw: Any) -> Any:
    """Launchers of 2 active nodes and a warm spare (`test_spares.Launchers`), one rank each
    of the recipe with --live, live recovery on, the rendezvous endpoint published as in a
    job."""
    from .test_spares import Launchers

    env = {EnvName.LIVE_RECOVERY.value: "1", "PYTHONUNBUFFERED": "1", **kw.pop("extra_env", {})}
    return Launchers(
        tmp_path,
        nnodes=3,
        spare_nodes=1,
        steps=steps,
        extra_env=env,
        recipe_args=("--live",),
        endpoint=False,
        **kw,
    )


def node_1_lost(
    tmp_path: Path, lose: Callable[[Any], list[int]], **launchers: Any
) -> tuple[Any, Any, float]:
    """2 active nodes + 1 warm spare with live recovery, one rank each, 120 steps: once step
    20 is saved, `lose(nodes)` takes node 1 away (the pids it returns are killed at the
    end). The run must end bit-identical to an uninterrupted one of 2 ranks, with node 0's
    rank never restarted and node 1's rank taken over by the spare. The launchers, the live
    recovery's record and when node 1 was lost. `launchers`: more for `live_launchers`."""
    from .daemon_scenarios import reference_digest

    steps = 120
    expected = reference_digest(tmp_path, steps)
    nodes = live_launchers(tmp_path, steps, **launchers)
    left: list[int] = []
    try:
        nodes.wait_checkpoint(20)
        assert "wait warm" in nodes.log(2), nodes.logs()
        lost_at = time.time()
        left = lose(nodes)
        codes = [nodes.procs[r].wait(timeout=180) for r in (0, 2)]
        assert codes == [0, 0], nodes.logs()
    finally:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        nodes.close()
    logs = nodes.logs()
    final = json.loads((nodes.ckpt / "final.json").read_text())
    assert final == {"step": steps, "digest": expected}, logs  # bit for bit
    assert nodes.log(0).count("rank 0 of 2 starts at step 0") == 1, logs  # never restarted
    assert "took over from node rank 1" in nodes.log(2), logs
    (record,) = read_reports(nodes.run, Kind.LIVE, 0)
    assert record.took_over == 1 and record.receivers == [1] and record.state_from == 0, record
    return nodes, record, lost_at


def test_a_warm_spare_takes_over_a_killed_node_and_the_others_keep_their_processes(tmp_path):
    """Node 1 is killed mid-training (its launcher and rank die together): node 0's rank
    keeps its process, the spare's rank takes rank 1 over and receives the state from rank
    0, the step the loss interrupted runs again, and the run ends bit-identical to an
    uninterrupted one of 2 ranks, with no rank started twice."""
    from .test_spares import node_report

    def kill(nodes: Any) -> list[int]:
        nodes.kill(1)
        return []

    nodes, record, _ = node_1_lost(tmp_path, kill)
    assert record.failed_at <= record.formed_at <= record.first_commit_at, record
    survivor, took_over = node_report(nodes.run, 0), node_report(nodes.run, 2)
    assert survivor["outcome"] == took_over["outcome"] == "finished", (survivor, took_over)
    assert survivor["in_job_restarts"] == 0 and took_over["role"] == "active", took_over


def test_a_silently_lost_node_costs_no_collective_timeout(tmp_path):
    """Node 1's launcher and rank are stopped (SIGSTOP), not killed: their sockets stay
    open, as on a power loss or a cut network, and rank 0's collective gets no error. Its
    launcher reports node 1 lost, the spare takes rank 1 over and declares the round
    failed; rank 0, stuck in its step, ends the round's own connections, its collective
    raises, and it recovers with its state: the spare receives it, the run ends
    bit-identical, well before gloo's timeout."""
    from .conftest import descendants

    def stop(nodes: Any) -> list[int]:
        node = descendants(nodes.procs[1].pid)
        for pid in node:
            os.kill(pid, signal.SIGSTOP)
        return node

    nodes, record, stopped_at = node_1_lost(tmp_path, stop)
    assert "ending the round's" in nodes.log(0), nodes.logs()
    took = record.first_commit_at - stopped_at
    assert took < live.COLLECTIVE_TIMEOUT_S, (took, nodes.logs())
    print(f"node stopped -> first committed step with the spare: {took:.2f}s")


def test_a_hung_node_steps_out_and_a_warm_spare_takes_its_ranks_over_live(tmp_path):
    """Node 1's rank is stopped (SIGSTOP) mid-training, a hang; short section timeouts (3 s)
    as in the in-job hang tests. Node 1's launcher finds its rank hung and steps out (its
    bench record, its rank killed); node 0's rank, blocked in the step's all-reduce on the
    hung peer, is judged hung by its own launcher too, which may not step out (the batch
    host) and waits for a peer to: the bench record explains the hang, and its rank keeps
    its process. The spare takes rank 1 over with the state from rank 0, and the run ends
    bit-identical to an uninterrupted one."""
    from .daemon_scenarios import training_process
    from .test_spares import node_report
    from .test_spares_bench import HANG_TIMEOUTS

    def hang(nodes: Any) -> list[int]:
        rank = training_process(nodes.procs[1].pid)
        os.kill(rank, signal.SIGSTOP)
        return [rank]

    nodes, record, hung_at = node_1_lost(
        tmp_path, hang, launch_args=("--section-timeouts", HANG_TIMEOUTS)
    )
    benched = json.loads(nodes.run.benched(0, 1).read_text())
    assert benched["why"] == "hang", benched
    assert node_report(nodes.run, 1)["outcome"] == "benched"
    survivor = node_report(nodes.run, 0)
    assert survivor["outcome"] == "finished" and survivor["in_job_restarts"] == 0, survivor
    took = record.first_commit_at - benched["time"]
    print(
        f"hung at +0, stepped out at +{benched['time'] - hung_at:.2f}s, first committed step "
        f"{took:.2f}s later"
    )


def test_a_straggler_that_steps_out_is_taken_over_by_a_warm_spare(tmp_path):
    """2 active nodes + 1 warm spare with live recovery. A persistent straggler (node 1
    made 4x slower from the start, 1 s report windows, two of them) steps out: its launcher
    writes its bench record and kills its ranks; rank 0 keeps its process, the spare's rank
    takes rank 1 over with the state from rank 0, and the run ends bit-identical to an
    uninterrupted one."""
    from .daemon_scenarios import reference_digest
    from .test_spares import node_report

    steps = 120
    expected = reference_digest(tmp_path, steps)
    slow = {
        "FTSLURM_INJECT": "straggler@0:n1*4",
        "FTSLURM_STRAGGLER_INTERVAL_S": "1",
        "FTSLURM_STRAGGLER_WINDOWS": "2",
    }
    nodes = live_launchers(tmp_path, steps, extra_env=slow)
    try:
        codes = [p.wait(timeout=240) for p in nodes.procs]
        assert codes == [0, 0, 0], nodes.logs()
    finally:
        nodes.close()
    logs = nodes.logs()
    final = json.loads((nodes.ckpt / "final.json").read_text())
    assert final == {"step": steps, "digest": expected}, logs
    assert nodes.log(0).count("rank 0 of 2 starts at step 0") == 1, logs  # never restarted
    benched = json.loads(nodes.run.benched(0, 1).read_text())
    assert benched["why"] == "straggler", benched
    (record,) = read_reports(nodes.run, Kind.LIVE, 0)
    assert record.took_over == 1 and record.receivers == [1] and record.state_from == 0, record
    assert node_report(nodes.run, 1)["outcome"] == "benched"
    assert node_report(nodes.run, 2)["outcome"] == "finished"
    took = record.first_commit_at - benched["time"]
    print(f"stepped out -> first committed step {took:.2f}s")


def test_the_rank_sending_the_state_lost_mid_transfer_another_sends_it(tmp_path, reference):
    """Forced timing: rank 1 fails at step 25 and is restarted alone; rank 0, which holds
    the newest step and the lowest rank, is to send it the state and is killed just
    before it sends (stopped at the live group's "sending" point). The receiver and rank 2
    form the next round with rank 0 restarted too; rank 2 sends both the state, and the run
    ends bit-identical to an uninterrupted one."""
    ranks = Ranks(tmp_path, "--fail-at-step", "25", "--fail-rank", "1", pause="sending:0:25")
    codes = ranks.run(on_tick=kill_when_paused(0))
    logs = ranks.logs()
    assert codes == dict.fromkeys(range(WORLD), 0), logs
    assert 0 in ranks.restarted and 1 in ranks.restarted, (ranks.restarted, logs)
    assert ranks.final() == reference, logs


def test_a_second_fault_while_the_round_forms_costs_no_backend_timeout(tmp_path, reference):
    """Forced timing: rank 1 fails at step 25; while the next round forms, rank 2 stops
    itself after every rank joined and before it connects to the others (the live group's
    "forming" point) and is killed there. The others, waiting in gloo's set-up for its
    address, leave that wait when its restarted process declares the round failed, not at
    gloo's timeout; a further round forms and the run ends bit-identical."""
    ranks = Ranks(tmp_path, "--fail-at-step", "25", "--fail-rank", "1", pause="forming:2:25")
    codes = ranks.run(on_tick=kill_when_paused(2))
    logs = ranks.logs()
    assert codes == dict.fromkeys(range(WORLD), 0), logs
    assert {1, 2} <= set(ranks.restarted) and 0 not in ranks.restarted, (ranks.restarted, logs)
    kept = (tmp_path / "rank-0-0.log").read_text()
    assert "live recovery: round 2 after" in kept, logs  # round 1 failed while forming
    seconds = [
        float(t) for t in re.findall(r"live recovery: round \d+ after .* in ([\d.]+)s", kept)
    ]
    assert seconds and max(seconds) < live.COLLECTIVE_TIMEOUT_S, logs
    assert ranks.final() == reference, logs


def test_a_warm_spare_lost_while_waiting_leaves_no_spare_for_the_next_loss(tmp_path):
    """2 active nodes + 1 warm spare: the spare is killed while its rank waits (nothing
    changes for the training), then node 1: no spare is left, so node 0's launcher stops
    its rank and reports that the run goes on in a new job (today's path)."""
    from .test_spares import node_report

    nodes = live_launchers(tmp_path, 2000)
    try:
        nodes.wait_checkpoint(10)
        wait_for(lambda: "wait warm" in nodes.log(2), 60, "the spare's ranks to start")
        nodes.kill(2)
        wait_for(lambda: nodes.run.peer_lost(0, 2).exists(), 30, "the spare reported lost")

        def step() -> int:
            return int(json.loads(nodes.run.progress.read_text()).get("step") or 0)

        before = step()
        wait_for(lambda: step() > before + 5, 60, "training on")
        nodes.kill(1)
        code = nodes.procs[0].wait(timeout=120)
    finally:
        nodes.close()
    report = node_report(nodes.run, 0)
    assert report["recovery"] == "new_job" and code != 0, (code, report, nodes.logs())
    records = read_reports(nodes.run, Kind.LIVE, 0)
    assert not [r for r in records if r.node_rank is None], nodes.logs()  # nothing taken over
    # node 0's launcher says why it fell back: no warm spare left for node 1
    (fell_back,) = [r for r in records if r.node_rank == 0]
    assert fell_back.given_up == Fallback.NO_SPARE.value, fell_back
    assert fell_back.recovery == "new_job" and fell_back.why.endswith(" lost"), fell_back


def test_on_the_mock_a_warm_spare_takes_over_a_failed_node_in_the_same_job(tmp_path):
    """`--dry-run --spare-nodes 1 --live-recovery` with the mock's default SlurmdTimeout
    (300 s): node rank 1's node fails once training passed step 20 (`mock fail-node`: its launcher
    and rank die with it); the spare's
    waiting rank takes rank 1 over live, inside the same job, and training ends
    bit-identical to an uninterrupted run."""
    from .daemon_scenarios import spare_takes_over_on_the_mock

    run, record = spare_takes_over_on_the_mock(tmp_path, live=True)
    assert record["took_over"] == 1 and record["receivers"] == [1], record
    assert record["first_commit_at"] is not None, record
    assert not list(run.recovery(0).glob("round-*.json"))  # no rank restarted


def test_the_batch_host_lost_with_live_recovery_moves_the_run_to_a_new_job(tmp_path):
    """The batch host (node rank 0) hosts the coordinator store: when it is lost, no live
    recovery is possible; the other node's launcher stops its rank and reports that the
    run goes on in a new job, the warm spare leaves as a spare, nothing is taken over."""
    from .test_spares import node_report

    nodes = live_launchers(tmp_path, 2000)
    try:
        nodes.wait_checkpoint(10)
        wait_for(lambda: "wait warm" in nodes.log(2), 60, "the spare's ranks to start")
        nodes.kill(0)
        codes = [nodes.procs[r].wait(timeout=120) for r in (1, 2)]
    finally:
        nodes.close()
    report = node_report(nodes.run, 1)
    assert report["recovery"] == "new_job" and codes[0] != 0, (codes, report, nodes.logs())
    assert node_report(nodes.run, 2)["outcome"] == "spare" and codes[1] == 0, nodes.logs()
    records = read_reports(nodes.run, Kind.LIVE, 0)
    assert not [r for r in records if r.took_over is not None]
    # each launcher that fell back says why (`RunDir.live_fallback`): the surviving active
    # node's (and the warm spare's, when it read the loss before it saw the run closed)
    fell_back = {r.node_rank: r for r in records if r.node_rank is not None}
    assert 1 in fell_back and set(fell_back) <= {1, 2}, (records, nodes.logs())
    for r in fell_back.values():
        assert r.given_up == Fallback.NO_COORDINATOR.value and r.recovery == "new_job", r
        assert r.why is not None and r.why.endswith(" lost"), r


def test_a_launcher_stopped_before_it_looked_at_the_batch_hosts_loss_still_says_why(tmp_path):
    """Forced timing (a race seen on the mock: the batch host's loss ends the job at once,
    and its stop and its ranks' end can reach a surviving launcher before its next look at
    the losses, once a second): node 1's launcher is paused (SIGSTOP) and told to stop
    (SIGTERM, pending while it is paused); node 0 is killed and the spare reports it lost;
    node 1's rank (and its wrapper) is killed, and its launcher continued: it takes the
    stop, then sees its ranks failed under it. It still records why live recovery fell
    back, and that the run goes on in a new job."""
    from ftslurm.procutil import pid_alive

    from .conftest import descendants
    from .test_spares import node_report

    nodes = live_launchers(tmp_path, 2000)
    launcher = nodes.procs[1].pid
    try:
        nodes.wait_checkpoint(10)
        wait_for(lambda: "wait warm" in nodes.log(2), 60, "the spare's ranks to start")
        os.kill(launcher, signal.SIGSTOP)
        os.kill(launcher, signal.SIGTERM)
        nodes.kill(0)
        wait_for(lambda: nodes.run.peer_lost(0, 0).exists(), 30, "the batch host reported lost")
        below = descendants(launcher)[1:]  # the rank's wrapper and the rank
        for pid in below:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(map(pid_alive, below)), 30, "node 1's rank to end")
        os.kill(launcher, signal.SIGCONT)
        code = nodes.procs[1].wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher, signal.SIGCONT)
        nodes.close()
    assert code != 0, nodes.logs()
    assert node_report(nodes.run, 1)["recovery"] == "new_job", nodes.logs()
    records = read_reports(nodes.run, Kind.LIVE, 0)
    fell_back = {r.node_rank: r for r in records if r.node_rank is not None}
    assert 1 in fell_back, nodes.logs()
    assert fell_back[1].given_up == Fallback.NO_COORDINATOR.value, fell_back
    assert fell_back[1].recovery == "new_job", fell_back


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_on_the_mock_the_batch_host_lost_with_live_recovery_goes_on_in_a_new_job(tmp_path):
    """The fallback end to end: the batch host (node index 0, the coordinator store's host)
    fails 40 s in; nothing can be recovered live, the daemon moves the run to a new job,
    which resumes from the last checkpoint and ends bit-identical."""
    from .daemon_scenarios import live_falls_back_to_a_new_job_on_the_mock

    s, status, report = live_falls_back_to_a_new_job_on_the_mock(tmp_path, "node_fail@40:0")
    assert [a["cause"] for a in s["attempts"]] == ["node_fail", "finished"], s
    assert len({a["job_id"] for a in s["attempts"]}) == 2, s  # a new job
    # The fallback says why in the live records, and `status` (while the new job ran) and
    # `report` show it.
    records = read_reports(RunDir(s["run_dir"]), Kind.LIVE, 0)
    fell_back = [r for r in records if r.node_rank is not None]
    assert fell_back, records
    assert {r.given_up for r in fell_back} == {Fallback.NO_COORDINATOR.value}, fell_back
    assert all(r.recovery == "new_job" for r in fell_back), fell_back
    said = f"{Fallback.NO_COORDINATOR.value} (node "
    assert said in status and "the run goes on in a new job" in status, status
    assert said in report and "the run goes on in a new job" in report, report


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_on_the_mock_a_warm_spare_lost_while_waiting_then_a_node_goes_on_in_a_new_job(tmp_path):
    """The spare lost while waiting, end to end (forced timing, not a time guess): once the
    spare's ranks wait warm and the training saved step 20, the spare's node fails (`mock
    fail-node`): the training goes on in the same processes; once its loss is reported and
    the training moved on, node rank 1's node fails: no spare is left, node 0's launcher
    falls back (NO_SPARE), the daemon moves the run to a new job (on a mock of 5 nodes: 3
    left beside the 2 lost), which resumes from the last checkpoint and ends bit-identical."""
    from .daemon_scenarios import (
        job_log,
        lease_of,
        live_falls_back_to_a_new_job_on_the_mock,
        started_once,
        trained_step,
        training_process,
        wait_trained,
    )

    seen: dict[str, Any] = {}

    def lose_the_spare_then_node_1(cli: Any, run_id: str, run: RunDir) -> None:
        wait_for(lambda: "wait warm" in job_log(run), 120, "the spare's ranks to start")
        wait_trained(run, 20)
        # The active ranks, started with the spare's from the same script, are past their
        # set-up: the spare's rank, up with torch loaded, waits in init_process_group.
        leases = {r: lease_of(run, 0, r) for r in range(3)}
        ranks = {r: training_process(leases[r]["pid"]) for r in range(3)}
        assert "libtorch" in Path(f"/proc/{ranks[2]}/maps").read_text(), ranks
        cli("mock", "fail-node", leases[2]["node"])
        wait_for(lambda: run.peer_lost(0, 2).exists(), 30, "the spare reported lost")
        before = seen["spare_lost_at"] = trained_step(run)
        wait_for(lambda: trained_step(run) > before + 5, 60, "training on without the spare")
        # the same rank processes trained on: none restarted
        seen["kept"] = {r: training_process(leases[r]["pid"]) == ranks[r] for r in (0, 1)}
        seen["log"] = job_log(run)  # the first job's, before node 1's loss
        cli("mock", "fail-node", leases[1]["node"])
        seen["lost"] = {leases[2]["node"], leases[1]["node"]}

    s, status, report = live_falls_back_to_a_new_job_on_the_mock(
        tmp_path, nodes=5, first_job=lose_the_spare_then_node_1
    )
    first, second = s["attempts"]
    assert [first["cause"], second["cause"]] == ["node_fail", "finished"], s
    assert len({first["job_id"], second["job_id"]}) == 2, s  # a new job
    assert seen["lost"] <= set(s["excluded_nodes"]), (seen, s)  # both lost nodes left out
    assert not seen["lost"] & set(second["nodes"]), (seen, s)
    # The spare's loss restarted no rank: the world started once, from nothing, and
    # trained on in the same processes until node 1 was lost.
    assert started_once(seen["log"]), seen["log"][-4000:]
    assert "took over from node rank" not in seen["log"], seen["log"][-4000:]
    run = RunDir(s["run_dir"])
    assert not list(run.recovery(0).glob("round-*.json")), s  # no in-job restart
    assert seen["kept"] == {0: True, 1: True}, seen
    node_0 = json.loads(run.node_report(0, 0).read_text())
    assert node_0["in_job_restarts"] == 0 and node_0["peers_lost"] == [2, 1], node_0
    assert node_0["recovery"] == "new_job", node_0
    # Node 0's launcher fell back: no warm spare left for node 1; nothing was taken over.
    records = read_reports(run, Kind.LIVE, 0)
    assert not [r for r in records if r.took_over is not None], records
    fell_back = [r for r in records if r.node_rank is not None]
    assert [r.node_rank for r in fell_back] == [0], records
    assert fell_back[0].given_up == Fallback.NO_SPARE.value, fell_back
    assert fell_back[0].recovery == "new_job", fell_back
    said = f"{Fallback.NO_SPARE.value} (node"
    assert said in status and "the run goes on in a new job" in status, status
    assert said in report and "the run goes on in a new job" in report, report
    # The spare's loss restarted nothing: said so, not "ranks restarting".
    spare = "warm spare lost: nothing restarted, no spare left"
    assert spare in status and "ranks restarting" not in status, status
    assert spare in report, report


# The mock's scenarios of tests/test_live_slurm.py: 2 nodes x 2 ranks of the recipe, steps
# of 0.05 s (a straggler slows a step that sleeps by its wait for the node's next running
# slice: about 1.7-fold at 0.05 s, barely at 0.1 s; docs/fault-injection.md).
MOCK_STEPS = 400
MOCK_ARGS = ["--live", "--steps", str(MOCK_STEPS), "--step-time", "0.05", "--ckpt-every", "50"]


def test_on_the_mock_a_crashed_rank_on_the_second_node_is_restarted_alone(tmp_path):
    """`--dry-run`, 2 nodes x 2 ranks of the recipe with --live, rank 3 crashed in its
    set-up (every rank restarts) and again in training: then its launcher restarts it
    alone, the other ranks (on both nodes) keep their processes, and the run ends in its
    first job with the parameters of an uninterrupted run of the same 4 ranks
    (test_live_slurm's scenario)."""
    from .daemon_scenarios import on_a_fresh_mock, rank_crash_restarted_alone, reference_digest

    expected = reference_digest(tmp_path, MOCK_STEPS, world=4)
    with on_a_fresh_mock(tmp_path) as cli:
        final = rank_crash_restarted_alone(cli, RECIPE, tmp_path / "ckpt", MOCK_ARGS, dry_run=True)
    assert final == {"step": MOCK_STEPS, "digest": expected}


def test_on_the_mock_a_straggler_steps_out_to_a_warm_spare(tmp_path):
    """`--dry-run`, 2 nodes x 2 ranks and a warm spare with live recovery: the second node
    is slowed 4-fold from 2 s in and judged a persistent straggler after two 2 s windows;
    its launcher steps out, the spare's waiting ranks take ranks 2 and 3 over live, and the
    run ends in its first job with the parameters of an uninterrupted run of the same 4
    ranks (test_live_slurm's scenario)."""
    from .daemon_scenarios import on_a_fresh_mock, reference_digest, straggler_steps_out_live

    expected = reference_digest(tmp_path, MOCK_STEPS, world=4)
    with on_a_fresh_mock(tmp_path) as cli:
        final = straggler_steps_out_live(
            cli,
            tmp_path,
            MOCK_ARGS,
            interval_s=2.0,
            dry_run=True,
            straggler_threshold=0.75,  # the slowed ranks score about 0.6
        )
    assert final == {"step": MOCK_STEPS, "digest": expected}


def test_a_transient_result_and_a_crashed_rank_in_one_live_run_end_bit_identical(
    tmp_path, reference, monkeypatch
):
    """Result validation inside a live group (issue 30 on top of issue 28): rank 1's first
    validated loss is a NaN (injected, transient) and is re-run in place by every rank, and
    rank 2 later fails and is restarted alone; the run ends with the uninterrupted run's
    parameters. The restarted rank starts its validation afresh (its spike statistic empty)
    and the group still agrees on every step."""
    monkeypatch.setenv(EnvName.INJECT.value, "nan@0:1")
    ranks = Ranks(tmp_path, "--validate", "--fail-at-step", "25", "--fail-rank", "2")
    codes = ranks.run()
    logs = ranks.logs()
    assert codes == dict.fromkeys(range(WORLD), 0), logs
    assert ranks.restarted == [2], logs
    assert "injected nan@0:1 on rank 1" in logs, logs
    assert "re-run in place" in logs and ": transient" in logs, logs
    assert ranks.final() == reference


def test_a_ranks_verdict_under_the_launcher_ends_the_round_and_is_not_restarted_alone(tmp_path):
    """The model's own NaN at step 15 on every rank (`--nan-at-step`), validated inside a
    live group under the launcher: the re-run in place reproduces it, every rank saves the
    last good state and exits 16. Those exits are verdicts, not faults: no rank is
    restarted alone (each one was, spending the in-job restarts, before), the launcher
    exits 16 and its node report says resume_elsewhere with no in-job restart used."""
    out = crash_under_the_launcher(
        tmp_path,
        "--validate",
        "--nan-at-step",
        "15",
        fail_at=None,
        code=ExitCode.RESUME_ELSEWHERE,
    )
    assert "restarted alone" not in out and "warm standby" not in out, out[-6000:]
    assert "exited 16 (resume_elsewhere): the round ends" in out, out[-6000:]
    report = json.loads((tmp_path / "run" / "attempts" / "0" / "node-0.json").read_text())
    assert report["outcome"] == "resume_elsewhere", report
    assert report["in_job_restarts"] == 0, report


def test_a_rank_lost_in_its_set_up_after_every_rank_joined_restarts_every_rank_in_one_group(
    tmp_path,
):
    """Forced timing (the last CI's failure): 2 launchers, one rank each of the recipe with
    --live. Rank 1 stops itself once every rank has joined the live group's first round
    (the `forming` pause, before its process group) and is killed there: nothing to hand
    over yet, so its launcher restarts it (torch counts a restart) and the other launcher
    restarts its rank for the changed membership (torch counts none). Both ranks must meet
    in one new group and train to the end; with the group named by torch's restart count
    they waited in two until the join timeout, one of them in the old round whose joins were
    already counted."""
    from .daemon_scenarios import reference_digest
    from .test_spares import Launchers

    steps = 60
    expected = reference_digest(tmp_path, steps)
    pause = {live.PAUSE_ENV: "forming:1:-1", "PYTHONUNBUFFERED": "1"}
    nodes = Launchers(
        tmp_path,
        nnodes=2,
        spare_nodes=0,
        steps=steps,
        max_restarts=2,
        extra_env=pause,
        recipe_args=("--live",),
        endpoint=False,
    )
    first: list[int] = []

    def paused() -> bool:
        """Kill rank 1's first process at its pause; let a later one (restarted, with the
        same environment) go on."""
        found = [pe for proc in nodes.procs for pe in recipe_processes(proc.pid)]
        for pid, env in found:  # on either node: the rendezvous orders them
            if env.get("RANK") == "1" and stopped(pid):
                if not first:
                    first.append(pid)
                    os.kill(pid, signal.SIGKILL)
                elif pid not in first:
                    os.kill(pid, signal.SIGCONT)
        return all(p.poll() is not None for p in nodes.procs)

    try:
        # every 0.2 s: each look reads all of /proc twice
        wait_for(paused, 240, "both launchers to end", interval=0.2)
        codes = [p.returncode for p in nodes.procs]
        assert codes == [0, 0], nodes.logs()
    finally:
        nodes.close()
    assert first, nodes.logs()  # the kill came at the pause
    assert json.loads((nodes.ckpt / "final.json").read_text()) == {
        "step": steps,
        "digest": expected,
    }, nodes.logs()
    logs = nodes.logs()
    assert "did not join" not in logs and "restarted alone" not in logs, logs
    # torch's restart counts differ (1 where the rank was lost, 0 beside it); the group not
    counts = sorted(int(n) for n in re.findall(r"finished after (\d+) in-job restart", logs))
    assert counts == [0, 1], logs


def test_the_nodes_of_a_rendezvous_round_agree_on_one_live_group_and_a_new_round_on_another():
    """Two launchers' rendezvous (torch's c10d handler, as `launch.rendezvous_handler`
    makes it): both nodes of a round name the same live group, whatever restart count each
    keeps; the next round (both rejoin, as after a set-up crash restarted every rank) names
    another, sorting after it."""
    import threading
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from ftslurm.agent.elastic import Agent

    def params(endpoint: str, host: bool) -> RendezvousParameters:
        return RendezvousParameters(
            backend="c10d",
            endpoint=endpoint,
            run_id="agree",
            min_nodes=2,
            max_nodes=2,
            is_host=host,
            join_timeout=30,
            last_call_timeout=1,
        )

    backend, store = create_backend(params("127.0.0.1:0", True))
    handlers = [create_handler(store, backend, params("127.0.0.1:0", True))]
    p = params(f"127.0.0.1:{store.port}", False)
    backend2, store2 = create_backend(p)
    handlers.append(create_handler(store2, backend2, p))

    def one_round() -> list[str]:
        groups: dict[int, str] = {}

        def node(i: int) -> None:
            info = handlers[i].next_rendezvous()
            spec = SimpleNamespace(rdzv_handler=handlers[i])
            groups[i] = Agent.agree_on_group(SimpleNamespace(store=info.store, spec=spec))

        threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(groups) == 2, groups
        return [groups[0], groups[1]]

    first = one_round()
    second = one_round()
    assert first[0] == first[1] and second[0] == second[1], (first, second)
    assert first[0] != second[0] and first[0].startswith(live_rules.ROOT + "/agree/"), first
    assert first[0] < second[0], (first, second)  # records of a later group sort after
    for h in handlers:
        h.shutdown()
