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

from .daemon_scenarios import Cli, daemon_cli_on_a_mock, ended, plain

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
