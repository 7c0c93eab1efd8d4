"""The rank agent: what a training script calls, small and explicit.

    from ftslurm.agent import rank as fta
    agent = fta.init()                      # once, after init_process_group
    with agent.section("setup"): ...        # timed sections the launcher watches
    for step in ...:
        with agent.section("step"):
            train_step()
        agent.heartbeat(step)               # a plain heartbeat (also counts progress)
        if agent.should_checkpoint():       # the SAME answer on every rank at this step
            with agent.section("checkpointing"):
                save(...)
            agent.checkpoint_saved(step, seconds)
            if agent.should_stop():         # records "saved step S, stopping"
                agent.exit(0)               # "checkpointed, continue me" (see below)
    agent.finished(step)
    agent.exit(0)

`should_checkpoint()` is True when a stop was asked for or a periodic checkpoint is due;
`should_stop()` only for the former; `checkpoint_tier` says where it must go: "disk", or
"memory" when the run keeps a memory tier (`ftslurm.memory_checkpoint`) and only that
tier's shorter interval has passed (the daemon tunes both, `ftslurm.core.cadence`). The
checkpoint signal (FTSLURM_CHECKPOINT_SIGNAL, default USR2) and SIGTERM only set a flag in
the handler. The periodic interval is the one
the daemon tuned for the run (`$FTSLURM_RUN_DIR/checkpoint-cadence.json`,
`ftslurm.core.cadence`), looked at no more than every CADENCE_REFRESH_S; a checkpoint is
due when that long has passed since the last one (or since the agent started).
`should_checkpoint()` turns both flags of all ranks into one answer with a MAX all-reduce
over the default process group, like Megatron's all-gather, so no rank is left waiting in
a collective and every rank saves at the same step. Heartbeats and sections go to a
shared-memory record the launcher reads from outside the process (`agent.heartbeat`);
section durations are remembered and saved next to the checkpoints so the next attempt's
launcher can tighten its timeouts.

Result validation (opt-in, `ftslurm.agent.validation`): `agent.validation(...)` once, then
`agent.validate(loss, step)` at every step before the optimizer's update answers GO_ON or
RERUN (the same on every rank: a collective); a result that reproduces wrong checkpoints
through the script's hook and exits 16 (17 in the disambiguation run) by `agent.exit`.

Leaving: `should_stop()` answering True and `finished()` record, durably (an atomic write into
`$FTSLURM_RUN_DIR/attempts/<attempt>/stopping-rank-<rank>.json`), that this rank saved
step S and is stopping. `agent.exit(code)` (or `leave(code)` without an agent) then waits
for checkpoint saves still in flight (`ftslurm.checkpoint`), flushes the reports, tears the
process group down in a thread for at most `TEARDOWN_TIMEOUT_S`, and ends the process with
`os._exit(code)`: gloo's and NCCL's native threads can abort (std::terminate, exit 134) or
hang in `destroy_process_group` and in the interpreter's exit-time destructors, and neither
may turn a good checkpoint into a failure. The launcher and the daemon also read the
record: a rank that recorded its stop and then died in teardown still counts as
checkpointed (docs/policy.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftslurm.agent import progress
from ftslurm.agent.heartbeat import HeartbeatWriter
from ftslurm.agent.straggler import StepTimer
from ftslurm.agent.validation_rules import Action, Settings
from ftslurm.core.cadence import Cadence
from ftslurm.core.contract import Disambiguation, EnvName, JobEnv, RunDir, observed_record
from ftslurm.core.contract.reports import Outcome, StopRecord
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.runfiles import write_report

if TYPE_CHECKING:
    from ftslurm.agent.validation import Validator

GO_ON, RERUN = Action.GO_ON, Action.RERUN  # what `validate` answers
TEARDOWN_TIMEOUT_S = 10.0  # how long `leave` lets destroy_process_group take
CADENCE_REFRESH_S = 5.0  # how often the agent looks for a new checkpoint interval
log = logging.getLogger("ftslurm.rank")


def _rank_started(environ: Mapping[str, str]) -> float:
    """The monotonic clock's reading when this rank's wrapper started (`RANK_STARTED`),
    so injected result faults count from the rank's start as its wrapper's crash and hang
    do; now, without the wrapper or with a value that does not read."""
    now = time.monotonic()
    try:
        since = time.time() - float(environ.get(EnvName.RANK_STARTED.value, ""))
    except ValueError:
        return now
    return now - since if 0 <= since < 86400 else now


def stop_record_path(run_dir: str | Path, attempt: str | int, rank: int) -> Path:
    """Where rank `rank` records that it saved its checkpoint and is stopping."""
    return RunDir(run_dir).stop_record(attempt, rank)


def read_stop_record(
    run_dir: str | Path | None, attempt: str | int, rank: int
) -> dict[str, Any] | None:
    """The rank's stop record, or None when it recorded none (or it is unreadable)."""
    if run_dir is None:
        return None
    record = read_json(stop_record_path(run_dir, attempt, rank))
    return record if isinstance(record, dict) else None


