"""Result validation end to end on the mock (issue 30, the daemon's side): a rank that
exits 16 has its attempt's nodes flagged ("result validation") and the run re-run on other
nodes, in a fresh job that tells the ranks it is a disambiguation run
(`ftslurm.agent.rank.disambiguation()`); there a 17 (the result reproduced) ends the run
FAILED and unflags those nodes, and a 0 completes it with the nodes still flagged. Through
the real CLI and daemon (`submit --dry-run`), `status` and `report` included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.daemon.store import Store

from .daemon_scenarios import (
    RECIPE,
    Cli,
    daemon_cli_on_a_mock,
    ended,
    plain,
    rank_node,
    reference_digest,
)

pytestmark = pytest.mark.slow  # two daemon runs of two short attempts each

# The rank agent's validation comes later (issue 30 item 1): this script plays its part.
# An ordinary attempt finds its result suspicious and asks to resume elsewhere (16); a
# disambiguation run reads the context and says whether the result reproduced (17) or not.
SCRIPT = r"""
import sys
from ftslurm.agent import rank

context = rank.disambiguation()
if context is None:
    print("suspicious result: resume elsewhere", flush=True)
    sys.exit(16)
print(f"disambiguation run of attempt {context.attempt} (its nodes {list(context.nodes)})",
      flush=True)
sys.exit(17 if sys.argv[1] == "reproduces" else 0)
"""


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    yield from daemon_cli_on_a_mock(tmp_path)


def _validated(cli: Cli, tmp_path: Path, verdict: str) -> tuple[dict, list[str]]:
    """Submit the script on one node with the verdict its disambiguation run gives; wait
    for the run's end; the summary and the nodes flagged after the first attempt."""
    script = tmp_path / "validate.py"
    script.write_text(SCRIPT)
    out = cli.submit("--dry-run", "-N", "1", "--retries", "2", str(script), "--", verdict)
    s = cli.wait_for(out["run_id"], ended, 120, "the run to end")
    store = Store(cli.home)
    try:
        events = store.events(out["run_id"])
    finally:
        store.close()
    flagged = [n for e in events if e.kind == "validation" for n in e.data.get("flagged", [])]
    return s, flagged


def test_a_result_that_reproduces_on_other_nodes_fails_the_run_and_unflags_them(cli, tmp_path):
    s, flagged = _validated(cli, tmp_path, "reproduces")
    assert s["state"] == "FAILED", s
    first, second = s["attempts"]
    assert (first["exit_code"], first["cause"]) == (16, "resume_elsewhere")
    assert (second["exit_code"], second["cause"]) == (17, "failed_validation")
    assert flagged == first["nodes"] and not set(first["nodes"]) & set(second["nodes"])
    assert "the result reproduced on different hardware: the model's" in s["reason"]
    assert s["job_retries_used"] == 0  # the first disambiguation is free
    assert s["flagged_nodes"] == {} and not set(flagged) & set(s["excluded_nodes"])  # cleared
    assert [v["verdict"] for v in s["validation"]] == ["disambiguate", "reproduced"]
    shown = plain(cli("status", s["run_id"]).stdout)
    assert f"nodes flagged (result validation): {flagged[0]}" in shown
    assert "disambiguation run on other nodes" in shown
    assert "the model's fault, not the machine's; nodes unflagged" in shown
    report = plain(cli("report", s["run_id"]).stdout)
    assert "exited 16" in report and "exited 17" in report


def test_a_result_that_does_not_reproduce_completes_with_the_nodes_flagged(cli, tmp_path):
    s, flagged = _validated(cli, tmp_path, "does-not-reproduce")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"]
    assert first["exit_code"] == 16 and second["exit_code"] == 0
    assert not set(first["nodes"]) & set(second["nodes"])
    assert s["flagged_nodes"] == {n: "result validation (exit 16)" for n in flagged} != {}
    assert s["job_retries_used"] == 0
    listed = json.loads(cli("nodes", "list", "--json").stdout)
    assert {(f["node"], f["reason"]) for f in listed} == {
        (n, "result validation (exit 16)") for n in flagged
    }
    shown = plain(cli("status", s["run_id"]).stdout)
    assert f"nodes flagged by this run: {flagged[0]}: result validation (exit 16)" in shown


# ---------------------------------------------------------------------------------------
# The rank agent's side (issue 30 items 1 and 3): examples/recipe.py --validate on 2 nodes
# x 1 rank, with an injected NaN (transient, or persistent on its node) or a NaN of the
# model's own (--nan-at-step: rank 0's batch of that step, on every node).
STEPS = 100


