"""Hugging Face's Trainer under ftslurm (issue 29, `ftslurm.integrations.transformers`).

A tiny model on CPU, two ranks over gloo (examples/hf_trainer_recipe.py):

* without a scheduler, under torch's own launcher: the checkpoint signal reaches one rank,
  both save `checkpoint-<S>` at the same step S (the rank agent's collective), record their
  stop and exit 0; the continuation resumes from that checkpoint and ends bit-identical to
  an uninterrupted run;
* a save cut short (no completion marker) is never resumed from, though the Trainer's own
  `get_last_checkpoint` would take it;
* end to end on the mock scheduler, one rank per node: the checkpoint signal before the wall
  limit, then a lost node in the continuation, then a third attempt on other nodes; the run
  ends COMPLETED with the parameters of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ftslurm.core.contract import EnvName, RunDir  # noqa: E402
from ftslurm.integrations.transformers import (  # noqa: E402
    COMPLETE_MARKER,
    complete_checkpoints,
    last_complete_checkpoint,
)

from .conftest import wait_for  # noqa: E402
from .daemon_scenarios import Cli, daemon_cli_on_a_mock, ended, saved_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hf_trainer_recipe.py"
PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    """This checkout first on the path, no Hub access, nothing of an enclosing ftslurm job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **extra}


def _torchrun(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(EXAMPLE), "--output-dir", str(out), *args],
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _uninterrupted(out: Path, steps: int, save_steps: int) -> dict:
    """The example run to the end by torch's launcher alone: the reference parameters."""
    proc = _torchrun(out, "--steps", str(steps), "--save-steps", str(save_steps))
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == steps, final
    return final


