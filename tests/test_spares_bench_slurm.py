"""A hung node steps out for the spare on the real local cluster: 2 active nodes + 1 spare,
examples/recipe.py, node rank 1's rank stopped (SIGSTOP) mid-training."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest

from ftslurm.core.contract import RunDir
from ftslurm.fsutil import read_json

from .conftest import wait_file, wait_for
from .daemon_scenarios import (
    Cli,
    daemon_cli,
    ended,
    lease_of,
    reference_digest,
    spare_recipe,
    training_process,
    wait_trained,
)

pytestmark = pytest.mark.slurm

STEPS = 300
STEP_TIME_S = 0.1  # 30 s of training at least: the rank stopped at step 20 is mid-training


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path, PYTHONWARNINGS="ignore")


def test_a_hung_node_steps_out_and_the_spare_trains_on_in_the_same_job(cli, tmp_path, measurements):
    expected = reference_digest(tmp_path, STEPS)
    recipe = spare_recipe(
        tmp_path,
        STEPS,
        ", section_timeouts={'step': 3.0, 'compute': 3.0, "
        "'checkpointing': 5.0}, out_of_section_timeout=3.0",
        step_time=STEP_TIME_S,
    )
    out = cli.submit(str(recipe))
    run = RunDir(cli.status(out["run_id"])["run_dir"])
    # Forced timing: node rank 1 (not the batch host, which never steps out) has its rank
    # stopped once training passed step 20. The hang injection aims at a rank, which torch's
    # rendezvous may have put on the batch host.
    wait_trained(run, 20)
    os.kill(training_process(lease_of(run, 0, 1)["pid"]), signal.SIGSTOP)
    record_path = run.round_record(0, 1)

    def first_step_with_the_spare() -> dict | None:
        record = read_json(record_path) or {}
        if record.get("first_step_at"):
            return record
        s = cli.summary(out["run_id"])
        assert not ended(s), f"the run ended ({s['state']}) before a round with the spare: {s}"
        return None

    record = wait_for(first_step_with_the_spare, 180, "the first step with the spare")
    benched = [json.loads(p.read_text()) for p in run.recovery(0).glob("benched-*.json")]
    assert len(benched) == 1 and benched[0]["why"] == "hang", benched
    assert benched[0]["node_rank"] == 1  # the node whose rank was stopped
    took = record["first_step_at"] - benched[0]["time"]
    measurements.record("hung node stepped out -> first step with the spare s", took)
    assert took < 30, record
    assert record["lost"] == [benched[0]["node"]] and "stepped out (hang" in record["why"]
    assert record["job_id"] == out["job_id"]
    s = wait_for(
        lambda: (lambda s: s if ended(s) else None)(cli.summary(out["run_id"])),
        240,
        "the run's end",
    )
    assert s["state"] == "COMPLETED", s  # the benched node's exit 0 changed no verdict
    assert [a["job_id"] for a in s["attempts"]] == [out["job_id"]], s  # no requeue
    final = json.loads(wait_file(tmp_path / "ckpt" / "final.json", bool, 10, "final.json"))
    assert final["step"] == STEPS and final["digest"] == expected  # bit for bit
    stepped = json.loads(run.node_report(0, benched[0]["node_rank"]).read_text())
    assert stepped["outcome"] == "benched" and stepped["exit_code"] == 0
