"""Result validation in the rank agent with real torch: two gloo ranks run
examples/validated_loop.py (a plain loop whose steps draw from the global RNG and a data
iterator) with the injections of FTSLURM_INJECT. A transient fault is re-run in place and
the run ends with the parameters of an uninterrupted one, bit for bit; a persistent one
saves the last good state and exits 16; a fault of the model reproduces in the
disambiguation run and exits 17; report_stats counts and never stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftslurm.agent.task import free_port
from ftslurm.core.contract import EnvName, RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.runfiles import read_reports

pytestmark = pytest.mark.slow  # two torch ranks per run, about two minutes in all

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "validated_loop.py"
STEPS = 30


def _run(tmp_path: Path, name: str, *args: str, attempt: int = 0, **env: str) -> list[int]:
    """Both ranks of the example, as attempt `attempt` of a run whose folder is
    tmp_path/run, checkpoints in tmp_path/<name>; their exit codes."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--checkpoint-dir",
             str(tmp_path / name), *args],
            env={
                **base,
                "RANK": str(r),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "SLURMD_NODENAME": f"node{r}",
                EnvName.RUN_DIR.value: str(tmp_path / "run"),
                EnvName.ATTEMPT.value: str(attempt),
                **env,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]  # fmt: skip
    codes = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        codes.append(p.returncode)
        print(out[-3000:])
    return codes


def _digest(tmp_path: Path, name: str) -> str:
    final = json.loads((tmp_path / name / "final.json").read_text())
    assert final["step"] == STEPS
    return final["digest"]


def _events(tmp_path: Path, attempt: int = 0) -> dict[int, list]:
    reports = read_reports(RunDir(tmp_path / "run"), Kind.VALIDATION, attempt)
    return {r.rank: r for r in reports}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The digest of the loop run uninterrupted, unvalidated."""
    folder = tmp_path_factory.mktemp("reference")
    assert _run(folder, "ref", "--no-validate") == [0, 0]
    return _digest(folder, "ref")


@pytest.mark.parametrize("inject", ["nan@0:1", "spike@0:1"])
def test_a_transient_fault_is_rerun_in_place_bit_identical(tmp_path, reference, inject):
    assert _run(tmp_path, "ck", **{EnvName.INJECT.value: inject}) == [0, 0]
    assert _digest(tmp_path, "ck") == reference  # the re-run restored RNG and data
    reports = _events(tmp_path)
    (event,) = reports[1].events
    assert (event.kind, event.verdict, event.action) == (inject[:-4], "transient", "go_on")
    assert event.differed and reports[1].reruns == 1 and reports[1].node == "node1"
    assert reports[0].reruns == 1 and reports[0].events == []  # it re-ran too, in step
    assert json.loads(RunDir(tmp_path / "run").fired(1).read_text()) == [inject]


def test_a_transient_fault_that_fired_does_not_fire_again_in_a_later_attempt(tmp_path, reference):
    inject = {EnvName.INJECT.value: "nan@0:1"}
    assert _run(tmp_path, "first", **inject) == [0, 0]
    assert _run(tmp_path, "second", attempt=1, **inject) == [0, 0]
    assert _events(tmp_path, 1) == {}  # nothing suspicious: no report


def test_a_persistent_fault_checkpoints_the_last_good_state_and_exits_16(tmp_path):
    assert _run(tmp_path, "ck", **{EnvName.INJECT.value: "nan@0:1:persistent"}) == [16, 16]
    (event,) = _events(tmp_path)[1].events
    assert (event.verdict, event.action, event.differed) == ("persistent", "exit_16", False)
    import torch

    saved = torch.load(tmp_path / "ck" / "state.pt", weights_only=False)
    assert saved["step"] == event.step  # the state before the suspicious step
    spoiled = json.loads(RunDir(tmp_path / "run").result_fault_nodes.read_text())
    assert spoiled == {"nan@0:1:persistent": "node1"}


def test_a_fault_of_the_model_exits_16_then_17_in_the_disambiguation_run(tmp_path):
    assert _run(tmp_path, "ck", "--nan-at-step", "12") == [16, 16]
    (event,) = _events(tmp_path)[0].events
    assert (event.step, event.verdict) == (12, "persistent")
    context = json.dumps({"attempt": 0, "nodes": ["node0", "node1"], "step": 12})
    codes = _run(
        tmp_path, "ck", "--nan-at-step", "12", attempt=1,
        **{EnvName.DISAMBIGUATE.value: context},
    )  # fmt: skip
    assert codes == [17, 17]
    (event,) = _events(tmp_path, 1)[0].events
    assert (event.step, event.verdict, event.action) == (12, "model", "exit_17")


def test_without_the_fault_the_disambiguation_run_goes_on(tmp_path, reference):
    """The persistent fault stays on its node: the disambiguation run on other nodes
    computes right and completes, with the parameters of an uninterrupted run."""
    inject = {EnvName.INJECT.value: "nan@0:1:persistent"}
    assert _run(tmp_path, "ck", **inject) == [16, 16]
    context = json.dumps({"attempt": 0, "nodes": ["node1"], "step": 0})
    codes = _run(
        tmp_path, "ck", attempt=1, SLURMD_NODENAME="node9",
        **{**inject, EnvName.DISAMBIGUATE.value: context},
    )  # fmt: skip
    assert codes == [0, 0]
    assert _digest(tmp_path, "ck") == reference


def test_report_stats_counts_and_never_stops(tmp_path, reference):
    codes = _run(tmp_path, "ck", "--report-stats", **{EnvName.INJECT.value: "nan@0:1:persistent"})
    assert codes == [0, 0]
    assert _digest(tmp_path, "ck") == reference  # only the validated value was spoiled
    report = _events(tmp_path)[1]
    assert report.mode == "report_stats" and report.reruns == STEPS == len(report.events)
    assert {(e.verdict, e.action) for e in report.events} == {("counted", "go_on")}


# `ftslurm.Training(validate=True)`: a model with dropout (the step draws from the global
# RNG, which Training captures before the block and puts back for a re-run) on data drawn
# from the step number.
TRAINING = r"""
import hashlib, json, sys
import torch, torch.distributed as dist
from ftslurm import Training
from ftslurm.agent.validation_rules import Mode, Settings

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
optim = torch.optim.SGD(model.parameters(), lr=0.05)
mode = sys.argv[2]
validate = {"off": False, "on": True, "stats": Settings(mode=Mode.REPORT_STATS)}[mode]
train = Training(model, optim, checkpoint_dir=sys.argv[1], every=0, memory=False,
                 validate=validate, log=None)
