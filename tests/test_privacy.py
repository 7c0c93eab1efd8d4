"""What other users on the machine can see or change: the state folder is never re-moded
and one others can write to is refused; checkpoints (model weights) are private by default,
readable by the group only when the run asks for it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from ftslurm.agent.submitit_compat import save_continuation
from ftslurm.checkpoint import CheckpointManager, save_sharded
from ftslurm.cli.main import main
from ftslurm.core.contract import EnvName, JobEnv
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError
from ftslurm.fsutil import make_dirs, private_dir
from ftslurm.recipe import Recipe


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def loose_umask():
    """A umask that would let others read what is not made private on purpose."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_a_new_state_folder_and_its_missing_parents_are_private(tmp_path):
    home = tmp_path / "a" / "b" / "home"
    private_dir(home)
    assert mode(home) == 0o700
    assert mode(tmp_path / "a") == 0o700


def test_an_existing_folder_keeps_its_mode(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o755)
    private_dir(mine)
    assert mode(mine) == 0o755


@pytest.mark.parametrize("shared_mode", [0o1777, 0o775, 0o2770])
def test_a_folder_others_can_write_is_refused_and_left_as_it_is(tmp_path, shared_mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, shared_mode)
    with pytest.raises(ConfigError, match="can be written by other users"):
        private_dir(shared)
    assert mode(shared) == shared_mode


def test_the_cli_refuses_a_shared_state_folder_in_one_line(tmp_path, monkeypatch, capsys):
    shared = tmp_path / "tmpdir"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv("FTSLURM_HOME", str(shared))
    code = main(["status"])
    out, err = capsys.readouterr()
    assert code != 0
    assert err.startswith("Error: ") and "written by other users" in err
    assert "Traceback" not in err + out
    assert mode(shared) == 0o1777
    assert list(shared.iterdir()) == []


def test_make_dirs_never_touches_what_exists(tmp_path):
    os.chmod(tmp_path, 0o751)
    make_dirs(tmp_path / "x" / "y", 0o700)
    assert mode(tmp_path) == 0o751
    assert mode(tmp_path / "x") == mode(tmp_path / "x" / "y") == 0o700


def checkpoint_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*")]


def test_checkpoints_are_private_by_default(tmp_path):
    folder = tmp_path / "scratch" / "ftslurm" / "run" / "checkpoints"
    manager = CheckpointManager(folder, rank=0, world_size=1, report=False, asynchronous=False)
    manager.save(5, {"w": torch.ones(3)})
    assert mode(folder) == mode(folder.parent) == 0o700
    files = checkpoint_files(folder)
    assert files and all(mode(p) == 0o600 for p in files if p.is_file())
    assert manager.load_latest() is not None


def test_a_group_shared_run_gives_the_group_read_access(tmp_path, monkeypatch):
    monkeypatch.setenv(EnvName.CHECKPOINT_SHARING.value, "group")
    folder = tmp_path / "team" / "checkpoints"
    manager = CheckpointManager(folder, rank=0, world_size=1, report=False, asynchronous=False)
    manager.save(1, {"w": torch.ones(3)})
    assert mode(folder) == 0o750
    assert all(mode(p) == 0o640 for p in checkpoint_files(folder) if p.is_file())


def test_an_existing_checkpoint_folder_keeps_its_mode(tmp_path):
    folder = tmp_path / "given"
    folder.mkdir()
    os.chmod(folder, 0o770)  # a folder the user set up for the team
    manager = CheckpointManager(folder, rank=0, world_size=1, report=False, asynchronous=False)
    manager.save(1, {"w": torch.ones(3)})
    assert mode(folder) == 0o770
    assert all(mode(p) == 0o600 for p in checkpoint_files(folder) if p.is_file())


def test_sharded_checkpoints_are_private(tmp_path):
    final = save_sharded(tmp_path / "ck", 3, {"w": torch.ones(4)})
    assert mode(final) == 0o700
    assert [p for p in final.rglob("*") if p.is_file()]
    assert all(mode(p) == (0o600 if p.is_file() else 0o700) for p in final.rglob("*"))


