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
            if agent.should_stop():
                break                       # exit 0: "checkpointed, continue me"
    agent.finished(step)

The checkpoint signal (FTSLURM_CHECKPOINT_SIGNAL, default USR2) and SIGTERM only set a flag
in the handler; `should_checkpoint()` turns the flags of all ranks into one answer with a
MAX all-reduce over the default process group, like Megatron's all-gather, so no rank is
left waiting in a collective. Heartbeats and sections go to a shared-memory record the
launcher reads from outside the process (`agent.heartbeat`); section durations are
remembered and saved next to the checkpoints so the next attempt's launcher can tighten
its timeouts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ftslurm.agent import progress
from ftslurm.agent.heartbeat import HeartbeatWriter
from ftslurm.agent.straggler import StepTimer
from ftslurm.fsutil import read_json, write_json_atomic

OBSERVED_DIR = ".ftslurm-observed"  # inside the checkpoint directory


class RankAgent:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        self.rank = int(env.get("RANK", "0"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.step: int | None = None
        self._requested = False
        self._decided: bool | None = None  # the collective answer for the current step
        self._observed: dict[str, float] = {}
        self._last_beat: float | None = None
        self._checkpoint_dir = env.get("FTSLURM_CHECKPOINT_DIR")
        self._open: list[tuple[str, float]] = []  # the sections entered, innermost last
        self._compute_seen = False
        # Step times for straggler scores, published once per interval to the run folder.
        self._timer: StepTimer | None = None
        if env.get("FTSLURM_RUN_DIR"):
            interval = float(env.get("FTSLURM_STRAGGLER_INTERVAL_S") or 60)
            self._timer = StepTimer(interval, rank=self.rank, run_dir=env["FTSLURM_RUN_DIR"],
                                    node=env.get("SLURMD_NODENAME") or None)  # fmt: skip
        hb_dir = env.get("FTSLURM_HEARTBEAT_DIR")
        self._hb = HeartbeatWriter(hb_dir, self.local_rank) if hb_dir else None
        name = env.get("FTSLURM_CHECKPOINT_SIGNAL", "USR2").upper().removeprefix("SIG")
        self.checkpoint_signal = getattr(signal, f"SIG{name}", signal.SIGUSR2)
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
        """Whether any rank was asked to checkpoint: the same answer on every rank
        (a collective: call it at the same point of every step on every rank)."""
        if self._decided is None:
            self._decided = _any_rank(self._requested)
        return self._decided

    def should_stop(self) -> bool:
        """After the checkpoint that `should_checkpoint` asked for: stop and exit 0."""
        return self.should_checkpoint()

    # ------------------------------------------------------------------ reports
    def checkpoint_saved(self, step: int, seconds: float | None = None) -> None:
        progress.checkpoint_saved(step, seconds)
        self.save_observed()

    def finished(self, step: int | None = None) -> None:
        progress.finished(step)
        self.save_observed()

    def save_observed(self) -> None:
        """Longest section durations and heartbeat gaps seen on this rank, next to the
        checkpoints, for the next attempt's launcher to compute timeouts from."""
        if not self._checkpoint_dir or not self._observed:
            return
        folder = Path(self._checkpoint_dir) / OBSERVED_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank-{self.rank}.json"
        old = read_json(path) or {}
        merged = {k: max(float(v), float(old.get(k, 0.0))) for k, v in self._observed.items()}
        write_json_atomic(path, {**old, **merged})

    def close(self) -> None:
        self.save_observed()
        if self._hb is not None:
            self._hb.close()


def _any_rank(flag: bool) -> bool:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return flag
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


_AGENT: RankAgent | None = None


def init() -> RankAgent:
    """The process's rank agent (created on first call)."""
    global _AGENT
    if _AGENT is None:
        _AGENT = RankAgent()
    return _AGENT
