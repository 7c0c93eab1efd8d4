"""torchrun scripts under ftslurm (issue 29 item 4): a run whose command is `torchrun ...`
runs its script under ftslurm's launcher, with torchrun's shape, so the script gets the
checkpoint signal (torchrun would not forward it: PyTorch #154849).

The table tests read torchrun's options (pure); the end-to-end tests run a plain torch
script written for `torchrun --nproc-per-node 2` (examples/torchrun_ddp.py) through the
daemon, on the mock with a preemption and a lost node, and on the real cluster: the
checkpoint signal before the wall limit reaches both ranks, they save at one step, the
continuations resume there and end with the parameters of an uninterrupted torchrun run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftslurm.cli.main import main
from ftslurm.core.torchrun import Mode, Torchrun, parse_torchrun, torchrun_args
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError
from ftslurm.recipe import Recipe, code_file, load_recipe

from .daemon_scenarios import Cli, daemon_cli, daemon_cli_on_a_mock, ended

PY = sys.executable


@pytest.mark.parametrize(
    "command,args",
    [
        (["torchrun", "train.py"], ["train.py"]),
        (["/opt/venv/bin/torchrun", "--nnodes=2", "t.py"], ["--nnodes=2", "t.py"]),
        (["python", "-m", "torch.distributed.run", "t.py"], ["t.py"]),
        (["python3.11", "-u", "-m", "torch.distributed.run", "t.py"], ["t.py"]),
        ([PY, "-mtorch.distributed.run", "t.py"], ["t.py"]),
        (["python", "train.py"], None),
        (["python", "-m", "torch.distributed.launch", "t.py"], None),
        (["./torchrun.sh", "t.py"], None),
        ([], None),
        (None, None),
    ],
)
def test_which_commands_run_torchrun(command, args):
    assert torchrun_args(command) == args


@pytest.mark.parametrize(
    "args,expected",
    [
        (["train.py"], Torchrun(script=("train.py",))),
        (
            ["--nproc-per-node", "2", "train.py", "--lr", "0.1"],
            Torchrun(script=("train.py", "--lr", "0.1"), nproc_per_node=2),
        ),
        (
            ["--nproc_per_node=4", "--nnodes", "2:2", "--max-restarts=3", "t.py"],
            Torchrun(script=("t.py",), nnodes=2, nproc_per_node=4, max_restarts=3),
        ),
        (["--nnodes=3", "t.py"], Torchrun(script=("t.py",), nnodes=3)),
        (["--nproc-per-node", "gpu", "t.py"], Torchrun(script=("t.py",), nproc_per_node="gpu")),
        (["--nproc-per-node=auto", "t.py"], Torchrun(script=("t.py",), nproc_per_node="gpu")),
        (
            [
                "--standalone",
                "--rdzv-backend=c10d",
                "--rdzv_endpoint",
                "host:29400",
                "--rdzv-id",
                "42",
                "--master-port",
                "1234",
                "-r",
                "3",
                "-t3",
                "--log-dir=logs",
                "t.py",
            ],
            Torchrun(
                script=("t.py",),
                ignored=(
                    "--standalone",
                    "--rdzv-backend",
                    "--rdzv-endpoint",
                    "--rdzv-id",
                    "--master-port",
                    "--redirects",
                    "--tee",
                    "--log-dir",
                ),
            ),
        ),
        (["-m", "pkg.train", "--x"], Torchrun(script=("pkg.train", "--x"), mode=Mode.MODULE)),
        (["--no-python", "./train.sh"], Torchrun(script=("./train.sh",), mode=Mode.PROGRAM)),
        (["--no-python", "--run-path", "/a/t.py"], Torchrun(script=("/a/t.py",))),
        # `--` ends torchrun's options; options after the script are the script's own
        (["--", "--weird.py", "-m"], Torchrun(script=("--weird.py", "-m"))),
        (["t.py", "--nnodes", "9"], Torchrun(script=("t.py", "--nnodes", "9"))),
    ],
)
def test_torchrun_options_are_read_as_torchrun_reads_them(args, expected):
    assert parse_torchrun(["torchrun", *args]) == expected


def test_the_command_each_rank_runs_is_the_one_torchrun_would_start():
    assert parse_torchrun(["torchrun", "t.py", "1"]).command("/py") == ["/py", "-u", "t.py", "1"]
    assert parse_torchrun(["torchrun", "-m", "m", "1"]).command("/py") == [
        "/py",
        "-u",
        "-m",
        "m",
        "1",
    ]
    assert parse_torchrun(["torchrun", "--no-python", "./a", "1"]).command("/py") == ["./a", "1"]
    # `PYTHON -m torch.distributed.run`: torchrun would start its workers with that PYTHON
    module = parse_torchrun(["/venv/python3", "-u", "-m", "torch.distributed.run", "t.py"])
    assert module.command("/py") == ["/venv/python3", "-u", "t.py"]


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "no training script"),
        (["--nproc-per-node", "2"], "no training script"),
        (["--nproc-per-node"], "--nproc-per-node needs a value"),
        (["--nproc-per-node", "0", "t.py"], "--nproc-per-node '0'"),
        (["--nproc-per-node", "cpu", "t.py"], "--nproc-per-node 'cpu'"),
        (["--nnodes", "1:4", "t.py"], "--nnodes 1:4: an elastic range"),
        (["--nnodes", "two", "t.py"], "--nnodes 'two'"),
        (["--max-restarts", "-1", "t.py"], "--max-restarts '-1'"),
        (["--numa-binding", "node", "t.py"], "--numa-binding"),
        (["--virtual-local-rank", "t.py"], "--virtual-local-rank"),
        (["--nproc", "2", "t.py"], "'--nproc' is not one ftslurm knows"),
        (["--bogus=1", "t.py"], "'--bogus=1' is not one ftslurm knows"),
        (["-x", "t.py"], "'-x' is not one ftslurm knows"),
        (["--standalone=yes", "t.py"], "--standalone takes no value"),
    ],
)
def test_a_torchrun_command_ftslurm_cannot_honour_is_one_line(args, message):
    with pytest.raises(ConfigError) as info:
        parse_torchrun(["torchrun", *args])
    text = info.value.user_message()
    assert message in text and "\n" not in text


def test_torchrun_gives_the_job_its_shape_where_the_recipe_does_not():
    r = Recipe(command=["torchrun", "--nnodes", "2", "--nproc-per-node", "3", "t.py", "--a"])
    assert (r.nodes, r.ranks_per_node(), r.num_in_job_restarts) == (2, 3, 0)
    assert r.job_command() == [PY, "-u", "t.py", "--a"]
    r = Recipe(command=["torchrun", "--max-restarts", "2", "t.py"])
    assert (r.nodes, r.ranks_per_node(), r.num_in_job_restarts) == (1, 1, 2)
    # the same numbers given twice agree; command-line overrides are checked again
    r = Recipe(command=["torchrun", "--nproc-per-node", "2", "t.py"], ntasks_per_node=2)
    assert r.with_overrides(nodes=2).nodes == 2
    gpus = Recipe(command=["torchrun", "--nproc-per-node", "gpu", "t.py"], gpus_per_node=4)
    assert gpus.ranks_per_node() == 4
    # torchrun's 4 workers on a node of 2 GPUs: 4 ranks, as torchrun would start
    shared = Recipe(command=["torchrun", "--nproc-per-node", "4", "t.py"], gpus_per_node=2)
    assert shared.ranks_per_node() == 4
    # not torchrun: the command as it is
    assert Recipe(command=["python", "t.py"]).job_command() == ["python", "t.py"]


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"nodes": 2, "command": ["torchrun", "--nnodes", "1", "t.py"]}, "--nnodes 1, but"),
        (
            {"ntasks_per_node": 4, "command": ["torchrun", "--nproc-per-node", "2", "t.py"]},
            "starts 2 rank(s) per node",
        ),
        (
            {
                "sbatch_extra": {"ntasks": "4"},
                "command": ["torchrun", "--nproc-per-node", "2", "t.py"],
            },
            "--ntasks 4 is not --nodes 1 times",
        ),
        ({"command": ["torchrun", "--nproc-per-node", "gpu", "t.py"]}, "asks for none"),
        (
            {"num_in_job_restarts": 1, "command": ["torchrun", "--max-restarts", "2", "t.py"]},
            "--max-restarts 2, but",
        ),
        ({"command": ["torchrun", "--tee"]}, "--tee needs a value"),
    ],
)
def test_a_recipe_and_its_torchrun_command_that_disagree_are_one_line(fields, message):
    with pytest.raises(ConfigError) as info:
        Recipe(**fields)
    assert message in info.value.user_message()


def test_a_command_of_the_wrong_type_is_left_to_pydantic():
    with pytest.raises(ValueError, match="command"):
        Recipe(command=3)
    with pytest.raises(ValueError, match="command"):
        Recipe(command=["torchrun", 3])


def test_an_override_that_contradicts_torchrun_is_refused():
    r = Recipe(command=["torchrun", "--nnodes", "2", "t.py"])
    with pytest.raises(ConfigError, match="--nnodes 2, but the job has 1 node"):
        r.with_overrides(nodes=1)


def test_the_job_runs_torchruns_script_under_ftslurms_launcher(tmp_path):
    recipe = Recipe(
        command=["torchrun", "--standalone", "--nnodes=2", "--nproc-per-node=2", "t.py", "x"]
    )
    spec = make_spec(recipe, run_dir=tmp_path / "run", backend="mock", workdir=str(tmp_path))
    script, options = build_attempt("r1", spec, recipe.settings().model_dump(mode="json"), 0, ())
    assert (options.nodes, options.ntasks_per_node) == (2, 2)
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "-m ftslurm.agent.launch --nproc-per-node=2 -- " in step
    assert step.endswith(f"-- {PY} -u t.py x &") and "torchrun" not in step.split()
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"' in script.splitlines()
    # without the launcher, srun starts each rank under the task wrapper alike
    plain = Recipe(command=["torchrun", "--nproc-per-node=2", "t.py"], use_launcher=False)
    spec = make_spec(plain, run_dir=tmp_path / "run", backend="mock", workdir=str(tmp_path))
    script, options = build_attempt("r2", spec, plain.settings().model_dump(mode="json"), 0, ())
    assert options.ntasks_per_node == 2
    assert f"-m ftslurm.agent.task -- {PY} -u t.py &" in script


def test_submit_torchrun_reads_the_script_header_and_snapshots_the_script(tmp_path, monkeypatch):
    """`ftslurm submit torchrun -- ARGS`: the word in the place of the recipe file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("#SBATCH -N 2\n#SBATCH -t 10\nprint('hi')\n")
    args = ["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "1"]
    recipe = load_recipe("torchrun", args)
    assert (recipe.nodes, recipe.ranks_per_node(), recipe.time) == (2, 2, "10")
    script = str(tmp_path / "train.py")
    assert recipe.command == ["torchrun", *args[:3], script, "--lr", "1"]
    assert recipe.job_command() == [PY, "-u", script, "--lr", "1"]
    assert code_file(Path("torchrun"), recipe) == Path(script)
    module = load_recipe("torchrun", ["-m", "pkg.train"])
    assert code_file(Path("torchrun"), module) == Path("torchrun")  # nothing to copy
    assert module.job_command() == [PY, "-u", "-m", "pkg.train"]
    with pytest.raises(ConfigError, match="training script missing.py not found"):
        load_recipe("torchrun", ["missing.py"])
    with pytest.raises(ConfigError, match="--nnodes 1, but the job has 2 node"):
        load_recipe("torchrun", ["--nnodes", "1", "train.py"])


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """A submit folder with a training script and a recipe whose torchrun command is bad."""
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "recipe.py").write_text(
        "import ftslurm\nrecipe = ftslurm.Recipe(command=['torchrun', '--nproc_per_node=2', "
        "'--tee', '3', '--bad', 't.py'])\n"
    )
    return tmp_path


