"""Hot spares: the job asks for N+K nodes with --no-kill, the launchers train on N and move
the training onto a spare inside the same job when an active node is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftslurm.cli.main import main
from ftslurm.core.contract import EnvName, JobEnv
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError
from ftslurm.recipe import Recipe


def attempt(**settings) -> tuple[str, object]:
    recipe = Recipe(command=["python", "train.py"], nodes=2, **settings)
    spec = make_spec(recipe, run_dir=Path("/runs/r1"), backend="slurm", workdir="/w")
    return build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 0, ())


def srun_line(script: str) -> str:
    return next(line for line in script.splitlines() if line.startswith("srun "))


# ---------------------------------------------------------------- submit side
def test_spares_ask_for_n_plus_k_nodes_with_no_kill_and_tell_the_launchers():
    script, options = attempt(spare_nodes=1)
    assert options.nodes == 3 and options.no_kill
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    srun = srun_line(script)
    assert " --no-kill " in srun and "--wait=" not in srun  # the step outlives a lost node
    line = f"export {EnvName.SPARE_NODES.value}="
    exported = {EnvName.SPARE_NODES.value: next(
        x.removeprefix(line) for x in script.splitlines() if x.startswith(line))}
    assert JobEnv.from_environ(exported).spare_nodes == 1


def test_without_spares_the_job_is_as_before():
    script, options = attempt()
    assert options.nodes == 2 and not options.no_kill
    assert "--no-kill" not in script and "--wait=" in srun_line(script)
    assert EnvName.SPARE_NODES.value not in script


def test_the_spec_counts_the_spares_among_the_jobs_nodes():
    """Exclusion planning and status read `options.nodes`: the job's N+K."""
    recipe = Recipe(command=["true"], nodes=2, spare_nodes=2)
    spec = make_spec(recipe, run_dir=Path("/runs/r1"), backend="slurm", workdir="/w")
    assert spec["options"]["nodes"] == 4 and spec["options"]["spare_nodes"] == 2


def test_one_node_with_a_spare_is_allowed():
    recipe = Recipe(command=["true"], nodes=1, spare_nodes=1)
    spec = make_spec(recipe, run_dir=Path("/runs/r1"), backend="slurm", workdir="/w")
    _, options = build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 0, ())
    assert options.nodes == 2 and options.no_kill


def test_spares_without_the_launcher_are_one_line():
    with pytest.raises(ConfigError, match="needs the launcher"):
        Recipe(command=["true"], nodes=2, spare_nodes=1, use_launcher=False)


@pytest.fixture()
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/bash\necho training\n")
    (tmp_path / "nolauncher.py").write_text(
        "import ftslurm\nrecipe = ftslurm.Recipe(command=['true'], use_launcher=False)\n")
    return tmp_path


@pytest.mark.parametrize("args, expected", [
    (["--spare-nodes", "-1", "train.sh"], "spare_nodes"),
    (["--spare-nodes", "1", "nolauncher.py"], "needs the launcher"),
])  # fmt: skip
def test_bad_spare_values_are_one_line_and_submit_nothing(env, capsys, args, expected):
    assert main(["submit", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error:") and expected in err and "\n" not in err, err
    assert not (env / "home" / "runs").exists() or not any((env / "home" / "runs").iterdir())


def test_submit_option_reaches_the_script(env, capsys):
    assert main(["submit", "-N", "2", "--spare-nodes", "1", "--print-script", "train.sh"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    assert f"export {EnvName.SPARE_NODES.value}=1" in script
