"""The mock scheduler's processes: launch a job's batch script, signal it, kill it.

Everything about a job's processes is recorded in its folder (`<mock home>/jobs/<id>/`), in
small JSON files written atomically, so any process can read a job's exit status, signal it
or kill it, whichever process launched it:

    launch.json  how to run it (env, cwd, output files)   written by launch_batch
    batch.json   jobwrap's pid                              written by launch_batch
    shell.json   the batch shell's pid and process group    written by jobwrap
    steps/N.json the tasks of step N (pid, pgid, node, rank) written by the mock srun
                 and whether it was started with --no-kill
    lost/NODE    the node died under the job (its processes are gone)
    down/NODE    the controller declared it down and the job lives on (--no-kill)
    exit.json    the batch shell's wait status             written by jobwrap at the end
    bin/srun     the mock srun, first on the job's PATH

A dead "host" is modelled by SIGKILLing the processes that run "on" it; a batch host that
dies leaves no exit.json, as a real dead node reports nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from ftslurm.errors import ConfigError
from ftslurm.fsutil import forget_node_memory, memory_base, read_json, write_json_atomic
from ftslurm.procutil import NOT_RUNNING, pid_alive, stat_fields


def launch_batch(
    job_dir: Path,
    script: str,
    env: Mapping[str, str],
    cwd: str,
    stdout_path: str,
    stderr_path: str,
    open_mode: str = "truncate",
    kill_wait_s: float = 30.0,
) -> int:
    """Start the job's batch script under a detached `jobwrap`; return jobwrap's pid."""
    job_dir = Path(job_dir)
    reap(job_dir)  # a requeued job: what is left of its previous run
    for stale in ("exit.json", "batch.json", "shell.json", "next_step"):
        (job_dir / stale).unlink(missing_ok=True)
    for stale in ("steps", "lost", "down"):
        shutil.rmtree(job_dir / stale, ignore_errors=True)
    (job_dir / "steps").mkdir(parents=True)
    (job_dir / "bin").mkdir(exist_ok=True)
    (job_dir / "script.sh").write_text(script)
    srun = job_dir / "bin" / "srun"
    srun.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ftslurm.backends.mock.srun "$@"\n')
    srun.chmod(0o755)
    full_env = dict(env)
    full_env["PATH"] = f"{job_dir / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
    full_env["FTSLURM_MOCK_JOB_DIR"] = str(job_dir)
    write_json_atomic(
        job_dir / "launch.json",
        {
            "env": full_env,
            "cwd": cwd,
            "stdout": stdout_path,
            "stderr": stderr_path,
            "open_mode": open_mode,
            "kill_wait_s": kill_wait_s,
        },
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftslurm.backends.mock.jobwrap", str(job_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
        env=full_env,
        cwd=cwd if os.path.isdir(cwd) else None,
    )
    write_json_atomic(job_dir / "batch.json", {"wrapper": proc.pid})
    _forget(proc)
    return proc.pid


def reap(job_dir: Path, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of the job's current run, jobwrap included, and wait until they
    are gone. Before a relaunch, the old jobwrap must not record an exit, or kill steps,
    after the next run started."""
    batch = _batch(job_dir)
    wrapper = batch.get("wrapper")
    if not _is_wrapper(wrapper, job_dir):
        wrapper = None
    deadline = time.monotonic() + timeout_s
    while True:
        if wrapper and pid_alive(wrapper):
            os.kill(wrapper, signal.SIGKILL)
        _killpg(batch.get("pgid"), signal.SIGKILL)
        signal_steps(job_dir, signal.SIGKILL)
        left = (
            (wrapper and pid_alive(wrapper))
            or _group_alive(batch.get("pgid"))
            or steps_alive(job_dir)
        )
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def _is_wrapper(pid: int | None, job_dir: Path) -> bool:
    """Whether `pid` is still this job's jobwrap (and not a reused pid)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"ftslurm.backends.mock.jobwrap" in argv and str(job_dir).encode() in argv


def _forget(proc: subprocess.Popen) -> None:
    """Let a child we will not wait for be reaped without leaving a zombie behind."""
    import threading

    threading.Thread(target=proc.wait, daemon=True).start()


def _group_alive(pgid: int | None) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # Zombies keep a group "alive" for killpg(0); look for a live member.
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None and int(fields[2]) == pgid and fields[0] not in NOT_RUNNING:
                return True
    return False


def _killpg(pgid: int | None, sig: int) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _tasks(job_dir: Path) -> Iterator[dict]:
    for step in sorted((Path(job_dir) / "steps").glob("*.json")):
        yield from (read_json(step) or {}).get("tasks", [])


def _batch(job_dir: Path) -> dict:
    job_dir = Path(job_dir)
    wrapper = read_json(job_dir / "batch.json") or {}
    return {**wrapper, **(read_json(job_dir / "shell.json") or {})}


def signal_steps(job_dir: Path, sig: int, node: str | None = None) -> int:
    """Signal the tasks of every step (only those on `node` if given)."""
    return sum(
        _killpg(t.get("pgid"), sig)
        for t in _tasks(job_dir)
        if node is None or t.get("node") == node
    )


def signal_rank(job_dir: Path, rank: int, sig: int) -> bool:
    """Signal one rank's task in the newest step that has it."""
    steps = sorted((Path(job_dir) / "steps").glob("*.json"), key=lambda p: int(p.stem))
    for step in reversed(steps):
        for task in (read_json(step) or {}).get("tasks", []):
            if task.get("rank") == rank:
                return _killpg(task.get("pgid"), sig)
    return False