def test_submit_torchrun_prints_the_launcher_job_in_torchruns_place(folder, capsys):
    argv = ["--standalone", "--nnodes=2", "--nproc-per-node=2", "train.py", "--x", "1"]
    code = main(["submit", "--print-script", "-t", "10", "-N", "2", "torchrun", "--", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=2" in lines
    step = next(line for line in lines if line.startswith("srun "))
    assert (
        "-m ftslurm.agent.launch --nproc-per-node=2 -- " in step and "torchrun" not in step.split()
    )
    assert step.endswith("/code/train.py --x 1 &"), step  # the snapshot of the script
    assert err.startswith("Warning: torchrun --standalone: ignored;"), err
    assert not (folder / "home").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["torchrun", "--", "--nproc", "2", "train.py"], "'--nproc' is not one ftslurm knows"),
        (["torchrun", "--", "--nnodes", "1:4", "train.py"], "--nnodes 1:4: an elastic range"),
        (["-N", "2", "torchrun", "--", "--nnodes=1", "train.py"], "--nnodes 1, but the job has 2"),
        (["torchrun", "--", "--nproc-per-node", "2"], "no training script"),
        (["torchrun", "--", "missing.py"], "training script missing.py not found"),
        (["recipe.py"], "'--bad' is not one ftslurm knows"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_torchrun_command_is_one_line_and_submits_nothing(folder, capsys, argv, message):
    code = main(["submit", "--dry-run", "-t", "10", *argv])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert message in lines[0]
    # nothing recorded (no state folder at all), nothing reached the mock scheduler
    assert not (folder / "home").exists() and not (folder / "mock").exists()


def test_torchrun_options_given_without_the_separator_get_the_hint(folder, capsys):
    code = main(["submit", "torchrun", "--nproc-per-node", "2", "train.py"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    first, hint = err.splitlines()
    assert first.startswith("Error: No such option: --nproc-per-node"), err
    assert hint == "Hint: put torchrun's arguments after `--`: ftslurm submit torchrun -- " + (
        "--nproc-per-node 2 train.py"
    )


# ---------------------------------------------------------------------- end to end
# examples/torchrun_ddp.py: a plain script for `torchrun --nproc-per-node 2`, no ftslurm in
# it. It catches SIGUSR2 (ftslurm's default checkpoint signal); every step all-reduces its
# gradients together with a "stop" flag, so both ranks stop at the same step; rank 0 saves
# the model, optimizer and step, and a later start resumes from them. At the end rank 0
# writes a digest of the parameters.
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_ddp.py"

# 50 s of steps: more than the first attempt's 20 s before the checkpoint signal (an
# injected 30 s wall limit, 10 s lead) and the second attempt's 28 s before it loses its node.
STEPS, STEP_S = 500, 0.1


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    # torchrun itself on PATH, as in a user's environment: the command must not need it
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    yield from daemon_cli_on_a_mock(tmp_path, PATH=path)


def _uninterrupted(tmp_path: Path, script: Path, steps: int = STEPS) -> str:
    """The digest of the same script run to the end by torchrun itself, with no ftslurm."""
    out = tmp_path / "reference"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    proc = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(script), str(steps), "0", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == steps
    return final["digest"]


def _stopped_at(log: str) -> int:
    """The step both ranks checkpointed at, from their lines in an attempt's log."""
    stopped = [line for line in log.splitlines() if "checkpointed at step" in line]
    # both ranks of torchrun's --nproc-per-node 2 caught the signal and stopped at one step
    assert len(stopped) == 2 and len({line.split()[-3] for line in stopped}) == 1, log
    return int(stopped[0].split()[-3])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_plain_torchrun_script_survives_a_preemption_and_a_lost_node(cli, tmp_path):
    """Attempt 1's wall limit is 30 s (an injected timeout): the checkpoint signal at 20 s
    reaches both ranks, which save at one step; attempt 2 resumes there and loses its node
    at 28 s (no checkpoint since the resume); attempt 3 resumes from the same checkpoint on
    another node and ends with the parameters of an uninterrupted torchrun run."""
    out = tmp_path / "out"
    out.mkdir()
    recipe = tmp_path / "recipe.py"
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", str(EXAMPLE)]
    recipe.write_text(
        "import ftslurm\n"
        f"recipe = ftslurm.Recipe(command={[*command, str(STEPS), str(STEP_S), str(out)]!r})\n"
    )
    run = cli.submit(
        "--dry-run", "-t", "5", "--preempt-time", "10", "--retries", "1",
        "--inject", "timeout@30", "--inject", "node_fail@28", str(recipe),
    )  # fmt: skip
    run_id = run["run_id"]
    s = cli.wait_for(run_id, ended, 480, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["checkpointed", "node_fail", "finished"], s
    assert s["continuations"] >= 1 and s["job_retries_used"] == 1, s
    at = _stopped_at(cli("logs", run_id, "--attempt", "0").stdout)
    for attempt in ("1", "2"):  # both resumed the one checkpoint
        log = cli("logs", run_id, "--attempt", attempt).stdout
        assert f"rank 0 of 2 starts at step {at}" in log, log
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == STEPS
    assert final["digest"] == _uninterrupted(tmp_path, EXAMPLE)  # bit-identical


# ---------------------------------------------------------------------- real cluster
@pytest.fixture
def slurm_cli(healthy_nodes, tmp_path) -> Iterator[Cli]:
    yield from daemon_cli(tmp_path)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_plain_torchrun_script_gets_the_checkpoint_signal_on_slurm(slurm_cli, tmp_path):
    """The same plain script on the real cluster: a one-minute wall limit, the checkpoint
    signal 30 s before it; both ranks of `torchrun --nproc-per-node 2` stop at one step, the
    continuation resumes there, and the run ends with the uninterrupted run's parameters."""
    steps = 500  # 50 s of steps of 0.1 s: beyond the first attempt's 30 s
    out = tmp_path / "out"
    out.mkdir()
    recipe = tmp_path / "recipe.py"
    command = ["torchrun", "--nproc-per-node", "2", str(EXAMPLE), str(steps), "0.1", str(out)]
    recipe.write_text(f"import ftslurm\nrecipe = ftslurm.Recipe(command={command!r})\n")
    run_id = slurm_cli.submit("-t", "1", "--preempt-time", "30", "--retries", "0", str(recipe))[
        "run_id"
    ]
    s = slurm_cli.wait_for(run_id, ended, 480, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert s["attempts"][0]["cause"] == "checkpointed", s
    assert s["continuations"] >= 1 and s["job_retries_used"] == 0, s
    at = _stopped_at(slurm_cli("logs", run_id, "--attempt", "0").stdout)
    second = slurm_cli("logs", run_id, "--attempt", "1").stdout
    assert f"rank 0 of 2 starts at step {at}" in second, second
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == steps
    assert final["digest"] == _uninterrupted(tmp_path, EXAMPLE, steps)
