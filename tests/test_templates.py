"""The sbatch template: a golden rendering, and the real cluster honours what it says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftslurm.core.types import JobOptions, JobState
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError
from ftslurm.recipe import Recipe
from ftslurm.templates import render_job_script

from .conftest import wait_job

GOLDEN = Path(__file__).parent / "data" / "job.sbatch.golden"


def render(**overrides) -> str:
    kwargs = dict(
        command=["python", "train.py", "--lr", "0.1"],
        options=JobOptions(
            name="my run",
            nodes=2,
            ntasks_per_node=1,
            time_limit="90",
            comment="ftslurm:run=r1:attempt=0",
            signal="B:USR1@120",
        ),
        run_id="r1",
        attempt=0,
        env={"FTSLURM_RUN_ID": "r1", "QUOTED": "a b'c"},
        setup=["module load cuda"],
    )
    kwargs.update(overrides)
    return render_job_script(**kwargs)


def test_rendering_matches_the_golden_file():
    assert render() == GOLDEN.read_text()


def test_empty_command_and_unknown_template_are_config_errors():
    with pytest.raises(ConfigError, match="nothing to run"):
        render(command=[])
    with pytest.raises(ConfigError, match="not found"):
        render(template="nope.j2")


def test_the_real_cluster_reads_the_rendered_header(backend, jobs, tmp_path):
    out = tmp_path / "out.txt"
    script = render(
        command=["bash", "-c", f"echo $SLURM_PROCID $QUOTED >> {out}"],
        options=JobOptions(
            name="my run", nodes=2, ntasks_per_node=1, time_limit="5", comment="with spaces here"
        ),
        setup=[],
    )
    job = backend.submit(script, JobOptions())
    jobs.append(job)
    info = wait_job(backend, job, lambda i: i.state.is_terminal, 60, "the end")
    assert info.state is JobState.COMPLETED
    assert (info.name, info.comment, info.time_limit_s) == ("my run", "with spaces here", 300)
    assert len(info.nodes) == 2
    assert sorted(out.read_text().splitlines()) == ["0 a b'c", "1 a b'c"]


ATTEMPT_GOLDEN = Path(__file__).parent / "data" / "attempt.sbatch.golden"


def typical_attempt() -> str:
    """The batch script the daemon submits for attempt 1 of a typical 2-node run, with a
    node excluded by the daemon and one by the user."""
    recipe = Recipe(
        command=["/opt/venv/bin/python", "/home/user/proj/train.py", "--lr", "3e-4"],
        name="llama-8b",
        nodes=2,
        gpus_per_node=4,
        time="4:00:00",
        partition="gpu",
        account="proj",
        exclude=("n9",),
        env={"NCCL_DEBUG": "WARN"},
        setup=("module load cuda",),
        num_in_job_restarts=2,
        preempt_time=120,
    )
    spec = make_spec(
        recipe,
        run_dir=Path("/home/user/.local/state/ftslurm/runs/r1"),
        backend="slurm",
        workdir="/home/user/proj",
    )
    spec["python"] = "/opt/venv/bin/python"  # the login node's interpreter, fixed here
    script, _ = build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 1, ("n3",))
    return script


def test_the_script_build_attempt_produces_for_a_typical_run_matches_the_golden_file():
    """What `build_attempt` really submits (options, environment, setup, launcher line),
    byte for byte. After an intended change: `UPDATE_GOLDEN=1 pytest -k golden`
    rewrites the file; review its diff."""
    if os.environ.get("UPDATE_GOLDEN"):
        ATTEMPT_GOLDEN.write_text(typical_attempt())
    assert typical_attempt() == ATTEMPT_GOLDEN.read_text()
