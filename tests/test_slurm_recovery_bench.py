"""benchmarks/slurm_recovery.py runs on the real cluster (one repeat of the signal-precision
half, about a minute); the numbers themselves belong to a full run of the benchmark."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent


def test_slurm_recovery_benchmark_preempt_smoke(slurm_cluster, healthy_nodes, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "slurm_recovery.py"),
            "--repeat",
            "1",
            "--only",
            "preempt",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "recovery" not in result and result["repeat"] == 1
    assert result["cluster"]["SlurmdTimeout"] and result["cluster"]["KillWait"]
    pre = result["preempt"]
    assert pre["preempt_time_s"] == 60 and pre["time_limit_s"] == 120
    assert sorted(r["source"] for r in pre["repeats"]) == ["ftslurm", "slurm"]
    for row in pre["repeats"]:  # both the daemon and Slurm delivered the signal to the rank
        assert row["received"], row
        assert row["start"] and row["due"] == row["start"] + 60
        assert math.isfinite(row["error_s"])
    for side in ("ftslurm", "slurm"):
        assert pre[side]["received"] == 1
        assert pre[side]["abs_error_s"]["n"] == 1
    # Sanity only: the daemon signals on its own clock, not on Slurm's 30 s timer.
    assert abs(pre["ftslurm"]["error_s"]["median"]) < 30
