"""Hot spares on the real local cluster: 2 active nodes + 1 spare, a plain DDP script
(examples/recipe.py: gloo, an all-reduce per parameter every step, rank 0 checkpointing every
10 steps). SlurmdTimeout is raised to 300 s so that it is the spare, not Slurm, that
recovers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from ftslurm.agent import spares as sp
from ftslurm.core.contract import RunDir
from ftslurm.daemon.store import Store

from .conftest import wait_file, wait_for
from .daemon_scenarios import Cli, daemon_cli, reference_digest, spare_recipe

pytestmark = pytest.mark.slurm

STEPS = 300


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


def test_a_spare_replaces_a_killed_node_in_the_same_job_within_30s(
    cli, healthy_nodes, tmp_path, measurements
):
    expected = reference_digest(tmp_path, STEPS)
    with healthy_nodes.slurmd_timeout(300):
        out = cli.submit(str(spare_recipe(tmp_path, STEPS)))
        job_id = out["job_id"]
        run = RunDir(cli.status(out["run_id"])["run_dir"])
        wait_file(
            run.progress,
            lambda text: bool(text) and json.loads(text).get("checkpoint_step", 0) >= 20,
            240,
            "two checkpoints",
        )
        leases = {r: sp.read_lease(run, 0, r) for r in range(3)}
        assert [lease.role if lease else None for lease in leases.values()] == [
            sp.ACTIVE,
            sp.ACTIVE,
            sp.SPARE,
        ], leases
        victim = leases[1].node  # active, and not the batch host (node rank 0)
        healthy_nodes.fail_node(victim)
        killed_at = time.time()
        record_path = run.round_record(0, 1)
        record = wait_for(
            lambda: (
                (json.loads(record_path.read_text()) if record_path.exists() else {}).get(
                    "first_step_at"
                )
                and json.loads(record_path.read_text())
            ),
            90,
            "the first step with the spare",
        )
        took = record["first_step_at"] - killed_at
        measurements.record("hot spare: kill -> first new step s (SlurmdTimeout 300)", took)
        assert took < 30, record
        assert record["lost"] == [victim] and record["world_size"] == 2
        assert record["job_id"] == job_id and record["spares_left"] == 0
        final = wait_file(tmp_path / "ckpt" / "final.json", bool, 240, "the end of training")
        # The dead node's task holds the step (--no-kill) until Slurm's verdict, 300 s
        # away: the daemon ends the run once the live launchers have all reported.
        s = wait_for(
            lambda: (lambda s: s if s["state"] == "COMPLETED" else None)(
                cli.summary(out["run_id"])
            ),
            90,
            "the run to complete before Slurm's verdict",
        )
        assert time.time() - killed_at < 240  # well before SlurmdTimeout after the kill
        assert [a["job_id"] for a in s["attempts"]] == [job_id], s  # the same job, no requeue
        store = Store(cli.home)
        try:
            assert victim in {f.node for f in store.node_flags()}  # kept out of later jobs
        finally:
            store.close()
    data = json.loads(final)
    assert data["step"] == STEPS and data["digest"] == expected  # bit for bit
    reports = [json.loads(run.node_report(0, r).read_text()) for r in (0, 2)]
    assert [r["outcome"] for r in reports] == ["finished", "finished"], reports
    assert reports[0]["spare_swaps"] == 1 and reports[0]["in_job_restarts"] == 1
    assert not run.node_report(0, 1).exists()  # the killed node's launcher wrote nothing
    assert leases[2].node != victim
