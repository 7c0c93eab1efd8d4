"""`ftslurm.Training` (ftslurm.agent.loop), the short rank-agent API, run for real: rank
processes of a small script on gloo (one or two), which checkpoint, resume bit for bit,
stop for a continuation when a rank is asked to (exit 0, the stop records), and, in a live
group whose coordinator store this test hosts, recover from a rank that crashed."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ftslurm.agent.rank import read_stop_record
from ftslurm.agent.task import free_port
from ftslurm.core.contract import EnvName

pytestmark = pytest.mark.slow  # real rank processes (torch imports): a few seconds each

SCRIPT = """
import argparse, hashlib, json, os, signal

import torch
import torch.distributed as dist

from ftslurm import Training
from ftslurm.agent import live

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=4)
parser.add_argument("--checkpoint-dir")
parser.add_argument("--stop-at", type=int, default=-1)   # the last rank asks for a stop
parser.add_argument("--fail-at", type=int, default=-1)   # the last rank crashes (exit 3)
parser.add_argument("--fail-in-block", action="store_true")  # in the step, before its all-reduce
parser.add_argument("--no-block", action="store_true")   # a loop without `train.step()`
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
group = live.init_process_group("gloo", init_method=os.environ["INIT"], live=True)
rank, world = dist.get_rank(), dist.get_world_size()
train = Training(model, optim, checkpoint_dir=args.checkpoint_dir, every=args.every, group=group)
last = rank == world - 1 and not train.rejoining
for step in train.steps(args.steps):
    if args.no_block:
        continue
    with train.step():
        with train.section("compute"):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * world + rank))
            optim.zero_grad()
            model(x).pow(2).mean().backward()
        if args.fail_in_block and step == args.fail_at and last:
            os._exit(3)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if step == args.stop_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the agent's flag only
    if not args.fail_in_block and train.committed and train.steps_done == args.fail_at and last:
        os._exit(3)
