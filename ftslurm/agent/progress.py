"""What a training script tells the daemon: its step, its checkpoints, that it finished.

    from ftslurm.agent import progress
    progress.report_step(step)               # cheap: written at most once a second
    progress.checkpoint_saved(step, seconds) # after a checkpoint is safely on disk
    progress.memory_saved(step, seconds)     # after a memory-tier save (not persistent)
    progress.finished(step)                  # training is complete: do not continue it
    progress.live_recovery()                 # the ranks recover live (`ftslurm.agent.live`)

Each call does nothing unless the script runs under ftslurm (FTSLURM_RUN_DIR set), and only
rank 0 (RANK, default 0) writes. The file `$FTSLURM_RUN_DIR/progress.json` is rewritten
atomically (read, update, write) and holds:

    step                   int    the last step reported (by any of the three calls)
    checkpoint_step        int    the step of the last checkpoint saved (absent before one)
    checkpoint_save_s      float  how long the training stood still for that save (when
                                  told): all of it for a blocking save, the snapshot (and
                                  any wait for the previous save) for an asynchronous one
    checkpoint_write_s     float  how long an asynchronous save wrote in the background
    checkpoint_at          float  unix time the daemon learned of that checkpoint
    max_checkpoint_save_s  float  the longest save told of so far
    max_checkpoint_write_s float  the longest background write told of so far
    memory_step            int    the step of the last memory-tier save (absent before one)
    memory_save_s          float  how long the training stood still for it
    live_recovery          bool   the ranks recover live: a live group formed (absent
                                  before one did, and for a run that never opts in)
    attempt                int    FTSLURM_ATTEMPT of the writer
    finished               bool   whether `finished()` was called
    updated_at             float  unix time of the write

`finished()` also writes `$FTSLURM_RUN_DIR/FINISHED` (atomic JSON: {"step", "time"}). The
daemon reads both: a checkpoint step that does not advance over continuations stops the
run, save times stretch the checkpoint signal's lead and tune the checkpoint interval
(`ftslurm.core.cadence`; live recovery spaces the disk's checkpoints for the failures it
cannot serve), and FINISHED means the run is done. The calls may come from
several threads (an asynchronous save reports from its writer): each read-update-write of
the file holds one lock, so no thread's update is lost to another's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from ftslurm.core.contract import JobEnv, RunDir
from ftslurm.core.contract.reports import Progress
from ftslurm.fsutil import write_json_atomic
from ftslurm.runfiles import read_report, write_report

_last_step_write: float | None = None
_lock = threading.Lock()  # one read-update-write of progress.json at a time


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def _target(environ: Mapping[str, str] | None = None) -> tuple[RunDir, JobEnv] | None:
    """Where to write and the job's environment (`environ`, default this process's), or
    None when this process should not write."""
    env = os.environ if environ is None else environ
    if _int(env.get("RANK")) != 0:
        return None
    job = JobEnv.from_environ(env)
    return (job.run, job) if job.run is not None else None


def _update(where: tuple[RunDir, JobEnv], told: Progress) -> Progress:
    run, job = where
    with _lock:
        old = read_report(run.progress, Progress) or Progress()
        new = merged(old, told, job.attempt or 0, time.time())
        write_report(run.progress, new)
    return new


def merged(old: Progress, told: Progress, attempt: int, now: float) -> Progress:
    """`old` (every key it has kept) updated with what the script `told`, the longest save
    times so far, the writer's `attempt` and `now`; `finished` False until told."""
    longest: dict[str, float] = {}
    if told.checkpoint_save_s is not None:
        longest.update(
            max_checkpoint_save_s=max(told.checkpoint_save_s, old.max_checkpoint_save_s or 0.0)
        )
    if told.checkpoint_write_s is not None:
        longest.update(
            max_checkpoint_write_s=max(told.checkpoint_write_s, old.max_checkpoint_write_s or 0.0)
        )
    stamp = Progress(attempt=attempt, updated_at=now).to_json()
    unfinished = Progress(finished=False).to_json()
    return Progress.model_validate(unfinished | old.to_json() | told.to_json() | longest | stamp)


def report_step(step: int) -> None:
    """The training reached `step`; written at most once a second, so call it freely."""
    global _last_step_write
    now = time.monotonic()
    if _last_step_write is not None and now - _last_step_write < 1.0:
        return
    where = _target()
    if where is None:
        return
    _last_step_write = now
    _update(where, Progress(step=int(step)))


def checkpoint_saved(
    step: int, duration_s: float | None = None, write_s: float | None = None
) -> None:
    """A checkpoint of `step` is safely stored; `duration_s` is how long the training stood
    still for it, `write_s` how long an asynchronous save then wrote in the background."""
    where = _target()
    if where is None:
        return
    told: dict[str, Any] = dict(checkpoint_step=int(step), checkpoint_at=time.time())
    if duration_s is not None:
        told.update(checkpoint_save_s=float(duration_s))
    if write_s is not None:  # written in the background: the training has moved on since
        told.update(checkpoint_write_s=float(write_s))
    else:
        told.update(step=int(step))
    _update(where, Progress(**told))


def memory_saved(step: int, duration_s: float) -> None:
    """The memory tier (`ftslurm.memory_checkpoint`) holds `step`, which stopped the
    training for `duration_s`: the daemon then tunes a memory interval and a longer disk
    one. Not a persistent checkpoint: `checkpoint_step` is only moved by the disk."""
    where = _target()
    if where is None:
        return
    # not `step`: an asynchronous save reports from its writer, after the training moved on
    _update(where, Progress(memory_step=int(step), memory_save_s=float(duration_s)))


def live_recovery(environ: Mapping[str, str] | None = None) -> None:
    """The ranks recover live (`ftslurm.agent.live` formed its group over a coordinator
    store; `environ`: the group's environment, default this process's): the daemon then
    spaces disk checkpoints for the node failures live recovery cannot serve
    (`ftslurm.core.cadence.live_coverage`). Kept for the rest of the run."""
    where = _target(environ)
    if where is None:
        return
    _update(where, Progress(live_recovery=True))


def finished(step: int | None = None) -> None:
    """The training is complete: the run must not be continued."""
    where = _target()
    if where is None:
        return
    _update(
        where, Progress(finished=True) if step is None else Progress(finished=True, step=int(step))
    )
    write_json_atomic(where[0].finished, {"step": step, "time": time.time()})