def _recipe(tmp_path: Path, *args: str) -> Path:
    flags = ["--steps", str(STEPS), "--step-time", "0.05", "--ckpt-every", "20"]
    flags += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--validate", *args]
    path = tmp_path / "validated.py"
    path.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(RECIPE)!r}, *{flags!r}], "
        "nodes=2, ntasks_per_node=1)\n"
    )
    return path


def _final(tmp_path: Path) -> str:
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["step"] == STEPS
    return final["digest"]


def test_transient_nans_are_rerun_in_place_the_run_goes_on_bit_identical_and_the_node_flagged(
    cli, tmp_path
):
    """Two transient faults on rank 1 (each fires once, on a step of its own): each step is
    re-run in place and training goes on, bit-identical to an uninterrupted run; two on one
    node (`transient_faults_to_flag`) flag it when the attempt ends."""
    specs = ["nan@2:1", "nan@3:1"]
    out = cli.submit(
        "--dry-run", "--retries", "0", "--inject", specs[0], "--inject", specs[1],
        str(_recipe(tmp_path)),
    )  # fmt: skip
    s = cli.wait_for(out["run_id"], ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    node = rank_node(s["run_dir"], 0, 1)
    assert len(s["attempts"]) == 1 and list(s["flagged_nodes"]) == [node], s
    assert "result validation: 2 transient result faults on its ranks" in str(
        s["flagged_nodes"][node]
    )
    (flaky,) = s["validation"]
    assert (flaky["verdict"], flaky["flagged"]) == ("flaky", [node])
    first, second = s["result_checks"]
    assert first["step"] < second["step"]
    for event in (first, second):
        assert (event["rank"], event["node"], event["kind"]) == (1, node, "nan")
        assert (event["verdict"], event["action"], event["differed"]) == (
            "transient",
            "go_on",
            True,
        )
    assert _final(tmp_path) == reference_digest(tmp_path, STEPS)  # as if nothing happened
    assert sorted(Store(cli.home).get_run(out["run_id"]).injected) == specs
    shown = plain(cli("status", s["run_id"]).stdout)
    assert f"rank 1 on {node}: nan result (nan) re-run in place" in shown
    assert f"a transient fault of node {node} (recorded); training went on" in shown
    assert "2 steps re-run in place, 2 re-runs differed" in shown
    assert f"nodes flagged (result validation): {node}: result validation: 2 transient" in shown
    assert f"transient fault of node {node}" in plain(cli("report", s["run_id"]).stdout)


def test_a_persistent_nan_exits_16_and_the_next_attempt_elsewhere_completes(cli, tmp_path):
    recipe = _recipe(tmp_path)
    out = cli.submit("--dry-run", "--retries", "1", "--inject", "nan@2:1:persistent", str(recipe))
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"]
    assert (first["exit_code"], first["cause"], second["exit_code"]) == (16, "resume_elsewhere", 0)
    bad = rank_node(s["run_dir"], 0, 1)
    assert bad in s["flagged_nodes"] and bad not in second["nodes"]
    assert s["job_retries_used"] == 0
    (event,) = s["result_checks"]
    assert (event["attempt"], event["node"], event["verdict"]) == (0, bad, "persistent")
    # resumed from the last good state saved before the suspicious step: bit-identical
    assert _final(tmp_path) == reference_digest(tmp_path, STEPS)
    shown = plain(cli("status", s["run_id"]).stdout)
    assert "reproduced on this hardware: last good state checkpointed, exit 16" in shown
    assert f"nodes flagged (result validation): {', '.join(first['nodes'])}" in shown


def test_a_nan_of_the_model_fails_the_run_with_exit_17_after_one_disambiguation(cli, tmp_path):
    recipe = _recipe(tmp_path, "--nan-at-step", "30")
    out = cli.submit("--dry-run", "--retries", "2", str(recipe))
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    assert s["state"] == "FAILED", s
    first, second = s["attempts"]  # exactly one disambiguation run
    assert (first["exit_code"], second["exit_code"]) == (16, 17)
    assert not set(first["nodes"]) & set(second["nodes"])
    assert "the result reproduced on different hardware: the model's" in s["reason"]
    assert [(e["attempt"], e["step"], e["rank"], e["verdict"]) for e in s["result_checks"]] == [
        (0, 30, 0, "persistent"),
        (1, 30, 0, "model"),
    ]
    assert s["flagged_nodes"] == {}  # unflagged: not the machines' fault
    shown = plain(cli("report", s["run_id"]).stdout)
    assert "reproduced on other hardware: the model's fault, not the machine's: exit 17" in shown
