"""Each benchmark script runs (tiny sizes); the numbers themselves belong to `make bench`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