# ---------------------------------------------------------------------- the resume helper
def _checkpoint(folder: Path, step: int, complete: bool) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    if complete:
        (path / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
    return path


def test_resume_skips_a_checkpoint_whose_save_was_cut_short(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    _checkpoint(tmp_path, 5, complete=True)
    seven = _checkpoint(tmp_path, 7, complete=True)
    _checkpoint(tmp_path, 10, complete=False)  # a node lost while it was being written
    (tmp_path / "checkpoint-12").write_text("not a folder")
    (tmp_path / "checkpoint-x").mkdir()
    # The Trainer's own helper would resume from the torn save:
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert last_complete_checkpoint(tmp_path) == str(seven)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-5", "checkpoint-7"]
    assert last_complete_checkpoint(tmp_path / "absent") is None
    assert last_complete_checkpoint(tmp_path / "checkpoint-x") is None


def test_without_transformers_the_module_says_what_to_install():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n"
        "    import ftslurm.integrations.transformers\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([PY, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pip install ftslurm[transformers]" in proc.stdout, proc.stdout


# One process, no process group: the signal at step 5 (sent from a callback, as a scheduler
# would between two steps) makes the Trainer save checkpoint-5 and return (exit_on_stop off).
ONE_PROCESS = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from hf_trainer_recipe import Synthetic, TinyRegressor
from transformers import Trainer, TrainerCallback, TrainingArguments
from ftslurm.integrations.transformers import FtslurmCallback, last_complete_checkpoint

class SignalAt(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 4:
            os.kill(os.getpid(), signal.SIGUSR2)

callback = FtslurmCallback(exit_on_stop=False)
args = TrainingArguments(output_dir=sys.argv[2], max_steps=20, save_strategy="no", use_cpu=True,
                         report_to="none", disable_tqdm=True, remove_unused_columns=False)
trainer = Trainer(model=TinyRegressor(), args=args, train_dataset=Synthetic(),
                  callbacks=[callback, SignalAt()])
trainer.train()
print(json.dumps({"stopped": callback.stopped, "step": trainer.state.global_step,
                  "resume": last_complete_checkpoint(sys.argv[2])}))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_exit_on_stop_the_trainer_returns_after_the_stops_save(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [PY, "-c", ONE_PROCESS, str(EXAMPLE.parent), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    # saved at the end of the step the signal came in, though save_strategy is "no"
    assert result == {"stopped": True, "step": 5, "resume": str(out / "checkpoint-5")}, result


# ---------------------------------------------------------------------- two ranks, no scheduler
def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def _ranks(launcher: subprocess.Popen) -> list[int]:
    """The rank processes torch's launcher started (its children)."""
    kids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    return [int(pid) for pid in kids.read_text().split()] if kids.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_checkpoint_signal_on_one_rank_saves_both_at_one_step_and_resumes_bit_identical(
    tmp_path,
):
    steps, save_steps = 60, 25
    out, run_dir = tmp_path / "out", tmp_path / "run"
    env = _env(**{EnvName.RUN_DIR.value: str(run_dir), EnvName.ATTEMPT.value: "0"})
    proc = _torchrun(
        out, "--steps", str(steps), "--save-steps", str(save_steps), "--step-time", "0.1", env=env
    )
    try:
        # training runs (the first periodic save is complete), then one rank gets the signal
        _wait_for(lambda: complete_checkpoints(out), 120, "the first checkpoint")
        ranks = _ranks(proc)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGUSR2)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log[-3000:]
    stopped = [line for line in log.splitlines() if "on request; stopping" in line]
    assert len(stopped) == 2, log[-3000:]
    at = {int(line.split("checkpoint-")[1].split()[0]) for line in stopped}
    assert len(at) == 1, stopped  # both ranks at one step
    (step,) = at
    assert save_steps <= step < steps, log[-3000:]
    assert last_complete_checkpoint(out) == str(out / f"checkpoint-{step}")
    assert not (out / "final.json").exists()  # trainer.train() did not return
    rd = RunDir(run_dir)
    for rank in (0, 1):  # "saved step S, stopping": the daemon reads "continue me"
        record = json.loads(rd.stop_record(0, rank).read_text())
        assert (record["step"], record["outcome"]) == (step, "checkpointed"), record
    assert json.loads(rd.progress.read_text())["checkpoint_step"] == step
    # A newer save cut short (a lost node): its files half there, no marker. The Trainer's
    # get_last_checkpoint would resume from it; the continuation must not.
    torn = out / f"checkpoint-{step + 3}"
    shutil.copytree(out / f"checkpoint-{step}", torn)
    (torn / COMPLETE_MARKER).unlink()
    model = torn / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])

    proc = _torchrun(out, "--steps", str(steps), "--save-steps", str(save_steps))
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert f"starts from {out / f'checkpoint-{step}'}" in log, log[-3000:]
    final = json.loads((out / "final.json").read_text())
    assert final == _uninterrupted(tmp_path / "reference", steps, save_steps)  # bit-identical


# ---------------------------------------------------------------------- end to end on the mock
@pytest.fixture
def cli(tmp_path) -> Iterator[Cli]:
    yield from daemon_cli_on_a_mock(tmp_path, **_env())


# 0.1 s steps, periodic saves every 100 steps: longer than two attempts of the tests below.
STEPS, SAVE_STEPS = 800, 100


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _uninterrupted(tmp_path_factory.mktemp("reference"), STEPS, SAVE_STEPS)


def _submit(cli: Cli, out: Path, *options: str) -> str:
    run = cli.submit(
        "--dry-run",
        *options,
        str(EXAMPLE),
        "--",
        "--steps",
        str(STEPS),
        "--save-steps",
        str(SAVE_STEPS),
        "--step-time",
        "0.1",
        "--output-dir",
        str(out),
    )
    return run["run_id"]


def _stopped_at(cli: Cli, run_id: str, attempt: int, ranks: int) -> int:
    """The one step at which every rank of `attempt` saved on request and stopped."""
    log = cli("logs", run_id, "--attempt", str(attempt)).stdout
    stopped = [line for line in log.splitlines() if "on request; stopping" in line]
    assert len(stopped) == ranks, log[-3000:]
    at = {int(line.split("checkpoint-")[1].split()[0]) for line in stopped}
    assert len(at) == 1, stopped  # all ranks at one step
    return at.pop()


def _resumed_from(cli: Cli, run_id: str, attempt: int) -> str:
    log = cli("logs", run_id, "--attempt", str(attempt)).stdout
    starts = [line for line in log.splitlines() if line.startswith("rank 0 of 2 starts from")]
    assert len(starts) == 1, log[-3000:]
    return starts[0].split("starts from ")[1].split()[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_survives_a_preemption_and_a_node_failure_on_the_mock(cli, tmp_path, reference):
    """One rank per node. The scheduler preempts attempt 1 once it saved step 100
    (`ftslurm mock preempt`: SIGTERM, the job requeued): both ranks save at one step they
    agree on and exit 0; attempt 2 resumes there and loses a node (`mock fail-node`) once it
    saved a newer step; attempt 3 runs on other nodes from the newest complete checkpoint
    and ends with the parameters of an uninterrupted run. Both faults come by the
    training's progress, not a clock a loaded start-up outlasts. (The checkpoint signal
    before a wall limit reaches the Trainer as the same request: the launcher-level test
    above sends it to one rank.)"""
    out = tmp_path / "out"
    run_id = _submit(cli, out, "-N", "2", "-t", "5:00", "--retries", "1")
    run = RunDir(cli.status(run_id)["run_dir"])
    wait_for(lambda: saved_step(run) >= SAVE_STEPS, 240, f"a save of step {SAVE_STEPS}")
    cli("mock", "preempt", cli.status(run_id)["attempts"][0]["job_id"])
    second = cli.wait_for(
        run_id, lambda s: len(s["attempts"]) >= 2 and s["attempts"][1]["nodes"], 240, "attempt 2"
    )
    first_save = saved_step(run)  # the preemption's save (attempt 1 ended)
    wait_for(lambda: saved_step(run) > first_save, 240, "a save of attempt 2")
    cli("mock", "fail-node", second["attempts"][1]["nodes"][-1])
    s = cli.wait_for(run_id, ended, 480, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert [a["cause"] for a in s["attempts"]] == ["checkpointed", "node_fail", "finished"], s
    assert s["job_retries_used"] == 1 and s["continuations"] >= 1, s
    lost = set(s["attempts"][1]["nodes"]) - set(s["attempts"][2]["nodes"])
    assert lost and lost <= set(s["excluded_nodes"]), s
    at = _stopped_at(cli, run_id, 0, ranks=2)
    assert _resumed_from(cli, run_id, 1) == str(out / f"checkpoint-{at}")
    # from the stop's checkpoint or a newer periodic one of attempt 2, never from scratch
    third = _resumed_from(cli, run_id, 2)
    assert third != "scratch" and int(third.rsplit("-", 1)[1]) >= at, third
    assert json.loads((out / "final.json").read_text()) == reference  # bit-identical
