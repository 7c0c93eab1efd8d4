"""Lightning under ftslurm (issue 29, "Lightning"): `ftslurm.integrations.lightning`.

- A Trainer in one process, in a Slurm-looking job with `SLURMEnvironment(auto_requeue=True)`
  and a fake `scontrol` on PATH that records its calls, gets the checkpoint signal (USR1,
  Lightning's requeue signal) or SIGTERM in the middle of a step. With `FtslurmCallback` it
  saves at the next step boundary, records its stop and exits 0, and `scontrol` is never
  run; without it Lightning saves inside the handler and runs `scontrol requeue` (USR1), or
  leaves fit on SIGTERM with exit 0 and no checkpoint (Lightning #20542).
- End to end on the mock: `examples/lightning_recipe.py` on 2 nodes (one rank each) through
  the daemon, preempted (SIGTERM) in its first attempt and losing a node in its second:
  both ranks checkpoint at one step, the continuations resume there, Lightning's requeue
  never runs, and the final parameters are bit-identical to an uninterrupted torchrun run.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from ftslurm.agent.rank import read_stop_record  # noqa: E402
from ftslurm.core.contract import EnvName, RunDir  # noqa: E402
from ftslurm.integrations import lightning as ftl  # noqa: E402

from .conftest import wait_for  # noqa: E402
from .daemon_scenarios import Cli, daemon_cli_on_a_mock, ended, job_log  # noqa: E402

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "lightning_recipe.py"


# ---------------------------------------------------------------------- pieces
def test_the_newest_complete_checkpoint_is_the_one_to_resume_from(tmp_path):
    assert ftl.latest_checkpoint(tmp_path / "none") is None
    for step in (40, 120, 80):
        ftl.checkpoint_path(tmp_path, step).write_bytes(b"x")
    ftl.checkpoint_path(tmp_path, 200).with_name(".lightning-step-0000000200.ckpt.tmp").touch()
    (tmp_path / "last.ckpt").touch()  # another callback's
    assert ftl.latest_checkpoint(tmp_path) == str(ftl.checkpoint_path(tmp_path, 120))
    assert [s for s, _ in ftl.checkpoints(tmp_path)] == [40, 80, 120]


def test_the_default_folder_is_inside_the_runs_checkpoint_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(EnvName.CHECKPOINT_DIR.value, str(tmp_path / "ck"))
    assert ftl.checkpoint_folder() == tmp_path / "ck" / "lightning"
    assert ftl.checkpoint_folder(tmp_path / "mine") == tmp_path / "mine"


def test_the_ranks_come_from_the_launchers_torch_elastic_variables(monkeypatch):
    """Under ftslurm's launcher the Slurm variables describe the launchers (one per node)."""
    slurm = {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1"}
    elastic = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0"}
    for key, value in {**slurm, **elastic, "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    [environment] = ftl.plugins()
    assert isinstance(environment, ftl.FtslurmEnvironment)
    assert (environment.global_rank(), environment.world_size()) == (1, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ftl.plugins() == []  # not started by a torch elastic agent: Lightning decides


def test_without_lightning_the_import_says_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['lightning.pytorch'] = None\n"
        "import ftslurm.integrations.lightning\n"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: ftslurm.integrations.lightning needs Lightning: "
        "pip install ftslurm[lightning]"
    )


# ---------------------------------------------------------------------- one process
# A Trainer in a Slurm-looking job with Lightning's auto-requeue on; the step that reaches
# SIGNAL_AT sends the process `sig` in the middle of the step.
SIGNALLED = r"""
import os, signal, sys
import lightning.pytorch as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

sig, with_callback, folder = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
SIGNAL_AT = 5

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step == SIGNAL_AT:
            os.kill(os.getpid(), sig)
        g = torch.Generator().manual_seed(self.global_step)
        x = torch.randn(8, 4, generator=g)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

callbacks = []
if with_callback:
    from ftslurm.integrations.lightning import FtslurmCallback
    ft = FtslurmCallback(folder)
    callbacks.append(ft)
environment = SLURMEnvironment(auto_requeue=True)
trainer = L.Trainer(
    accelerator="cpu", devices=1, plugins=[environment], callbacks=callbacks, max_steps=20,
    logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, default_root_dir=folder,
)
trainer.fit(Module(), torch.utils.data.DataLoader(range(20), batch_size=None))
print(f"fit returned at step {trainer.global_step}, auto_requeue {environment.auto_requeue}",
      flush=True)
if with_callback:
    ft.exit(0)
"""


@pytest.fixture
def job(tmp_path) -> dict[str, str]:
    """The environment of a one-rank Slurm job under ftslurm, with a fake `scontrol` first on
    PATH that records each call in `scontrol-calls`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol-calls"}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train",
        SLURM_NTASKS="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NNODES="1",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    env[EnvName.RUN_DIR.value] = str(tmp_path / "run")
    env[EnvName.CHECKPOINT_SIGNAL.value] = "USR1"  # Lightning's requeue signal too
    return env


def _signalled(tmp_path: Path, env: dict[str, str], sig: int, with_callback: bool):
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED)
    folder = tmp_path / "ckpt"
    return subprocess.run(
        [PY, str(script), str(int(sig)), "1" if with_callback else "0", str(folder)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_the_callback_checkpoints_at_the_step_boundary_and_lightning_never_requeues(
    tmp_path, job, sig
):
    proc = _signalled(tmp_path, job, sig, with_callback=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the signal came inside step 5: the checkpoint is the state after that step
    assert ftl.latest_checkpoint(tmp_path / "ckpt") == str(
        ftl.checkpoint_path(tmp_path / "ckpt", 6)
    )
    assert "fit returned at step 6, auto_requeue False" in proc.stdout, proc.stdout
    assert ftl.REQUEUE_OFF in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert not (tmp_path / "scontrol-calls").exists()  # Lightning's requeue never ran
    folder = tmp_path / "ckpt"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # private, as every checkpoint
    assert [stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()] == [0o600]
    record = read_stop_record(tmp_path / "run", 0, 0)
    assert record is not None and (record["step"], record["outcome"]) == (6, "checkpointed")
    progress = json.loads(RunDir(tmp_path / "run").progress.read_text())
    assert progress["checkpoint_step"] == 6 and not progress.get("finished"), progress


@pytest.mark.timeout(300)
def test_without_the_callback_lightning_requeues_from_inside_the_job(tmp_path, job):
    """What the callback prevents (and what makes the fake `scontrol` worth trusting)."""
    proc = _signalled(tmp_path, job, signal.SIGUSR1, with_callback=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "scontrol-calls").read_text() == "requeue 4242\n"
    assert "fit returned at step 20" in proc.stdout  # and trained on: two owners of one job


@pytest.mark.timeout(300)
def test_without_the_callback_sigterm_ends_the_rank_without_a_checkpoint(tmp_path, job):
    """Lightning raises SIGTERMException (a SystemExit) at the next batch: the rank leaves
    fit and exits 0 having saved nothing, an exit that reads as "checkpointed, continue me"
    after a signal, while the steps since the last checkpoint are lost."""
    proc = _signalled(tmp_path, job, signal.SIGTERM, with_callback=False)
    assert "Received SIGTERM" in proc.stderr, proc.stderr[-3000:]
    assert (proc.returncode, "fit returned" in proc.stdout) == (0, False), proc.stdout
    assert not list((tmp_path / "ckpt").rglob("*.ckpt"))


def test_a_trainer_that_took_slurms_variables_for_the_ranks_stops_in_one_line(tmp_path, job):
    """Rank 1 of 2 under the launcher, without `plugins()`: Lightning reads the launcher's
    Slurm variables (one task) and would train alone as rank 0 of 1."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import lightning.pytorch as L, torch\n"
        "from ftslurm.integrations.lightning import FtslurmCallback\n"
        "class M(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(2, 1)\n"
        "    def training_step(self, batch, i):\n"
        "        return self.layer(torch.ones(1, 2)).sum()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "trainer = L.Trainer(accelerator='cpu', devices=1, callbacks=[FtslurmCallback()],\n"
        "                    max_steps=2, logger=False, enable_checkpointing=False)\n"
        "trainer.fit(M(), torch.utils.data.DataLoader(range(2), batch_size=None))\n"
    )
    env = dict(job, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", GROUP_RANK="0")
    env["LOCAL_WORLD_SIZE"] = "2"
    proc = subprocess.run(
        [PY, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "RuntimeError: Lightning runs this process as rank 0 of 1, ftslurm's launcher started "
        "it as rank 1 of 2: pass Trainer(plugins=ftslurm.integrations.lightning.plugins()) "
        "(and devices= the ranks per node, num_nodes= the nodes)"
    ), proc.stderr[-3000:]


# ---------------------------------------------------------------------- end to end
STEP_S = 0.1


@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    """A mock cluster that notices a failed node in 2 s and kills 5 s after SIGTERM; a fake
    `scontrol` first on the jobs' PATH records any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol-calls"}\n')
    fake.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(PY).parent), os.environ.get("PATH", "")])
    yield from daemon_cli_on_a_mock(tmp_path, PATH=path)


def _uninterrupted(tmp_path: Path, steps: int) -> dict:
    """The example run to the end by torchrun itself, with no ftslurm and no Slurm."""
    out = tmp_path / "reference"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(EXAMPLE), "--steps", str(steps), "--output-dir", str(out)]
        + ["--checkpoint-dir", str(out / "ckpt")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "final.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_lightning_example_survives_a_preemption_and_a_lost_node_on_the_mock(cli, tmp_path):
    """The scheduler preempts the first attempt (`ftslurm mock preempt`) once both ranks
    started training, so Lightning's callback is in place however slow the imports were
    (ranks without a handler die of the SIGTERM: a preemption without a checkpoint, which
    spends a retry; 40 s from the job's start once came too early). The second attempt's
    node is lost (`mock fail-node`) once its ranks train again. 700 steps of 0.1 s."""
    out, steps = tmp_path / "out", 700
    run = cli.submit(
        "--dry-run",
        "-N",
        "2",
        "--retries",
        "1",
        str(EXAMPLE),
        "--",
        "--steps",
        str(steps),
        "--step-time",
        str(STEP_S),
        "--output-dir",
        str(out),
    )
    run_id = run["run_id"]
    rd = RunDir(cli.status(run_id)["run_dir"])

    def training(attempt: int) -> bool:
        return job_log(rd).count(f"(attempt {attempt})") >= 2  # both ranks' first lines

    wait_for(lambda: training(0), 240, "attempt 0's ranks training")
    cli("mock", "preempt", cli.status(run_id)["attempts"][0]["job_id"])
    second = cli.wait_for(
        run_id, lambda s: len(s["attempts"]) >= 2 and s["attempts"][1]["nodes"], 240, "attempt 1"
    )
    wait_for(lambda: training(1), 240, "attempt 1's ranks training")
    cli("mock", "fail-node", second["attempts"][1]["nodes"][-1])
    run_id = run["run_id"]
    s = cli.wait_for(run_id, ended, 480, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["checkpointed", "node_fail", "finished"], s
    assert s["job_retries_used"] == 1 and s["continuations"] >= 1, s

    # both ranks checkpointed at one step, on the preemption's SIGTERM
    at = _stopped_at(cli("logs", run_id, "--attempt", "0").stdout)
    assert 0 < at < steps
    records = [read_stop_record(s["run_dir"], 0, rank) for rank in (0, 1)]
    assert [(r["step"], r["outcome"]) for r in records] == [(at, "checkpointed")] * 2, records
    second = cli("logs", run_id, "--attempt", "1").stdout
    third = cli("logs", run_id, "--attempt", "2").stdout
    # Attempt 1 resumed from that step; unless its node was lost before its ranks started
    # (the loss comes 25 s into the attempt, and on a loaded machine Lightning's imports
    # can take that long): then attempt 2 did. Neither started over.
    resumed = second if "rank 0 of 2 starts at step " in second else third
    assert f"rank 0 of 2 starts at step {at} " in resumed, (second, third)
    assert "rank 0 of 2 starts at step 0 " not in second + third, (second, third)
    assert not (tmp_path / "scontrol-calls").exists()  # Lightning's requeue never ran

    final = json.loads((out / "final.json").read_text())
    assert final == _uninterrupted(tmp_path, steps)  # bit-identical parameters, step 700


def _stopped_at(log: str) -> int:
    """The step at which both ranks stopped (the example's lines), asserting it is one."""
    stopped = [line for line in log.splitlines() if " stopped at step " in line]
    assert len(stopped) == 2 and len({line.split()[-1] for line in stopped}) == 1, log
    return int(stopped[0].split()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_on_one_node_checkpoint_on_the_signal_and_continue_on_the_mock(cli, tmp_path):
    """ftslurm's checkpoint signal (USR2, 10 s before the 30 s wall limit) reaches both
    ranks of one node (devices=2): they save at one step and the continuation resumes
    there; 250 steps of 0.1 s take longer than the first attempt (20 s with the start)."""
    out, steps = tmp_path / "out", 250
    run = cli.submit(
        "--dry-run", "-N", "1", "--ntasks-per-node", "2", "-t", "0:30", "--preempt-time", "10",
        "--retries", "0", str(EXAMPLE), "--",
        "--steps", str(steps), "--step-time", "0.1", "--output-dir", str(out),
    )  # fmt: skip
    run_id = run["run_id"]
    s = cli.wait_for(run_id, ended, 420, "the run to end")
    assert s["state"] == "COMPLETED", s
    causes = [a["cause"] for a in s["attempts"]]  # a slow start may take a third attempt
    assert len(causes) >= 2 and set(causes[:-1]) == {"checkpointed"}, s
    assert causes[-1] == "finished" and s["job_retries_used"] == 0, s
    at = _stopped_at(cli("logs", run_id, "--attempt", "0").stdout)
    second = cli("logs", run_id, "--attempt", "1").stdout
    assert f"rank 0 of 2 starts at step {at} " in second, second
    assert f"rank 1 of 2 starts at step {at} " in second, second
    assert not (tmp_path / "scontrol-calls").exists()
    final = json.loads((out / "final.json").read_text())
    assert final == _uninterrupted(tmp_path, steps)
