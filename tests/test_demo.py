"""`make demo` is the first thing a user runs: it must pass, end to end, on real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the whole `make demo`

ROOT = Path(__file__).resolve().parent.parent


def test_mock_demo_survives_node_failure_and_preemption_with_identical_parameters(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo_mock.py")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "demo passed" in out
    flat = " ".join(out.split())
    summary = flat[flat.find("with faults:"):][:300]
    assert "(node_fail, checkpointed, finished), excluded n2" in flat, summary
