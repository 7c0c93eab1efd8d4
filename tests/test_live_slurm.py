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
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.runfiles import read_reports

from .daemon_scenarios import RECIPE, Cli, daemon_cli, ended

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ARGS = ["--live", "--steps", "800", "--step-time", "0.05", "--ckpt-every", "50"]


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


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
    recipe = [sys.executable, str(RECIPE), *ARGS, "--checkpoint-dir", str(tmp / "ckpt")]
    proc = subprocess.run(
        [*launcher, *recipe], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "ckpt" / "final.json").read_text())


def test_a_crashed_rank_on_the_second_node_is_restarted_alone(cli, tmp_path):
    reference = uninterrupted(tmp_path / "reference")
    ckpt = tmp_path / "ckpt"
    out = cli.submit(
        *("-N", "2", "--ntasks-per-node", "2", "--in-job-restarts", "2"),
        *("--inject", "crash@30:3"),
        str(RECIPE),
        "--",
        *ARGS,
        *("--checkpoint-dir", str(ckpt)),
    )
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    log = cli("logs", out["run_id"], "--attempt", "0").stdout
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 1, (s, log[-4000:])
    assert "restarted alone" in log, log[-4000:]
    assert log.count("rank 0 of 4 starts at step") == 1, log[-4000:]  # never every rank
    (record,) = read_reports(RunDir(s["run_dir"]), Kind.LIVE, 0)
    assert 3 in record.receivers and record.state_from is not None, record
    assert json.loads((ckpt / "final.json").read_text()) == reference, log[-4000:]
