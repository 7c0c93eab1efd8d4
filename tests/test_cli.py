"""The `ftslurm` command line: one-line errors, exit codes, nothing submitted on bad input."""

from __future__ import annotations

import json

from ftslurm.cli.main import main
from ftslurm.core.types import JobState

from .conftest import wait_job


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, fragment: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("Error: ") and fragment in lines[0]
    assert "Traceback" not in err


def test_version(capsys):
    code, out, _ = run(capsys, "version")
    assert code == 0 and out.strip() == "0.1.0"


def test_every_command_has_help(capsys):
    commands = [
        "submit",
        "query",
        "cancel",
        "requeue",
        "release",
        "start-now",
        "exclude",
        "signal",
        "nodes",
        "facts",
    ]
    for command in commands:
        code, out, _ = run(capsys, "scheduler", command, "--help")
        assert code == 0 and "Usage" in out, command


def test_missing_script_is_a_one_line_error(capsys, tmp_path):
    code, _, err = run(capsys, "scheduler", "submit", str(tmp_path / "nope.sh"))
    assert_one_line_error(code, err, "does not exist")


def test_malformed_time_limit_is_refused_before_submitting(capsys, tmp_path, monkeypatch):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch reachable: must not be needed
    code, _, err = run(capsys, "scheduler", "submit", str(script), "-t", "ten minutes")
    assert_one_line_error(code, err, "malformed time limit 'ten minutes'")


def test_unknown_backend_lists_the_valid_ones(capsys):
    code, _, err = run(capsys, "scheduler", "nodes", "--backend", "lsf")
    assert_one_line_error(code, err, "choose one of auto, slurm, pyslurm, mock")


def test_usage_error_exits_2(capsys):
    code, _, _ = run(capsys, "scheduler", "no-such-command")
    assert code == 2


def test_unknown_partition_on_the_real_cluster(capsys, tmp_path, backend):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    code, _, err = run(capsys, "scheduler", "submit", str(script), "-p", "nosuchpartition")
    assert_one_line_error(code, err, "Invalid partition")


def test_submit_and_query_json_on_the_real_cluster(capsys, tmp_path, backend, jobs):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    code, out, _ = run(
        capsys, "scheduler", "submit", str(script), "-N", "2", "--name", "cli", "--json"
    )
    assert code == 0
    job = json.loads(out)["job_id"]
    jobs.append(job)
    wait_job(backend, job, lambda i: i.state is JobState.RUNNING, 30, "RUNNING")
    code, out, _ = run(capsys, "scheduler", "query", job, "--json")
    info = json.loads(out)[job]
    assert code == 0 and info["state"] == "RUNNING" and len(info["nodes"]) == 2
    assert info["name"] == "cli"
    code, _, _ = run(capsys, "scheduler", "cancel", job)
    assert code == 0
    wait_job(backend, job, lambda i: i.state is JobState.CANCELLED, 30, "CANCELLED")
