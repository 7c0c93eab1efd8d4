"""The per-task wrapper (`ftslurm.agent.task`) and the progress API, with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ftslurm.agent import progress
from ftslurm.agent.task import (
    _applies,
    classify_exit,
    disk_full,
    error_line,
    parse_inject_env,
    torch_env,
)
from ftslurm.core.contract import EnvName, HeartbeatDir, rendezvous_port
from ftslurm.core.inject import parse_injection

from .conftest import proc_state, wait_for

REPO = Path(__file__).resolve().parents[1]
_TORCH_KEYS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
}


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "FTSLURM_")) and k not in _TORCH_KEYS
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(
        {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242"}
    )
    env.update(extra)
    return env


def start(
    command: list[str], env: Mapping[str, str], stderr: Any = subprocess.PIPE
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ftslurm.agent.task", "--", *command],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


def run(
    command: list[str], env: Mapping[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "ftslurm.agent.task", "--", *command],
        env=dict(env),
        capture_output=True,
        timeout=timeout,
    )


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def report(run_dir: Path, attempt: int = 0, rank: int = 0) -> dict[str, Any]:
    return json.loads((run_dir / "attempts" / str(attempt) / f"rank-{rank}.json").read_text())


def finish(proc: subprocess.Popen[bytes], timeout: float = 20) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- torch_env
def test_torch_env_from_a_multi_node_step() -> None:
    env = torch_env(
        {
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_NODELIST": "n[3-4]",
            "SLURM_JOB_ID": "77",
        }
    )
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "4"  # the step's task count wins over the job's
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "n3"
    assert 20000 <= int(env["MASTER_PORT"]) <= 59999
    assert "FTSLURM_ATTEMPT" not in env


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, "1"),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, "2"),
        ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, "1"),
        ({"SLURM_NTASKS_PER_NODE": "3"}, "3"),
        ({}, "1"),
    ],
)
def test_local_world_size(environ: dict[str, str], expected: str) -> None:
    assert torch_env(environ)["LOCAL_WORLD_SIZE"] == expected


def test_torch_env_defaults_and_kept_values() -> None:
    env = torch_env(
        {
            "SLURM_NTASKS": "2",
            "MASTER_ADDR": "batchhost",
            "MASTER_PORT": "1234",
            "SLURM_JOB_NODELIST": "n[3-4]",
            "FTSLURM_ATTEMPT": "5",
        }
    )
    assert env["RANK"] == env["LOCAL_RANK"] == env["NODE_RANK"] == "0"
    assert env["WORLD_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("batchhost", "1234")
    assert env["FTSLURM_ATTEMPT"] == "5"
    assert torch_env({"SLURM_JOB_NODELIST": "gpu-a17,gpu-b2"})["MASTER_ADDR"] == "gpu-a17"


def test_master_port_is_shared_by_ranks_and_moves_with_restarts() -> None:
    """Ranks of one step started without the launcher and without a run directory (a rank
    alone gets a free port; with a run directory, the port rank 0 published)."""
    ranks = [
        torch_env(
            {
                "SLURM_JOB_ID": "123456",
                "SLURM_RESTART_COUNT": "2",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": str(r),
            }
        )["MASTER_PORT"]
        for r in range(4)
    ]
    assert len(set(ranks)) == 1
    ports = {
        torch_env({"SLURM_JOB_ID": "123456", "SLURM_RESTART_COUNT": str(n), "SLURM_NTASKS": "2"})[
            "MASTER_PORT"
        ]
        for n in range(10)
    }
    assert len(ports) == 10
    port = torch_env({"SLURM_JOB_ID": "123456", "SLURM_NTASKS": "2"})["MASTER_PORT"]
    assert port == str(rendezvous_port("123456", 0))
    assert all(
        20000 <= rendezvous_port(str(j), r) <= 59999
        for j in range(0, 10**6, 9973)
        for r in range(3)
    )


def test_attempt_is_base_plus_restart_count() -> None:
    assert torch_env({"FTSLURM_ATTEMPT_BASE": "2"})["FTSLURM_ATTEMPT"] == "2"
    env = torch_env(
        {"FTSLURM_ATTEMPT_BASE": "2", "SLURM_RESTART_COUNT": "3", "FTSLURM_ATTEMPT": "2"}
    )
    assert env["FTSLURM_ATTEMPT"] == "5"


# ---------------------------------------------------------------------- classify_exit
TRACEBACK = 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'


@pytest.mark.parametrize(
    ("args", "outcome"),
    [
        ((0, None, False, 500.0, ""), "finished"),
        ((0, None, True, 500.0, ""), "checkpointed"),
        ((16, None, False, 1.0, ""), "resume_elsewhere"),
        ((17, None, False, 1.0, ""), "failed_validation"),
        ((93, None, True, 1.0, ""), "do_not_retry"),
        (
            (1, None, False, 1.0, TRACEBACK + "ModuleNotFoundError: No module named 'x'\n"),
            "user_error",
        ),
        ((1, None, False, 1.0, TRACEBACK + "ImportError: cannot import name 'y'\n"), "user_error"),
        ((1, None, False, 1.0, TRACEBACK + "NameError: name 'z' is not defined\n\n"), "user_error"),
        ((1, None, False, 1.0, "  x = (\n      ^\nSyntaxError: invalid syntax\n"), "user_error"),
        ((1, None, False, 1.0, "IndentationError: unexpected indent"), "user_error"),
        (
            (2, None, False, 1.0, "python3: can't open file '/x/train.py': [Errno 2] No such file"),
            "user_error",
        ),
        ((1, None, False, 120.0, TRACEBACK + "NameError: name 'z' is not defined\n"), "failed"),
        ((1, None, False, 1.0, TRACEBACK + "RuntimeError: NCCL error\n"), "failed"),
        ((1, None, False, 1.0, "ImportError: early\nthen the training ran and failed\n"), "failed"),
        ((None, 9, False, 1.0, ""), "killed"),
        ((None, 15, True, 1.0, ""), "killed"),
        ((3, None, False, 1.0, ""), "failed"),
        # recorded "saved step S, stopping", then died in teardown: the save stands
        (
            (None, 6, True, 5.0, "terminate called without an active exception\n", "checkpointed"),
            "teardown_failed",
        ),
        ((1, None, False, 5.0, "", "checkpointed"), "teardown_failed"),
        ((1, None, False, 5.0, "", "finished"), "teardown_failed"),
        ((0, None, False, 5.0, "", "checkpointed"), "checkpointed"),
        # recorded "finished" (the training is done): finished, even after a signal
        ((0, None, False, 5.0, "", "finished"), "finished"),
        ((0, None, True, 5.0, "", "finished"), "finished"),
        ((93, None, True, 5.0, "", "checkpointed"), "do_not_retry"),
        # ENOSPC, from Python or from a C library, not a crash (and not a user error)
        (
            (1, None, False, 1.0, TRACEBACK + "OSError: [Errno 28] No space left on device\n"),
            "disk_full",
        ),
        ((None, 6, False, 500.0, "write failed: No space left on device\nAborted\n"), "disk_full"),
        (
            (1, None, False, 500.0, "No space left on device\n" + "x\n" * 10 + "RuntimeError: y\n"),
            "failed",
        ),
    ],
)
def test_classify_exit(args: tuple[Any, ...], outcome: str) -> None:
    stopped = args[5] if len(args) > 5 else None
    assert classify_exit(*args[:5], user_error_window_s=60.0, stopped=stopped) == outcome


@pytest.mark.parametrize(
    ("tail", "found"),
    [
        (
            "OSError: [Errno 28] No space left on device: '/ckpt/step-9.pt'",
            (True, "/ckpt/step-9.pt"),
        ),
        ('cp: error writing "/ckpt/x": No space left on device', (True, None)),
        ('torch: No space left on device: "/d/f"\n', (True, "/d/f")),
        ("RuntimeError: boom", (False, None)),
    ],
)
def test_disk_full_is_read_from_the_tail(tail: str, found: tuple[bool, str | None]) -> None:
    assert disk_full(tail) == found


def test_a_rank_dying_of_enospc_is_reported_as_disk_full(tmp_path: Path) -> None:
    child = (
        "import errno, os\n"
        "raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/ckpt/step-9.pt')"
    )
    done = run(py(child), clean_env(FTSLURM_RUN_DIR=str(tmp_path), SLURMD_NODENAME="n2"))
    assert done.returncode == 1
    r = report(tmp_path)
    assert (r["outcome"], r["disk_full_path"], r["node"]) == ("disk_full", "/ckpt/step-9.pt", "n2")


def test_a_rank_that_recorded_its_stop_then_aborted_is_teardown_failed(tmp_path: Path) -> None:
    stale = tmp_path / "attempts" / "0" / "stopping-rank-0.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"rank": 0, "step": 3, "outcome": "checkpointed"}')  # an older process
    done = run(py("import os; os.abort()"), clean_env(FTSLURM_RUN_DIR=str(tmp_path)))
    assert done.returncode == 128 + signal.SIGABRT
    assert report(tmp_path)["outcome"] == "killed"  # the stale record was not taken for its
    assert not stale.exists()
    child = (
        "import os\nfrom ftslurm.agent import rank as fta\n"
        "agent = fta.init(); agent.heartbeat(7); agent.record_stop()\nos.abort()"
    )
    done = run(py(child), clean_env(FTSLURM_RUN_DIR=str(tmp_path)))
    assert done.returncode == 128 + signal.SIGABRT
    r = report(tmp_path)
    assert (r["outcome"], r["saved_step"], r["signal"]) == ("teardown_failed", 7, signal.SIGABRT)
    assert b"the checkpoint stands" in done.stderr


def test_leave_exits_with_the_code_after_waiting_for_saves(tmp_path: Path) -> None:
    # an async save still running when the rank leaves is finished first; the process group
    # is torn down within the bound, and the exit code is the one asked for
    child = f"""
