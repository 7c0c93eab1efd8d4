"""The common training loop of a rank in a few lines: `Training`.

    from ftslurm import Training
    group = live.init_process_group("gloo", live=True)  # or dist.init_process_group(...)
    train = Training(model, optimizer, checkpoint_dir="ckpt", every=20, group=group)
    for step in train.steps(1000):      # restores first; checkpoints; stops when asked to
        with train.step():              # forward, backward, gradient all-reduce
            loss = compute(step)        # (the optimizer step comes after the block)
    train.finish()                      # the end reported, exit 0: never returns

It is the long form of docs/agent.md (the rank agent, `ftslurm.checkpoint`,
`ftslurm.memory_checkpoint`, `ftslurm.agent.live`) put together, in this order:

- Start (the first `steps()`): the newest state of this run is loaded: from the memory tier
  (this node's memory or a peer's replica) when it holds a step as new as the disk's, else
  the newest checkpoint on disk that verifies, else none; a rank restarted alone in a live
  group receives it from a running rank. It prints where it started from (rank 0, and a
  restarted rank).
- Each step: first the checkpoints, then the block. Every `every` steps, and whenever the
  ranks agree one is due (`should_checkpoint()`: the checkpoint signal or SIGTERM, or the
  interval the daemon tuned for the run) the whole training state is saved: to the memory
  tier (unless `memory=False`) and, for every `disk_every`'th one, a stop's, or a disk
  one the daemon asks for, also to disk (`CheckpointManager`, rank 0 writes, in the
  background). A stop then ends the process with exit 0 ("checkpointed, continue me")
  after the durable stop record, without running the block.
- The block (`with train.step():`) is the step's work with collectives, in a "step"
  section the launcher watches (time your own work in `train.section("compute")`: the
  straggler scores come from it). In a live group the ranks vote when it ends: the step
  commits only when every rank finished it, and then the optimizer steps and the step
  count moves on; after a fault (a collective that raised because a peer failed, or a
  peer's abort) the group is formed again, a restarted rank receives the state, and
  `steps()` yields the same step again. Outside a live group a fault propagates.
- With `validate=...`, the block gives its loss to `train.validate(loss)`: a suspicious one
  (NaN, Inf, a spike) re-runs the step in place (the RNG put back, the gradients zeroed,
  no optimizer step, `steps()` yields it again), or ends the rank with exit 16 after a
  disk checkpoint of the state before the step (docs/agent.md#result-validation).
- The end (the loop ran out): a last checkpoint when the last step is a multiple of
  `every`; `finish()` tells the daemon the run is finished (rank 0), drops the memory tier
  and leaves with exit 0 through `agent.exit` (teardown cannot abort it).

Everything the checkpoints and a live handover carry is `ftslurm.checkpoint.training_state`
(model, optimizer, step, RNG states) and the helper's own count of saves, so every rank
takes the same collectives at the same step. For more control (other states, another
order, sharded checkpoints), write the loop with the parts themselves: docs/agent.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ftslurm.agent import live
from ftslurm.agent import rank as fta
from ftslurm.agent.validation import capture_rng, restore_rng
from ftslurm.agent.validation_rules import Action, Settings
from ftslurm.checkpoint import CheckpointManager, restore_training_state, training_state
from ftslurm.core.contract import EnvName
from ftslurm.memory_checkpoint import MemoryTier


def _say(line: str) -> None:
    print(line, flush=True)


class Training:
    """One rank's training loop (the module doc). `model` and `optimizer` are what the
    checkpoints hold; `checkpoint_dir` defaults to $FTSLURM_CHECKPOINT_DIR, else
    "checkpoints"; `every`: a checkpoint every that many steps (0: only those the daemon
    asks for); `disk_every`: of those, every how many also go to disk (the others stay in
    the memory tier); `memory=False`: disk only; `group`: the `live.LiveGroup` of
    `live.init_process_group` (else the default process group, without live recovery);
    `replicated=False` for a state each rank holds a different part of, `shards=S` for one
    sharded over each S consecutive ranks and replicated across those groups (HSDP)
    (`LiveGroup.attach`);
    `log`: where the progress lines go (None: nowhere); `validate`: result validation
    (True, or its `Settings`): give each step's loss to `train.validate(loss)` in the
    block, and a suspicious one re-runs the step in place (`Training` restores the RNG and
    zeroes the gradients; the model and the optimizer have not changed yet), or saves the
    last good state and exits 16 (docs/agent.md#result-validation); `data_position`: the
    hooks (capture, restore) of where the data comes from, for data not drawn from the step
    number. The default process group must exist."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        checkpoint_dir: str | Path | None = None,
        every: int = 0,
        disk_every: int = 1,
        memory: bool = True,
        group: live.LiveGroup | None = None,
        replicated: bool = True,
        shards: int | None = None,
        keep_last: int = 2,
        log: Callable[[str], None] | None = _say,
        validate: bool | Settings = False,
        data_position: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ) -> None:
        if every < 0 or disk_every < 1:
            raise ValueError(
                f"every must be 0 or more, disk_every 1 or more: {every}, {disk_every}"
            )
        if not dist.is_initialized():
            raise RuntimeError("Training needs the process group: init_process_group first")
        self.model, self.optimizer = model, optimizer
        self.every, self.disk_every = every, disk_every
        self.group = group if group is not None else live.LiveGroup(live=False)
        self.replicated, self.shards = replicated, shards
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.agent = fta.init()  # signal handlers (a flag only), heartbeats, sections
        # Saves are asynchronous: the training stands still only for the snapshot; the
        # manager tells the daemon of each save once it is on disk.
        self.manager = CheckpointManager(checkpoint_dir, keep_last=keep_last)
        self.directory = self.manager.directory
        self._memory = memory
        self.memory: MemoryTier | None = None  # created at the start (a collective)
        self._log = log
        self.steps_done = 0  # the step this rank holds: how many optimizer steps were applied
        self.start_step: int | None = None  # where this process started (`start`)
        self.restored_from: str | None = None  # "nothing", "disk", "memory", "peer", "a live peer"
        self.committed = False  # whether the last `with train.step()` was applied
        self.saves = 0  # checkpoints taken (a live handover carries it: it decides collectives)
        self.saved_at = -1  # the step saved last
        self._stopping = False
        self._in_block = False
        self._block_error: str | None = None
        self.disk_saved_at = -1  # the step saved to disk last
        # result validation: the group's answer for this block (None: not validated yet)
        self.validator = (
            self.agent.validation(
                validate if isinstance(validate, Settings) else None, checkpoint=self._last_good
            )
            if validate
            else None
        )
        self._data_position = data_position
        self._verdict: Action | None = None

    @property
    def rejoining(self) -> bool:
        """A rank restarted alone in a live group: its state comes from the running ranks
        (it must not take part in collectives the others took before, a broadcast of the
        initial weights say)."""
        return self.group.rejoining

    def section(self, name: str) -> AbstractContextManager[None]:
        """A timed section the launcher watches (`RankAgent.section`); "compute", the rank's
        own work without collectives, gives the straggler scores."""
        return self.agent.section(name)

    # ------------------------------------------------------------------ start
    def start(self) -> int:
        """Load the newest state (once; `steps()` calls it) and return its step."""
        if self.start_step is not None:
            return self.start_step
        self.directory.mkdir(parents=True, exist_ok=True)
        # Every checkpoint is also kept in node memory, with a replica on another node:
        # after a lost node the ranks restore from memory when it holds a step as new as
        # the disk's.
        self.memory = MemoryTier() if self._memory else None
        tier = "nothing"
        with self.agent.section("setup"):
            if self.rejoining:  # restarted alone: the state comes from the running ranks
                tier = "a live peer"
            else:
                on_disk = self.manager.steps()
                got = (
                    self.memory.load_latest(min_step=on_disk[-1] if on_disk else None)
                    if self.memory is not None
                    else None
                )
                if got is not None:
                    self.steps_done = restore_training_state(got[1], self.model, self.optimizer)
                    tier = got[2]
                else:
                    latest = self.manager.load_latest()  # the newest checkpoint that verifies
                    if latest is not None:
                        self.steps_done = restore_training_state(
                            latest[1], self.model, self.optimizer
                        )
                        tier = "disk"
        self.group.attach(
            state=self._state,
            load=self._load,
            step=lambda: self.steps_done,
            on_regroup=[self.memory.regroup] if self.memory is not None else [],
            replicated=self.replicated,
            shards=self.shards,
        )
        self.start_step, self.restored_from = self.steps_done, tier
        if self.rank == 0 or self.rejoining:
            self._say(
                f"rank {self.rank} of {self.world} starts at step {self.steps_done} "
                f"(attempt {os.environ.get(EnvName.ATTEMPT.value, '0')}, in-job restart "
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}) from {tier}"
            )
        if tier in ("memory", "peer"):  # which tier each rank's state came from
            self._say(
                f"rank {self.rank} restored step {self.steps_done} from "
                f"{'its node memory' if tier == 'memory' else 'a peer replica'}"
            )
        return self.steps_done

    def _state(self) -> dict[str, Any]:
        """What a live recovery hands over: the training state, and what decides the ranks'
        next collectives (a rank that lacked the count of saves would save alone)."""
        return {
            "training": training_state(self.model, self.optimizer, self.steps_done),
            "saves": self.saves,
            "saved_at": self.saved_at,
        }

    def _load(self, state: dict[str, Any]) -> None:
        self.steps_done = restore_training_state(state["training"], self.model, self.optimizer)
        self.saves, self.saved_at = state["saves"], state["saved_at"]

    # ------------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """The steps to run, up to `total`: each is run in `with train.step():`; a step a
        fault aborted comes again. A stop for a continuation leaves the process from in
        here (exit 0)."""
        self.start()
        while self.steps_done < total:
            self.group.begin_step()
            error: str | None = None
            try:
                self._checkpoint_if_due()
            except Exception as exc:
                error = live.fault_text(exc) if self.group.enabled else None
                if error is None:
                    self.group.cancel_step()
                    raise
            if error is not None or self._stopping:
                if not self.group.end_step(error):
                    self.agent.heartbeat(self.steps_done)  # formed again: this step again
                    continue
                if self.rank == 0:
                    self._say(
                        f"checkpointed at step {self.steps_done} on request; "
                        "exiting for a continuation"
                    )
                self.agent.exit(0)  # the process group torn down, then os._exit
            self._in_block, self.committed = False, False
            try:
                yield self.steps_done
            except GeneratorExit:  # the loop was left (break, an exception)
                self.group.cancel_step()
                raise
            if not self._in_block:
                self.group.cancel_step()
                raise RuntimeError("run each step in `with train.step():` (ftslurm Training)")
            if self._block_error is not None:  # this rank's collective failed: recover now,
                error, self._block_error = self._block_error, None  # the exception is gone
                self.group.end_step(error)
            if not self.committed:
                self.agent.heartbeat(self.steps_done)  # formed again: this step again
        if self.every and self.steps_done % self.every == 0 and self.saved_at != self.steps_done:
            self.checkpoint()

    def step(self) -> AbstractContextManager[int]:
        """The block of one step's work (forward, backward, gradient reduction): in a "step"
        section; when it ends the ranks agree the step is done, then the optimizer steps.
        `as` gives the step."""
        return _StepBlock(self)

    def _checkpoint_if_due(self) -> None:
        """The checkpoints before a step's work (inside the step: a fault here costs the
        step, as one in the work)."""
        step = self.steps_done
        if self.every and step and step % self.every == 0 and self.saved_at != step:
            self.checkpoint()
        # The same answer on every rank at this step: the checkpoint signal, or the
        # periodic interval the daemon tuned for this run has passed.
        if self.agent.should_checkpoint():
            # To memory, or also to disk: a stop's, and the disk tier's longer interval.
            self.checkpoint(disk=self.agent.checkpoint_tier == "disk")
            if self.agent.should_stop():  # the signal, not the periodic one
                self._stopping = True
                return
            if self.rank == 0:
                self._say(
                    f"periodic checkpoint at step {step} to {self.agent.checkpoint_tier} "
                    f"(every {self.agent.checkpoint_interval or 0:.3g} s, disk every "
                    f"{self.agent.disk_checkpoint_interval or 0:.3g} s)"
                )

    def checkpoint(self, disk: bool = False) -> None:
        """Save the training state now (a collective: every rank, the same step): to the
        memory tier and, when `disk` or for every `disk_every`'th save, to disk."""
        step = self.steps_done
        with self.agent.section("checkpointing"):
            state = training_state(self.model, self.optimizer, step)
            if self.memory is not None:
                self.memory.save(step, state)  # a collective: every rank, this step
            self.saves += 1
            if self.memory is None or disk or self.saves % self.disk_every == 0:
                self.manager.checkpoint(step, state)  # rank 0 writes
                self.disk_saved_at = step
            dist.barrier()
        self.saved_at = step
        self.agent.save_observed()  # the sections' timings, for the next attempt's timeouts

    # ------------------------------------------------------------------ validation
    def validate(self, loss: Any) -> Any:
        """This step's result (in the block, after the backward pass, before the block
        ends): checked on every rank at once (a collective); when it is suspicious, the
        block's end re-runs the step in place instead of applying it (`steps()` yields it
        again), or this rank saves the last good state and exits 16 (or 17 in the
        disambiguation run). Returns `loss`."""
        if self.validator is None:
            raise RuntimeError("Training(validate=...) turns result validation on")
        if not self._in_block:
            raise RuntimeError("call train.validate(loss) inside `with train.step():`")
        self._verdict = self.validator.validate(loss, self.steps_done)
        return loss

    def _last_good(self) -> None:
        """Before an exit 16: the state before the suspicious step (not applied yet), on
        disk (the next attempt runs on other nodes)."""
        if self.disk_saved_at != self.steps_done:
            self.checkpoint(disk=True)

    # ------------------------------------------------------------------ the end
    def finish(self) -> NoReturn:
        """The training is complete: tell the daemon (rank 0), drop this run's memory tier,
        leave with exit 0 (`RankAgent.exit`: not `destroy_process_group()` and a return,
        whose teardown can abort the interpreter). Never returns."""
        if self.rank == 0:
            self.agent.finished(self.steps_done)
        if self.memory is not None:
            self.memory.clear()  # the run is over: its states leave this node's memory
        self.agent.exit(0)
        raise AssertionError("not reached")  # pragma: no cover

    def _say(self, line: str) -> None:
        if self._log is not None:
            self._log(line)