def test_submitit_continuations_are_private(tmp_path):
    folder = tmp_path / "ck" / "submitit"
    save_continuation(folder, {"state": [1, 2, 3]}, 1, 0)
    assert mode(folder) == 0o700
    assert all(mode(p) == 0o600 for p in folder.iterdir())


def test_a_bad_sharing_value_is_one_line():
    with pytest.raises(ConfigError):
        JobEnv.from_environ({EnvName.CHECKPOINT_SHARING.value: "world"})
    with pytest.raises(ValueError):
        Recipe(command=["true"], checkpoint_sharing="world")


def test_the_group_setting_travels_to_the_job_and_private_adds_nothing(tmp_path):
    def script(**settings):
        recipe = Recipe(command=["python", "train.py"], time="10", **settings)
        spec = make_spec(recipe, run_dir=tmp_path / "r1", backend="slurm", workdir="/w")
        return build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 1, ())[0]

    assert f"export {EnvName.CHECKPOINT_SHARING.value}=group" in script(checkpoint_sharing="group")
    assert EnvName.CHECKPOINT_SHARING.value not in script()


def job_prologue(tmp_path: Path, **settings) -> tuple[str, Path]:
    """The batch script's part before the step of a run whose checkpoints go under
    `$SCRATCH` (tmp_path/scratch), and its checkpoint folder."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o755)
    recipe = Recipe(command=["python", "train.py"], time="10", **settings)
    spec = make_spec(
        recipe,
        run_dir=tmp_path / "home" / "runs" / "r1",
        backend="slurm",
        workdir=str(tmp_path),
        environ={"SCRATCH": str(scratch)},
    )
    script = build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 1, ())[0]
    checkpoints = Path(spec["checkpoint_dir"])
    assert checkpoints == scratch / "ftslurm" / "r1" / "checkpoints"
    return script.split("\nsrun ")[0], checkpoints


def run_prologue(prologue: str, umask: int) -> None:
    """Run it with bash, as the job's shell does, at `umask`."""
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    subprocess.run(
        ["bash", "-c", f"umask {umask:03o}\n{prologue}"], env=env, check=True, timeout=60
    )


@pytest.mark.parametrize(
    ("sharing", "folder_mode"), [("private", 0o700), ("group", 0o750)], ids=["private", "group"]
)
def test_the_job_creates_the_checkpoint_folders_under_scratch_with_the_runs_modes(
    tmp_path, sharing, folder_mode
):
    """The batch script creates `$SCRATCH/ftslurm/<run>/checkpoints` before any rank runs,
    and `ftslurm.checkpoint` then leaves it as it is: the script itself must make it (and
    every parent it creates) private, or the group's under "group", at any umask."""
    (tmp_path / "home").mkdir(mode=0o700)
    prologue, checkpoints = job_prologue(tmp_path, checkpoint_sharing=sharing)
    run_prologue(prologue, 0o022)
    for folder in (checkpoints, checkpoints.parent, checkpoints.parent.parent):
        assert mode(folder) == folder_mode, folder
    logs = tmp_path / "home" / "runs" / "r1" / "logs"
    for folder in (logs, logs.parent, logs.parent.parent):
        assert mode(folder) == 0o700, folder
    assert mode(tmp_path / "scratch") == 0o755  # the user's own, as it was
    CheckpointManager(checkpoints).save(1, {"w": torch.zeros(1)})
    assert mode(checkpoints) == folder_mode


def test_the_job_leaves_the_checkpoint_folders_the_user_has_as_they_are(tmp_path):
    """A scratch folder the user made for ftslurm (here group-writable for a team) keeps
    its mode; only what the script creates below it is private."""
    prologue, checkpoints = job_prologue(tmp_path)
    checkpoints.parent.parent.mkdir()
    os.chmod(checkpoints.parent.parent, 0o775)
    run_prologue(prologue, 0o002)
    assert mode(checkpoints.parent.parent) == 0o775
    assert mode(checkpoints.parent) == mode(checkpoints) == 0o700
