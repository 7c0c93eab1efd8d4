"""An attempt runs what was submitted (issue 26 item 9): `submit` copies the recipe file
into the run folder and every attempt runs the copy, so a retry after the file was edited
or deleted runs the submitted code; `--no-snapshot-code` runs the file as it is at each
attempt, and a file gone by then is named in the run's reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.cli.submit import CODE_DIR, snapshot_spec

from .daemon_scenarios import Cli

# Attempt 0 records its version, replaces (or deletes) the recipe file it was submitted
# from, and crashes; the retry records its version and ends well. A module beside the
# recipe is imported from its folder, as `python train.py` would.
TRAIN = """\
import os, sys, helper
out, original, mode = sys.argv[1:4]
with open(out, "a") as f:
    f.write(f"{helper.VERSION} v1\\n")
if len(open(out).read().splitlines()) == 1:
    if mode == "edit":
        open(original, "w").write("import sys\\nopen(sys.argv[1], 'a').write('v2\\\\n')\\n")
    else:
        os.remove(original)
    sys.exit(1)
"""


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    c = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    yield c
    c.stop_daemon()
    c("mock", "destroy", check=False)


def _submit(cli: Cli, tmp_path: Path, mode: str, *flags: str) -> tuple[str, Path]:
    train = tmp_path / "project" / "train.py"
    train.parent.mkdir()
    train.write_text(TRAIN)
    (train.parent / "helper.py").write_text("VERSION = 'helper'\n")
    out = tmp_path / "out.txt"
    run_id = cli.submit(
        "--dry-run",
        "-t",
        "10",
        "--retries",
        "1",
        *flags,
        str(train),
        "--",
        str(out),
        str(train),
        mode,
    )["run_id"]
    return run_id, out


def _ended(s: dict) -> bool:
    return s["state"] in ("COMPLETED", "FAILED", "CANCELLED")


def test_a_retry_runs_the_submitted_code_not_the_edited_file(cli, tmp_path):
    run_id, out = _submit(cli, tmp_path, "edit")
    s = cli.wait_for(run_id, _ended, 240, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["crash", "finished"], s
    assert out.read_text() == "helper v1\nhelper v1\n"  # the copy ran twice, not v2
    copy = Path(s["run_dir"]) / CODE_DIR / "train.py"
    assert copy.read_text() == TRAIN and copy.stat().st_mode & 0o777 == 0o700


def test_without_a_snapshot_a_deleted_recipe_is_named_in_the_reason(cli, tmp_path):
    run_id, out = _submit(cli, tmp_path, "delete", "--no-snapshot-code")
    s = cli.wait_for(run_id, _ended, 240, "the run to end")
    assert s["state"] == "FAILED", s
    train = tmp_path / "project" / "train.py"
    assert s["reason"].startswith(
        f"user error: {train} not found (deleted or moved since the submit?)"
    ), s
    assert not (Path(s["run_dir"]) / CODE_DIR).exists()


def test_the_snapshot_spec_runs_the_copy_with_the_recipes_folder_on_the_path():
    spec = {"command": ["/py", "/p/train.py", "--lr", "/p/train.py"], "setup": ["echo hi"]}
    got = snapshot_spec(spec, Path("/p/train.py"), Path("/run/code/train.py"))
    assert got["command"] == ["/py", "/run/code/train.py", "--lr", "/p/train.py"]  # an arg
    assert got["setup"] == ['export PYTHONPATH=/p"${PYTHONPATH:+:$PYTHONPATH}"', "echo hi"]
    script = snapshot_spec(
        {"command": ["/p/run.sh"], "setup": []}, Path("/p/run.sh"), Path("/run/code/run.sh")
    )
    assert script["command"] == ["/run/code/run.sh"] and script["setup"] == []
    other = snapshot_spec(
        {"command": ["torchrun", "x.py"], "setup": []}, Path("/p/r.py"), Path("/run/code/r.py")
    )
    assert other["code_snapshot"] is None and other["command"] == ["torchrun", "x.py"]


def test_a_script_without_its_execute_bit_runs_from_its_snapshot_only(cli, tmp_path):
    """sbatch runs a script without its execute bit (it runs its own copy); so does the
    snapshot. Without one, such a script is refused at submit, not left to exit 126."""
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\nexit 0\n")
    proc = cli("submit", "--print-script", "-t", "10", str(script))
    assert f"/{CODE_DIR}/run.sh" in proc.stdout
    proc = cli(
        "submit", "--print-script", "-t", "10", "--no-snapshot-code", str(script), check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.startswith(f"Error: recipe {script} is not executable")
        and proc.stderr.count("\n") == 1
    )
