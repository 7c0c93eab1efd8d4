"""submitit-style callables under ftslurm (`ftslurm.agent.submitit_compat`), with real
processes: the example trainer run under the task wrapper (uninterrupted; signalled, then
resumed; resumed from a damaged continuation), and a small torch-free callable for the
other endings and for two ranks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import submitit

from ftslurm.agent import submitit_compat as compat
from ftslurm.core.contract import ExitCode

from .conftest import wait_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "submitit_recipe.py"
STEPS = 200
STEP_TIME = "0.02"  # the signalled run must still be training when the signal comes
EXIT_TIMEOUT = 90.0  # torch's import alone takes seconds on a busy machine
_OWN_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def make_env(root: Path, attempt: int = 0, rank: int = 0, world: int = 1) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "FTSLURM_", "TORCHELASTIC_")) and k not in _OWN_KEYS
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(
        {
            "FTSLURM_RUN_ID": "run-test",
            "FTSLURM_RUN_DIR": str(root / "run"),
            "FTSLURM_CHECKPOINT_DIR": str(root / "ckpt"),
            "FTSLURM_ATTEMPT": str(attempt),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_JOB_ID": "777",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",
            "FTSLURM_GRACE_S": "30",
        }
    )
    (root / "run").mkdir(parents=True, exist_ok=True)
    return env


class Proc:
    """A command under the task wrapper (`ftslurm.agent.task`), output into files."""

    def __init__(self, root: Path, name: str, command: list[str], env: dict[str, str]):
        self.out, self.err = root / f"{name}.out", root / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "ftslurm.agent.task", "--", *command],
                env=env,
                stdout=out,
                stderr=err,
            )

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(
                f"still running after {timeout:.0f}s; stderr: {self.stderr()[-2000:]}"
            ) from None

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)  # the wrapper forwards it to the command's group

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()


def read(path: Path) -> Any:
    return json.loads(path.read_text())


def progress_step(root: Path) -> int:
    path = root / "run" / "progress.json"
    try:
        return int(read(path).get("step") or 0)
    except (OSError, ValueError):
        return 0


def rank_report(root: Path, attempt: int = 0, rank: int = 0) -> dict[str, Any]:
    return read(root / "run" / "attempts" / str(attempt) / f"rank-{rank}.json")


def folder(root: Path) -> Path:
    return root / "ckpt" / compat.FOLDER


def run_example(root: Path, name: str, attempt: int = 0, *args: str) -> Proc:
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), *args]
    return Proc(root, name, command, make_env(root, attempt))


def start_line(text: str) -> int:
    match = re.search(r"^starting at step (\d+) of \d+$", text, re.M)
    assert match, text
    return int(match.group(1))


# --------------------------------------------------------------------------- the example
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = run_example(root, "train")
    assert proc.wait() == 0, proc.stderr()
    return root


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, Proc, int]:
    """The example signalled (USR2) once it reported a step; returns the folder, the
    process and the exit code."""
    root = tmp_path_factory.mktemp("interrupted")
    proc = run_example(root, "train", 0, "--step-time", STEP_TIME)
    wait_for(
        lambda: progress_step(root) > 0 or not proc.alive(), EXIT_TIMEOUT, "the first reported step"
    )
    assert proc.alive(), proc.stderr()
    proc.signal(signal.SIGUSR2)
    return root, proc, proc.wait()


def copy_run(source: Path, target: Path) -> Path:
    for part in ("run", "ckpt"):
        shutil.copytree(source / part, target / part)
    return target


def test_uninterrupted_run_finishes_and_tells_the_daemon(uninterrupted):
    root = uninterrupted
    final = read(root / "ckpt" / "final.json")
    assert final["step"] == STEPS and re.fullmatch(r"[0-9a-f]{16}", final["digest"])
    assert f"finished at step {STEPS}, digest {final['digest']}" in (root / "train.out").read_text()
    assert read(root / "run" / "progress.json")["finished"] is True
    assert (root / "run" / "FINISHED").exists()
    assert rank_report(root)["outcome"] == "finished"
    assert not (folder(root) / compat.MANIFEST).exists()  # no signal: nothing to continue


def test_signal_stores_a_continuation_and_exits_0(interrupted):
    root, proc, code = interrupted
    assert code == 0, proc.stderr()
    saved = int(re.search(r"checkpoint at step (\d+)", proc.stdout()).group(1))
    assert 0 < saved < STEPS
    manifest = read(folder(root) / compat.MANIFEST)
    assert manifest["sequence"] == 1 and manifest["callable"] == "__main__.Trainer"
    data = (folder(root) / manifest["file"]).read_bytes()
    assert len(data) == manifest["size"]
    assert hashlib.sha256(data).hexdigest() == manifest["sha256"]
    assert sorted(p.name for p in folder(root).iterdir()) == [manifest["file"], compat.MANIFEST]
    progress = read(root / "run" / "progress.json")
    # The step the trainer reported last (progress.json lags by up to a second of steps).
    assert 0 < progress["checkpoint_step"] == manifest["step"] <= saved
    assert progress["finished"] is False and not (root / "run" / "FINISHED").exists()
    assert rank_report(root)["outcome"] == "checkpointed"  # "continue me", for the daemon
    assert not (root / "ckpt" / "final.json").exists()
    # What was stored is submitit's own object, loadable as submitit loads it.
    delayed = submitit.helpers.DelayedSubmission.load(folder(root) / manifest["file"])
    assert delayed.kwargs["steps"] == STEPS and delayed.function.last_complete["step"] == saved


def test_resumed_run_continues_from_the_saved_step_to_the_same_parameters(
    interrupted, uninterrupted, tmp_path
):
    source, first, code = interrupted
    assert code == 0, first.stderr()
    saved = int(re.search(r"checkpoint at step (\d+)", first.stdout()).group(1))
    root = copy_run(source, tmp_path)
    proc = run_example(root, "resume", 1)  # the daemon's continuation: attempt 1
    assert proc.wait() == 0, proc.stderr()
    assert start_line(proc.stdout()) == saved  # from the stored step, not from 0
    assert "resuming continuation 1" in proc.stderr()
    final = read(root / "ckpt" / "final.json")
    assert final == read(uninterrupted / "ckpt" / "final.json")  # bit-identical parameters
    assert read(root / "run" / "progress.json")["finished"] is True
    assert (root / "run" / "FINISHED").exists()
    assert rank_report(root, attempt=1)["outcome"] == "finished"


def test_damaged_continuation_is_refused_in_one_line(interrupted, tmp_path):
    """A user who lost the continuation would rather hear it than have the run start over
    from step 0 (and overwrite what it keeps) or be retried into the same error."""
    source, first, code = interrupted
    assert code == 0, first.stderr()
    root = copy_run(source, tmp_path)
    manifest = read(folder(root) / compat.MANIFEST)
    stored = folder(root) / manifest["file"]
    stored.write_bytes(stored.read_bytes()[: manifest["size"] // 2])  # truncated
    proc = run_example(root, "resume", 1)
    assert proc.wait() == ExitCode.DO_NOT_RETRY
    lines = proc.stderr().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ftslurm: cannot resume: ") and "truncated" in lines[0]
    assert str(stored) in lines[0] and f"delete {folder(root)}" in lines[0]
    assert "starting at step" not in proc.stdout()
    assert stored.stat().st_size == manifest["size"] // 2  # left as it was, for the user
    assert not (root / "ckpt" / "final.json").exists()
    assert rank_report(root, attempt=1)["outcome"] == "do_not_retry"


# --------------------------------------------------------------------------- storage
def _stored(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    target = tmp_path / "c"
    delayed = submitit.helpers.DelayedSubmission(max, 3, 4)
    return target, compat.save_continuation(target, delayed, sequence=2, step=7)


def test_save_then_load_round_trip_and_older_files_go(tmp_path):
    target = tmp_path / "c"
    compat.save_continuation(target, submitit.helpers.DelayedSubmission(min, 1), 1, 1)
    (target / ".continuation-000002.pkl.999.tmp").write_bytes(b"half")  # a crashed save
    manifest = compat.save_continuation(target, submitit.helpers.DelayedSubmission(max, 3, 4), 2, 7)
    assert sorted(p.name for p in target.iterdir()) == [
        "continuation-000002.pkl",
        "continuation.json",
    ]
    delayed, loaded = compat.load_continuation(target)
    assert loaded == manifest and manifest["step"] == 7 and manifest["training_step"] is None
    assert delayed.function(*delayed.args) == 4
    assert compat.load_continuation(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    "damage, words",
    [
        ("flip", "does not match the sha256"),
        ("grow", "bytes where its manifest says"),
        ("remove", "No such file"),
        ("manifest", "not a readable continuation manifest"),
        ("not-delayed", "not a DelayedSubmission"),
        ("unpicklable", "cannot be unpickled"),
        ("format", "this ftslurm reads format 1"),
    ],
)
def test_damaged_continuations_raise_one_line_errors(tmp_path, damage, words):
    target, manifest = _stored(tmp_path)
    stored = target / manifest["file"]
    data = stored.read_bytes()
    if damage == "flip":
        stored.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    elif damage == "grow":
        stored.write_bytes(data + b"\0")
    elif damage == "remove":
        stored.unlink()
    elif damage == "manifest":
        (target / compat.MANIFEST).write_text('{"file": ')
    elif damage == "format":
        (target / compat.MANIFEST).write_text(json.dumps(manifest | {"format": 2}))
    else:
        payload = b"\x80\x04K\x01." if damage == "not-delayed" else b"\x80\x04cno_such\nmod\n."
        stored.write_bytes(payload)
        manifest.update(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        (target / compat.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(compat.ContinuationError, match=re.escape(words)) as info:
        compat.load_continuation(target)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- other endings
COUNTER = """
import os, signal, sys, time
from pathlib import Path
import submitit
from ftslurm.agent import progress, submitit_compat