class RankAgent:
    def __init__(
        self,
        environ: dict[str, str] | None = None,
        *,
        heartbeats: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env = dict(os.environ if environ is None else environ)
        job = JobEnv.from_environ(env)
        self.rank = int(env.get("RANK", "0"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.step: int | None = None
        self._requested = False
        # the collective answer for the current step: (stop asked, periodic checkpoint due,
        # a disk one due)
        self._decided: tuple[bool, ...] | None = None
        self._clock = clock
        self._started = _rank_started(os.environ)  # injected result faults count from here
        self.validator: Validator | None = None  # `validation()`
        self._cadence = _CadenceFile(job.run.cadence if job.run else None, clock)
        # the periodic intervals count from here: the last checkpoint of any tier, of disk
        self._last_checkpoint = self._last_disk = clock()
        self._observed: dict[str, float] = {}
        self._last_beat: float | None = None
        self._checkpoint_dir = job.checkpoint_dir
        self._open: list[tuple[str, float]] = []  # the sections entered, innermost last
        self._compute_seen = False
        self._run_dir = job.run_dir
        self._attempt = job.attempt or 0
        self._saved_step: int | None = None
        self._stop_recorded = False
        # Step times for straggler scores, published once per interval to the run folder.
        self._timer: StepTimer | None = None
        if job.run_dir:
            self._timer = StepTimer(
                job.straggler_interval_s,
                rank=self.rank,
                run_dir=job.run_dir,
                attempt=self._attempt,
                node=env.get("SLURMD_NODENAME") or None,
            )
        hb_dir = job.heartbeat_dir
        self._hb = HeartbeatWriter(hb_dir, self.local_rank, beats=heartbeats) if hb_dir else None
        self.checkpoint_signal = job.checkpoint_signal_number
        for sig in {self.checkpoint_signal, signal.SIGTERM}:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, _sig: int, _frame: Any) -> None:
        self._requested = True  # nothing else here: the work happens at the step boundary

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, step: int | None = None) -> None:
        now = time.monotonic()
        if self._last_beat is not None:
            gap = now - self._last_beat
            if gap > self._observed.get("out_of_section", 0.0):
                self._observed["out_of_section"] = gap
        self._last_beat = now
        if step is not None:
            self.step = step
            self._decided = None
            progress.report_step(step)
        if self._hb is not None:
            self._hb.beat(step)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time a block the launcher watches. Sections nest: leaving the inner one resumes
        the outer one (with its own start time). The straggler timer takes the durations
        of "compute" sections (the part of a step without collectives, so that waiting
        for a slow peer does not make a fast rank look slow), or of "step" sections while
        no "compute" section has been seen."""
        started = time.monotonic()
        if self._hb is not None:
            self._hb.open_section(name, started)
        self._open.append((name, started))
        try:
            yield
        finally:
            now = time.monotonic()
            elapsed = now - started
            self._open.pop()
            if elapsed > self._observed.get(name, 0.0):
                self._observed[name] = elapsed
            if self._hb is not None:
                if self._open:
                    self._hb.open_section(*self._open[-1])
                else:
                    self._hb.close_section()
            self._last_beat = now
            if self._timer is not None:
                self._time_step(name, elapsed)

    def _time_step(self, name: str, elapsed: float) -> None:
        if name == "compute" and not self._compute_seen:
            self._compute_seen = True
            self._timer.discard_window()  # "step" samples would mix with "compute" ones
        if name == ("compute" if self._compute_seen else "step"):
            self._timer.record(elapsed)
            self._timer.maybe_publish()

    # ------------------------------------------------------------------ agreement
    def should_checkpoint(self) -> bool:
        """Whether to checkpoint at this step: a rank was asked to stop (the checkpoint
        signal, SIGTERM) or the run's periodic interval has passed on some rank. The same
        answer on every rank (a collective: call it at the same point of every step on
        every rank)."""
        if self._decided is None:
            now = self._clock()
            cadence = self._cadence.current()
            due = disk = False
            if cadence is not None and cadence.interval_s is not None:
                due = now - self._last_checkpoint >= cadence.interval_s
                # to disk: its own interval passed, or every checkpoint goes there (one tier)
                disk = now - self._last_disk >= cadence.tier_interval("disk") or (
                    due and cadence.disk_interval_s is None
                )
            # One all-reduce, so ranks that read different versions of the file still agree
            # on whether and where to checkpoint.
            self._decided = _any_rank(self._requested, due, disk)
            if any(self._decided):
                self._last_checkpoint = now
                if self.checkpoint_tier == "disk":
                    self._last_disk = now
        return any(self._decided)

    @property
    def checkpoint_tier(self) -> str:
        """Where this step's checkpoint must go (`should_checkpoint()` first): "disk" for a
        stop, a disk checkpoint due, or a run with one tier; "memory" when only the memory
        tier's shorter interval has passed (`ftslurm.memory_checkpoint`). The same answer on
        every rank."""
        stop, _due, disk = self._decided or (False, False, False)
        return "disk" if stop or disk else "memory"

    def should_stop(self) -> bool:
        """After the checkpoint that `should_checkpoint` asked for: True when it was asked
        for a stop (not a periodic one): stop and exit 0. Call it once the save is complete
        on this rank: a True answer records (durably) that this rank saved its step and is
        stopping."""
        self.should_checkpoint()
        assert self._decided is not None
        stop = self._decided[0]
        if stop:
            self.record_stop(Outcome.CHECKPOINTED)
        return stop

    @property
    def stopping(self) -> bool:
        """Whether this step's checkpoint was asked for a stop (`should_checkpoint()` first;
        unlike `should_stop()`, records nothing)."""
        return self._decided is not None and self._decided[0]

    @property
    def checkpoint_interval(self) -> float | None:
        """The periodic checkpoint interval in force (seconds; None: none); with a memory
        tier, the memory tier's (`disk_checkpoint_interval` is the disk's)."""
        cadence = self._cadence.current()
        return cadence.interval_s if cadence is not None else None

    @property
    def disk_checkpoint_interval(self) -> float | None:
        """The disk tier's periodic interval in force (seconds; None: none)."""
        cadence = self._cadence.current()
        return cadence.tier_interval("disk") if cadence is not None else None

    def record_stop(self, outcome: str = Outcome.CHECKPOINTED, step: int | None = None) -> None:
        """Record, atomically and before any teardown, "I saved step S and am stopping"
        (`outcome`: "checkpointed" or "finished"); once per process."""
        if self._stop_recorded or self._run_dir is None:
            return
        step = (
            step
            if step is not None
            else (self._saved_step if self._saved_step is not None else self.step)
        )
        write_report(
            stop_record_path(self._run_dir, self._attempt, self.rank),
            StopRecord(
                rank=self.rank,
                step=step,
                outcome=Outcome(outcome).value,
                pid=os.getpid(),
                time=time.time(),
            ),
        )
        self._stop_recorded = True

    def exit(self, code: int = 0, teardown_timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
        """Leave the process with `code` (see the module doc): never returns."""
        leave(code, teardown_timeout_s, agent=self)

    # ------------------------------------------------------------------ reports
    def checkpoint_saved(self, step: int, seconds: float | None = None, tier: str = "disk") -> None:
        """The checkpoint of `step` is saved; `seconds`: how long the training stood still
        for it (the daemon tunes the interval from it); `tier`: "disk" (persistent) or
        "memory" (`ftslurm.memory_checkpoint` reports its own saves). The next periodic
        one counts from now."""
        if tier not in ("disk", "memory"):
            raise ValueError(f"tier must be 'disk' or 'memory', not {tier!r}")
        self._last_checkpoint = self._clock()
        if tier == "memory":
            progress.memory_saved(step, seconds or 0.0)
            return
        self._saved_step = step
        self._last_disk = self._last_checkpoint
        progress.checkpoint_saved(step, seconds)
        self.save_observed()

    def finished(self, step: int | None = None) -> None:
        progress.finished(step)
        self.save_observed()
        self.record_stop(Outcome.FINISHED, step)

    def save_observed(self) -> None:
        """Longest section durations and heartbeat gaps seen on this rank, next to the
        checkpoints, for the next attempt's launcher to compute timeouts from."""
        if not self._checkpoint_dir or not self._observed:
            return
        path = observed_record(self._checkpoint_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        old = read_json(path) or {}
        merged = {k: max(float(v), float(old.get(k, 0.0))) for k, v in self._observed.items()}
        write_json_atomic(path, {**old, **merged})

    # ------------------------------------------------------------------ results
    def validation(
        self,
        settings: Settings | None = None,
        *,
        checkpoint: Callable[[], None] | None = None,
        **options: Any,
    ) -> Validator:
        """Turn result validation on (`ftslurm.agent.validation`): `settings` (or its
        fields as keywords: `spike_factor`, `window`, `warmup`, `max_reruns`, `mode`
        ("enforce" or "report_stats"), `stats_every`); `checkpoint`: saves the last good
        state before an exit 16 (called on every rank). Returns the `Validator`."""
        from ftslurm.agent.validation import Validator

        self.validator = Validator(
            settings if settings is not None else Settings(**options),
            checkpoint=checkpoint,
            leave=self.exit,
            started=self._started,
        )
        return self.validator

    def validate(self, result: Any, step: int | None = None) -> Action:
        """Check this step's result (the loss, before the optimizer's update): GO_ON, or
        RERUN (restore the state from before the step, run it again, validate again). A
        collective: the same answer on every rank; exit 16 and 17 never return. `step`
        defaults to the last `heartbeat`'s. Without `validation()` first: the defaults,
        and no checkpoint before an exit 16."""
        if self.validator is None:
            self.validation()
        assert self.validator is not None
        return self.validator.validate(result, step if step is not None else (self.step or 0))

    def close(self) -> None:
        if self.validator is not None:
            self.validator.flush()
        self.save_observed()
        if self._hb is not None:
            self._hb.close()


class _CadenceFile:
    """The run's checkpoint interval as the daemon wrote it, looked at (one stat, and a
    read when the file changed) no more than every CADENCE_REFRESH_S."""

    def __init__(self, path: Path | None, clock: Callable[[], float]) -> None:
        self.path, self.clock = path, clock
        self._looked: float | None = None
        self._sig: tuple[int, int, int] | None = None
        self._cadence: Cadence | None = None

    def current(self) -> Cadence | None:
        now = self.clock()
        if self.path is None or (
            self._looked is not None and now - self._looked < CADENCE_REFRESH_S
        ):
            return self._cadence
        self._looked = now
        try:
            st = self.path.stat()
        except OSError:
            self._sig, self._cadence = None, None
            return None
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig != self._sig:
            cadence = Cadence.from_json(read_json(self.path))
            if cadence is not None:  # a torn or foreign file: keep what was in force
                self._sig, self._cadence = sig, cadence
        return self._cadence


def _any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag true on any rank (one MAX all-reduce of all of them)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return flags
    if not (dist.is_available() and dist.is_initialized()):
        return flags
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    value = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in value.tolist())


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # the checkpoint is safe: nothing here changes the outcome
        log.warning("destroy_process_group failed: %s", exc)


def leave(
    code: int = 0, teardown_timeout_s: float = TEARDOWN_TIMEOUT_S, agent: RankAgent | None = None
) -> None:
    """End this rank's process with `code`, whatever native threads do at teardown: wait
    for checkpoint saves in flight, flush the reports and stdio, give
    `destroy_process_group` `teardown_timeout_s` in a daemon thread, then `os._exit(code)`
    (no interpreter finalisation: no exit-time C++ destructors, whose joinable gloo threads
    are what std::terminate aborts on). A save that failed turns `code` into 1 and takes
    back the stop record. Never returns."""
    agent = agent if agent is not None else _AGENT
    checkpoint = sys.modules.get("ftslurm.checkpoint")
    if checkpoint is not None:
        try:
            checkpoint.wait_for_saves()
        except Exception as exc:
            print(f"ftslurm: checkpoint save failed before exit: {exc!r}", file=sys.stderr)
            code = code or 1
            if agent is not None and agent._run_dir is not None:
                stop_record_path(agent._run_dir, agent._attempt, agent.rank).unlink(missing_ok=True)
    if agent is not None:
        try:
            agent.close()
        except OSError as exc:
            print(f"ftslurm: could not save the rank agent's records: {exc}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    worker = threading.Thread(target=_destroy_process_group, name="ftslurm-teardown", daemon=True)
    worker.start()
    worker.join(teardown_timeout_s)
    if worker.is_alive():
        print(
            f"ftslurm: destroy_process_group still running after {teardown_timeout_s:.0f}s;"
            " leaving without it",
            file=sys.stderr,
        )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def disambiguation(environ: dict[str, str] | None = None) -> Disambiguation | None:
    """The context of a disambiguation run, or None in an ordinary attempt: the attempt
    before this one ended with exit 16 (a rank could not trust a result and asked to resume
    on other hardware) on nodes the daemon then flagged, and this attempt runs elsewhere
    (`attempt`: the one that exited 16, `nodes`: its nodes, `step`: the checkpoint step
    this attempt starts from). A script re-runs the suspicious step: when the result
    reproduces, the fault is the model's, not the machine's, and it exits 17 (the run ends
    FAILED with that reason); when it does not, it goes on. Reads `FTSLURM_DISAMBIGUATE`
    (a bad value: a one-line `ConfigError`); needs no `init`."""
    return JobEnv.from_environ(dict(os.environ if environ is None else environ)).disambiguate


_AGENT: RankAgent | None = None


def current() -> RankAgent | None:
    """The process's rank agent, if `init` created one."""
    return _AGENT


def init(*, heartbeats: bool = True) -> RankAgent:
    """The process's rank agent (created on first call). `heartbeats=False` for code that
    never calls `heartbeat()` or `section()` (a submitit callable, say): the launcher then
    watches the rank's CPU time instead of waiting for heartbeats that never come."""
    global _AGENT
    if _AGENT is None:
        _AGENT = RankAgent(heartbeats=heartbeats)
    return _AGENT
