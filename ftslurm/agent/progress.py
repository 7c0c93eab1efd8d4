"""What a training script tells the daemon: its step, its checkpoints, that it finished.

    from ftslurm.agent import progress
    progress.report_step(step)               # cheap: written at most once a second
    progress.checkpoint_saved(step, seconds) # after a checkpoint is safely on disk
    progress.finished(step)                  # training is complete: do not continue it

Each call does nothing unless the script runs under ftslurm (FTSLURM_RUN_DIR set), and only
rank 0 (RANK, default 0) writes. The file `$FTSLURM_RUN_DIR/progress.json` is rewritten
atomically (read, update, write) and holds:

    step                   int    the last step reported (by any of the three calls)
    checkpoint_step        int    the step of the last checkpoint saved (absent before one)
    checkpoint_save_s      float  how long that save took (when told)
    checkpoint_at          float  unix time the daemon learned of that checkpoint
    max_checkpoint_save_s  float  the longest save told of so far
    attempt                int    FTSLURM_ATTEMPT of the writer
    finished               bool   whether `finished()` was called
    updated_at             float  unix time of the write

`finished()` also writes `$FTSLURM_RUN_DIR/FINISHED` (atomic JSON: {"step", "time"}). The
daemon reads both: a checkpoint step that does not advance over continuations stops the
run, save times stretch the checkpoint signal's lead, and FINISHED means the run is done.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ftslurm.core.contract import JobEnv, RunDir
from ftslurm.fsutil import read_json, write_json_atomic

_last_step_write: float | None = None


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def _target() -> tuple[RunDir, JobEnv] | None:
    """Where to write and the job's environment, or None when this process should not
    write."""
    if _int(os.environ.get("RANK")) != 0:
        return None
    job = JobEnv.from_environ(os.environ)
    return (job.run, job) if job.run is not None else None


def _update(where: tuple[RunDir, JobEnv], **changes: Any) -> dict[str, Any]:
    run, job = where
    path = run.progress
    data = read_json(path)
    data = data if isinstance(data, dict) else {}
    if changes.get("checkpoint_save_s") is not None:
        changes["max_checkpoint_save_s"] = max(
            changes["checkpoint_save_s"], float(data.get("max_checkpoint_save_s") or 0.0))
    data.update(changes)
    data.setdefault("finished", False)
    data["attempt"] = job.attempt or 0
    data["updated_at"] = time.time()
    run.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)
    return data


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
    _update(where, step=int(step))


def checkpoint_saved(step: int, duration_s: float | None = None) -> None:
    """A checkpoint of `step` is safely stored; `duration_s` is how long saving it took."""
    where = _target()
    if where is None:
        return
    changes: dict[str, Any] = {"step": int(step), "checkpoint_step": int(step),
                               "checkpoint_at": time.time()}
    if duration_s is not None:
        changes["checkpoint_save_s"] = float(duration_s)
    _update(where, **changes)


def finished(step: int | None = None) -> None:
    """The training is complete: the run must not be continued."""
    where = _target()
    if where is None:
        return
    changes: dict[str, Any] = {"finished": True}
    if step is not None:
        changes["step"] = int(step)
    _update(where, **changes)
    write_json_atomic(where[0].finished, {"step": step, "time": time.time()})
