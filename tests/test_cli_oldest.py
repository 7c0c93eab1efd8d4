"""The CLI on the oldest typer and click pyproject allows (issue 26 item 4: its last-resort
handler, usage errors and help must work on every version it admits, not only the newest
installed here): those versions go to a folder of their own, first on the path of a pytest
that runs the CLI's tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLI_TESTS = ["tests/test_cli_main.py", "tests/test_cli_bad_input.py"]


def floor(name: str) -> str:
    """`name==X` for pyproject's `name>=X`."""
    found = re.search(rf'"{name}>=([\w.]+)"', (REPO / "pyproject.toml").read_text())
    assert found, f"pyproject names no floor for {name}"
    return f"{name}=={found.group(1)}"


@pytest.mark.slow
def test_the_cli_works_on_the_oldest_typer_and_click_allowed(tmp_path):
    typer, click = floor("typer"), floor("click")
    slim = typer.replace("typer==", "typer-slim==")  # typer 0.12 ships its code as typer-slim
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            typer,
            slim,
            click,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if pip.returncode != 0:
        why = f"cannot install {typer}, {click}: {pip.stderr.strip()[-200:]}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # as conftest's IN_CI
            pytest.fail(why)  # CI installs from the package index: there, this must not skip
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "FTSLURM_TEST_SUMMARY"}  # the outer's
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    versions = subprocess.run(
        [sys.executable, "-c", "import typer, click; print(typer.__version__, click.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert versions.stdout.split() == [typer.split("==")[1], click.split("==")[1]]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slurm and not slow",
            *CLI_TESTS,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
