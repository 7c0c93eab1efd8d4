"""Run a submitit-style checkpointable callable under ftslurm, as it is.

    from ftslurm.agent import submitit_compat

    class Trainer(submitit.helpers.Checkpointable):
        def __call__(self, steps): ...               # state in attributes
        def checkpoint(self, *args, **kwargs):       # optional: the default resubmits self
            return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    if __name__ == "__main__":
        submitit_compat.run(Trainer(), steps=1000)

What submitit (1.5) does, and what `run` does in its place:

* submitit stores `DelayedSubmission(fn, *args, **kwargs)`, pickled with cloudpickle, as the
  job's `<job id>_submitted.pkl`; every task of the job loads that file when it starts and
  calls `fn(*args, **kwargs)`. Here the first attempt calls the callable it is given, and an
  attempt that finds a saved continuation in `$FTSLURM_CHECKPOINT_DIR` (else ./checkpoints)
  loads it on every rank and calls that instead. The arguments of a continuation are the ones
  `checkpoint()` returned: what the command line says on later attempts is not used.
* On the preemption signal (USR2) submitit's handler, on global rank 0 only, calls
  `fn.__submitit_checkpoint__` (else `fn.checkpoint`) with the call's arguments, stores the
  `DelayedSubmission` it returns over the submitted pickle (temporary file, rename), requeues
  the job with `scontrol requeue` and exits; the other ranks return from the handler and run
  on until the requeue kills them; SIGTERM is ignored. Here the same method is called at the
  same place (inside the signal handler) on the same rank, for the checkpoint signal
  (FTSLURM_CHECKPOINT_SIGNAL, default USR2) and for SIGTERM (ftslurm gives ranks a grace
  period on TERM to save). The continuation is stored atomically, reported to the daemon
  (`ftslurm.agent.progress`) once the callable has unwound (the signal may have come while
  the callable's own step report held progress.json's lock), and the process exits 0:
  "checkpointed, continue me". There is no `scontrol requeue`: the daemon owns requeueing,
  and submits the continuation without spending the failure budget. The other ranks do not
  call `checkpoint()` either; they wait (up to FTSLURM_GRACE_S, default 120 s) until rank
  0's continuation is stored and exit 0 too, so no rank leaves rank 0 waiting in a
  collective while it saves.
* When the callable returns, `run` reports the end of training (`progress.finished`, which
  writes the FINISHED marker) and returns its result.

The other endings:

* `checkpoint()` returns None: submitit does not requeue the job ("checkpoint function
  returned None"). Here nothing is stored and the process exits 93, which asks the daemon
  not to retry the run.
* The callable has no checkpoint method (a plain function): nothing can be saved. The
  checkpoint signal is not caught, so under ftslurm's task wrapper it never reaches the
  process (the wrapper delivers it only to processes that catch it): the callable runs on
  until the wall limit ends it, as a plain script, and the daemon goes on from the last
  continuation, if there is one (docs/policy.md). SIGTERM ends the process as it would
  without a handler; the daemon treats that like any failure.
* `checkpoint()` raises, or storing the continuation fails: the traceback is printed and the
  process exits 1, a failure; the previous continuation is left intact.
* The saved continuation cannot be used (missing, truncated or altered so that its size or
  sha256 no longer match its manifest, or it cannot be unpickled): one line on stderr and
  exit 93. It is neither replaced by a silent start from scratch, which would throw away
  the run's progress and might overwrite the files the training keeps next to it, nor
  retried, which would fail the same way. Delete the folder below to start over.

Trade-off. Like submitit, this calls `checkpoint()` from the signal handler, that is between
any two Python instructions of the callable: possibly halfway through an optimizer step,
with the model updated and the step counter not yet. Existing submitit code keeps working
unchanged (with the same caveat: its `checkpoint()` must save a consistent state, e.g. the
one of the last complete step, as `examples/submitit_recipe.py` does), and on several ranks
only rank 0's state is kept. The rank agent (`ftslurm.agent.rank`: `should_checkpoint()`, a
collective every rank answers the same at a step boundary) is the safer path for multi-rank
training; prefer it for new code.

Steps. The daemon stops a run whose checkpoint step does not advance over continuations. A
callable that reports its step (`progress.report_step(step)`, which also works under plain
submitit, or `ftslurm.agent.rank.init().heartbeat(step)`) has its checkpoints reported at the
step it last reported (as `progress.json` has it: at most a second old), or, when it reported
none during the attempt, at the step of the continuation it resumed from. A callable that
reports no steps has each continuation reported at its sequence number (1, 2, ...), so every
one counts as progress, as in submitit, which has no such check. Such a callable sends no
heartbeats either: its rank attaches without them (`rank.init(heartbeats=False)`), so the
launcher judges it by its CPU time (idle for the running timeout: hung), not by heartbeats
that never come; one that calls `heartbeat()` is judged by its heartbeats from then on.

On-disk layout, in `<checkpoint dir>/submitit/` (only global rank 0 writes):

    continuation.json        the manifest: {"format", "file", "size", "sha256", "sequence",
                             "step", "training_step", "attempt", "callable", "time"};
                             written atomically, after the file it names
    continuation-<n>.pkl     the n-th continuation: cloudpickle of the DelayedSubmission
                             (read with submitit's `DelayedSubmission.load`)

A continuation file is written to a temporary file, fsynced and renamed, then the manifest
is replaced the same way; older continuation files are removed after that, so a crash at any
point leaves the previous manifest naming a complete file.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle
from submitit.helpers import DelayedSubmission

from ftslurm.agent import rank as fta
from ftslurm.core.contract import ExitCode, JobEnv
from ftslurm.core.contract.reports import Progress
from ftslurm.fsutil import (
    make_dirs,
    read_json,
    sharing_modes,
    write_bytes_atomic,
    write_json_atomic,
)
from ftslurm.runfiles import read_report

FOLDER = "submitit"
MANIFEST = "continuation.json"
FORMAT = 1
EXIT_CHECKPOINTED = ExitCode.FINISHED  # submitit's "checkpointed, continue me" is exit 0
UNWIND_TIMEOUT_S = 30.0  # after saving, how long the callable's own cleanup may take
_POLL_S = 0.1


class ContinuationError(Exception):
    """The saved continuation exists but cannot be used (one-line message)."""


class _Exit(SystemExit):
    """Raised from the signal handler to leave the callable with a decided exit code."""


# --------------------------------------------------------------------------- storage
def continuation_folder(checkpoint_dir: str | Path | None = None) -> Path:
    """Where continuations live: `<checkpoint dir>/submitit`; the checkpoint directory is
    $FTSLURM_CHECKPOINT_DIR unless given, else ./checkpoints."""
    base = checkpoint_dir or JobEnv.from_environ(os.environ).checkpoint_folder
    return Path(base) / FOLDER


def _attempt_text() -> str | None:
    """FTSLURM_ATTEMPT as the manifest records it (text, or None outside a run)."""
    attempt = JobEnv.from_environ(os.environ).attempt
    return None if attempt is None else str(attempt)


def _checkpoint_method(function: Any) -> Any:
    """submitit's lookup: `__submitit_checkpoint__` first, then `checkpoint`."""
    method = getattr(function, "__submitit_checkpoint__", None)
    return method if method is not None else getattr(function, "checkpoint", None)