OUT = Path(os.environ["OUT"])
RANK = os.environ["RANK"]

def mark(name, value):  # atomic: the test polls these files
    tmp = OUT / f".{name}.tmp"
    tmp.write_text(str(value))
    os.replace(tmp, OUT / name)

class Counter(submitit.helpers.Checkpointable):
    def __init__(self):
        self.count = 0

    def __call__(self, limit, mode):
        mark(f"started-{RANK}-{os.environ['FTSLURM_ATTEMPT']}", self.count)
        while self.count < limit:
            self.count += 1
            progress.report_step(self.count)
            time.sleep(0.005)
        return self.count

    def checkpoint(self, limit, mode):
        mark(f"checkpoint-{RANK}", self.count)
        if mode == "none":
            return None
        if mode == "raise":
            raise RuntimeError("no space left")
        return submitit.helpers.DelayedSubmission(self, limit, mode)

def plain(limit, mode):
    mark(f"started-{RANK}-{os.environ['FTSLURM_ATTEMPT']}", 0)
    time.sleep(limit)

def signal_inside_progress_write():
    # The worst moment: the checkpoint signal lands while report_step() holds the lock of
    # progress.json (the handler then runs inside that critical section).
    real = progress.write_report
    def write(*args, **kwargs):
        if not os.path.exists(OUT / "signalled"):
            mark("signalled", 1)
            os.kill(os.getpid(), signal.SIGUSR2)
        real(*args, **kwargs)
    progress.write_report = write

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "in-lock":
        signal_inside_progress_write()
    result = submitit_compat.run(plain if mode == "plain" else Counter(), 10**9, mode)
    print(f"result {result}")
