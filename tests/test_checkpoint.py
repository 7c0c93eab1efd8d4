"""ftslurm.checkpoint: atomic saves, verified loads, bit-for-bit resumption, sharded DCP."""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from ftslurm.checkpoint import (
    CheckpointManager,
    SaveHandle,
    capture_rng_state,
    load_sharded,
    restore_rng_state,
    restore_training_state,
    save_sharded,
    sharded_steps,
    training_state,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "FTSLURM_RUN_DIR",
        "FTSLURM_CHECKPOINT_DIR",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(name, raising=False)


def child_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FTSLURM_RUN_DIR")
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def small_state(value: float = 0.0) -> dict:
    return {"w": torch.full((64,), value), "step_value": value, "names": ["a", "b"]}


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", report=False, **kw)


# --------------------------------------------------------------------------- resumption
def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One step whose data and loss depend on all three generators."""
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    scale = 1.0 + random.random() + float(np.random.rand())
    loss = ((model(x) - y) ** 2).mean() * scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def draws() -> tuple[torch.Tensor, float, float]:
    return torch.randn(5), random.random(), float(np.random.standard_normal())


def test_round_trip_resumes_bit_for_bit(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    model, opt = make_model()
    for _ in range(3):
        train_step(model, opt)
    np.random.standard_normal()  # numpy holds a cached gaussian at the checkpoint
    ckpt = manager(tmp_path)
    state = training_state(
        model, opt, 3, data_position={"epoch": 0, "index": 12}, extra={"note": "x"}
    )
    ckpt.save(3, state)
    # The uninterrupted process goes on.
    expected_loss = train_step(model, opt)
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_draws = draws()

    # A new process: other weights, other generator states.
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    model2, opt2 = make_model()
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded[0] == 3
    step = restore_training_state(loaded[1], model2, opt2)
    assert step == 3
    assert loaded[1]["data_position"] == {"epoch": 0, "index": 12}
    assert loaded[1]["extra"] == {"note": "x"}
    assert torch.equal(train_step(model2, opt2), expected_loss)
    for got, want in zip(model2.parameters(), expected_params, strict=True):
        assert torch.equal(got.detach(), want)
    got_draws = draws()
    assert torch.equal(got_draws[0], expected_draws[0])
    assert got_draws[1:] == expected_draws[1:]


def test_ddp_wrapped_model_saves_the_inner_state_dict(tmp_path):
    model, opt = make_model()

    class Wrapped(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):  # no process group needed for the shape of the API
            torch.nn.Module.__init__(self)
            self.module = module

    state = training_state(Wrapped(model), opt, 1)
    assert set(state["model"]) == set(model.state_dict())
    model2, opt2 = make_model()
    restore_training_state(state, Wrapped(model2), opt2)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )


def test_rng_state_is_loadable_with_weights_only(tmp_path):
    path = tmp_path / "rng.pt"
    torch.save(capture_rng_state(), path)
    state = torch.load(path, weights_only=True)
    restore_rng_state(state)
    expected = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_state(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


class NotATensor:
    pass


def test_load_latest_uses_weights_only(tmp_path):
    ckpt = manager(tmp_path)
    ckpt.save(1, {"obj": NotATensor()})
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load_latest()


# --------------------------------------------------------------------------- layout, pruning
def test_layout_and_manifest(tmp_path):
    ckpt = manager(tmp_path)
    path = ckpt.save(42, small_state(1.0))
    assert path == tmp_path / "ckpt" / "step-0000000042.pt"
    assert sorted(os.listdir(path.parent)) == ["step-0000000042.json", "step-0000000042.pt"]
    meta = json.loads((path.parent / "step-0000000042.json").read_text())
    assert meta["step"] == 42 and meta["size"] == path.stat().st_size
    assert meta["file"] == path.name and meta["save_s"] >= 0 and meta["world_size"] == 1
    import hashlib

    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_keep_last_keeps_exactly_the_newest(tmp_path):
    ckpt = manager(tmp_path, keep_last=2)
    for step in range(1, 6):
        ckpt.save(step * 10, small_state(step))
        assert ckpt.steps() == [s * 10 for s in range(max(1, step - 1), step + 1)]
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "step-0000000040.json",
        "step-0000000040.pt",
        "step-0000000050.json",
        "step-0000000050.pt",
    ]
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded[0] == 50 and loaded[1]["step_value"] == 5


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    ckpt = manager(tmp_path, keep_last=1)
    ckpt.save(100, small_state(1))
    ckpt.save(50, small_state(2))  # resumed from an older one: 100 is newer but 50 stays
    assert ckpt.steps() == [50, 100]
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)


def test_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FTSLURM_CHECKPOINT_DIR", str(tmp_path / "env"))
    assert CheckpointManager().directory == tmp_path / "env"
    monkeypatch.delenv("FTSLURM_CHECKPOINT_DIR")
    assert CheckpointManager().directory == Path("checkpoints")


# --------------------------------------------------------------------------- corruption
def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def _no_manifest(path: Path) -> None:
    path.with_suffix(".json").unlink()


def _bad_manifest(path: Path) -> None:
    path.with_suffix(".json").write_text("{not json")


def _only_temp_file(path: Path) -> None:
    # The newest "checkpoint" is only a temporary file (with complete contents, even).
    path.rename(path.with_name(f".{path.name}.12345.deadbeef.tmp"))
    path.with_suffix(".json").unlink()


@pytest.mark.parametrize(
    "corrupt",
    [_truncate, _flip, _no_manifest, _bad_manifest, _only_temp_file],
    ids=lambda f: f.__name__.strip("_"),
)
def test_corrupt_newest_falls_back_to_previous(tmp_path, corrupt, caplog):
    ckpt = manager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.randn(4096), "step_value": step})
    corrupt(ckpt.path_of(3))
    with caplog.at_level(logging.WARNING, logger="ftslurm.checkpoint"):
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded[0] == 2 and loaded[1]["step_value"] == 2
    if corrupt is not _only_temp_file:
        assert "skipping checkpoint" in caplog.text and "step-0000000003.pt" in caplog.text


def test_all_corrupt_gives_none(tmp_path):
    ckpt = manager(tmp_path, keep_last=5)
    assert ckpt.load_latest() is None  # folder does not even exist
    for step in (1, 2):
        ckpt.save(step, small_state(step))
    _truncate(ckpt.path_of(1))
    _flip(ckpt.path_of(2))
    assert ckpt.load_latest() is None


CRASH_CHILD = r"""
import os, sys, threading, torch
from ftslurm.checkpoint import CheckpointManager
directory, marker, stall = sys.argv[1], sys.argv[2], sys.argv[3] == "stall"
if stall:
    real_save = torch.save
    class Stalling:  # lets the first tensor reach the temporary file, then hangs
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, b):
            n = self.f.write(b)
            self.n += n
            if self.n >= 8 << 20:
                open(marker, "w").close()
                threading.Event().wait()
            return n
        def flush(self):
            self.f.flush()
    torch.save = lambda obj, f, **kw: real_save(obj, Stalling(f), **kw)