import threading, time, torch, torch.distributed as dist
from ftslurm.checkpoint import CheckpointManager
from ftslurm.agent import rank as fta
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
agent = fta.init()
ckpt = CheckpointManager({str(tmp_path / "ckpt")!r}, report=False)
real = ckpt._write
def slow(*a, **kw):
    time.sleep(0.5)
    return real(*a, **kw)
ckpt._write = slow
ckpt.save_async(5, {{"w": torch.ones(3)}})
agent.exit(3)
"""
    done = run(py(child), clean_env(FTSLURM_RUN_DIR=str(tmp_path / "run")), timeout=120)
    assert done.returncode == 3, done.stderr
    from ftslurm.checkpoint import CheckpointManager

    assert CheckpointManager(tmp_path / "ckpt").steps() == [5]


def test_a_save_that_fails_in_flight_at_the_stop_is_discarded_and_the_rank_fails(
    tmp_path: Path,
) -> None:
    # the checkpoint signal's save is written in the background and fails (a full disk):
    # leaving, the rank waits for it, takes back its stop record and exits 1, and the
    # newest checkpoint is still the one before
    child = f"""
import os, signal, torch, torch.distributed as dist
from ftslurm.checkpoint import CheckpointManager
from ftslurm.agent import rank as fta
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
agent = fta.init()
ckpt = CheckpointManager({str(tmp_path / "ckpt")!r}, report=False)
ckpt.checkpoint(4, {{"w": torch.ones(3)}}).wait()
def full(step, *a, **kw):
    raise OSError(28, "No space left on device")