class _StepBlock:
    """`with train.step():` (`Training.step`)."""

    def __init__(self, train: Training) -> None:
        self.train = train
        self.section = train.agent.section("step")

    def __enter__(self) -> int:
        train = self.train
        train._in_block = True
        if train.validator is not None:  # the state a re-run in place starts from
            train._verdict = None
            self.rng = capture_rng()
            self.data = train._data_position[0]() if train._data_position else None
        self.section.__enter__()
        return train.steps_done

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        train = self.train
        self.section.__exit__(kind, exc, tb)
        if exc is None and train.validator is not None:
            if train._verdict is None:
                train.group.cancel_step()
                raise RuntimeError(
                    "with Training(validate=...), give each step's loss to train.validate(loss)"
                )
            if train._verdict is Action.RERUN:  # suspicious: this step again, in place
                train.group.cancel_step()
                restore_rng(self.rng)
                if train._data_position is not None:
                    train._data_position[1](self.data)
                train.optimizer.zero_grad()
                train.committed = False
                return False
        if exc is None:
            train.committed = train.group.end_step(None)  # the vote (a live group)
            if train.committed:
                train.optimizer.step()
                train.steps_done += 1
                train.agent.heartbeat(train.steps_done)
            return False
        error = live.fault_text(exc) if train.group.enabled else None
        if error is None:  # a bug, or no live recovery: it propagates
            train.group.cancel_step()
            return False
        # A fault: recovered by `steps()` once this exception is gone (its frames would
        # keep the broken group's sockets open, and a peer waiting on them would wait).
        train._block_error = error
        return True
