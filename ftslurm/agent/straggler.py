"""Straggler detection: which ranks, and which nodes, make every step of the job slower.

Each rank times its steps (`StepTimer`) and, once per report window, publishes the median
step time of that window. A collector (the launcher on node 0, or the daemon) scores the
latest window that every rank has finished (`collect_report`). For a rank whose window
median is `m`:

    relative   = min(1, reference / m)   reference = the best (minimum) median across ranks
                                         ("best"), or the median of the ranks' medians
                                         ("median": one unusually fast rank cannot make
                                         every other rank look slow)
    individual = min(1, best / m)        best = this rank's own best median of earlier windows
                                         (this window's when it has none)

Both lie in (0, 1]; 1 means as fast as the reference. A rank is a straggler when either score
is below the threshold (0.75 by default). Ranks with fewer than `MIN_SAMPLES` steps in the
window are not scored, nor are medians that are not positive. A node is the unit that can be
excluded from the next allocation, so verdicts are also kept per node: the number of
consecutive scored windows in which any of the node's ranks was a straggler (a window in which
the node did not report leaves its count as it is); the counts start again with every attempt.
Statistics restart with every window.

Rank side, in the training loop:

    timer = StepTimer(report_interval_s=60)
    for batch in loader:
        with timer.step():              # or timer.record(seconds): appends to a list, no I/O
            train_step(batch)
        timer.maybe_publish()           # writes once per interval, nothing in between

Rank, node and run directory default to RANK (or SLURM_PROCID), SLURMD_NODENAME (or the host
name) and FTSLURM_RUN_DIR; without a run directory nothing is written. Files, all written
atomically, under `$FTSLURM_RUN_DIR/stragglers/`:

    rank-<rank>.json  one per rank, its last published window:
                      {rank, node, median_s, samples, window_end, window_index, attempt,
                       previous}; `window_end` is unix time, `window_index` counts from 0 per
                      process, `attempt` is FTSLURM_ATTEMPT, and `previous` holds
                      {median_s, samples, window_end, window_index} of the window before (or
                      null), so that a collector can still score a window after some ranks
                      have moved on to the next one.
    state.json        the collector's memory: the window last scored (attempt, window_index),
                      each rank's best median in this attempt, and the per-node counts.
    report.json       {window_index, attempt, reference, threshold, scores, stragglers,
                       persistent_nodes, skipped_ranks, updated_at}; `scores` is a list of
                      {rank, node, relative, individual, median_s}, `stragglers` of
                      {rank, node, relative, individual}.

Only files of the latest attempt are read. The window scored is the highest index that every
live rank has published (a rank more than one window behind the others is skipped as stale).
Scoring the same window twice changes nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftslurm.core.contract import DEFAULT_STRAGGLER_THRESHOLD, JobEnv, RunDir
from ftslurm.core.contract.reports import Kind, StragglerReport, StragglerScore, StragglerWindow
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.runfiles import read_report, read_reports, write_report

MIN_SAMPLES = 3
DEFAULT_THRESHOLD = DEFAULT_STRAGGLER_THRESHOLD
REFERENCES = ("best", "median")


@dataclass(frozen=True)
class RankTiming:
    """One rank's step times over one window."""

    rank: int
    node: str
    median_s: float
    samples: int


@dataclass(frozen=True)
class Score:
    """One rank's scores for one window; both in (0, 1], 1 = as fast as the reference."""

    rank: int
    node: str
    relative: float
    individual: float
    median_s: float


# --------------------------------------------------------------------------- scoring
def window_median(samples: Sequence[float]) -> float:
    """The median of a window's step times; ValueError when there are none."""
    if not samples:
        raise ValueError("no samples in the window")
    return float(statistics.median(samples))


def _usable(timing: RankTiming, min_samples: int) -> bool:
    return timing.samples >= min_samples and math.isfinite(timing.median_s) and timing.median_s > 0