ckpt._write = full
os.kill(os.getpid(), signal.SIGUSR2)
agent.heartbeat(5)
assert agent.should_checkpoint()
ckpt.checkpoint(5, {{"w": torch.zeros(3)}})
assert agent.should_stop()
agent.exit(0)
"""
    env = clean_env(FTSLURM_RUN_DIR=str(tmp_path / "run"), FTSLURM_ATTEMPT="0")
    done = run(py(child), env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert b"checkpoint save failed before exit" in done.stderr
    assert not (tmp_path / "run" / "attempts" / "0" / "stopping-rank-0.json").exists()
    from ftslurm.checkpoint import CheckpointManager

    latest = CheckpointManager(tmp_path / "ckpt").load_latest()
    assert latest is not None and latest[0] == 4


def test_injection_env_round_trip_and_targets() -> None:
    injections = parse_inject_env("crash@5:1,straggler@0:n2*3,bogus@1,hang@2")
    assert [i.spec() for i in injections] == ["crash@5:1", "straggler@0:n2*3", "hang@2:0"]
    assert parse_inject_env("") == () and parse_inject_env(None) == ()
    last = parse_injection("straggler@0")
    assert _applies(last, 0, "n1", node_id=1, nnodes=2)
    assert not _applies(last, 0, "n0", node_id=0, nnodes=2)
    assert _applies(parse_injection("straggler@0:n0*3"), 0, "n0", node_id=0, nnodes=2)
    assert _applies(parse_injection("straggler@0:0*3"), 5, "n0", node_id=0, nnodes=2)
    assert not _applies(parse_injection("crash@1:1"), 0, "n0", node_id=0, nnodes=1)


# ---------------------------------------------------------------------- running it
@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (0, "finished"),
        (3, "failed"),
        (16, "resume_elsewhere"),
        (17, "failed_validation"),
        (93, "do_not_retry"),
    ],
)
def test_exit_codes_pass_through(tmp_path: Path, code: int, outcome: str) -> None:
    child = (
        f"import sys; print('out', flush=True); sys.stderr.write('err line\\n'); sys.exit({code})"
    )
    done = run(py(child), clean_env(FTSLURM_RUN_DIR=str(tmp_path), SLURMD_NODENAME="n7"))
    assert done.returncode == code
    assert done.stdout == b"out\n" and b"err line" in done.stderr
    r = report(tmp_path)
    assert r["outcome"] == outcome and r["exit_code"] == code and r["signal"] is None
    assert (r["rank"], r["node"], r["job_id"], r["attempt"]) == (0, "n7", "4242", 0)
    assert r["restart_count"] == 0 and r["injected"] == [] and r["checkpoint_signal_at"] is None
    assert r["started_at"] <= r["ended_at"]
    assert r["error_tail"] == (None if code == 0 else "err line")


def test_child_gets_torch_env_and_report_goes_to_the_attempt(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    child = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    env = clean_env(
        FTSLURM_RUN_DIR=str(tmp_path),
        FTSLURM_ATTEMPT_BASE="2",
        SLURM_RESTART_COUNT="1",
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NTASKS="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="n[3-4]",
        KEEP_ME="yes",
    )
    from ftslurm.core.contract import RunDir, rendezvous_record

    published = RunDir(tmp_path).rendezvous(3, 1)  # by rank 0's wrapper: the port it bound
    published.parent.mkdir(parents=True)
    record = rendezvous_record(
        host="n3",
        port=23456,
        rdzv_id="r",
        job_id="4242",
        step_id="",
        restart_count=1,
        pid=1,
        time=1,
    )
    published.write_text(json.dumps(record))
    before = time.time()
    assert run(py(child), env).returncode == 0
    seen = json.loads(out.read_text())
    assert before <= float(seen[EnvName.RANK_STARTED.value]) <= time.time()  # the wrapper's start
    assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"]) == ("1", "1", "2")
    assert (seen["LOCAL_WORLD_SIZE"], seen["MASTER_ADDR"]) == ("2", "n3")
    assert seen["MASTER_PORT"] == "23456"
    assert seen["FTSLURM_ATTEMPT"] == "3" and seen["KEEP_ME"] == "yes"
    r = report(tmp_path, attempt=3, rank=1)
    assert (r["attempt"], r["restart_count"], r["outcome"]) == (3, 1, "finished")


@pytest.mark.parametrize(
    "tail,code,line",
    [
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\n'
            "ModuleNotFoundError: No module named 'foo'\n",
            1,
            "ModuleNotFoundError: No module named 'foo'",
        ),
        # the exception line, not what a library printed after it
        (
            "torch.distributed.DistNetworkError: port in use\n[W socket.cpp] closing\n",
            1,
            "torch.distributed.DistNetworkError: port in use",
        ),
        ("KeyboardInterrupt\n", None, "KeyboardInterrupt"),
        ("loss went NaN at step 40, giving up\n", 3, "loss went NaN at step 40, giving up"),
        ("step 10\nstep 11\n", None, None),  # killed by a signal: its last line says nothing
        ("", 1, None),
        ("ValueError: " + "x" * 400, 1, "ValueError: " + "x" * 285 + "..."),
    ],
)
def test_the_error_line_says_what_failed(tail: str, code: int | None, line: str | None) -> None:
    assert error_line(tail, code) == line


def test_user_error_and_missing_command(tmp_path: Path) -> None:
    done = run(py("import nonexistent_module_xyz"), clean_env(FTSLURM_RUN_DIR=str(tmp_path)))
    assert done.returncode == 1 and b"nonexistent_module_xyz" in done.stderr
    r = report(tmp_path)
    assert r["outcome"] == "user_error"
    assert r["error_tail"].splitlines()[-1].startswith("ModuleNotFoundError")
    assert r["error_line"] == "ModuleNotFoundError: No module named 'nonexistent_module_xyz'"

    done = run(
        ["/nonexistent/ftslurm-no-such-command"],
        clean_env(FTSLURM_RUN_DIR=str(tmp_path), FTSLURM_ATTEMPT="1"),
    )
    assert done.returncode == 127
    assert len(done.stderr.decode().strip().splitlines()) == 1
    r = report(tmp_path, attempt=1)
    assert r["outcome"] == "user_error" and r["exit_code"] == 127
    assert r["error_line"].startswith("ftslurm: cannot start '/nonexistent/ftslurm-no-such")

    usage = subprocess.run(
        [sys.executable, "-m", "ftslurm.agent.task", "--"],
        env=clean_env(),
        capture_output=True,
        timeout=30,
    )
    assert usage.returncode == 2 and len(usage.stderr.decode().strip().splitlines()) == 1


def test_killed_child(tmp_path: Path) -> None:
    done = run(
        py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        clean_env(FTSLURM_RUN_DIR=str(tmp_path)),
    )
    assert done.returncode == 128 + signal.SIGKILL
    r = report(tmp_path)
    assert (r["outcome"], r["exit_code"], r["signal"]) == ("killed", None, signal.SIGKILL)


# A child that records the signals it gets: TERM (or USR2) also makes it exit 0.
SIGNAL_CHILD = r"""
import os, signal, sys, time
folder = sys.argv[1]
def got(sig, _frame):
    open(os.path.join(folder, signal.Signals(sig).name), "w").close()
    if sig in (signal.SIGTERM, signal.SIGUSR2):
        sys.exit(0)
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, got)
open(os.path.join(folder, "ready"), "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(5)
"""


def test_signals_are_forwarded(tmp_path: Path) -> None:
    proc = start(
        [sys.executable, "-c", SIGNAL_CHILD, str(tmp_path)],
        clean_env(FTSLURM_RUN_DIR=str(tmp_path)),
    )
    wait_for((tmp_path / "ready").exists, what="the child to start")
    for sig in (signal.SIGUSR1, signal.SIGHUP):
        proc.send_signal(sig)
        wait_for((tmp_path / sig.name).exists, what=f"{sig.name} to reach the child")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 0
    assert (tmp_path / "SIGTERM").exists()
    r = report(tmp_path)
    assert r["outcome"] == "checkpointed" and r["checkpoint_signal_at"] is not None


def test_checkpoint_signal_makes_exit_zero_checkpointed(tmp_path: Path) -> None:
    proc = start(
        [sys.executable, "-c", SIGNAL_CHILD, str(tmp_path)],
        clean_env(FTSLURM_RUN_DIR=str(tmp_path), FTSLURM_CHECKPOINT_SIGNAL="SIGUSR2"),
    )
    wait_for((tmp_path / "ready").exists, what="the child to start")
    before = time.time()
    proc.send_signal(signal.SIGUSR2)
    assert finish(proc) == 0
    r = report(tmp_path)
    assert r["outcome"] == "checkpointed" and (tmp_path / "SIGUSR2").exists()
    assert before <= r["checkpoint_signal_at"] <= r["ended_at"]


# A child without a USR2 handler until the file "arm" appears (never, unless the test makes
# it); it exits 0 when "go" appears, or on USR2 once it has its handler.
LATE_HANDLER_CHILD = r"""
import os, signal, sys, time
folder = sys.argv[1]
def got(sig, _frame):
    open(os.path.join(folder, signal.Signals(sig).name), "w").close()
    sys.exit(0)
open(os.path.join(folder, "ready"), "w").close()
armed = False
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not os.path.exists(os.path.join(folder, "go")):
    if not armed and os.path.exists(os.path.join(folder, "arm")):
        signal.signal(signal.SIGUSR2, got)
        open(os.path.join(folder, "armed"), "w").close()
        armed = True
    time.sleep(0.01)
sys.exit(0 if os.path.exists(os.path.join(folder, "go")) else 5)
"""


def held_said(err: Path) -> bool:
    return "SIGUSR2 held: no process of rank 0 catches it" in err.read_text(errors="replace")


def test_a_child_without_a_handler_is_not_killed_by_the_checkpoint_signal(tmp_path: Path) -> None:
    """USR2 would end a script without a handler: the wrapper holds it instead, the script
    runs on and finishes (not "checkpointed": it never got the signal), and the report
    names the signal withheld."""
    err = tmp_path / "stderr"
    with err.open("wb") as out:
        proc = start(
            [sys.executable, "-c", LATE_HANDLER_CHILD, str(tmp_path)],
            clean_env(FTSLURM_RUN_DIR=str(tmp_path)),
            stderr=out,
        )
        wait_for((tmp_path / "ready").exists, what="the child to start")
        proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: held_said(err), what="the wrapper to hold USR2")
        assert proc.poll() is None
        (tmp_path / "go").touch()
        assert finish(proc) == 0, err.read_text()
    r = report(tmp_path)
    assert (r["outcome"], r["signal"], r["checkpoint_signal_withheld"]) == (
        "finished",
        None,
        "USR2",
    ), r
    assert r["checkpoint_signal_at"] is not None  # it came, when


def test_a_held_checkpoint_signal_is_delivered_once_the_child_catches_it(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with err.open("wb") as out:
        proc = start(
            [sys.executable, "-c", LATE_HANDLER_CHILD, str(tmp_path)],
            clean_env(FTSLURM_RUN_DIR=str(tmp_path)),
            stderr=out,
        )
        wait_for((tmp_path / "ready").exists, what="the child to start")
        proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: held_said(err), what="the wrapper to hold USR2")
        (tmp_path / "arm").touch()  # the child installs its handler now
        assert finish(proc) == 0, err.read_text()
    assert (tmp_path / "SIGUSR2").exists() and not (tmp_path / "go").exists()
    r = report(tmp_path)
    assert (r["outcome"], r["checkpoint_signal_withheld"]) == ("checkpointed", None), r


def test_a_plain_child_ended_by_term_after_a_withheld_signal(tmp_path: Path) -> None:
    """What the wall limit does to a plain script: TERM ends it (TERM is never held); the
    report says the checkpoint signal was withheld, so the daemon continues the run."""
    err = tmp_path / "stderr"
    with err.open("wb") as out:
        proc = start(
            [sys.executable, "-c", LATE_HANDLER_CHILD, str(tmp_path)],
            clean_env(FTSLURM_RUN_DIR=str(tmp_path)),
            stderr=out,
        )
        wait_for((tmp_path / "ready").exists, what="the child to start")
        proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: held_said(err), what="the wrapper to hold USR2")
        proc.send_signal(signal.SIGTERM)
        assert finish(proc) == 128 + signal.SIGTERM
    r = report(tmp_path)
    assert (r["outcome"], r["signal"], r["checkpoint_signal_withheld"]) == (
        "killed",
        signal.SIGTERM,
        "USR2",
    ), r


# The wrapper, stopped (SIGSTOP) where it removes an old stop record of its rank: its
# handlers are in place, its command not started yet (an audit hook: the code is the same).
PAUSED_BEFORE_START = r"""
import os, runpy, signal, sys
paused, name = [], sys.argv[1]
def pause(event, args):
    if event == "os.remove" and not paused and str(args[0]).endswith(name):
        paused.append(1)
        os.kill(os.getpid(), signal.SIGSTOP)
sys.addaudithook(pause)
sys.argv = [sys.argv[0], *sys.argv[2:]]
runpy.run_module("ftslurm.agent.task", run_name="__main__", alter_sys=True)
"""


def proc_stopped(pid: int) -> bool:
    return proc_state(pid) == "T"


def test_a_term_before_the_command_started_means_it_never_starts(tmp_path: Path) -> None:
    """Forced timing: TERM reaches the wrapper after its handlers are in place and before
    it starts the command. The command never starts, and the report says the rank was
    stopped (not a command killed at its start)."""
    from ftslurm.core.contract import RunDir

    mark = tmp_path / "started"
    err = tmp_path / "stderr"
    with err.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                PAUSED_BEFORE_START,
                RunDir(tmp_path).stop_record(0, 0).name,
                "--",
                *py(f"open({str(mark)!r}, 'w').close()"),
            ],
            env=clean_env(FTSLURM_RUN_DIR=str(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=out,
        )
        try:
            wait_for(lambda: proc_stopped(proc.pid), 60, "the wrapper to pause")
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
            assert finish(proc) == 128 + signal.SIGTERM, err.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not mark.exists()
    r = report(tmp_path)
    assert (r["outcome"], r["exit_code"], r["signal"]) == ("stopped", None, signal.SIGTERM), r
    assert "told to stop (SIGTERM) before its command started" in err.read_text()


# A child that beats: writes a growing counter (and its pid) every 20 ms until TERM.
HEARTBEAT_CHILD = r"""
import os, signal, sys, time
folder = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
open(os.path.join(folder, "pid"), "w").write(str(os.getpid()))
n, deadline = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    n += 1
    tmp = os.path.join(folder, "beat.tmp")
    open(tmp, "w").write(str(n))
    os.replace(tmp, os.path.join(folder, "beat"))
    time.sleep(0.02)
"""


def beat(folder: Path) -> int:
    try:
        return int((folder / "beat").read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_crash_injection_kills_rank_zero_only(tmp_path: Path) -> None:
    env = clean_env(FTSLURM_RUN_DIR=str(tmp_path), FTSLURM_INJECT="crash@1")
    t0 = time.monotonic()
    proc = start([sys.executable, "-c", HEARTBEAT_CHILD, str(tmp_path), "60"], env)
    assert finish(proc) == 137
    assert time.monotonic() - t0 >= 1.0
    assert b"ftslurm: injected crash@1:0 on rank 0 (node " in proc.stderr.read()  # type: ignore
    r = report(tmp_path)
    assert (r["outcome"], r["signal"], r["injected"]) == ("killed", 9, ["crash@1:0"])
    assert r["ended_at"] - r["started_at"] >= 1.0

    other = tmp_path / "rank1"
    other.mkdir()
    done = run(
        [sys.executable, "-c", HEARTBEAT_CHILD, str(other), "1.5"], {**env, "SLURM_PROCID": "1"}
    )
    assert done.returncode == 0 and b"injected" not in done.stderr
    assert report(tmp_path, rank=1)["injected"] == []


def test_an_injection_fires_once_per_run(tmp_path: Path) -> None:
    env = clean_env(
        FTSLURM_RUN_DIR=str(tmp_path), FTSLURM_INJECT="crash@0.2", FTSLURM_ATTEMPT_BASE="0"
    )
    assert run([sys.executable, "-c", HEARTBEAT_CHILD, str(tmp_path), "60"], env).returncode == 137
    requeued = run(
        [sys.executable, "-c", HEARTBEAT_CHILD, str(tmp_path), "1"],
        {**env, "SLURM_RESTART_COUNT": "1"},
    )
    assert requeued.returncode == 0
    assert report(tmp_path, attempt=1)["injected"] == []


def test_hang_injection_stops_the_child_until_sigcont(tmp_path: Path) -> None:
    proc = start(
        [sys.executable, "-c", HEARTBEAT_CHILD, str(tmp_path), "60"],
        clean_env(FTSLURM_RUN_DIR=str(tmp_path), FTSLURM_INJECT="hang@0.5"),
    )
    try:
        pid = int(
            wait_for(
                lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
                what="the child's pid",
            )
        )
        wait_for(lambda: proc_state(pid) == "T", what="the child to be stopped")
        stopped_at = beat(tmp_path)
        assert stopped_at > 0
        # Stopped, it makes no progress (no new beat over a window of 25 beats).
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert beat(tmp_path) == stopped_at and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: beat(tmp_path) > stopped_at + 2, what="the child to resume")
        proc.send_signal(signal.SIGTERM)
        assert finish(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert report(tmp_path)["injected"] == ["hang@0.5:0"]


# A busy loop that counts its iterations over a fixed wall-clock window.
BUSY_CHILD = r"""
import os, sys, time
open(sys.argv[1] + ".pid", "w").write(str(os.getpid()))
start = time.monotonic()
end, n = start + float(sys.argv[2]), 0
while time.monotonic() < end:
    n += 1
open(sys.argv[1], "w").write(str(n))
"""


def stopped_share(out: Path, env: Mapping[str, str]) -> float:
    """Run BUSY_CHILD for 1.5 s under the task wrapper and look at its state in /proc every
    few ms until it ends: the share of looks that found it stopped (T). Unlike the work it
    gets done, this does not depend on how busy the machine is."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ftslurm.agent.task",
            "--",
            sys.executable,
            "-c",
            BUSY_CHILD,
            str(out),
            "1.5",
        ],
        env=dict(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        pid_file = Path(f"{out}.pid")  # where BUSY_CHILD writes its pid
        wait_for(lambda: pid_file.exists() or proc.poll() is not None, 30, "the child's pid")
        stat = Path(f"/proc/{pid_file.read_text()}/stat")
        looks = stopped = 0
        while proc.poll() is None:
            try:
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                break  # the child has ended
            looks, stopped = looks + 1, stopped + (state == "T")
            time.sleep(0.005)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and looks > 20, (proc.returncode, looks, err)
    return stopped / looks


def test_straggler_slows_the_child(tmp_path: Path) -> None:
    """A 4-fold straggler is stopped 3/4 of every period (and continued: the child ends);
    the same child without the injection is never stopped."""
    share = {}
    for name, inject in (("baseline", ""), ("slow", "straggler@0:4")):
        env = clean_env(
            FTSLURM_RUN_DIR=str(tmp_path / f"run-{name}"),
            FTSLURM_INJECT=inject,
            SLURM_NODEID="1",
            SLURM_NNODES="2",
        )  # the last node: the default target
        share[name] = stopped_share(tmp_path / name, env)
    assert share["baseline"] == 0 and 0.4 < share["slow"] < 0.95, share
    assert report(tmp_path / "run-slow")["injected"] == ["straggler@0:4"]


def test_under_the_launcher_a_straggler_slows_the_training_not_the_start_up(tmp_path: Path):
    """Forced timing: with a heartbeat folder (the launcher's) and no heartbeat record yet
    (the rank still starting), a straggler due at once stops the rank never; once the test
    writes the record (the rank agent attached), the rank is stopped in most looks."""
    hb = tmp_path / "hb"
    hb.mkdir()
    out = tmp_path / "busy"
    env = clean_env(
        FTSLURM_RUN_DIR=str(tmp_path / "run"),
        FTSLURM_INJECT="straggler@0:4",
        FTSLURM_HEARTBEAT_DIR=str(hb),
        SLURM_NODEID="1",
        SLURM_NNODES="2",
    )  # the last node: the default target
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftslurm.agent.task", "--", sys.executable, "-c", BUSY_CHILD]
        + [str(out), "4"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        pid_file = Path(f"{out}.pid")
        wait_for(lambda: pid_file.exists() or proc.poll() is not None, 30, "the child's pid")
        stat = Path(f"/proc/{pid_file.read_text()}/stat")

        def stopped_share(seconds: float) -> tuple[int, int]:
            looks = stopped = 0
            end = time.monotonic() + seconds
            while time.monotonic() < end and proc.poll() is None:
                stopped += stat.read_text().rsplit(")", 1)[1].split()[0] == "T"
                looks += 1
                time.sleep(0.005)
            return stopped, looks

        before, looks = stopped_share(1.0)
        assert before == 0 and looks > 20, (before, looks)  # starting: never stopped
        HeartbeatDir(hb).record("0").write_bytes(b"")  # the rank agent attached
        after, looks = stopped_share(1.0)
        assert after > 0.4 * looks, (after, looks)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A rank whose step is a sleep of the straggler's period (0.1 s), as the example recipe's
# `--step-time 0.1`: it records how long each step took.
SLEEPING_CHILD = r"""
import json, sys, time
took = []
for _ in range(40):
    start = time.monotonic()
    time.sleep(0.1)
    took.append(time.monotonic() - start)
open(sys.argv[1], "w").write(json.dumps(took))
"""


def test_a_straggler_slows_a_rank_whose_step_sleeps_its_period(tmp_path: Path) -> None:
    """A 4-fold straggler stops the node for 3/4 of periods of varying length: a rank whose
    steps sleep 0.1 s wakes inside a stop in about 3 steps of 4 and waits for its end. (With
    a fixed 0.1 s period, it woke in its run slice every time and was not slowed at all.)
    Counted per step (a step that woke inside a stop mostly took 20 ms more), not by the work
    done."""
    out = tmp_path / "took.json"
    env = clean_env(
        FTSLURM_RUN_DIR=str(tmp_path / "run"),
        FTSLURM_INJECT="straggler@0:4",
        SLURM_NODEID="1",
        SLURM_NNODES="2",
    )  # the last node: the default target
    done = run([sys.executable, "-c", SLEEPING_CHILD, str(out)], env)
    assert done.returncode == 0, done.stderr
    took = json.loads(out.read_text())
    slowed = sum(t > 0.12 for t in took) / len(took)  # about half of them; none before
    assert slowed > 0.2, sorted(round(t, 3) for t in took)


def test_a_straggler_stays_on_the_node_it_first_slowed(tmp_path: Path) -> None:
    """Like a bad node: in a later attempt the same rank on another node runs at full speed,
    and any rank that lands on the slowed node is slow again."""
    run_dir = tmp_path / "run"
    base = clean_env(
        FTSLURM_RUN_DIR=str(run_dir),
        FTSLURM_INJECT="straggler@0:1*4",
        FTSLURM_ATTEMPT_BASE="0",
        SLURM_NNODES="2",
    )

    def ran(name: str, **env: str) -> list[str]:
        done = run([sys.executable, "-c", BUSY_CHILD, str(tmp_path / name), "0.5"], {**base, **env})
        assert done.returncode == 0, done.stderr
        return report(
            run_dir, attempt=int(env.get("SLURM_RESTART_COUNT", "0")), rank=int(env["SLURM_PROCID"])
        )["injected"]

    assert ran("first", SLURM_PROCID="2", SLURM_NODEID="1", SLURMD_NODENAME="n2") == [
        "straggler@0:1*4"
    ]
    assert json.loads((run_dir / "attempts" / "straggler-nodes.json").read_text()) == {
        "straggler@0:1*4": "n2"
    }
    # attempt 1: node index 1 is now n4 (n2 excluded): spared; n2 as index 0: slowed again
    assert (
        ran(
            "moved",
            SLURM_PROCID="2",
            SLURM_NODEID="1",
            SLURMD_NODENAME="n4",
            SLURM_RESTART_COUNT="1",
        )
        == []
    )
    assert ran(
        "back", SLURM_PROCID="0", SLURM_NODEID="0", SLURMD_NODENAME="n2", SLURM_RESTART_COUNT="1"
    ) == ["straggler@0:1*4"]


# ---------------------------------------------------------------------- progress
def test_progress_api_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTSLURM_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("FTSLURM_ATTEMPT", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(progress, "_last_step_write", None)
    progress.report_step(5)
    progress.report_step(6)  # within a second of the last write: skipped
    data = json.loads((tmp_path / "progress.json").read_text())
    assert (data["step"], data["attempt"], data["finished"]) == (5, 2, False)
    progress.checkpoint_saved(10, 2.5)
    progress.checkpoint_saved(20, 0.5)
    progress.checkpoint_saved(25)
    data = json.loads((tmp_path / "progress.json").read_text())
    assert (data["checkpoint_step"], data["checkpoint_save_s"]) == (25, 0.5)
    assert data["max_checkpoint_save_s"] == 2.5 and data["step"] == 25
    assert not (tmp_path / "FINISHED").exists()
    progress.finished(30)
    data = json.loads((tmp_path / "progress.json").read_text())
    assert data["finished"] is True and data["step"] == 30 and data["checkpoint_step"] == 25
    assert abs(data["updated_at"] - time.time()) < 60
    assert json.loads((tmp_path / "FINISHED").read_text())["step"] == 30


def test_progress_api_is_quiet_elsewhere(tmp_path: Path) -> None:
    code = (
        "from ftslurm.agent import progress\n"
        "progress.report_step(1); progress.checkpoint_saved(2, 1.0); progress.finished(3)"
    )
    for extra in ({"RANK": "1", "FTSLURM_RUN_DIR": str(tmp_path)}, {"RANK": "0"}):
        env = {**clean_env(), **extra}
        assert subprocess.run(py(code), env=env, timeout=30).returncode == 0
    assert list(tmp_path.iterdir()) == []
    env = {**clean_env(), "FTSLURM_RUN_DIR": str(tmp_path)}  # RANK unset: rank 0
    assert subprocess.run(py(code), env=env, timeout=30).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FINISHED", "progress.json"]


def test_the_command_dies_with_a_sigkilled_wrapper(tmp_path):
    """A task killed by SIGKILL (a node's processes killed, a crash) takes its rank along."""
    pidfile = tmp_path / "child.pid"
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ftslurm.agent.task",
            "--",
            "bash",
            "-c",
            f"echo $$ > {pidfile}; exec sleep 60",
        ]
    )
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.02)
    child = int(pidfile.read_text())
    wrapper.send_signal(signal.SIGKILL)
    wrapper.wait()
    deadline = time.monotonic() + 10
    while (
        Path(f"/proc/{child}").exists()
        and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]
    ):
        assert time.monotonic() < deadline, "the child outlived its wrapper"
        time.sleep(0.02)