def _describe(function: Any) -> str:
    """`module.Name` of a function or class, else of the instance's class."""
    target = function if hasattr(function, "__qualname__") else type(function)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


def save_continuation(
    folder: Path, delayed: Any, sequence: int, step: int, training_step: int | None = None
) -> dict[str, Any]:
    """Store `delayed` (a DelayedSubmission) as continuation number `sequence`; returns the
    manifest. The manifest is replaced only once the file it names is complete."""
    dir_mode, file_mode = sharing_modes()  # the callable holds the training's state
    make_dirs(folder, dir_mode)
    data = cloudpickle.dumps(delayed, protocol=pickle.HIGHEST_PROTOCOL)
    name = f"continuation-{sequence:06d}.pkl"
    write_bytes_atomic(folder / name, data, mode=file_mode)
    manifest = {
        "format": FORMAT,
        "file": name,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "sequence": sequence,
        "step": step,
        "training_step": training_step,
        "attempt": _attempt_text(),
        "callable": _describe(getattr(delayed, "function", delayed)),
        "time": time.time(),
    }
    write_json_atomic(folder / MANIFEST, manifest, mode=file_mode)
    for old in folder.iterdir():  # earlier continuations, and temporary files of crashed saves
        stale = old.name.startswith("continuation-") and old.suffix == ".pkl"
        if (stale and old.name != name) or (old.name.startswith(".") and old.suffix == ".tmp"):
            old.unlink(missing_ok=True)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest, or None when there is none; ContinuationError when it is unreadable."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    manifest = read_json(path)
    keys = ("file", "size", "sha256", "sequence")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys):
        raise ContinuationError(f"{path} is not a readable continuation manifest")
    if not isinstance(manifest.get("format"), int) or manifest["format"] > FORMAT:
        raise ContinuationError(
            f"{path} has format {manifest.get('format')!r}; this ftslurm reads format {FORMAT}"
        )
    return manifest