state = {f"t{i}": torch.randn(8 << 20) for i in range(4)}
CheckpointManager(directory, report=False).save(2, state)
"""


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("mode", ["stall", "race"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, mode):
    """SIGKILL while the step file is being written. `stall`: the child hangs after part of
    the data reached the temporary file, then dies; `race`: a real 128 MB save killed as
    soon as its temporary file appears (wherever it then is, nothing torn is accepted)."""
    ckpt = manager(tmp_path)
    directory = ckpt.directory
    ckpt.save(1, small_state(1.0))
    marker = tmp_path / "stalled"
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, str(directory), str(marker), mode],
        env=child_env(),
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() if mode == "stall" else temp_files(directory)):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    if mode == "stall":
        (tmp,) = temp_files(directory)
        assert tmp.stat().st_size >= 8 << 20 and ckpt.steps() == [1]
    loaded = ckpt.load_latest()
    assert loaded is not None
    if loaded[0] == 1:
        assert loaded[1]["step_value"] == 1.0
    else:  # the race finished the save before the signal landed: then it is whole
        assert mode == "race" and loaded[0] == 2 and set(loaded[1]) == {f"t{i}" for i in range(4)}
    assert all(s in (1, 2) for s in ckpt.steps())
    (directory / ".step-0000000002.json.999.tmp").write_text("{")  # a torn manifest write
    ckpt.save(3, small_state(3.0))  # the next save clears what the crash left
    assert temp_files(directory) == []
    assert ckpt.load_latest()[0] == 3


# --------------------------------------------------------------------------- async
@pytest.fixture
def gated_torch_save(monkeypatch):
    """torch.save that waits for `gate` and counts concurrent writers."""
    real = torch.save
    gate = threading.Event()
    stats = {"active": 0, "max_active": 0, "calls": 0}
    lock = threading.Lock()

    def save(obj, f, **kw):
        with lock:
            stats["active"] += 1
            stats["calls"] += 1
            stats["max_active"] = max(stats["max_active"], stats["active"])
        try:
            assert gate.wait(60), "gate never opened"
            return real(obj, f, **kw)
        finally:
            with lock:
                stats["active"] -= 1

    monkeypatch.setattr(torch, "save", save)
    return gate, stats


def test_save_async_snapshots_the_state_at_call_time(tmp_path, gated_torch_save):
    gate, _ = gated_torch_save
    ckpt = manager(tmp_path)
    weights = torch.arange(1000, dtype=torch.float32)
    nested = {"w": weights, "groups": [{"m": weights * 2}], "pair": (weights[:3], 7)}
    handle = ckpt.save_async(5, nested)
    assert not handle.done()  # the writer is held at the gate: nothing written yet
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.01)
    weights.add_(1000)
    nested["groups"][0]["m"].zero_()
    nested["new"] = torch.ones(1)
    gate.set()
    assert handle.wait(timeout=60) == ckpt.path_of(5) and handle.done()
    step, state = ckpt.load_latest()
    assert step == 5 and set(state) == {"w", "groups", "pair"}
    assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(state["groups"][0]["m"], torch.arange(1000, dtype=torch.float32) * 2)
    assert torch.equal(state["pair"][0], torch.arange(3, dtype=torch.float32))
    assert state["pair"][1] == 7


def test_snapshot_memory_is_released_once_written(tmp_path, monkeypatch):
    """No reference cycle keeps a written snapshot (it may be gigabytes) alive until the next
    garbage collection."""
    real = torch.save
    written: list[weakref.ref] = []

    def save(obj, f, **kw):
        written.append(weakref.ref(obj["w"]))
        return real(obj, f, **kw)

    monkeypatch.setattr(torch, "save", save)
    ckpt = manager(tmp_path)
    enabled = gc.isenabled()
    gc.disable()
    try:
        handle = ckpt.save_async(1, {"w": torch.ones(1000), "nested": [{"m": torch.zeros(3)}]})
        handle.wait(60)
        assert written and written[0]() is None
    finally:
        if enabled:
            gc.enable()


def test_second_save_async_waits_for_the_first(tmp_path, gated_torch_save, monkeypatch):
    gate, stats = gated_torch_save
    ckpt = manager(tmp_path)
    first = ckpt.save_async(1, small_state(1.0))
    waiting = threading.Event()
    real_wait = first.wait

    def observed_wait(timeout=None):
        waiting.set()
        return real_wait(timeout)

    monkeypatch.setattr(first, "wait", observed_wait)
    second: list[SaveHandle] = []
    caller = threading.Thread(target=lambda: second.append(ckpt.save_async(2, small_state(2.0))))
    caller.start()
    assert waiting.wait(60), "the second call did not wait for the first"
    assert not second and not first.done()  # still blocked behind the gated first save
    gate.set()
    caller.join(60)
    assert second and first.done()
    ckpt.wait()
    assert second[0].done() and ckpt.steps() == [1, 2]
    assert stats == {"active": 0, "max_active": 1, "calls": 2}


def test_writer_exception_surfaces_on_wait(tmp_path, monkeypatch, caplog):
    def failing_save(obj, f, **kw):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    ckpt = manager(tmp_path)
    ckpt.save(1, small_state(1.0))
    monkeypatch.setattr(torch, "save", failing_save)
    handle = ckpt.save_async(2, small_state(2.0))
    with caplog.at_level(logging.ERROR, logger="ftslurm.checkpoint"):
        with pytest.raises(OSError, match="No space left"):
            handle.wait()
    with pytest.raises(OSError):  # again: the handle keeps its error
        handle.wait()
    with pytest.raises(OSError):  # and the manager reports it once
        ckpt.wait()
    ckpt.wait()
    assert "step 2 failed" in caplog.text
    assert temp_files(ckpt.directory) == [] and ckpt.steps() == [1]
    with pytest.raises(OSError):
        ckpt.save(3, small_state(3.0))
    assert temp_files(ckpt.directory) == [] and ckpt.load_latest()[0] == 1


def test_a_failed_async_save_does_not_block_the_next(tmp_path, monkeypatch):
    real = torch.save
    calls = []

    def fail_first(obj, f, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(obj, f, **kw)

    monkeypatch.setattr(torch, "save", fail_first)
    ckpt = manager(tmp_path)
    first = ckpt.save_async(1, small_state(1.0))
    second = ckpt.save_async(2, small_state(2.0))
    assert second.wait(60) == ckpt.path_of(2)
    with pytest.raises(RuntimeError, match="boom"):
        first.wait()
    assert ckpt.steps() == [2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_memory", [True, False])
def test_cuda_state_snapshot_and_rng(tmp_path, pin_memory):
    ckpt = manager(tmp_path, pin_memory=pin_memory)
    weights = torch.randn(1 << 20, device="cuda")
    expected = weights.cpu()
    rng = capture_rng_state()
    assert len(rng["cuda"]) == torch.cuda.device_count()
    draw = torch.randn(8, device="cuda")
    handle = ckpt.save_async(1, {"w": weights, "rng": rng})
    weights.zero_()  # after the call returns: the snapshot already holds the old values
    torch.cuda.synchronize()
    handle.wait(60)
    step, state = ckpt.load_latest(map_location="cuda")
    assert step == 1 and state["w"].is_cuda and torch.equal(state["w"].cpu(), expected)
    restore_rng_state(state["rng"])  # CUDA-resident RNG tensors are accepted too
    assert torch.equal(torch.randn(8, device="cuda"), draw)


# --------------------------------------------------------------------------- ranks, reports
def test_only_rank_zero_writes(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ckpt", rank=1, world_size=2, report=False)
    assert ckpt.save(1, small_state()) == ckpt.path_of(1)
    handle = ckpt.save_async(2, small_state())
    assert handle.done() and handle.wait() == ckpt.path_of(2)
    ckpt.wait()
    assert not (tmp_path / "ckpt").exists()


def test_rank_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    ckpt = CheckpointManager(tmp_path)
    assert (ckpt.rank, ckpt.world_size) == (3, 8)
    assert CheckpointManager(tmp_path, rank=0).rank == 0


def test_save_reports_progress(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("FTSLURM_RUN_DIR", str(run_dir))
    monkeypatch.setenv("RANK", "0")
    ckpt = CheckpointManager(tmp_path / "ckpt")
    ckpt.save(7, small_state())
    progress = json.loads((run_dir / "progress.json").read_text())
    assert progress["checkpoint_step"] == 7 and progress["checkpoint_save_s"] >= 0
    ckpt.save_async(8, small_state()).wait()
    progress = json.loads((run_dir / "progress.json").read_text())
    assert progress["checkpoint_step"] == 8 and isinstance(progress["checkpoint_save_s"], float)
    CheckpointManager(tmp_path / "quiet", report=False).save(9, small_state())
    assert json.loads((run_dir / "progress.json").read_text())["checkpoint_step"] == 8


def reporting_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run as rank 0 of a run whose folder is returned: saves report to its progress.json."""
    monkeypatch.setenv("FTSLURM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("RANK", "0")
    return tmp_path / "run" / "progress.json"


def test_checkpoint_is_asynchronous_and_reported_only_once_written(
    tmp_path, monkeypatch, gated_torch_save
):
    """The default save blocks for the snapshot only; the daemon hears of the step once
    the file is on disk, with the blocking time and the background write apart."""
    gate, _ = gated_torch_save
    progress_file = reporting_to(tmp_path, monkeypatch)
    ckpt = CheckpointManager(tmp_path / "ckpt")
    handle = ckpt.checkpoint(5, small_state(5.0))
    assert handle is not None and not handle.done()  # writing, held at the gate
    assert not progress_file.exists() and ckpt.steps() == []  # nothing told before it is safe
    time.sleep(0.3)  # a background write of at least 0.3 s
    gate.set()
    assert handle.wait(60) == ckpt.path_of(5) and ckpt.steps() == [5]
    told = json.loads(progress_file.read_text())
    assert told["checkpoint_step"] == 5 and "step" not in told  # the training moved on
    assert told["max_checkpoint_write_s"] >= 0.3 > told["checkpoint_save_s"]
    manifest = json.loads(ckpt.manifest_of(5).read_text())
    assert manifest["blocking_s"] == pytest.approx(told["checkpoint_save_s"])
    assert manifest["save_s"] >= 0.3 + manifest["blocking_s"] - 1e-6


def test_a_busy_writer_makes_the_next_checkpoint_wait_or_skip(tmp_path, gated_torch_save, caplog):
    gate, stats = gated_torch_save
    skipping = manager(tmp_path, busy="skip")
    first = skipping.checkpoint(1, small_state(1.0))
    with caplog.at_level(logging.WARNING, logger="ftslurm.checkpoint"):
        assert skipping.checkpoint(2, small_state(2.0)) is None
    assert "checkpoint of step 2 skipped: the save of step 1 is still writing" in caplog.text
    gate.set()
    assert first is not None and first.wait(60)
    skipping.wait()
    assert skipping.steps() == [1] and stats["calls"] == 1
    # once the previous one is written, the next is taken
    third = skipping.checkpoint(3, small_state(3.0))
    assert third is not None and third.wait(60) and skipping.steps() == [1, 3]
    with pytest.raises(ValueError):
        manager(tmp_path, busy="sometimes")


def test_a_blocking_manager_has_written_the_file_when_checkpoint_returns(tmp_path, monkeypatch):
    progress_file = reporting_to(tmp_path, monkeypatch)
    ckpt = CheckpointManager(tmp_path / "ckpt", asynchronous=False)
    handle = ckpt.checkpoint(4, small_state(4.0))
    assert handle is not None and handle.done() and ckpt.steps() == [4]
    told = json.loads(progress_file.read_text())
    assert told["step"] == 4 and "checkpoint_write_s" not in told


def test_a_report_from_the_writer_thread_is_not_lost_to_a_step_report(tmp_path, monkeypatch):
    """progress.json is read, updated and written whole: the writer thread's checkpoint and
    the training's step report, at the worst moment (one holding its write while the other
    reads), both survive."""
    from ftslurm.agent import progress

    progress_file = reporting_to(tmp_path, monkeypatch)
    progress.report_step(1)
    real_write = progress.write_report
    inside, release = threading.Event(), threading.Event()

    def held_write(path, report):  # type: ignore[no-untyped-def]
        if report.checkpoint_step is not None and not inside.is_set():
            inside.set()
            assert release.wait(60)
        return real_write(path, report)

    monkeypatch.setattr(progress, "write_report", held_write)
    monkeypatch.setattr(progress, "_last_step_write", None)
    writer = threading.Thread(target=progress.checkpoint_saved, args=(1, 0.01, 0.5))
    writer.start()
    assert inside.wait(60)  # the checkpoint report has read the file and holds its write
    stepper = threading.Thread(target=progress.report_step, args=(7,))
    stepper.start()
    stepper.join(0.5)
    assert stepper.is_alive()  # it waits for the lock instead of reading the old file
    release.set()
    writer.join(60)
    stepper.join(60)
    told = json.loads(progress_file.read_text())
    assert (told["step"], told["checkpoint_step"], told["checkpoint_write_s"]) == (7, 1, 0.5)


# --------------------------------------------------------------------------- sharded
def test_sharded_round_trip_single_process(tmp_path):
    state = {
        "a": torch.randn(4, 4),
        "b": torch.arange(10),
        "nested": {"c": torch.ones(2)},
        "count": 7,
    }
    (tmp_path / ".sharded-step-9.tmp").mkdir()  # an interrupted save of a later step
    path = save_sharded(tmp_path, 5, state)
    assert path == tmp_path / "sharded-step-5" and (path / ".metadata").is_file()
    assert sharded_steps(tmp_path) == [5]
    fresh = {
        "a": torch.zeros(4, 4),
        "b": torch.zeros(10, dtype=torch.int64),
        "nested": {"c": torch.zeros(2)},
        "count": 0,
    }
    load_sharded(tmp_path, 5, fresh)
    assert torch.equal(fresh["a"], state["a"]) and torch.equal(fresh["b"], state["b"])
    assert torch.equal(fresh["nested"]["c"], state["nested"]["c"]) and fresh["count"] == 7
    state["a"].add_(1)
    save_sharded(tmp_path, 5, state)  # saving the same step again replaces it whole
    load_sharded(tmp_path, 5, fresh)
    assert torch.equal(fresh["a"], state["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sharded-step-9.tmp", "sharded-step-5"]
    with pytest.raises(FileNotFoundError):
        load_sharded(tmp_path, 9, fresh)


SHARDED_CHILD = r"""
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from ftslurm.checkpoint import load_sharded, save_sharded, sharded_steps
rank, store, directory, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
local = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 100 * (rank + 1)
state = {"w": DTensor.from_local(local, mesh, [Shard(0)]), "r": torch.full((3,), 5.0),
         "step": 11}
save_sharded(directory, 11, state)
fresh = {"w": DTensor.from_local(torch.zeros(4, 2), mesh, [Shard(0)]), "r": torch.zeros(3),
         "step": 0}
load_sharded(directory, 11, fresh)
result = {"local_equal": torch.equal(fresh["w"].to_local(), local), "r": fresh["r"].tolist(),
          "step": fresh["step"], "steps": sharded_steps(directory),
          "full": fresh["w"].full_tensor().tolist()}
with open(out, "w") as f:
    json.dump(result, f)
dist.barrier()  # both ranks are done with every collective
# Leave as a rank should: exit-time destructors with gloo's threads up now and then abort
# ("terminate called without an active exception"); leave() tears the group down within a
# bound and ends with os._exit.
from ftslurm.agent.rank import leave
leave(0)
"""


def test_sharded_round_trip_two_ranks(tmp_path):
    store, directory = tmp_path / "store", tmp_path / "ckpt"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                SHARDED_CHILD,
                str(rank),
                str(store),
                str(directory),
                str(tmp_path / f"rank{rank}.json"),
            ],
            env=child_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    full = (
        torch.arange(8, dtype=torch.float32).reshape(4, 2).repeat(2, 1)
        + torch.tensor([100.0] * 4 + [200.0] * 4).unsqueeze(1)
    ).tolist()
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "local_equal": True,
            "r": [5.0, 5.0, 5.0],
            "step": 11,
            "steps": [11],
            "full": full,
        }
    files = sorted(p.name for p in (directory / "sharded-step-11").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in directory.iterdir()) == ["sharded-step-11"]