def score_window(
    timings: Sequence[RankTiming],
    best_history: Mapping[int, float],
    reference: str = "best",
    min_samples: int = MIN_SAMPLES,
) -> list[Score]:
    """Score one window (see the module docstring), ordered by rank; ranks with fewer than
    `min_samples` samples or a median that is not positive are left out."""
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, not {reference!r}")
    usable = sorted((t for t in timings if _usable(t, min_samples)), key=lambda t: t.rank)
    if not usable:
        return []
    medians = [t.median_s for t in usable]
    ref = min(medians) if reference == "best" else float(statistics.median(medians))
    scores = []
    for t in usable:
        best = best_history.get(t.rank, t.median_s)
        if not (math.isfinite(best) and best > 0):
            best = t.median_s
        scores.append(
            Score(
                t.rank, t.node, min(1.0, ref / t.median_s), min(1.0, best / t.median_s), t.median_s
            )
        )
    return scores


def update_best_history(
    best_history: Mapping[int, float], timings: Iterable[RankTiming]
) -> dict[int, float]:
    """A new history: for each rank the smallest positive median seen so far."""
    history = dict(best_history)
    for t in timings:
        if math.isfinite(t.median_s) and t.median_s > 0:
            history[t.rank] = min(history.get(t.rank, t.median_s), t.median_s)
    return history


def stragglers(scores: Iterable[Score], threshold: float = DEFAULT_THRESHOLD) -> list[Score]:
    """The scores whose relative or individual score is below `threshold`."""
    return [s for s in scores if s.relative < threshold or s.individual < threshold]


class NodeVerdicts:
    """Per node, the number of consecutive windows in which any of its ranks was a straggler.

    A window in which the node was scored and clean resets its count to 0; a window in which
    it was not scored at all leaves the count unchanged."""

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        self.counts: dict[str, int] = {str(k): int(v) for k, v in (counts or {}).items()}

    def update(
        self, scores: Iterable[Score], threshold: float = DEFAULT_THRESHOLD
    ) -> dict[str, int]:
        """Count one window; returns all counts."""
        scores = list(scores)
        flagged = {s.node for s in stragglers(scores, threshold)}
        for node in {s.node for s in scores}:
            self.counts[node] = self.counts.get(node, 0) + 1 if node in flagged else 0
        return dict(self.counts)

    def persistent(self, n_windows: int) -> list[str]:
        """Nodes that were stragglers in at least `n_windows` consecutive windows, sorted."""
        return sorted(node for node, count in self.counts.items() if count >= n_windows)


# --------------------------------------------------------------------------- rank side
def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default


