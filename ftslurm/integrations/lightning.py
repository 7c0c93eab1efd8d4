"""Lightning under ftslurm: a callback, a cluster environment, the checkpoint to resume from.

    import lightning.pytorch as L
    from ftslurm.integrations.lightning import FtslurmCallback, plugins

    ft = FtslurmCallback()                  # checkpoints in $FTSLURM_CHECKPOINT_DIR/lightning
    trainer = L.Trainer(..., callbacks=[ft], plugins=plugins())
    trainer.fit(model, data, ckpt_path=ft.resume_path())  # None on the first attempt
    ft.exit()                               # "finished" or "checkpointed, continue me"

What it changes, and why:

* **Checkpoints at a step agreed by all ranks, outside any signal handler.** The checkpoint
  signal (FTSLURM_CHECKPOINT_SIGNAL, default USR2) and SIGTERM only set the rank agent's
  flag (`ftslurm.agent.rank`). After every optimizer step (`on_train_batch_end`) every rank
  asks `agent.should_checkpoint()`, one all-reduce, so all of them save at the same step:
  `trainer.save_checkpoint` into a temporary file that global rank 0 then fsyncs and renames
  into place (`lightning-step-<step>.ckpt`: a file with that name is complete; private, as
  every checkpoint of a run, unless the run shares them with its group). The save is
  reported with the time it took (the daemon tunes the checkpoint interval from it, and asks
  for periodic ones: `should_checkpoint()` is also true when that interval has passed). On a
  stop request the ranks record their stop and set `trainer.should_stop`; `fit` returns and
  `exit()` leaves with 0: the daemon starts the continuation. Lightning's own handling saves
  inside the SIGUSR1 handler (Lightning #21406) and broadcasts inside the SIGTERM handler.
* **Lightning's signal handlers are not installed.** With `SLURMEnvironment(auto_requeue=
  True)` (what Lightning picks by itself inside a Slurm job) Lightning saves and runs
  `scontrol requeue` on SIGUSR1, from inside the job: a second requeue mechanism beside the
  daemon's, and one that fails in containers without `scontrol` (Lightning #21404); on
  SIGTERM it broadcasts inside the handler and raises at the next batch: the rank leaves
  `fit` with exit 0 and no checkpoint (#20542). The callback keeps the agent's handlers in
  place for the whole fit, and sets `auto_requeue` to False (saying so in one line) when it
  finds it on.
* **The ranks as ftslurm's launcher started them.** The launcher is a torch elastic agent:
  every rank has `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, ...; the
  Slurm variables it also sees (`SLURM_NTASKS`, `SLURM_PROCID`) describe the launchers, one
  per node, not the ranks, but Lightning looks for Slurm first. `plugins()` gives the Trainer
  `FtslurmEnvironment` (torch elastic's variables) wherever those variables are set, and
  nothing elsewhere (a plain `python train.py`: Lightning decides as usual). A Trainer whose
  world size or rank disagrees with the launcher's stops at `setup` with one line saying so.
* **Resuming.** `resume_path()` (or `latest_checkpoint(folder)`) is the newest complete
  checkpoint, for `trainer.fit(..., ckpt_path=...)`. Lightning restores the model, the
  optimizers, the loops' counters (`trainer.global_step`) and the callbacks' states; the
  position inside a plain `DataLoader` only with a stateful loader. A run that must resume
  mid-epoch exactly draws each step's data from the step (`examples/lightning_recipe.py`).

Outside ftslurm (no run directory) it works the same, with nothing to report to: SIGTERM
(or USR2) makes the ranks save at one step and stop, no interval asks for periodic
checkpoints, and `exit()` ends the process with its code.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
except ImportError as exc:  # an optional dependency
    raise ImportError(
        "ftslurm.integrations.lightning needs Lightning: pip install ftslurm[lightning]"
    ) from exc

from ftslurm.agent import rank as fta
from ftslurm.core.contract import JobEnv
from ftslurm.fsutil import fsync_dir, make_dirs, replace_durably, sharing_modes

SUBFOLDER = "lightning"  # the callback's folder inside the run's checkpoint folder
PREFIX = "lightning-step-"
_CHECKPOINT = re.compile(rf"{PREFIX}(\d+)\.ckpt")
_TORCH_ELASTIC = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")
REQUEUE_OFF = (
    "ftslurm: Lightning's SLURM auto-requeue turned off (ftslurm's daemon requeues); to say "
    "so yourself: Trainer(plugins=ftslurm.integrations.lightning.plugins()), or "
    "SLURMEnvironment(auto_requeue=False)"
)


class FtslurmEnvironment(TorchElasticEnvironment):
    """The ranks as ftslurm's launcher (a torch elastic agent) starts them: torch elastic's
    variables, never Slurm's (which describe the launchers). Detected wherever those
    variables are set (also under torchrun)."""

    @staticmethod
    def detect() -> bool:
        return all(name in os.environ for name in _TORCH_ELASTIC)


def plugins() -> list[Any]:
    """The Trainer's `plugins=`: `[FtslurmEnvironment()]` where a torch elastic agent
    (ftslurm's launcher, torchrun) started the process, else none."""
    return [FtslurmEnvironment()] if FtslurmEnvironment.detect() else []


def checkpoint_folder(dirpath: str | os.PathLike[str] | None = None) -> Path:
    """Where the callback keeps its checkpoints: `dirpath`, else the run's checkpoint folder
    (FTSLURM_CHECKPOINT_DIR, else ./checkpoints) / "lightning"."""
    if dirpath is not None:
        return Path(dirpath)
    return Path(JobEnv.from_environ(os.environ).checkpoint_folder) / SUBFOLDER


def checkpoint_path(folder: str | os.PathLike[str], step: int) -> Path:
    return Path(folder) / f"{PREFIX}{step:010d}.ckpt"


def checkpoints(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints in `folder` (a temporary file never is one), oldest first."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), Path(folder) / n) for n in names if (m := _CHECKPOINT.fullmatch(n))]
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike[str] | None = None) -> str | None:
    """The newest complete checkpoint in `folder` (default: `checkpoint_folder()`), or None:
    `trainer.fit(..., ckpt_path=latest_checkpoint())`."""
    found = checkpoints(checkpoint_folder(folder))
    return str(found[-1][1]) if found else None


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


class FtslurmCallback(pl.Callback):
    """Checkpoints when ftslurm asks for one, at a step agreed by all ranks; keeps
    Lightning's signal handlers and in-job requeue out of ftslurm's way (the module's
    docstring). `dirpath`: the checkpoints' folder (default: `checkpoint_folder()`);
    `keep_last`: how many of them to keep."""

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, not {keep_last}")
        self.dirpath = checkpoint_folder(dirpath)
        self.keep_last = keep_last
        # private by default, as every checkpoint of a run (FTSLURM_CHECKPOINT_SHARING)
        self.dir_mode, self.file_mode = sharing_modes()
        # The rank agent now: its handlers (a flag, nothing else) are in place before
        # Lightning starts, and stay for the whole fit (`setup`).
        self.agent = fta.init()
        self.stopped = False  # a stop was asked for: checkpointed, to be continued
        self.saved_step: int | None = None
        self._last_step: int | None = None
        self._sections = contextlib.ExitStack()
        self._handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ resuming
    def resume_path(self) -> str | None:
        """The newest complete checkpoint of this callback's folder, or None."""
        return latest_checkpoint(self.dirpath)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_ranks(trainer)
        # the environment Lightning's signal connector looks at (a single-device strategy
        # has none of its own)
        connector = getattr(trainer, "_accelerator_connector", None)
        environment = getattr(connector, "cluster_environment", None) or getattr(
            trainer.strategy, "cluster_environment", None
        )
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            environment.auto_requeue = False
            if trainer.is_global_zero:
                print(REQUEUE_OFF, file=sys.stderr, flush=True)
        # Lightning installs its SIGTERM (and requeue) handlers after this hook
        # (`_SignalConnector.register_signal_handlers`): its SIGTERM handler broadcasts
        # inside the handler and makes the next batch raise, ending the rank without a
        # checkpoint. The agent's handlers only set a flag; they stay.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "register_signal_handlers"):
            connector.register_signal_handlers = lambda: None
        self._handlers = {
            int(sig): signal.getsignal(sig)
            for sig in {self.agent.checkpoint_signal, signal.SIGTERM}
        }
        self._sections.close()
        self._sections.enter_context(self.agent.section("setup"))  # restoring, until training

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sections.close()
        for sig, handler in self._handlers.items():  # should Lightning have replaced them
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        self._last_step = trainer.global_step
        self.agent.heartbeat(trainer.global_step)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sections.close()
        self._sections.enter_context(self.agent.section("step"))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._sections.close()
        step = trainer.global_step
        if step == self._last_step:  # accumulating gradients: not a step boundary
            return
        self._last_step = step
        self.agent.heartbeat(step)
        # The same answer on every rank at this step (an all-reduce): a stop was asked for
        # on some rank (the checkpoint signal, SIGTERM), or the daemon's interval passed.
        if not self.agent.should_checkpoint():
            return
        self.save(trainer, step)
        if self.agent.should_stop():  # records, durably, "saved step S, stopping"
            self.stopped = True
            trainer.should_stop = True
            if trainer.is_global_zero:
                print(
                    f"ftslurm: checkpointed at step {step} on request; stopping for a continuation",
                    flush=True,
                )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sections.close()
        if not self.stopped:
            self.agent.finished(trainer.global_step)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._sections.close()

    # ------------------------------------------------------------------ actions
    def save(self, trainer: pl.Trainer, step: int) -> Path:
        """Save the trainer's whole state as the checkpoint of `step` (a collective: every
        rank, this step), atomically, and report it; older ones beyond `keep_last` go."""
        final = checkpoint_path(self.dirpath, step)
        tmp = _temporary(final)
        started = time.monotonic()
        with self.agent.section("checkpointing"):
            if trainer.is_global_zero:
                make_dirs(self.dirpath, self.dir_mode)
            trainer.save_checkpoint(tmp, weights_only=False)  # rank 0 writes; a barrier after
            if trainer.is_global_zero:
                os.chmod(tmp, self.file_mode)  # Lightning wrote it with the umask's mode
                replace_durably(tmp, final)
                self._prune(final)
            trainer.strategy.barrier("ftslurm checkpoint")  # in place before anyone goes on
        self.saved_step = step
        self.agent.checkpoint_saved(step, time.monotonic() - started)
        return final

    def _prune(self, newest: Path) -> None:
        for _step, path in checkpoints(self.dirpath)[: -self.keep_last]:
            if path != newest:
                path.unlink(missing_ok=True)
        for name in os.listdir(self.dirpath):  # temporary files a crash left
            if name.startswith(f".{PREFIX}") and name != _temporary(newest).name:
                (self.dirpath / name).unlink(missing_ok=True)
        fsync_dir(self.dirpath)

    def exit(self, code: int = 0) -> None:
        """Leave the process after `fit` (never returns): after a stop, 0 says
        "checkpointed, continue me"; after the last step, "finished". Through the rank
        agent's exit path: a teardown that hangs or aborts cannot turn a good checkpoint
        into a failure (`ftslurm.agent.rank.leave`)."""
        self.agent.exit(code)

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_ranks(trainer: pl.Trainer) -> None:
        """Under a torch elastic agent (ftslurm's launcher), Lightning's world must be the
        launcher's: Lightning reads Slurm's variables first, which describe the launchers."""
        if not FtslurmEnvironment.detect() or not JobEnv.from_environ(os.environ).run_dir:
            return
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if (trainer.world_size, trainer.global_rank) != (world, rank):
            raise RuntimeError(
                f"Lightning runs this process as rank {trainer.global_rank} of "
                f"{trainer.world_size}, ftslurm's launcher started it as rank {rank} of "
                f"{world}: pass Trainer(plugins=ftslurm.integrations.lightning.plugins()) "
                "(and devices= the ranks per node, num_nodes= the nodes)"
            )