"""


def run_counter(root: Path, mode: str, rank: int = 0, world: int = 1, attempt: int = 0) -> Proc:
    script = root / "counter.py"
    if not script.exists():
        script.write_text(COUNTER)
    (root / "out").mkdir(exist_ok=True)
    env = make_env(root, attempt, rank, world) | {"OUT": str(root / "out")}
    return Proc(root, f"{mode}-{rank}-{attempt}", [sys.executable, str(script), mode], env)


def started(root: Path, proc: Proc, rank: int = 0, attempt: int = 0, steps: bool = True) -> int:
    """Wait until the callable runs (and rank 0 reported a step): the count it started at."""
    mark = root / "out" / f"started-{rank}-{attempt}"
    wait_for(
        lambda: (
            (mark.exists() and (rank != 0 or not steps or progress_step(root) > 0))
            or not proc.alive()
        ),
        30,
        f"rank {rank} to start its callable",
    )
    assert proc.alive(), proc.stderr()
    return int(mark.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=["TERM", "USR2"])
def test_small_callable_continues_over_attempts_at_its_count(tmp_path, sig):
    proc = run_counter(tmp_path, "ok")
    started(tmp_path, proc)
    proc.signal(sig)
    assert proc.wait() == 0, proc.stderr()
    first = read(folder(tmp_path) / compat.MANIFEST)
    counted = int((tmp_path / "out" / "checkpoint-0").read_text())
    assert first["training_step"] is not None and 0 < first["training_step"] <= counted
    again = run_counter(tmp_path, "ok", attempt=1)
    assert started(tmp_path, again, attempt=1) == counted  # not from 0
    again.signal(sig)
    assert again.wait() == 0, again.stderr()
    second = read(folder(tmp_path) / compat.MANIFEST)
    assert second["sequence"] == 2 and second["step"] >= first["step"]
    assert rank_report(tmp_path, attempt=1)["outcome"] == "checkpointed"


def test_a_signal_while_progress_is_being_written_still_stores_and_records_the_continuation(
    tmp_path,
):
    proc = run_counter(tmp_path, "in-lock")
    assert proc.wait() == 0, proc.stderr()
    assert (tmp_path / "out" / "signalled").exists()
    assert "continuation 1 stored" in proc.stderr()
    manifest = read(folder(tmp_path) / compat.MANIFEST)
    saved = read(tmp_path / "run" / "progress.json")
    assert saved["checkpoint_step"] == manifest["step"] == 1 and saved["finished"] is False


def test_checkpoint_returning_none_asks_not_to_be_retried(tmp_path):
    proc = run_counter(tmp_path, "none")
    started(tmp_path, proc)
    proc.signal(signal.SIGUSR2)
    assert proc.wait() == ExitCode.DO_NOT_RETRY
    assert "checkpoint() returned None" in proc.stderr()
    assert not (folder(tmp_path) / compat.MANIFEST).exists()
    assert rank_report(tmp_path)["outcome"] == "do_not_retry"


def test_failing_checkpoint_is_a_failure_and_keeps_the_previous_continuation(tmp_path):
    proc = run_counter(tmp_path, "ok")
    started(tmp_path, proc)
    proc.signal(signal.SIGUSR2)
    assert proc.wait() == 0, proc.stderr()
    # The continuation stores mode "ok"; make its checkpoint() raise by changing the mode.
    delayed, _ = compat.load_continuation(folder(tmp_path))
    compat.save_continuation(
        folder(tmp_path),
        submitit.helpers.DelayedSubmission(delayed.function, delayed.args[0], "raise"),
        1,
        1,
    )
    before = (folder(tmp_path) / compat.MANIFEST).read_text()
    again = run_counter(tmp_path, "ok", attempt=1)
    started(tmp_path, again, attempt=1)
    again.signal(signal.SIGUSR2)
    assert again.wait() == ExitCode.FAILED
    assert "RuntimeError: no space left" in again.stderr()
    assert (folder(tmp_path) / compat.MANIFEST).read_text() == before
    assert compat.load_continuation(folder(tmp_path)) is not None


def test_plain_function_is_not_killed_by_the_checkpoint_signal_and_ends_as_term_would(tmp_path):
    proc = run_counter(tmp_path, "plain")
    started(tmp_path, proc, steps=False)
    proc.signal(signal.SIGUSR2)  # not caught: the wrapper holds it back
    wait_for(
        lambda: "SIGUSR2 held" in proc.stderr() or not proc.alive(), 30, "the wrapper to hold USR2"
    )
    assert proc.alive(), proc.stderr()
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 128 + signal.SIGTERM  # the wrapper's code for "killed by it"
    assert "has no checkpoint() method" in proc.stderr()
    report = rank_report(tmp_path)
    assert (report["outcome"], report["checkpoint_signal_withheld"]) == ("killed", "USR2")
    assert not (folder(tmp_path) / compat.MANIFEST).exists()


def test_two_ranks_rank0_stores_and_the_other_waits_for_it(tmp_path):
    """As in submitit only global rank 0 calls checkpoint(); rank 1 exits 0 only once the
    continuation is stored, so rank 0 is never left alone in a collective while saving."""
    rank0 = run_counter(tmp_path, "ok", rank=0, world=2)
    rank1 = run_counter(tmp_path, "ok", rank=1, world=2)
    started(tmp_path, rank0, 0)
    started(tmp_path, rank1, 1)
    rank1.signal(signal.SIGUSR2)
    wait_for(lambda: "waiting for it" in rank1.stderr(), 30, "rank 1 to take the signal")
    assert rank1.alive() and rank0.alive()  # nothing stored yet: rank 1 runs on
    rank0.signal(signal.SIGUSR2)
    assert rank0.wait() == 0, rank0.stderr()
    assert rank1.wait() == 0, rank1.stderr()
    assert "rank 0 stored continuation 1" in rank1.stderr()
    assert (tmp_path / "out" / "checkpoint-0").exists()
    assert not (tmp_path / "out" / "checkpoint-1").exists()
    assert {rank_report(tmp_path, rank=r)["outcome"] for r in (0, 1)} == {"checkpointed"}