def signal_batch(job_dir: Path, sig: int) -> bool:
    """Signal the batch shell and its children (its process group; the mock srun in it
    ignores USR1/USR2 as Slurm's does, and steps' tasks have groups of their own)."""
    return _killpg(_batch(job_dir).get("pgid"), sig)


def kill_node(job_dir: Path, node: str, batch_host: str) -> int:
    """SIGKILL what runs on `node`; the batch host takes the batch shell and jobwrap along.

    The node is marked lost first: as with a real host that dies, srun on the batch host
    hears nothing from the tasks that ran there (see `node_lost`) and waits until the
    controller declares the node down and ends the job."""
    lost = Path(job_dir) / "lost"
    lost.mkdir(exist_ok=True)
    (lost / node).touch()
    count = signal_steps(job_dir, signal.SIGKILL, node)
    with contextlib.suppress(ConfigError):  # a bad FTSLURM_MEMORY_DIR: nothing to wipe
        forget_node_memory(memory_base(), node)  # its memory is lost with it
    if node == batch_host:
        batch = _batch(job_dir)
        for pid in (batch.get("wrapper"),):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                count += 1
        count += _killpg(batch.get("pgid"), signal.SIGKILL)
    return count


def node_down(job_dir: Path, node: str) -> int:
    """The controller declared `node` down under a `--no-kill` job, which lives on. As
    Slurm: srun learns it (see `node_declared_down`), and every step that had a task on the
    node is ended (its other tasks SIGKILLed) unless it was started with `srun --no-kill`.
    Returns the number of tasks killed."""
    down = Path(job_dir) / "down"
    down.mkdir(exist_ok=True)
    (down / node).touch()
    count = 0
    for step in sorted((Path(job_dir) / "steps").glob("*.json")):
        data = read_json(step) or {}
        tasks = data.get("tasks", [])
        if data.get("no_kill") or not any(t.get("node") == node for t in tasks):
            continue
        count += sum(_killpg(t.get("pgid"), signal.SIGKILL) for t in tasks)
    return count


def node_declared_down(job_dir: Path, node: str) -> bool:
    """Whether the controller declared `node` down while the job lives on (`node_down`)."""
    return (Path(job_dir) / "down" / node).exists()


def node_lost(job_dir: Path, node: str) -> bool:
    """Whether `node` died under this job (srun then never learns how its tasks ended)."""
    return (Path(job_dir) / "lost" / node).exists()


def kill_job(job_dir: Path) -> None:
    """SIGKILL every task and the batch shell (jobwrap then records the batch's end)."""
    signal_steps(job_dir, signal.SIGKILL)
    signal_batch(job_dir, signal.SIGKILL)


def exit_status(job_dir: Path) -> tuple[int, int | None] | None:
    """(exit code, signal) of the batch shell, once jobwrap recorded it."""
    data = read_json(Path(job_dir) / "exit.json")
    if not data:
        return None
    return int(data["exit_code"]), data.get("signal")


def batch_alive(job_dir: Path) -> bool:
    batch = _batch(job_dir)
    return pid_alive(batch.get("wrapper")) or _group_alive(batch.get("pgid"))


def steps_alive(job_dir: Path) -> bool:
    return any(_group_alive(t.get("pgid")) for t in _tasks(job_dir))
