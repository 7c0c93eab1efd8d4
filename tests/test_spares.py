"""Hot spares: the job asks for N+K nodes with --no-kill, the launchers train on N and move
the training onto a spare inside the same job when an active node is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftslurm.agent import spares as sp
from ftslurm.agent.peers import Lease
from ftslurm.cli.main import main
from ftslurm.core.contract import ROUND_RECORDS, EnvName, JobEnv, RunDir, rendezvous_port
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.errors import ConfigError
from ftslurm.recipe import Recipe

from .conftest import wait_for
from .daemon_scenarios import (
    RECIPE,
    kill_groups,
    reference_digest,
    saved_step,
    spare_takes_over_on_the_mock,
)


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
    exported = {
        EnvName.SPARE_NODES.value: next(
            x.removeprefix(line) for x in script.splitlines() if x.startswith(line)
        )
    }
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
        "import ftslurm\nrecipe = ftslurm.Recipe(command=['true'], use_launcher=False)\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--spare-nodes", "-1", "train.sh"], "spare_nodes"),
        (["--spare-nodes", "1", "nolauncher.py"], "needs the launcher"),
        (["--live-recovery", "nolauncher.py"], "--live-recovery needs the launcher"),
    ],
)
def test_bad_spare_values_are_one_line_and_submit_nothing(env, capsys, args, expected):
    assert main(["submit", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error:") and expected in err and "\n" not in err, err
    assert not (env / "home" / "runs").exists() or not any((env / "home" / "runs").iterdir())


def test_live_recovery_reaches_the_launchers_only_when_asked():
    script, _ = attempt(spare_nodes=1, live_recovery=True)
    plain, _ = attempt(spare_nodes=1)
    assert f"{EnvName.LIVE_RECOVERY.value}=" in script
    assert EnvName.LIVE_RECOVERY.value not in plain
    job = JobEnv.from_environ({EnvName.LIVE_RECOVERY.value: "True"})
    assert job.live_recovery is True


def test_submit_option_reaches_the_script(env, capsys):
    assert main(["submit", "-N", "2", "--spare-nodes", "1", "--print-script", "train.sh"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    assert f"export {EnvName.SPARE_NODES.value}=1" in script


# ---------------------------------------------------------------- the launchers' rules
def lease(node_rank: int, role: str | None, ended: str | None = None, seq: int = 1) -> Lease:
    return Lease(node_rank, f"n{node_rank}", 100 + node_rank, seq, 0.0, ended, role)


def test_node_ranks_beyond_n_start_as_spares_and_the_batch_host_trains():
    assert [sp.starts_as_spare(r, 3, 1) for r in range(3)] == [False, False, True]
    assert [sp.starts_as_spare(r, 4, 2) for r in range(4)] == [False, False, True, True]
    assert sp.active_nodes(3, 1) == 2 and not sp.starts_as_spare(0, 2, 1)


def test_a_lost_active_node_is_swapped_while_a_spare_can_take_its_place():
    assert sp.loss_action({1}, {1: sp.ACTIVE}, 1) is sp.Action.SWAP
    assert sp.loss_action({1, 2}, {2: sp.ACTIVE}, 2) is sp.Action.SWAP


def test_a_lost_spare_restarts_no_one():
    assert sp.loss_action({2}, {2: sp.SPARE}, 1) is sp.Action.NONE
    assert sp.loss_action({2}, {2: None}, 1) is sp.Action.NONE  # never started its ranks


def test_no_spare_left_or_the_batch_host_lost_is_a_new_job():
    assert sp.loss_action({1, 2}, {1: sp.ACTIVE}, 1) is sp.Action.NEW_JOB  # spares used up
    assert sp.loss_action({0}, {0: sp.ACTIVE}, 3) is sp.Action.NEW_JOB  # the batch host


def test_a_spare_joins_once_every_first_node_trains_or_one_was_lost():
    leases = {0: lease(0, sp.ACTIVE), 1: lease(1, None)}
    assert not sp.may_join(leases, 3, 1, lost=())
    assert not sp.may_join({0: lease(0, sp.ACTIVE)}, 3, 1, lost=())  # node 1 not seen yet
    assert sp.may_join({**leases, 1: lease(1, sp.ACTIVE)}, 3, 1, lost=())
    assert sp.may_join(leases, 3, 1, lost=(1,))


def test_peers_are_alive_after_two_renewals_since_the_failure_or_when_they_ended():
    first = {0: 5, 2: 7}

    def both(a: int, b: int) -> dict[int, Lease]:
        return {0: lease(0, sp.ACTIVE, seq=a), 2: lease(2, sp.ACTIVE, seq=b)}

    assert not sp.alive_since(first, both(7, 8))
    assert sp.alive_since(first, both(7, 9))
    assert sp.alive_since(
        first, {0: lease(0, sp.ACTIVE, seq=7), 2: lease(2, sp.ACTIVE, "finished", seq=7)}
    )
    assert not sp.alive_since(first, {0: lease(0, sp.ACTIVE, seq=9), 2: None})


def test_spares_left_counts_every_lost_node():
    assert sp.spares_left({1}, 2) == 1 and sp.spares_left({1, 2, 3}, 2) == 0


def test_the_lease_says_the_role_and_reads_back():
    assert Lease.from_json(lease(2, sp.SPARE).to_json()).role == sp.SPARE
    old = {k: v for k, v in lease(2, None).to_json().items() if k != "role"}
    assert Lease.from_json(old) == lease(2, None)  # a lease without the field


# ---------------------------------------------------------------- three launchers, one machine
class Launchers:
    """N+K launchers on this machine as nodes n0, n1, ... (node rank 0 hosts the rendezvous),
    each in its own process group (a node's processes die together), training
    examples/recipe.py with one rank per node."""

    def __init__(
        self,
        tmp_path: Path,
        nnodes: int,
        spare_nodes: int,
        steps: int,
        max_restarts: int = 0,
        launch_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        recipe_args: tuple[str, ...] = (),
        endpoint: bool = True,
        node_args: dict[int, tuple[str, ...]] | None = None,
    ) -> None:
        """`endpoint`: every launcher is given the rendezvous endpoint (else node rank 0
        binds one and publishes it in the run directory, as in a job). `node_args`: more
        launcher arguments of one node (after `launch_args`: the last of a kind wins)."""
        self.tmp, self.names = tmp_path, [f"n{r}" for r in range(nnodes)]
        self.run = RunDir(tmp_path / "run")
        self.ckpt = tmp_path / "ckpt"
        job = str(os.getpid() % 9000 + len(str(tmp_path)) * 13 + 1)
        port = rendezvous_port(job)
        self.procs: list[subprocess.Popen] = []
        for node_rank, name in enumerate(self.names):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
            env.update(
                FTSLURM_RUN_DIR=str(self.run.root),
                FTSLURM_CHECKPOINT_DIR=str(self.ckpt),
                # the memory tier's own folder: another test's launchers may share this
                # one's job id, and so its memory area under the default base
                FTSLURM_MEMORY_DIR=str(tmp_path / "memory"),
                MASTER_ADDR="127.0.0.1",
                SLURM_JOB_ID=job,
                SLURMD_NODENAME=name,
                **(extra_env or {}),
            )
            log = open(tmp_path / f"{name}.log", "w")
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ftslurm.agent.launch",
                        "--nproc-per-node=1",
                        f"--nnodes={nnodes}",
                        f"--node-rank={node_rank}",
                        f"--spare-nodes={spare_nodes}",
                        f"--max-restarts={max_restarts}",
                        *([f"--rdzv-endpoint=127.0.0.1:{port}"] if endpoint else []),
                        "--monitor-interval=0.2",
                        "--peer-timeout=3",
                        *launch_args,
                        *(node_args or {}).get(node_rank, ()),
                        "--",
                        sys.executable,
                        str(RECIPE),
                        "--steps",
                        str(steps),
                        "--ckpt-every",
                        "10",
                        "--step-time",
                        "0.05",
                        *recipe_args,
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()

    def wait_checkpoint(self, step: int, timeout: float = 180) -> None:
        """Until the run's progress says a checkpoint of `step` or later."""
        wait_for(lambda: saved_step(self.run) >= step, timeout, f"a checkpoint of step {step}")

    def log(self, node_rank: int) -> str:
        return (self.tmp / f"{self.names[node_rank]}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(r)[-3000:]}" for r, n in enumerate(self.names))

    def kill(self, node_rank: int) -> None:
        os.killpg(self.procs[node_rank].pid, signal.SIGKILL)

    def close(self) -> None:
        kill_groups(self.procs)


def node_report(run: RunDir, node_rank: int) -> dict:
    return json.loads(run.node_report(0, node_rank).read_text())


def test_a_spare_takes_over_a_killed_node_and_the_run_ends_as_if_never_interrupted(tmp_path):
    """2 active + 1 spare, no in-job restart allowed: node 1 is killed mid-training; the
    survivor and the spare carry on from the last checkpoint in a world of 2, the spare's
    round is recorded, and the parameters end as an uninterrupted run's."""
    steps = 150
    expected = reference_digest(tmp_path, steps)
    nodes = Launchers(tmp_path, nnodes=3, spare_nodes=1, steps=steps)
    try:
        nodes.wait_checkpoint(20)
        spare = sp.read_lease(nodes.run, 0, 2)
        assert spare is not None and spare.role == sp.SPARE, nodes.logs()
        assert sp.read_lease(nodes.run, 0, 1).role == sp.ACTIVE
        nodes.kill(1)
        codes = [nodes.procs[r].wait(timeout=180) for r in (0, 2)]
        assert codes == [0, 0], nodes.logs()
    finally:
        nodes.close()
    final = json.loads((nodes.ckpt / "final.json").read_text())
    assert final["step"] == steps and final["digest"] == expected  # bit for bit
    rounds = sorted(nodes.run.recovery(0).glob(ROUND_RECORDS))
    assert [p.name for p in rounds] == ["round-1.json"], nodes.logs()
    record = json.loads(rounds[0].read_text())
    assert record["world_size"] == 2 and record["nnodes_active"] == 2
    assert record["lost"] == ["n1"] and record["spares_left"] == 0
    assert record["first_step_at"] is not None and record["first_step_at"] >= record["started_at"]
    assert "n1 lost" in record["why"]
    survivor, took_over = node_report(nodes.run, 0), node_report(nodes.run, 2)
    assert survivor["spare_swaps"] == 1 and survivor["in_job_restarts"] == 1
    assert survivor["outcome"] == took_over["outcome"] == "finished"
    assert took_over["role"] == sp.ACTIVE
    starts = [int(s) for s in re.findall(r"starts at step (\d+)", nodes.logs())]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 20, starts  # the checkpoint


def test_a_spare_never_needed_ends_with_outcome_spare_and_exit_0(tmp_path):
    nodes = Launchers(tmp_path, nnodes=3, spare_nodes=1, steps=20)
    try:
        codes = [p.wait(timeout=180) for p in nodes.procs]
    finally:
        nodes.close()
    assert codes == [0, 0, 0], nodes.logs()
    spare = node_report(nodes.run, 2)
    assert spare["outcome"] == spare["role"] == sp.SPARE and spare["exit_code"] == 0
    assert [node_report(nodes.run, r)["outcome"] for r in (0, 1)] == ["finished", "finished"]
    assert not list(nodes.run.recovery(0).glob(ROUND_RECORDS))


# ---------------------------------------------------------------- the mock scheduler
def test_on_the_mock_a_spare_replaces_a_failed_node_in_the_same_job(tmp_path):
    """`--dry-run` with the mock's default SlurmdTimeout (300 s): node index 1 (active, not
    the batch host) fails once training passed step 20; its launcher and rank die with it; the
    spare takes over inside the same job, long before Slurm would have noticed, and
    training ends bit-identical."""
    _, record = spare_takes_over_on_the_mock(tmp_path)
    assert record["lost"]
