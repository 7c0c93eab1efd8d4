"""The agent-overhead and daemon-scale benchmarks run with tiny sizes and report what they
claim to measure. No timing is asserted (the numbers belong to `make bench`): only structure,
that every call happened, and the daemon's scheduler-command counts, which are behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def start(script: str, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(BENCH / script), *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


def result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Both benchmarks at once (most of their time is starting Python and importing torch)."""
    pytest.importorskip("torch")
    agent = start(
        "agent_overhead.py",
        "--calls",
        "200",
        "--rare-calls",
        "3",
        "--collective-calls",
        "20",
        "--validation-steps",
        "200",
        cwd=tmp_path_factory.mktemp("agent"),
    )
    scale = start(
        "daemon_scale.py",
        "--runs",
        "4,30",
        "--cycles",
        "2",
        "--flags",
        "3",
        cwd=tmp_path_factory.mktemp("scale"),
    )
    return {"agent": result(agent), "scale": result(scale)}


@pytest.fixture
def agent_result(results) -> dict:
    return results["agent"]


@pytest.fixture
def scale_result(results) -> dict:
    return results["scale"]


def test_agent_overhead_times_every_call_in_both_environments(agent_result):
    r = agent_result
    assert r["calls"] == 200 and r["timer_overhead_ns"] > 0
    assert all(b["median_ns"] >= 0 for b in r["baselines"].values())
    by_mode: dict[str, set[str]] = {}
    for row in r["rows"]:
        by_mode.setdefault(row["mode"], set()).add(row["call"])
        assert row["calls"] == 200
        assert 0 <= row["median_ns"] <= row["p99_ns"] <= row["max_ns"]
        assert row["mean_ns"] >= 0 and row["baseline"] in r["baselines"]
    assert set(by_mode) == {"launcher", "bare"}
    assert {'RankAgent.section("step")', "RankAgent.heartbeat(step)"} <= by_mode["bare"]
    # the shared-memory writer is only there under the launcher
    assert "HeartbeatWriter.beat(step)" in by_mode["launcher"] - by_mode["bare"]
    for row in r["rows"]:
        if row["call"] in ('RankAgent.section("step")', "RankAgent.heartbeat(step)"):
            assert row["median_ns"] > 0 and row["ratio"] is not None and row["ratio"] > 0


def test_agent_overhead_calls_left_their_traces(agent_result):
    """Every timed call really ran: the last step reached the shared-memory record, the step
    timer holds one sample per call, each due publish wrote a window."""
    r = agent_result
    calls, warmup = r["calls"], r["warmup_calls"]
    launcher, bare = r["checks"]["launcher"], r["checks"]["bare"]
    assert launcher["agent_step"] == bare["agent_step"] == calls - 1
    assert launcher["heartbeat_step_in_shared_memory"] == calls - 1
    assert launcher["step_timer_samples"] == bare["step_timer_samples"] == warmup + calls
    rare = r["checks"]["rare"]
    assert rare["progress_file_step"] == r["rare_calls"] - 1
    assert rare["windows_published"] == 1 + r["rare_calls"]  # the warm-up call publishes too
    assert [row["calls"] for row in r["rare"]] == [r["rare_calls"]] * 2


def test_agent_overhead_measures_the_agreement_collective(agent_result):
    c = agent_result["collective"]
    assert "skipped" not in c, c
    assert c["backend"] == "gloo" and c["world_size"] == 1
    for key in ("all_reduce", "should_checkpoint_first_in_step", "should_checkpoint_cached"):
        assert c[key]["calls"] == agent_result["collective_calls"] == 20
    assert c["all_reduce"]["median_ns"] > 0
    assert c["should_checkpoint_first_in_step"]["median_ns"] > 0


def test_agent_overhead_measures_result_validation_against_the_same_loop(agent_result):
    """Issue 30: validation's cost per step, next to the same loop without it."""
    v = agent_result["validation"]
    assert "skipped" not in v, v
    assert v["capture_rng"]["calls"] == v["validate"]["calls"] == 20
    assert v["loop_steps"] == v["loop_validated"]["calls"] == 200
    assert v["validated_results"] >= 20 + 200 + 100  # direct calls, the loop, its warm-up
    assert v["per_step_ns"] == v["capture_rng"]["median_ns"] + v["validate"]["median_ns"] > 0
    assert v["share_of_100ms_step"] == v["per_step_ns"] / 1e8


def test_daemon_scale_commands_per_cycle_are_constant_and_at_most_two(scale_result):
    r = scale_result
    assert r["sizes"] == [4, 30] and r["backends"] == ["mock", "memory"]
    rows = r["rows"]
    assert sorted((row["backend"], row["runs"]) for row in rows) == [
        ("memory", 4),
        ("memory", 30),
        ("mock", 4),
        ("mock", 30),
    ]
    for row in rows:
        # the first cycle also asks the cluster facts, once per backend; then one query
        assert row["first_cycle_commands"] == {"cluster_facts": 1, "query": 1}
        assert row["steady_cycle_totals"] == [1, 1] and row["commands_per_cycle"] <= 2
        assert row["steady_cycle_commands"] == {"query": 1}
        assert row["flagged"]["node_flags"] == 3 and row["flagged"]["commands_per_cycle"] <= 2
        assert row["cycle_cpu_s"] > 0 and row["rss_peak_mib"] > 0
    for kind, summary in r["summary"].items():
        assert summary["constant_commands"], kind
        assert summary["sizes"] == [4, 30] and max(summary["commands_per_cycle"]) <= 2


def test_daemon_scale_runs_half_running_on_memory_and_counts_endings(scale_result):
    rows = {(row["backend"], row["runs"]): row for row in scale_result["rows"]}
    assert rows[("memory", 30)]["running"] == 15 and rows[("mock", 30)]["running"] == 0
    churn = rows[("memory", 30)]["churn"]
    ended = churn["ended_runs"]
    assert ended == 1
    # the cycle that sees the endings: one query, one node listing, one requeue for all
    assert churn["ending_cycle"] == {"nodes": 1, "query": 1, "requeue_many": 1}
    # the next one brings the requeued jobs back: exclusions, release, start now, one each
    assert churn["requeue_cycle"] == {
        "nodes": 1,
        "query": 1,
        "update_excluded_nodes_many": 1,
        "release_many": 1,
        "start_now_many": 1,
    }
    assert rows[("mock", 30)]["churn"] is None