def test_ranks_without_the_launcher_take_the_port_rank_0_bound_and_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the job's derived port, which any process (another mock cluster's job of the
    same id) may hold: rank 0's wrapper publishes a free port in the run directory, the
    others wait for the record of their own job's step and restart."""
    from ftslurm.agent import task
    from ftslurm.core.contract import RunDir

    run = RunDir(tmp_path / "run")
    base = {
        "FTSLURM_RUN_DIR": str(run.root),
        "FTSLURM_ATTEMPT": "0",
        "SLURM_JOB_ID": "777000",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1",
    }
    other = task.Task(["true"], {**base, "SLURM_PROCID": "1"})
    run.rendezvous(0, 0).parent.mkdir(parents=True)
    record = {**json.loads(json.dumps(base)), "port": 4321}  # not a record of this job's
    run.rendezvous(0, 0).write_text(json.dumps({"job_id": "776000", **record}))
    monkeypatch.setattr(task, "PORT_WAIT_S", 0.5)
    assert other.agree_port() == 1  # another job's record is never taken: no port in time
    said = json.loads(run.rank_report(0, 1).read_text())
    assert said["outcome"] == "failed" and "rank 0 published no port" in said["error_line"]
    first = task.Task(["true"], {**base, "SLURM_PROCID": "0"})
    assert first.agree_port() is None
    other = task.Task(["true"], {**base, "SLURM_PROCID": "1"})
    assert other.agree_port() is None
    assert other.env["MASTER_PORT"] == first.env["MASTER_PORT"], (first.env, other.env)
    published = json.loads(run.rendezvous(0, 0).read_text())
    assert str(published["port"]) == first.env["MASTER_PORT"]
    assert published["job_id"] == "777000" and published["step_id"] == "0", published
