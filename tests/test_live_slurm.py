"""Live recovery on the real cluster: 2 nodes x 2 ranks of the example recipe with --live,
one rank crashed by the in-job injection. Its launcher restarts it alone; the other ranks,
on both nodes, keep their processes (the coordinator is node rank 0's rendezvous store,
published in the run directory); the run ends in its first job with the parameters of an
uninterrupted run of the same 4 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.agent import spares as sp
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.fsutil import read_json
from ftslurm.runfiles import read_reports

from .conftest import wait_for
from .daemon_scenarios import (
    RECIPE,
    Cli,
    daemon_cli,
    ended,
    rank_crash_restarted_alone,
    started_once,
    straggler_steps_out_live,
    taken_over,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ARGS = ["--live", "--steps", "800", "--step-time", "0.05", "--ckpt-every", "50"]


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final parameters of the same 4 ranks on this machine under one launcher, nothing
    injected: run once for the module's tests, which compare with it bit for bit."""
    return uninterrupted(tmp_path_factory.mktemp("reference"))


def uninterrupted(tmp: Path) -> dict:
    """The same 4 ranks on this machine under one launcher, nothing injected."""
    for name in ("run", "ckpt"):
        (tmp / name).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
    env.update(
        FTSLURM_RUN_DIR=str(tmp / "run"),
        FTSLURM_MEMORY_DIR=str(tmp / "memory"),
        MASTER_ADDR="127.0.0.1",
    )
    launcher = [sys.executable, "-m", "ftslurm.agent.launch", "--nproc-per-node", "4", "--"]
    # (no step time: the parameters do not depend on it, and 800 steps of it are 40 s)
    args = [*ARGS[: ARGS.index("--step-time")], *ARGS[ARGS.index("--step-time") + 2 :]]
    recipe = [sys.executable, str(RECIPE), *args, "--checkpoint-dir", str(tmp / "ckpt")]
    proc = subprocess.run(
        [*launcher, *recipe], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "ckpt" / "final.json").read_text())


def test_a_crashed_rank_on_the_second_node_is_restarted_alone(cli, reference, tmp_path):
    """With the `live_recovery` setting: in training, the node's warm standby normally
    waits and takes the crashed rank's place (else the rank is restarted cold)."""
    final = rank_crash_restarted_alone(
        cli, RECIPE, tmp_path / "ckpt", ARGS, dry_run=False, live_recovery=True
    )
    assert final == reference


def test_a_killed_node_is_taken_over_by_a_warm_spare(cli, healthy_nodes, reference, tmp_path):
    """2 nodes x 2 ranks and a warm spare (`--live-recovery`), Slurm's default
    SlurmdTimeout: node 1 is killed mid-training (its slurmd, launcher and ranks). The ranks
    of node 0 keep their processes, the spare's waiting ranks take ranks 2 and 3 over and
    receive the state from a running rank, and the run ends in its first job with the
    parameters of an uninterrupted run of the same 4 ranks."""
    ckpt = tmp_path / "ckpt"
    with healthy_nodes.slurmd_timeout(300):  # the spare, not Slurm, handles the loss
        out = cli.submit(
            *("-N", "2", "--spare-nodes", "1", "--live-recovery", "--ntasks-per-node", "2"),
            str(RECIPE),
            "--",
            *ARGS,
            *("--checkpoint-dir", str(ckpt)),
        )
        run_id = out["run_id"]
        run_dir = RunDir(cli.status(run_id)["run_dir"])

        def training() -> int | None:
            step = (read_json(run_dir.progress) or {}).get("step")
            return step if isinstance(step, int) and step >= 150 else None

        wait_for(training, 240, "training past step 150")
        leases = [sp.read_lease(run_dir, 0, r) for r in range(3)]
        assert [x.role if x else None for x in leases] == [sp.ACTIVE, sp.ACTIVE, sp.SPARE]
        killed_at = time.time()
        healthy_nodes.fail_node(leases[1].node)  # type: ignore[union-attr]
        s = cli.wait_for(run_id, ended, 300, "the run to end")
    log = cli("logs", run_id, "--attempt", "0").stdout
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 1, (s, log[-4000:])
    assert started_once(log), log[-4000:]  # never every rank
    assert "took over from node rank 1" in log, log[-4000:]
    records = read_reports(run_dir, Kind.LIVE, 0)
    assert [r.took_over for r in records] == [1], records
    (record,) = records
    took = taken_over(log, 1)
    assert len(took) == 2 and sorted(record.receivers) == took, (record, log[-4000:])
    assert record.state_from is not None and record.state_from not in took, record
    assert json.loads((ckpt / "final.json").read_text()) == reference, log[-4000:]
    print(
        f"node killed -> first committed step with the spare: "
        f"{record.first_commit_at - killed_at:.2f}s; step {record.step} run again"
    )


def test_a_straggler_steps_out_to_a_warm_spare(cli, reference, tmp_path):
    """2 nodes x 2 ranks and a warm spare: the second node is slowed 4-fold from 2 s in and
    judged a persistent straggler after two 3 s windows; its launcher steps out, the
    spare's waiting ranks take ranks 2 and 3 over live, and the run ends in its first job
    with the parameters of an uninterrupted run of the same 4 ranks."""
    final = straggler_steps_out_live(cli, tmp_path, ARGS, interval_s=3.0, dry_run=False)
    assert final == reference