class StepTimer:
    """Per-rank step timing for straggler scores; `with timer.step(): ...` or
    timer.record(seconds), then `timer.maybe_publish()` once per step."""

    def __init__(
        self,
        report_interval_s: float = 60.0,
        *,
        rank: int | None = None,
        node: str | None = None,
        run_dir: str | Path | None = None,
        attempt: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if report_interval_s <= 0:
            raise ValueError("report_interval_s must be positive")
        env = os.environ
        job = JobEnv.from_environ(env) if run_dir is None or attempt is None else None
        self.report_interval_s = float(report_interval_s)
        self.rank = rank if rank is not None else _int(env.get("RANK") or env.get("SLURM_PROCID"))
        self.node = node or env.get("SLURMD_NODENAME") or socket.gethostname()
        run_dir = run_dir if run_dir is not None or job is None else job.run_dir
        self.run = RunDir(run_dir) if run_dir else None
        self.run_dir = self.run.root if self.run is not None else None
        self.attempt = attempt if attempt is not None else (job.attempt or 0 if job else 0)
        self.clock = clock
        self.window_index = 0  # the index the current window will be published under
        self._samples: list[float] = []
        self._window_start = clock()
        self._previous: dict[str, Any] | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the block with `clock` and record it (not when the block raises)."""
        start = self.clock()
        yield
        self._samples.append(self.clock() - start)

    def record(self, seconds: float) -> None:
        """Record one step that took `seconds`."""
        self._samples.append(seconds)

    def discard_window(self) -> None:
        """Drop the samples of the current window (e.g. when what is timed changes)."""
        self._samples = []

    def window(self) -> RankTiming | None:
        """The current window's timing, or None before its first step."""
        if not self._samples:
            return None
        return RankTiming(self.rank, self.node, window_median(self._samples), len(self._samples))

    def maybe_publish(self) -> bool:
        """When `report_interval_s` has passed since the window began, write it (see the module
        docstring) and start a new one; returns whether a file was written. An empty window is
        not published, and without a run directory the window restarts without writing."""
        now = self.clock()
        if now - self._window_start < self.report_interval_s:
            return False
        timing = self.window()
        self._samples = []
        self._window_start = now
        if timing is None or self.run is None:
            return False
        window = {
            "median_s": timing.median_s,
            "samples": timing.samples,
            "window_end": time.time(),
            "window_index": self.window_index,
        }
        published = StragglerWindow(
            rank=self.rank, node=self.node, **window, attempt=self.attempt, previous=self._previous
        )
        write_report(self.run.straggler_rank(self.rank), published)
        self._previous = window
        self.window_index += 1
        return True


# --------------------------------------------------------------------------- collector
def _window(data: Any) -> tuple[int, float, int] | None:
    """(window_index, median_s, samples) of a published window, or None when malformed."""
    if not isinstance(data, dict):
        return None
    index, median, samples = data.get("window_index"), data.get("median_s"), data.get("samples")
    if (
        not isinstance(index, int)
        or not isinstance(samples, int)
        or not isinstance(median, (int, float))
        or isinstance(median, bool)
    ):
        return None
    return index, float(median), samples


def _rank_files(run: RunDir) -> list[dict[str, Any]]:
    """The windows the ranks published (`StragglerWindow`) that name their rank and node
    and hold a well-formed window, as their JSON."""
    return [
        window.to_json()
        for window in read_reports(run, Kind.STRAGGLER_WINDOW)
        if isinstance(window.rank, int)
        and isinstance(window.node, str)
        and _window(window.to_json()) is not None
    ]


def _complete_window(
    entries: list[dict[str, Any]],
) -> tuple[int, int, list[RankTiming], list[int]] | None:
    """(attempt, window_index, timings, stale ranks) of the latest window every live rank of
    the latest attempt has published, or None when there is none."""
    if not entries:
        return None
    attempt = max(_int(str(e.get("attempt", 0))) for e in entries)
    entries = [e for e in entries if _int(str(e.get("attempt", 0))) == attempt]
    top = max(e["window_index"] for e in entries)
    live = [e for e in entries if e["window_index"] >= top - 1]
    stale = sorted(e["rank"] for e in entries if e["window_index"] < top - 1)
    index = top if all(e["window_index"] == top for e in live) else top - 1
    timings = []
    for e in live:
        window = _window(e) if e["window_index"] == index else _window(e.get("previous"))
        if window is None or window[0] != index:
            stale.append(e["rank"])
            continue
        timings.append(RankTiming(e["rank"], e["node"], window[1], window[2]))
    if index < 0 or not timings:
        return None
    return attempt, index, timings, sorted(stale)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Serialise collectors sharing the run directory (best effort where locks fail)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def collect_report(
    run_dir: str | Path,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    reference: str = "best",
    persistent_windows: int = 3,
    state: str | Path | None = None,
    min_samples: int = MIN_SAMPLES,
) -> dict[str, Any]:
    """Score the latest complete window under `run_dir`, update the collector's state
    (`state`, default `$run_dir/stragglers/state.json`) and write `report.json`; returns the
    report's JSON. Without any complete window it returns the last report (or an empty one)
    and writes nothing. Calling it again for a window already scored does not count it
    twice."""
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, not {reference!r}")
    run = RunDir(run_dir)
    run.stragglers.mkdir(parents=True, exist_ok=True)
    state_path = Path(state) if state is not None else run.straggler_state
    with _locked(run.straggler_lock):
        saved = read_json(state_path)
        saved = saved if isinstance(saved, dict) else {}
        chosen = _complete_window(_rank_files(run))
        if chosen is None:
            return _last_report(run, saved, reference, threshold, persistent_windows)
        attempt, index, timings, stale = chosen
        scores, verdicts = _score(saved, chosen, state_path, threshold, reference, min_samples)
        scored = {s.rank for s in scores}
        report = StragglerReport(
            window_index=index,
            attempt=attempt,
            reference=reference,
            threshold=threshold,
            scores=[_score_entry(s, with_median=True) for s in scores],
            stragglers=[_score_entry(s) for s in stragglers(scores, threshold)],
            persistent_nodes=verdicts.persistent(persistent_windows),
            skipped_ranks=sorted(set(stale) | {t.rank for t in timings} - scored),
            updated_at=time.time(),
        )
        write_report(run.straggler_report, report)
        return report.to_json()


def _last_report(
    run: RunDir, saved: dict[str, Any], reference: str, threshold: float, persistent_windows: int
) -> dict[str, Any]:
    """Without a complete window: the report last written, or an empty one (with the
    persistent nodes of the collector's state `saved`)."""
    last = read_report(run.straggler_report, StragglerReport)
    if last is not None:
        return last.to_json()
    verdicts = NodeVerdicts(saved.get("node_windows") or {})
    return StragglerReport(
        window_index=None,
        attempt=None,
        reference=reference,
        threshold=threshold,
        scores=[],
        stragglers=[],
        persistent_nodes=verdicts.persistent(persistent_windows),
        skipped_ranks=[],
        updated_at=time.time(),
    ).to_json()


def _score_entry(score: Score, with_median: bool = False) -> StragglerScore:
    """A rank's entry in the report: its scores (and its median, in `scores`)."""
    entry: dict[str, Any] = dict(
        rank=score.rank, node=score.node, relative=score.relative, individual=score.individual
    )
    return (
        StragglerScore(**entry, median_s=score.median_s) if with_median else StragglerScore(**entry)
    )


def _score(
    saved: dict[str, Any],
    chosen: tuple[int, int, list[RankTiming], list[int]],
    state_path: Path,
    threshold: float,
    reference: str,
    min_samples: int,
) -> tuple[list[Score], NodeVerdicts]:
    """The scores of the `chosen` window and the per-node counts; a window not scored
    before is counted and the collector's state (`saved`, at `state_path`) rewritten."""
    attempt, index, timings, _ = chosen
    same_attempt = saved.get("attempt") == attempt
    # a new attempt: its nodes start with a clean slate
    verdicts = NodeVerdicts(saved.get("node_windows") or {}) if same_attempt else NodeVerdicts()
    history = (
        {int(k): float(v) for k, v in (saved.get("best_history") or {}).items()}
        if same_attempt
        else {}
    )
    scores = score_window(timings, history, reference, min_samples)
    # Any other window is new, an earlier index too: after an in-job restart the ranks'
    # new processes count their windows from 0 again.
    if (attempt, index) != (saved.get("attempt"), saved.get("window_index")):
        # Scoring first and updating after gives the same individual scores as a repeat
        # of this window would, so a repeat needs no memory of the scores.
        verdicts.update(scores, threshold)
        history = update_best_history(history, [t for t in timings if _usable(t, min_samples)])
        write_json_atomic(
            state_path,
            {
                "attempt": attempt,
                "window_index": index,
                "best_history": {str(k): v for k, v in sorted(history.items())},
                "node_windows": verdicts.counts,
                "updated_at": time.time(),
            },
        )
    return scores, verdicts
