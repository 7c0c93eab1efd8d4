"""The in-memory checkpoint tier (`ftslurm.memory_checkpoint`): who keeps whose replica, and
real process groups of 4 ranks on 2 "nodes" (node areas named apart in one folder) that
save, lose a node's memory and restore."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftslurm.agent.task import free_port
from ftslurm.memory_checkpoint import holders, partners

from .conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_each_rank_replicates_to_the_same_local_index_on_the_next_node():
    nodes = ["a", "a", "b", "b"]
    assert partners(nodes) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert partners(["b", "a", "c", "a", "b", "c"]) == {1: 0, 3: 4, 0: 2, 4: 5, 2: 1, 5: 3}
    assert partners(["a", "a"]) == {}  # one node: no replicas
    # uneven nodes still give every rank a partner on another node
    got = partners(["a", "a", "a", "b"])
    assert all(nodes_of != "a" for nodes_of in (["a", "a", "a", "b"][got[r]] for r in (0, 1, 2)))


def test_the_newest_step_held_for_every_rank_is_restored_and_served_locally_first():
    nodes = ["a", "a", "c", "c"]  # node b was lost; c replaced it
    # a holds shards 0, 1 (own) and 2, 3 (replicas of b's ranks) at steps 10 and 20
    a = {0: [10, 20], 1: [10, 20], 2: [10, 20], 3: [10, 20]}
    step, serve = holders([a, a, {}, {}], nodes, None)  # type: ignore[misc]
    assert step == 20 and serve[0] == 0 and serve[1] == 1
    assert serve[2] in (0, 1) and serve[3] in (0, 1) and serve[2] != serve[3]  # spread
    # a shard held nowhere at 20: 10 is the newest complete step; below min_step: None
    gap = {0: [10, 20], 1: [10, 20], 2: [10], 3: [10, 20]}
    assert holders([gap, gap, {}, {}], nodes, None)[0] == 10  # type: ignore[index]
    assert holders([gap, gap, {}, {}], nodes, 15) is None
    assert holders([{}, {}, {}, {}], nodes, None) is None


WORKER = r"""
import json, os, sys, torch, torch.distributed as dist
from ftslurm.memory_checkpoint import MemoryTier
rank, phase = int(os.environ["RANK"]), sys.argv[1]
dist.init_process_group("gloo")
tier = MemoryTier()
if phase == "save":
    for step in (10, 20, 30):
        tier.save(step, {"w": torch.full((1000,), float(rank * 100 + step)), "step": step})
    tier.wait()  # the last save's replicas are sent in the background
    print(json.dumps({"rank": rank, "keeps": tier.keeps}), flush=True)
elif phase == "async":  # rank 1 pauses before it saves: rank 0's save returns all the same
    import signal
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    state = {"w": torch.full((1000,), float(rank))}
    tier.save(10, state)
    state["w"].fill_(-1.0)  # the training goes on: the save holds its own snapshot
    print("returned", flush=True)
    tier.wait()
    print(json.dumps({"rank": rank, "keeps": tier.keeps}), flush=True)
else:
    got = tier.load_latest(min_step=int(sys.argv[2]) if len(sys.argv) > 2 else None)
    out = None if got is None else {"step": got[0], "w": float(got[1]["w"][0]), "tier": got[2]}
    print(json.dumps({"rank": rank, "got": out}), flush=True)