def load_continuation(folder: Path) -> tuple[Any, dict[str, Any]] | None:
    """The saved DelayedSubmission and its manifest, None when nothing was saved, or
    ContinuationError when what was saved cannot be used."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    path = folder / str(manifest["file"])
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        size = path.stat().st_size
    except OSError as exc:
        raise ContinuationError(f"{path}: {exc.strerror or exc}") from None
    if size != manifest["size"]:
        raise ContinuationError(
            f"{path} has {size} bytes where its manifest says "
            f"{manifest['size']}: truncated or overwritten"
        )
    if digest.hexdigest() != manifest["sha256"]:
        raise ContinuationError(f"{path} does not match the sha256 of its manifest: corrupt")
    try:  # submitit's own loader; its check of the class (by name) is an assert
        delayed = DelayedSubmission.load(path)
    except AssertionError as exc:
        raise ContinuationError(f"{path} is not a DelayedSubmission: {exc}") from None
    except Exception as exc:  # a class renamed or a module gone since it was saved
        raise ContinuationError(
            f"{path} cannot be unpickled: {type(exc).__name__}: {exc}"
        ) from None
    return delayed, manifest


# --------------------------------------------------------------------------- running
def _say(message: str) -> None:
    """One line on stderr in one write: `print` writes the text and its newline apart
    (two writes when the stream is unbuffered), and a relay that merges the rank's stdout
    and stderr (srun's) can put a stdout line between them."""
    sys.stderr.write(f"ftslurm: {message}\n")
    sys.stderr.flush()


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _hard_exit(code: int) -> None:
    _flush_stdio()
    os._exit(code)


class _Runner:
    def __init__(
        self,
        function: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        folder: Path,
        resumed: dict[str, Any] | None,
    ) -> None:
        self.function, self.args, self.kwargs = function, args, kwargs
        self.folder = folder
        self.resumed = resumed
        # The record tells the task wrapper the handlers are in place; the callable sends
        # no heartbeats, so the launcher judges it by its CPU time.
        self.agent = fta.init(heartbeats=False)
        self.rank = self.agent.rank
        self.started_at = time.time()
        self.exit_code: int | None = None  # decided by the signal handler
        # (step, seconds) of the continuation the handler stored, recorded once unwound
        self.saved: tuple[int, float] | None = None
        self.recorded = threading.Lock()
        self.handling = False
        self.returned = False

    # ------------------------------------------------------------------ signals
    def install(self) -> None:
        plain = _checkpoint_method(self.function) is None
        for sig in {self.agent.checkpoint_signal, signal.SIGTERM}:
            if plain and sig != signal.SIGTERM:
                # Nothing to save on the checkpoint signal: not caught, so the task wrapper
                # holds it back and the wall limit ends the callable, as a plain script.
                signal.signal(sig, signal.SIG_DFL)
            else:
                signal.signal(sig, self.on_signal)
        if getattr(self.agent, "_requested", False) and not plain:  # came before our handlers
            self.on_signal(self.agent.checkpoint_signal, None)

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.handling or self.returned:
            return  # a second signal while saving, or the training is already complete
        self.handling = True
        name = signal.Signals(signum).name
        method = _checkpoint_method(self.function)
        if method is None:  # on every rank: rank 0 has nothing to store either
            _say(
                f"{name}: {_describe(self.function)} has no checkpoint() method: nothing is "
                f"saved; ending as {name} would without a handler"
            )
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if self.rank != 0:
            _say(f"rank {self.rank}: {name}: rank 0 stores the continuation; waiting for it")
            threading.Thread(target=self._await_rank0, daemon=True).start()
            return  # run on, as submitit's other ranks do, until rank 0 has saved
        started = time.monotonic()
        try:
            delayed = method(*self.args, **self.kwargs)
            if delayed is None:
                _say(
                    f"{name}: checkpoint() returned None: the run is not to be continued "
                    f"(exit {ExitCode.DO_NOT_RETRY:d})"
                )
                self._leave(ExitCode.DO_NOT_RETRY)
            sequence = int(self.resumed["sequence"]) + 1 if self.resumed else 1
            training_step = self._training_step()
            step = training_step if training_step is not None else sequence
            manifest = save_continuation(self.folder, delayed, sequence, step, training_step)
            # Recorded in progress.json only after unwinding (`_record_saved`): the signal
            # may have landed while the callable's own report held that file's lock.
            self.saved = (step, time.monotonic() - started)
        except _Exit:
            raise
        except Exception:
            traceback.print_exc()
            _say(
                f"{name}: checkpoint() or storing its continuation failed; exit {ExitCode.FAILED:d}"
            )
            self._leave(ExitCode.FAILED)
        _say(
            f"{name}: continuation {sequence} stored ({manifest['size']} bytes, step {step}) "
            f"in {self.folder}; exiting {EXIT_CHECKPOINTED:d} to be continued"
        )
        self._leave(EXIT_CHECKPOINTED)

    def _leave(self, code: int) -> None:
        """Unwind the callable with `code`; cleanup that outlasts UNWIND_TIMEOUT_S (waiting
        for ranks that already left, say) must not turn a stored continuation into a kill."""
        self.exit_code = code
        timer = threading.Timer(UNWIND_TIMEOUT_S, self._give_up_unwinding, (code,))
        timer.daemon = True
        timer.start()
        raise _Exit(code)

    def _give_up_unwinding(self, code: int) -> None:
        self._record_saved()
        _hard_exit(code)

    def _record_saved(self) -> None:
        """Tell the daemon (progress.json) of the stored continuation; once, from outside
        the signal handler."""
        if self.saved is not None and self.recorded.acquire(blocking=False):
            self.agent.checkpoint_saved(*self.saved)

    def _training_step(self) -> int | None:
        """The step the callable last reported in this process, else the one the resumed
        continuation was saved at (no progress since), else None (it reports no steps)."""
        if self.agent.step is not None:
            return self.agent.step
        run = JobEnv.from_environ(os.environ).run
        progress = read_report(run.progress, Progress) if run is not None else None
        if (
            progress is not None
            and progress.step is not None
            and (progress.updated_at or 0.0) >= self.started_at
        ):
            return progress.step  # progress.report_step() from the callable, this attempt
        if self.resumed and isinstance(self.resumed.get("training_step"), int):
            return int(self.resumed["training_step"])
        return None

    def _await_rank0(self) -> None:
        """Another rank: exit 0 once rank 0 has stored a continuation newer than the one
        this process started from; exit 1 if none comes within the grace period."""
        start_sequence = int(self.resumed["sequence"]) if self.resumed else 0
        grace = JobEnv.from_environ(os.environ).grace_s
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                manifest = read_manifest(self.folder)
            except ContinuationError:
                manifest = None  # rank 0 may be replacing it right now
            if manifest and int(manifest["sequence"]) > start_sequence:
                _say(
                    f"rank {self.rank}: rank 0 stored continuation {manifest['sequence']}; "
                    f"exiting {EXIT_CHECKPOINTED:d}"
                )
                try:
                    self.agent.save_observed()
                except OSError:
                    pass
                _hard_exit(EXIT_CHECKPOINTED)
            time.sleep(_POLL_S)
        _say(
            f"rank {self.rank}: rank 0 stored no continuation within {grace:g}s; "
            f"exit {ExitCode.FAILED:d}"
        )
        _hard_exit(ExitCode.FAILED)

    # ------------------------------------------------------------------ the call
    def call(self) -> Any:
        try:
            self.install()
            result = self.function(*self.args, **self.kwargs)
        except BaseException as exc:
            if self.exit_code is None:
                raise
            if not isinstance(exc, _Exit):  # e.g. a collective whose peers already left
                _say(
                    f"ignoring {type(exc).__name__} raised while the callable unwound "
                    f"after the checkpoint signal"
                )
            self._record_saved()
            self.agent.close()
            raise SystemExit(self.exit_code) from None
        self.returned = True
        self.agent.finished(self.agent.step)  # None keeps the last step progress.json has
        self.agent.close()
        return result


def run(function: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Call `function(*args, **kwargs)` -- or, when this run saved a continuation before,
    the continuation -- with submitit's checkpoint-on-signal semantics under ftslurm (see
    the module's docstring). Returns the callable's result when it completes; after the
    checkpoint signal the process exits instead (0: stored, continue the run)."""
    folder = continuation_folder()
    try:
        loaded = load_continuation(folder)
    except ContinuationError as exc:
        _say(
            f"cannot resume: {exc}; refusing to start over from scratch; delete {folder} to "
            f"do so (exit {ExitCode.DO_NOT_RETRY:d})"
        )
        raise SystemExit(ExitCode.DO_NOT_RETRY) from None
    resumed = None
    if loaded is not None:
        delayed, resumed = loaded
        function, args, kwargs = delayed.function, tuple(delayed.args), dict(delayed.kwargs)
        if fta.init().rank == 0:
            _say(
                f"resuming continuation {resumed['sequence']} ({resumed.get('callable')}, "
                f"saved at step {resumed.get('step')})"
            )
    return _Runner(function, args, kwargs, folder, resumed).call()