for step in train.steps(30):
    with train.step():
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 8, generator=g)
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if validate:
            train.validate(loss)
if rank == 0:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(",".join(float(v).hex() for v in p.detach().flatten().tolist()).encode())
    (train.directory / "final.json").write_text(json.dumps({"digest": h.hexdigest()[:16]}))
train.finish()
"""


def _training(tmp_path: Path, name: str, mode: str, **env: str) -> tuple[list[int], str | None]:
    script = tmp_path / "training.py"
    script.write_text(TRAINING)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / name), mode],
            env={**base, "RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "SLURMD_NODENAME": f"node{r}",
                 EnvName.RUN_DIR.value: str(tmp_path / "run"), **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]  # fmt: skip
    codes = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        codes.append(p.returncode)
        print(out[-3000:])
    final = tmp_path / name / "final.json"
    return codes, json.loads(final.read_text())["digest"] if final.exists() else None


def test_training_reruns_a_step_in_place_with_its_rng_put_back(tmp_path):
    codes, plain = _training(tmp_path, "plain", "off")
    assert codes == [0, 0] and plain
    codes, validated = _training(tmp_path, "validated", "on", **{EnvName.INJECT.value: "nan@0:0"})
    assert codes == [0, 0]
    assert validated == plain  # the dropout masks of the re-run were the first run's
    (event,) = _events(tmp_path)[0].events
    assert (event.verdict, event.action) == ("transient", "go_on")


def test_training_exits_16_with_the_last_good_state_on_disk(tmp_path):
    codes, final = _training(
        tmp_path, "ck", "on", **{EnvName.INJECT.value: "nan@0:1:persistent"}
    )  # fmt: skip
    assert codes == [16, 16] and final is None
    (event,) = _events(tmp_path)[1].events
    assert event.verdict == "persistent"
    manifests = sorted((tmp_path / "ck").glob("step-*.json"))
    assert [int(m.stem.split("-")[1]) for m in manifests] == [event.step]


def test_training_in_report_stats_counts_and_finishes(tmp_path):
    codes, _ = _training(tmp_path, "ck", "stats", **{EnvName.INJECT.value: "spike@0:1"})
    assert codes == [0, 0]
    (event,) = _events(tmp_path)[1].events
    assert (event.kind, event.verdict) == ("spike", "counted")


def test_injected_result_faults_count_from_the_rank_wrappers_start():
    """`nan@T` counts from the rank's start (its wrapper's, `RANK_STARTED`), as the
    wrapper's own crash@T and hang@T do, not from the rank agent's creation after the
    script's imports; without the wrapper, or with a value that does not read, from now."""
    from ftslurm.agent.rank import _rank_started

    before = time.monotonic()
    started = _rank_started({EnvName.RANK_STARTED.value: repr(time.time() - 30)})
    assert before - 31 < started < time.monotonic() - 29
    for value in ("", "soon", repr(time.time() + 60)):
        started = _rank_started({EnvName.RANK_STARTED.value: value})
        assert before <= started <= time.monotonic(), value
    assert before <= _rank_started({}) <= time.monotonic()