dist.destroy_process_group()
"""


def run_world(tmp_path: Path, nodes: list[str], *args: str) -> list[dict]:
    """One process per rank, each "on" node `nodes[rank]`, sharing a memory base folder."""
    port = str(21000 + (os.getpid() + len(args) * 7 + len(nodes)) % 20000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM"))}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        FTSLURM_MEMORY_DIR=str(tmp_path / "shm"),
        FTSLURM_RUN_ID="r1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        WORLD_SIZE=str(len(nodes)),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, *args],
            env={**env, "RANK": str(r), "SLURMD_NODENAME": n},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, n in enumerate(nodes)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def area(tmp_path: Path, node: str) -> Path:
    return tmp_path / "shm" / "r1" / node


@pytest.mark.slow
def test_a_lost_nodes_ranks_restore_from_the_replicas_on_the_other_node(tmp_path):
    saved = run_world(tmp_path, ["a", "a", "b", "b"], "save")
    assert [s["keeps"] for s in saved] == [[2], [3], [0], [1]]
    # bounded: two states per rank in each node's memory (its own and one replica)
    assert sorted(p.name for p in area(tmp_path, "a").glob("*.pt")) == [
        f"shard-{r}-step-30.pt" for r in range(4)
    ]
    # node b is lost with its memory; node c takes its place
    for p in area(tmp_path, "b").iterdir():
        p.unlink()
    area(tmp_path, "b").rmdir()
    got = [o["got"] for o in run_world(tmp_path, ["a", "a", "c", "c"], "load")]
    assert [g["step"] for g in got] == [30] * 4
    assert [g["w"] for g in got] == [r * 100 + 30.0 for r in range(4)]  # each its own state
    assert [g["tier"] for g in got] == ["memory", "memory", "peer", "peer"]


@pytest.mark.slow
def test_a_corrupt_or_missing_replica_leaves_the_world_to_the_persistent_tier(tmp_path):
    run_world(tmp_path, ["a", "a", "b", "b"], "save")
    for p in area(tmp_path, "b").iterdir():
        p.unlink()
    replica = area(tmp_path, "a") / "shard-3-step-30.pt"
    replica.write_bytes(b"x" + replica.read_bytes()[1:])  # one byte changed
    got = [o["got"] for o in run_world(tmp_path, ["a", "a", "c", "c"], "load")]
    assert got == [None] * 4  # rank 3's state is held nowhere that verifies
    # with every node's memory intact, a newer step than asked for is restored locally
    run_world(tmp_path, ["a", "a", "b", "b"], "save")
    got = [o["got"] for o in run_world(tmp_path, ["a", "a", "b", "b"], "load", "30")]
    assert [(g["step"], g["tier"]) for g in got] == [(30, "memory")] * 4
    assert [o["got"] for o in run_world(tmp_path, ["a", "a", "b", "b"], "load", "31")] == [None] * 4


@pytest.mark.slow
def test_a_save_returns_after_its_snapshot_and_the_replica_follows_in_the_background(tmp_path):
    """Forced timing: rank 1 (node b) is stopped before it saves, so rank 0's replica cannot
    be received; rank 0's save returns all the same (the step stood still only for the
    snapshot), its own state is in node a's memory, and the replica reaches node b once
    rank 1 runs again. The state kept is the snapshot, not what the training did after."""
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM"))}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        FTSLURM_MEMORY_DIR=str(tmp_path / "shm"),
        FTSLURM_RUN_ID="r1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, "async"],
            env={**env, "RANK": str(r), "SLURMD_NODENAME": n},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, n in enumerate(["a", "b"])
    ]
    try:
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline().strip() == "returned"  # while rank 1 is stopped
        wait_for(
            lambda: (area(tmp_path, "a") / "shard-0-step-10.json").exists(),
            60,
            "rank 0's own state in node a's memory",
        )
        assert not (area(tmp_path, "b") / "shard-0-step-10.pt").exists()  # not sent yet
        os.kill(procs[1].pid, signal.SIGCONT)
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    replica = torch.load(area(tmp_path, "b") / "shard-0-step-10.pt", weights_only=True)
    assert float(replica["w"][0]) == 0.0  # rank 0's snapshot, not the -1 written after


@pytest.mark.parametrize("world", [["a", "a"]])
def test_with_one_node_there_is_no_replica_and_memory_serves_its_own(tmp_path, world):
    run_world(tmp_path, world, "save")
    assert sorted(p.name for p in area(tmp_path, "a").glob("*.pt")) == [
        "shard-0-step-30.pt",
        "shard-1-step-30.pt",
    ]
    got = [o["got"] for o in run_world(tmp_path, world, "load")]
    assert [(g["step"], g["tier"]) for g in got] == [(30, "memory")] * 2


@pytest.mark.slow
def test_uneven_nodes_replicate_every_rank_without_hanging(tmp_path):
    """Three ranks on one node, one on the other: the lone rank keeps all three replicas;
    losing it, its state comes back from the replica on the first node."""
    saved = run_world(tmp_path, ["a", "a", "a", "b"], "save")
    assert [s["keeps"] for s in saved] == [[3], [], [], [0, 1, 2]]
    for p in area(tmp_path, "b").iterdir():
        p.unlink()
    got = [o["got"] for o in run_world(tmp_path, ["a", "a", "a", "c"], "load")]
    assert [(g["step"], g["tier"], g["w"]) for g in got] == [
        (30, "memory", 30.0),
        (30, "memory", 130.0),
        (30, "memory", 230.0),
        (30, "peer", 330.0),
    ]


@pytest.mark.slow
def test_a_corrupt_own_copy_is_left_out_and_the_replica_on_the_next_node_serves_it(tmp_path):
    """States are verified when read to be served, not all of them up front: the own copy
    of rank 2 fails its check when read, so the restore chooses again without it and rank 2
    receives its state from its replica on node a (the other ranks read their own)."""
    run_world(tmp_path, ["a", "a", "b", "b"], "save")
    own = area(tmp_path, "b") / "shard-2-step-30.pt"
    own.write_bytes(b"x" + own.read_bytes()[1:])  # one byte changed, the size kept
    got = [o["got"] for o in run_world(tmp_path, ["a", "a", "b", "b"], "load")]
    assert [g["step"] for g in got] == [30] * 4
    assert [g["w"] for g in got] == [r * 100 + 30.0 for r in range(4)]
    assert [g["tier"] for g in got] == ["memory", "memory", "peer", "memory"]
