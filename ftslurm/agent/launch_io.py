"""What the launcher's shell (`ftslurm.agent.launch`, `ftslurm.agent.elastic`) shares and
that needs no torch: its exceptions, the test pause, and what it does to rank processes
(kill them and wait; their CPU time)."""

from __future__ import annotations

import os
import select
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ftslurm.core.contract import HeartbeatDir
from ftslurm.procutil import pid_alive


class Abandoned(Exception):
    """The rendezvous given up for news of a peer (its launcher failed or its node was
    lost) or a stop: not this launcher's own failure."""


class FailedHealthCheck(Exception):
    """The node failed its health check between two in-job rounds: the launcher leaves with
    `code` (its failure reported; with a spare that takes its place, stepped out)."""

    def __init__(self, code: int, benched: bool) -> None:
        super().__init__(f"health check failed between rounds: exit {code}")
        self.code = code
        self.benched = benched


class Stopped(Exception):
    """Told to stop (SIGTERM, SIGINT) before the ranks started: they never do. Raised at
    the phase boundaries before a round of ranks starts, and by the signal handler itself
    out of torch's rendezvous join, so a stop does not wait for the other nodes."""

    def __init__(self, sig: int) -> None:
        super().__init__(f"told to stop ({signal.Signals(sig).name}) before the ranks started")
        self.sig = sig


# Test hook: the launcher stops itself (SIGSTOP) at each phase named here (comma-separated:
# "start", "rendezvous", "ranks", "spawn"; see `ftslurm.agent.launch.main`), so a test can
# send a signal at exactly that point and then continue it. Continued before any signal
# came (a scheduler continues a job's tasks before it signals them: `scancel` sends SIGCONT,
# then SIGTERM), it stays there until one comes (at most PAUSE_HOLD_S): the signal comes at
# that phase, not a little later.
PAUSE_ENV = "FTSLURM_TEST_PAUSE_LAUNCH"
PAUSE_HOLD_S = 10.0


def pause_for_tests(phase: str) -> None:
    if phase not in os.environ.get(PAUSE_ENV, "").split(","):
        return
    came, wake = os.pipe()  # Python's signal handling writes each handled signal here
    os.set_blocking(wake, False)
    try:
        before = signal.set_wakeup_fd(wake)
    except ValueError:  # not the main thread: no waiting for the signal
        before = None
    try:
        os.kill(os.getpid(), signal.SIGSTOP)
        if before is not None:
            select.select([came], [], [], PAUSE_HOLD_S)
    finally:
        if before is not None:
            signal.set_wakeup_fd(before)
        os.close(came)
        os.close(wake)


def sweep_heartbeat_dirs(tmp: Path) -> None:
    """Remove the node-local folders (`HeartbeatDir`) that launchers of this user left in
    `tmp` when they were killed (SIGKILL at a lost node or at KillWait: no clean-up ran),
    whose launcher no longer runs on this machine. Another user's folder, or one whose
    launcher runs (stopped included), is left alone."""
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return
    for entry in entries:
        pid = HeartbeatDir.launcher_pid(entry.name)
        try:
            mine = entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == os.getuid()
        except OSError:
            continue
        if pid is None or not mine or pid_alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def _below(pid: int) -> Iterator[tuple[int, list[str]]]:
    """Each process below `pid` (left out itself), with the fields of its `/proc/<pid>/stat`
    after the command name ([] when it could not be read: it just ended); nothing when
    `pid` is gone."""
    todo, seen = [pid], {pid}
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            for kid in kids:
                if kid in seen:
                    continue
                seen.add(kid)
                todo.append(kid)
                try:
                    with open(f"/proc/{kid}/stat") as f:
                        yield kid, f.read().rsplit(")", 1)[-1].split()
                except OSError:
                    yield kid, []


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds used by the processes below a rank's wrapper (the training script and
    its children; the wrapper itself polls and is left out once they run), or None when it
    is gone. Until the wrapper has started the script, its own: its start (Python and its
    imports) is the rank's start, and under load it can take more than a tight running
    limit, which a rank using no CPU at all would be judged hung by."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            own = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    below = list(_below(pid))
    total = 0.0
    for fields in [fields for _kid, fields in below] if below else [own]:
        try:
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (IndexError, ValueError):
            pass
    return total


def _states(pid: int) -> dict[int, str]:
    """The scheduling state (`/proc/<pid>/stat`'s third field: R, S, D, T, t, ...) of each
    process below a rank's wrapper (the wrapper left out); empty when it is gone."""
    return {kid: fields[0] for kid, fields in _below(pid) if fields}


FROZEN_LOOK_S = 0.5  # how long a launcher looks at a hung rank's processes (`frozen`)


def frozen(pid: int, look_s: float = FROZEN_LOOK_S) -> bool:
    """Whether a rank judged hung is frozen: a process below its wrapper is stopped or
    traced (T, t) at the end of a look of `look_s`, or in uninterruptible sleep (D, stuck in
    the kernel) all through it. A frozen rank waits on no peer; one sleeping or running
    may be blocked in a collective on another node's hung rank."""
    before = _states(pid)
    time.sleep(look_s)
    after = _states(pid)
    return any(s in ("T", "t") or (s == "D" and before.get(p) == "D") for p, s in after.items())


def kill_ranks(pids: Any, wait_s: float = 10.0) -> None:
    """SIGKILL the ranks (their own children die with them) and wait until they are gone,
    so the next round never meets a straggling process of the last one."""
    pids = list(pids)
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            if not pid_alive(pid):  # gone, or a zombie: dead
                break
            time.sleep(0.02)


def rendezvous_closed(handler: Any) -> bool:
    """Whether torch's rendezvous `handler` was closed (a launcher ended the run); its store
    gone with node rank 0's launcher counts as closed."""
    try:
        return bool(handler.is_closed())
    except Exception:  # noqa: BLE001 - the store is gone with node 0's launcher
        return True