if rank == 0:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print("FINAL " + json.dumps({"step": train.steps_done, "digest": digest.hexdigest()}))
train.finish()
"""


class Ranks:
    """The script's ranks, one process each, ended (killed) when the test leaves."""

    def __init__(self, tmp: Path, world: int, store: dist.TCPStore | None = None) -> None:
        self.tmp, self.world, self.store = tmp, world, store
        self.script = tmp / "train.py"
        self.script.write_text(SCRIPT)
        self.ckpt = tmp / "ckpt"
        self.runs = 0

    def env(self, rank: int, rejoin: bool = False, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.world),
            INIT=f"tcp://127.0.0.1:{self.port}",
            FTSLURM_MEMORY_DIR=str(self.tmp / "memory"),
            PYTHONUNBUFFERED="1",
            **extra,
        )
        if self.store is not None:
            env[EnvName.LIVE_STORE.value] = f"127.0.0.1:{self.store.port}"
        if rejoin:
            env[EnvName.LIVE_REJOIN.value] = "1"
        return env

    def start(self, rank: int, *args: str, rejoin: bool = False, **env: str) -> subprocess.Popen:
        log = self.tmp / f"run-{self.runs}-rank-{rank}{'-rejoin' if rejoin else ''}.log"
        return subprocess.Popen(
            [sys.executable, str(self.script), "--checkpoint-dir", str(self.ckpt), *args],
            env=self.env(rank, rejoin, **env),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def run(self, *args: str, restart_alone: bool = False, **env: str) -> dict[int, int]:
        """Every rank to its end (a rank that fails restarted alone, rejoining, with
        `restart_alone`): their exit codes."""
        self.port, self.runs = free_port(), self.runs + 1
        procs = {r: self.start(r, *args, **env) for r in range(self.world)}
        deadline = time.monotonic() + 180
        try:
            while time.monotonic() < deadline:
                codes = {r: p.poll() for r, p in procs.items()}
                for r, code in codes.items():
                    if code not in (None, 0) and restart_alone:
                        restart_alone = False  # once
                        procs[r] = self.start(r, *args, rejoin=True, **env)
                        codes[r] = None
                if all(c is not None for c in codes.values()):
                    return codes
                time.sleep(0.05)
            pytest.fail(f"the ranks did not end in time:\n{self.logs()}")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return {}

    def logs(self, run: int | None = None) -> str:
        pattern = f"run-{run if run is not None else self.runs}-rank-*.log"
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob(pattern))
        )

    def final(self) -> dict:
        for line in self.logs().splitlines():
            if line.startswith("FINAL "):
                return json.loads(line.removeprefix("FINAL "))
        raise AssertionError(f"no final line:\n{self.logs()}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """12 steps in one go, two ranks."""
    ranks = Ranks(tmp_path_factory.mktemp("reference"), 2)
    assert ranks.run() == {0: 0, 1: 0}, ranks.logs()
    assert ranks.final()["step"] == 12
    return ranks.final()


def test_a_run_checkpoints_and_its_continuation_ends_bit_identically(tmp_path, reference):
    ranks = Ranks(tmp_path, 2)
    assert ranks.run("--steps", "7") == {0: 0, 1: 0}, ranks.logs()
    first = ranks.logs()
    assert "rank 0 of 2 starts at step 0 (attempt 0, in-job restart 0) from nothing" in first
    assert ranks.final()["step"] == 7
    # every 4 steps: 4 saved, and at the end (7) nothing more; the memory tier was cleared
    assert sorted(p.name for p in ranks.ckpt.glob("step-*.pt")) == ["step-0000000004.pt"]
    assert not any((tmp_path / "memory").rglob("*.pt"))
    assert ranks.run() == {0: 0, 1: 0}, ranks.logs()
    assert "rank 0 of 2 starts at step 4 (attempt 0, in-job restart 0) from disk" in ranks.logs()
    assert ranks.final() == reference, ranks.logs()
    assert (ranks.ckpt / "step-0000000012.pt").exists()  # the last step is one of `every`


def test_a_stop_request_checkpoints_on_every_rank_and_exits_0_for_a_continuation(
    tmp_path, reference
):
    ranks = Ranks(tmp_path, 2)
    run_dir = tmp_path / "run"
    env = {EnvName.RUN_DIR.value: str(run_dir), EnvName.ATTEMPT.value: "0"}
    # the last rank is asked to stop during step 5: the ranks agree at step 6's start
    assert ranks.run("--stop-at", "5", **env) == {0: 0, 1: 0}, ranks.logs()
    logs = ranks.logs()
    assert "checkpointed at step 6 on request; exiting for a continuation" in logs, logs
    assert "FINAL" not in logs
    for rank in (0, 1):
        record = read_stop_record(run_dir, 0, rank)
        assert record is not None, logs
        assert (record["step"], record["outcome"]) == (6, "checkpointed"), record
    assert (ranks.ckpt / "step-0000000006.pt").exists()
    assert ranks.run() == {0: 0, 1: 0}, ranks.logs()
    # the stop's checkpoint is in node memory too (the run was not over): restored from there
    logs = ranks.logs()
    assert "rank 0 of 2 starts at step 6 (attempt 0, in-job restart 0) from memory" in logs
    assert "rank 1 restored step 6 from its node memory" in logs
    assert ranks.final() == reference, ranks.logs()


@pytest.mark.parametrize("where", ["after the commit", "in the block"])
def test_in_a_live_group_a_crashed_rank_rejoins_and_the_run_ends_bit_identically(
    tmp_path, reference, where
):
    """The crash right after step 5 committed (the survivor's next collective, the agreement
    on a checkpoint, fails), or during step 6 (its gradient all-reduce fails inside the
    block): either way step 6 runs again with the restarted rank, which received the
    state."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(30)
    )
    ranks = Ranks(tmp_path, 2, store)
    block = ["--fail-in-block"] if where == "in the block" else []
    codes = ranks.run("--fail-at", "6", *block, restart_alone=True)
    logs = ranks.logs()
    assert codes == {0: 0, 1: 0}, logs
    rejoined = (tmp_path / "run-1-rank-1-rejoin.log").read_text()
    assert "rank 1 of 2 starts at step 6 (attempt 0, in-job restart 0) from a live peer" in (
        rejoined
    ), logs
    assert "live recovery: round 1 after" in (tmp_path / "run-1-rank-0.log").read_text(), logs
    assert ranks.final() == reference, logs


def test_a_loop_that_runs_a_step_without_the_block_is_an_error(tmp_path):
    ranks = Ranks(tmp_path, 1)
    assert ranks.run("--no-block") == {0: 1}, ranks.logs()
    assert "run each step in `with train.step():`" in ranks.logs()
