"""Result validation on the real local Slurm cluster (issue 30), 2 nodes x 1 rank of
examples/recipe.py --validate, through the CLI and the daemon: a transient NaN on rank 1 is
re-run in place and the run ends bit-identical to an uninterrupted one; a persistent one
ends the attempt with 16 and the next attempt, on other nodes, completes with that node
flagged; a NaN of the model's own (on every node) ends the run FAILED with exit 17's reason
after exactly one disambiguation run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.daemon.store import Store

from .daemon_scenarios import RECIPE, Cli, daemon_cli, ended, plain, rank_node, reference_digest

pytestmark = pytest.mark.slurm

STEPS = 100


@pytest.fixture
def cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path)


def _submit(cli: Cli, tmp_path: Path, retries: int, *more: str) -> str:
    """examples/recipe.py --validate on 2 nodes x 1 rank; `more`: the CLI's options
    (--inject) and, after "--", the recipe's."""
    at = more.index("--") if "--" in more else len(more)
    options, recipe = list(more[:at]), list(more[at + 1 :])
    out = cli.submit(
        "--retries", str(retries), "-N", "2", "--ntasks-per-node", "1", "-t", "10",
        *options, str(RECIPE), "--",
        "--steps", str(STEPS), "--step-time", "0.1", "--ckpt-every", "20",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--validate", *recipe,
    )  # fmt: skip
    return out["run_id"]


def _final(tmp_path: Path) -> str:
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["step"] == STEPS
    return final["digest"]


def test_a_transient_nan_is_rerun_in_place_and_training_goes_on_bit_identical(cli, tmp_path):
    run_id = _submit(cli, tmp_path, 0, "--inject", "nan@5:1")
    s = cli.wait_for(run_id, ended, 300, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert len(s["attempts"]) == 1 and s["flagged_nodes"] == {}
    (event,) = s["result_checks"]
    node = rank_node(s["run_dir"], 0, 1)
    assert (event["rank"], event["node"], event["verdict"]) == (1, node, "transient")
    assert _final(tmp_path) == reference_digest(tmp_path, STEPS)
    assert Store(cli.home).get_run(run_id).injected == ["nan@5:1"]
    assert f"a transient fault of node {node}" in plain(cli("status", run_id).stdout)


def test_a_persistent_nan_exits_16_and_the_next_attempt_elsewhere_completes(cli, tmp_path):
    run_id = _submit(cli, tmp_path, 1, "--inject", "nan@5:1:persistent")
    s = cli.wait_for(run_id, ended, 420, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"]
    assert (first["exit_code"], second["exit_code"]) == (16, 0)
    bad = rank_node(s["run_dir"], 0, 1)
    assert bad in s["flagged_nodes"] and bad not in second["nodes"]
    assert s["job_retries_used"] == 0
    assert [(e["attempt"], e["node"], e["verdict"]) for e in s["result_checks"]] == [
        (0, bad, "persistent")
    ]
    assert _final(tmp_path) == reference_digest(tmp_path, STEPS)


def test_a_nan_everywhere_fails_the_run_with_17_after_one_disambiguation(cli, tmp_path):
    run_id = _submit(cli, tmp_path, 2, "--", "--nan-at-step", "30")
    s = cli.wait_for(run_id, ended, 420, "the run to end")
    assert s["state"] == "FAILED", s
    first, second = s["attempts"]
    assert (first["exit_code"], second["exit_code"]) == (16, 17)
    assert not set(first["nodes"]) & set(second["nodes"])
    assert "the result reproduced on different hardware: the model's" in s["reason"]
    assert [(e["attempt"], e["verdict"]) for e in s["result_checks"]] == [
        (0, "persistent"),
        (1, "model"),
    ]
    assert s["flagged_nodes"] == {}
