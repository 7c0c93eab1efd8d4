"""Each benchmark script runs (tiny sizes); the numbers themselves belong to `make bench`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_query_scaling_benchmark_runs(slurm_cluster, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "query_scaling.py"),
            "--jobs",
            "3",
            "--repeat",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["jobs"] == 3 and result["commands_per_query"] == 1.0


def test_virtual_campaign_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "virtual_campaign.py"),
            "--sizes",
            "8,16",
            "--days",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["nodes"] for r in rows] == [8, 16] and all(r["simulated_days"] > 0 for r in rows)


@pytest.mark.slow  # launcher runs and a commit measurement: about two minutes
def test_live_recovery_benchmark_runs(tmp_path):
    """Today's path and the live path on one node, small: every run ends identical; the
    rank killed after a step is restarted alone on the live path and every rank on today's
    (the crash is timed by the step, so a slow start under load cannot move it before the
    training); a straggler steps out to the spare on both paths."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "live_recovery.py"),
            "--steps",
            "80",
            "--step-time",
            "0.05",
            "--ckpt-every",
            "20",
            "--crash-step",
            "30",
            "--commit-calls",
            "20",
            "--stepout",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["identical"], result
    assert result["restarted_alone"]["live, fault"] == 1, result
    assert result["world_restarts"]["live, fault"] == 0, result
    assert result["world_restarts"]["today, fault"] == 1, result
    assert result["restarted_alone"]["today, fault"] == 0, result
    assert result["commit"]["commit_s"] > 0, result
    took = result["stepout"]["stepout_to_training_s"]
    assert result["stepout"]["identical"] and took["today"] > 0 and took["live"] > 0, result


def test_rank_setup_benchmark_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rank_setup.py"), "--device", "cpu"]
        + ["--layers", "1", "--dim", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["params"] == 12 * 16 * 16 + (3 + 1 + 4 + 1) * 16  # weights and biases
    phases = ("import_s", "context_s", "model_build_s", "first_step_s")
    assert result["total_s"] >= sum(result[p] for p in phases) - 0.01


def test_health_check_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "health_check.py"), "--repeat", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bound_s"] == 5.0
    assert 0 < result["local_checks"]["median_s"] <= result["local_checks"]["max_s"]
    assert "with_network_probe_8_nodes" in result