# --------------------------------------------------------------------------- benchmark
def test_checkpoint_throughput_benchmark_runs(tmp_path):
    """Every tier is measured in one small run: the disk tier in --dir, the memory tier's
    two ranks in --memory-dir, one of them restoring from its partner's replica."""
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    disk.mkdir()
    memory.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "checkpoint_throughput.py"),
            "--size-mb",
            "4",
            "--repeat",
            "1",
            "--dir",
            str(disk),
            "--memory-dir",
            str(memory),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in (
        "raw_mb_s",
        "save_mb_s",
        "save_fraction_of_raw",
        "async_blocking_s",
        "async_total_s",
        "size_mb",
        "raw_read_mb_s",
        "raw_copy_mb_s",
        "disk_restore_s",
        "memory_save_s",
        "memory_restore_s",
        "peer_restore_s",
    ):
        assert key in result, key
    assert result["size_mb"] == 4 and result["raw_mb_s"] > 0 and result["save_mb_s"] > 0
    assert 0 <= result["async_blocking_s"] <= result["async_total_s"]
    # the memory tier's save is asynchronous too: the step stands still for a part of it
    assert 0 < result["memory_save_blocking_s"] <= result["memory_save_s"]
    # the memory part ran two CPU ranks; the peer restore really came from the replica
    assert result["memory_device"] == "cpu" and result["memory_ranks"] == 2
    assert result["memory_restore_tiers"] == ["memory", "memory"]
    assert result["peer_restore_tiers"] == ["memory", "peer"]
    for name in (
        "raw",
        "raw_read",
        "raw_copy",
        "save",
        "disk_restore",
        "memory_save",
        "memory_restore",
        "peer_restore",
    ):
        seconds = result[f"{name}_s"]
        assert seconds > 0 and result[f"{name}_mb_s"] == pytest.approx(4 / seconds), name
    # each tier's ratio is to its own raw reference, measured in the same run
    references = {
        "save": "raw",
        "disk_restore": "raw_read",
        "memory_save": "raw_copy",
        "memory_restore": "raw_copy",
        "peer_restore": "raw_copy",
    }
    for name, raw in references.items():
        ratio = result[f"{name}_fraction_of_raw"]
        assert ratio == pytest.approx(result[f"{raw}_s"] / result[f"{name}_s"]), name
    assert os.listdir(disk) == [] and os.listdir(memory) == []  # it cleans up after itself
