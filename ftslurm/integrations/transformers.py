"""Hugging Face's `Trainer` under ftslurm: one callback and one helper.

    from ftslurm.integrations.transformers import FtslurmCallback, last_complete_checkpoint

    callback = FtslurmCallback()          # first: the signal handlers (a flag, nothing else)
    args = TrainingArguments(output_dir="out", ...)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))

`FtslurmCallback` (a `TrainerCallback`) drives ftslurm's rank agent (`ftslurm.agent.rank`)
from the Trainer's events:

* `on_step_end`, on every rank at every optimizer step: a heartbeat with the global step,
  then `agent.should_checkpoint()`, a collective (one MAX all-reduce over the default
  process group) that gives every rank the same answer at this step: the checkpoint signal
  (USR2 unless the run says otherwise) or SIGTERM reached some rank, or the checkpoint
  interval the daemon tuned for the run has passed. Then it sets `control.should_save`, and
  on a stop request also `control.should_training_stop`: the Trainer saves
  `checkpoint-<step>` right after `on_step_end` (`_maybe_log_save_evaluate`), outside any
  signal handler, on every rank at the same step, and leaves its loop after it.
* `on_save`, after any save (the Trainer's own `save_steps` ones too): every rank waits for
  the others (a barrier: each rank writes its own RNG state, rank 0 the rest), then the
  process that saves (`args.should_save`) fsyncs the checkpoint's files and writes
  `ftslurm-complete.json` into it, atomically, last. The Trainer writes a checkpoint in
  place, file after file (it is not atomic, and `trainer_utils.get_last_checkpoint` takes
  the highest-numbered folder whatever it holds), so that file is what makes a checkpoint
  complete: `last_complete_checkpoint` skips a folder without it (a save cut short by a
  lost node or the wall limit). Then the save is reported to the daemon with the time the
  training stood still for it (`agent.checkpoint_saved`); after a stop's save each rank
  records its stop (`agent.should_stop()`), so the daemon reads the exit as "checkpointed,
  continue me" (docs/policy.md) even if the process then dies in teardown.
* `on_train_end`: after a stop, `agent.exit(0)` ends the process (exit 0, the process group
  torn down with a time limit: `trainer.train()` does not return, so nothing after it takes
  the stop for the end of training); `exit_on_stop=False` returns instead (`callback.stopped`
  then says why). Otherwise training ended: `agent.finished(step)`.
* Sections for the launcher's hang detection: "setup" from the callback's creation to the
  first step (model loading, resuming, skipping the batches already trained on; it has its
  own limit, 30 min unless the run sets one), "step" for each optimizer step, and
  "checkpointing" from a save's decision to its end. Evaluation and logging run outside
  them, under the running timeout: a long evaluation needs a longer `out_of_section_timeout`.

The next attempt resumes with `trainer.train(resume_from_checkpoint=...)`: the model, the
optimizer, the scheduler, each rank's RNG state and the Trainer's state come back, and the
Trainer skips the batches of the epoch already trained on (`ignore_data_skip=False`, its
default), so with a seed, full precision and the same world size the continued run ends
with the parameters of an uninterrupted one, bit for bit (tests/test_transformers_integration.py).

Outside ftslurm the callback works the same (no run directory: nothing is reported, the
signals still stop the training at a saved step). Needs `pip install ftslurm[transformers]`.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "ftslurm.integrations.transformers needs Hugging Face transformers: "
        "pip install ftslurm[transformers]"
    ) from exc

from ftslurm.agent import rank as fta
from ftslurm.fsutil import write_json_atomic

# Written into checkpoint-<step>/ last, once every rank's part of the save is on disk.
COMPLETE_MARKER = "ftslurm-complete.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def complete_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete `checkpoint-<step>` folders of `output_dir` (those holding
    `COMPLETE_MARKER`), oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _CHECKPOINT.match(path.name)
        if match and path.is_dir() and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _step, path in sorted(found)]


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """What to give `trainer.train(resume_from_checkpoint=...)`: the newest complete
    checkpoint of `output_dir`, or None (start from scratch). Unlike
    `transformers.trainer_utils.get_last_checkpoint`, a folder whose save was cut short is
    skipped."""
    found = complete_checkpoints(output_dir)
    return str(found[-1]) if found else None


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class FtslurmCallback(TrainerCallback):
    """Turns ftslurm's checkpoint request into a Trainer save at a step all ranks agree on,
    and a stop after it (see the module doc). Create it early, before the model and the data
    are loaded: from then on the checkpoint signal and SIGTERM only set a flag."""

    def __init__(self, *, exit_on_stop: bool = True) -> None:
        self.agent = fta.init()
        self.exit_on_stop = exit_on_stop
        self.stopped = False  # training left its loop on ftslurm's stop request
        self._stop_asked = False
        self._decided_at: float | None = None
        self._open: list[AbstractContextManager[None]] = []
        self._enter("setup")

    # ------------------------------------------------------------------ sections
    def _enter(self, name: str) -> None:
        section = self.agent.section(name)
        section.__enter__()
        self._open.append(section)

    def _leave_all(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)

    # ------------------------------------------------------------------ events
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leave_all()  # "setup" before the first step
        self._enter("step")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leave_all()
        step = state.global_step
        self.agent.heartbeat(step)
        self._decided_at = time.monotonic()
        # A collective: every rank calls it here, at every optimizer step.
        if self.agent.should_checkpoint():
            control.should_save = True
            if self.agent.stopping:
                self._stop_asked = True
                control.should_training_stop = True
        if control.should_save:
            self._enter("checkpointing")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        _barrier()  # every rank's files are written
        if args.should_save:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
            if folder.is_dir():
                _fsync_tree(folder)
                write_json_atomic(folder / COMPLETE_MARKER, {"step": step, "time": time.time()})
        _barrier()  # the marker is there before any rank reports the save
        self._leave_all()
        seconds = time.monotonic() - self._decided_at if self._decided_at is not None else None
        self.agent.checkpoint_saved(step, seconds)
        if self._stop_asked:
            self.agent.should_stop()  # records "saved step S, stopping" on this rank
            print(
                f"ftslurm: rank {self.agent.rank} saved checkpoint-{step} on request; stopping",
                flush=True,
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leave_all()
        if self._stop_asked:
            self.stopped = True
            if self.exit_on_stop:
                self.agent.exit(0)  # "checkpointed, continue me": never returns
            return
        self.agent.finished(state.global_step)
