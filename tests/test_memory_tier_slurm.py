"""The memory checkpoint tier on the real local Slurm cluster: 2 nodes x 2 ranks and a hot
spare keep every checkpoint in node memory (a replica on the other node) and every third on
disk; a node is killed after a checkpoint that only memory holds. The ranks restart in the
same job on the survivor and the spare and restore that newer step, the spare's ranks from
the replica on the survivor, and the run ends bit-identical to an uninterrupted one. (With
the survivor's copies corrupted, the ranks fall back to the disk: the ranks' code, the same
whichever the scheduler, tested with real ranks in `test_memory_checkpoint.py`; this module
ran that case too until the suite outgrew its time.)

(A fresh job after a lost node gets whatever nodes Slurm gives it: on this cluster the
survivor is still completing the old job, the new one lands on two other nodes, and the
disk serves, as `test_lost_node_slurm.py` shows.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from ftslurm.agent import spares as sp
from ftslurm.core.contract import RunDir
from ftslurm.fsutil import read_json

from .conftest import wait_for
from .daemon_scenarios import RECIPE, Cli, daemon_cli, ended, reference_digest

pytestmark = pytest.mark.slurm

STEPS, EVERY, DISK_EVERY = 100, 10, 3  # memory at 10, 20, 30, ...; disk at 30, 60, ...


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path)


def test_a_lost_nodes_ranks_restore_from_the_peer_replica_in_memory(cli, healthy_nodes, tmp_path):
    ckpt = tmp_path / "ckpt"
    expected = reference_digest(tmp_path, STEPS, world=4)
    with healthy_nodes.slurmd_timeout(300):  # the spare, not Slurm, handles the loss
        out = cli.submit(
            "--retries",
            "0",
            "-N",
            "2",
            "--spare-nodes",
            "1",
            "--ntasks-per-node",
            "2",
            "-t",
            "10",
            str(RECIPE),
            "--",
            "--steps",
            str(STEPS),
            "--step-time",
            "0.2",
            "--ckpt-every",
            str(EVERY),
            "--disk-every",
            str(DISK_EVERY),
            "--checkpoint-dir",
            str(ckpt),
        )
        run_id = out["run_id"]
        run_dir = RunDir(cli.status(run_id)["run_dir"])

        def past_a_memory_only_checkpoint() -> int | None:
            step = (read_json(run_dir.progress) or {}).get("step")
            # rank 0 past step 40 has passed the barrier of the checkpoint at 40, which
            # memory alone holds (the disk has 30), and is not at 50's yet; it reports its
            # step at most once a second, every 5 steps or so at 0.2 s a step
            return step if isinstance(step, int) and 41 <= step <= 49 else None

        at = wait_for(past_a_memory_only_checkpoint, 180, "training between steps 41 and 49")
        leases = [sp.read_lease(run_dir, 0, r) for r in range(3)]
        assert [x.role if x else None for x in leases] == [sp.ACTIVE, sp.ACTIVE, sp.SPARE]
        healthy_nodes.fail_node(leases[1].node)  # type: ignore[union-attr]
        s = cli.wait_for(run_id, ended, 300, "the run to end")
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 1, s  # the spare took over
    final = json.loads((ckpt / "final.json").read_text())
    assert final == {"step": STEPS, "digest": expected}  # bit-identical
    log = cli("logs", run_id, "--attempt", "0").stdout
    # the first round, then the one with the spare (torch's restart count starts again at
    # 0 in the spare's new rendezvous)
    first, start = re.findall(
        r"rank 0 of 4 starts at step (\d+) \(attempt 0, in-job restart "
        r"\d+\) from (\w+)",
        log,
    )
    assert first == ("0", "nothing"), log
    restored = re.findall(
        r"rank (\d) restored step (\d+) from (its node memory|a peer replica)", log
    )
    # the newest checkpoint before the kill, in memory only (the disk has 30): 40, or 50
    # when the kill (through sudo, slow under load) came after rank 0 passed it
    memory_step = int(start[0])
    assert memory_step in (40, 50), (at, log)
    assert sorted(r for r, _, _ in restored) == ["0", "1", "2", "3"], log
    assert {t for _, _, t in restored} == {"its node memory", "a peer replica"}, log
    assert {int(x) for _, x, _ in restored} == {memory_step}
