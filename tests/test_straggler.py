"""Straggler scores (`ftslurm.agent.straggler`): the pure scoring, the rank-side timer with a
fake clock, the collector, and an end-to-end run with real processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftslurm.agent.straggler import (
    MIN_SAMPLES,
    NodeVerdicts,
    RankTiming,
    Score,
    StepTimer,
    collect_report,
    score_window,
    stragglers,
    update_best_history,
    window_median,
)

from .conftest import wait_for

REPO = Path(__file__).resolve().parents[1]


def timings(*medians: float, samples: int = 10, nodes: tuple[str, ...] = ()) -> list[RankTiming]:
    return [
        RankTiming(rank, nodes[rank] if nodes else f"n{rank}", m, samples)
        for rank, m in enumerate(medians)
    ]


def by_rank(scores: list[Score]) -> dict[int, tuple[float, float]]:
    return {s.rank: (pytest.approx(s.relative), pytest.approx(s.individual)) for s in scores}


# --------------------------------------------------------------------------- pure part
def test_window_median() -> None:
    assert window_median([3.0, 1.0, 2.0]) == 2.0
    assert window_median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        window_median([])


@pytest.mark.parametrize(
    ("medians", "history", "reference", "expected"),
    [
        # reference "best": the fastest rank scores 1, the others best / own.
        ((1.0, 1.0, 2.0), {}, "best", {0: (1.0, 1.0), 1: (1.0, 1.0), 2: (0.5, 1.0)}),
        ((2.0, 4.0, 2.5), {}, "best", {0: (1.0, 1.0), 1: (0.5, 1.0), 2: (0.8, 1.0)}),
        # one unusually fast rank makes every other rank look slow against "best" ...
        (
            (0.5, 1.0, 1.0, 1.0),
            {},
            "best",
            {0: (1.0, 1.0), 1: (0.5, 1.0), 2: (0.5, 1.0), 3: (0.5, 1.0)},
        ),
        # ... but not against "median" (median of 0.5, 1, 1, 1 is 1); faster ranks are capped at 1.
        (
            (0.5, 1.0, 1.0, 1.0),
            {},
            "median",
            {0: (1.0, 1.0), 1: (1.0, 1.0), 2: (1.0, 1.0), 3: (1.0, 1.0)},
        ),
        ((1.0, 1.0, 3.0), {}, "median", {0: (1.0, 1.0), 1: (1.0, 1.0), 2: (1 / 3, 1.0)}),
        # individual: own best of earlier windows over the current median, capped at 1.
        ((1.0, 2.0), {0: 0.5, 1: 4.0}, "best", {0: (1.0, 0.5), 1: (0.5, 1.0)}),
    ],
)
def test_score_window_table(
    medians: tuple[float, ...],
    history: dict[int, float],
    reference: str,
    expected: dict[int, tuple[float, float]],
) -> None:
    assert by_rank(score_window(timings(*medians), history, reference)) == expected


def test_score_window_skips_under_sampled_ranks() -> None:
    window = [
        RankTiming(0, "a", 1.0, MIN_SAMPLES),
        RankTiming(1, "a", 0.1, MIN_SAMPLES - 1),
        RankTiming(2, "b", 2.0, 50),
        RankTiming(3, "b", 0.0, 50),
    ]
    scores = score_window(window, {})
    assert [s.rank for s in scores] == [0, 2]  # the fast rank 1 does not set the reference
    assert by_rank(scores) == {0: (1.0, 1.0), 2: (0.5, 1.0)}
    assert [s.rank for s in score_window(window, {}, min_samples=1)] == [0, 1, 2]
    assert score_window([RankTiming(0, "a", 1.0, 1)], {}) == []
    with pytest.raises(ValueError):
        score_window(window, {}, reference="mean")


def test_update_best_history_and_stragglers() -> None:
    history = update_best_history({0: 1.0, 1: 3.0}, timings(2.0, 2.0, 5.0))
    assert history == {0: 1.0, 1: 2.0, 2: 5.0}
    scores = [
        Score(0, "a", 1.0, 1.0, 1.0),
        Score(1, "a", 0.74, 1.0, 1.3),
        Score(2, "b", 1.0, 0.6, 1.0),
        Score(3, "b", 0.75, 0.75, 1.0),
    ]
    assert [s.rank for s in stragglers(scores)] == [1, 2]
    assert [s.rank for s in stragglers(scores, threshold=0.7)] == [2]


# --------------------------------------------------------------------------- properties
medians_st = st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=16)


@st.composite
def windows(draw: st.DrawFn) -> tuple[list[RankTiming], dict[int, float]]:
    medians = draw(medians_st)
    history = draw(st.dictionaries(st.integers(0, len(medians) - 1), st.floats(1e-4, 1e3)))
    return timings(*medians), history


@given(windows(), st.sampled_from(["best", "median"]))
def test_scores_are_in_unit_interval(window: Any, reference: str) -> None:
    scores = score_window(*window, reference=reference)
    assert len(scores) == len(window[0])
    for s in scores:
        assert 0 < s.relative <= 1 and 0 < s.individual <= 1


@given(medians_st)
def test_fastest_rank_is_the_best_reference(medians: list[float]) -> None:
    scores = score_window(timings(*medians), {}, "best")
    fastest = min(scores, key=lambda s: s.median_s)
    assert fastest.relative == 1.0


@given(medians_st, st.floats(1e-3, 1e3), st.sampled_from(["best", "median"]))
def test_scaling_all_times_keeps_relative_scores(
    medians: list[float], factor: float, reference: str
) -> None:
    before = score_window(timings(*medians), {}, reference)
    after = score_window(timings(*(m * factor for m in medians)), {}, reference)
    for a, b in zip(before, after, strict=True):
        assert math.isclose(a.relative, b.relative, rel_tol=1e-9)


@given(st.data())
def test_a_slowed_rank_is_flagged_and_only_it(data: st.DataObject) -> None:
    threshold = data.draw(st.floats(0.5, 0.8), label="threshold")
    n = data.draw(st.integers(3, 16), label="ranks")
    base = data.draw(st.floats(1e-3, 10.0), label="base")
    # healthy ranks within 1/0.8 of each other: none of them is a straggler by itself
    healthy = [base * data.draw(st.floats(1.0, 1.2)) for _ in range(n)]
    slow = data.draw(st.integers(0, n - 1), label="slow rank")
    # k > 1 / threshold, with room for rounding at the boundary
    k = data.draw(st.floats(1 / threshold * (1 + 1e-9), 100.0), label="k")
    medians = [k * max(healthy) if r == slow else m for r, m in enumerate(healthy)]
    flagged = stragglers(score_window(timings(*medians), {}, "median"), threshold)
    assert [s.rank for s in flagged] == [slow]


# --------------------------------------------------------------------------- node verdicts
def test_node_verdicts_count_consecutive_windows() -> None:
    slow_a = [
        Score(0, "a", 0.5, 1.0, 2.0),
        Score(1, "a", 1.0, 1.0, 1.0),
        Score(2, "b", 1.0, 1.0, 1.0),
    ]
    clean = [Score(0, "a", 1.0, 1.0, 1.0), Score(2, "b", 1.0, 1.0, 1.0)]
    verdicts = NodeVerdicts()
    assert verdicts.update(slow_a) == {"a": 1, "b": 0}
    assert verdicts.update(slow_a) == {"a": 2, "b": 0}
    assert verdicts.persistent(2) == ["a"] and verdicts.persistent(3) == []
    assert verdicts.update(clean) == {"a": 0, "b": 0}  # one clean window resets the count
    assert verdicts.persistent(1) == []
    verdicts.update(slow_a)
    verdicts.update([Score(2, "b", 1.0, 1.0, 1.0)])  # "a" not scored: its count stays
    assert verdicts.update(slow_a)["a"] == 2
    assert NodeVerdicts(verdicts.counts).persistent(2) == ["a"]
    # individual scores count too, and the threshold is the caller's
    assert NodeVerdicts().update([Score(0, "c", 1.0, 0.72, 1.0)], threshold=0.7) == {"c": 0}
    assert NodeVerdicts().update([Score(0, "c", 1.0, 0.72, 1.0)]) == {"c": 1}


# --------------------------------------------------------------------------- step timer
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rank_file(run_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / "stragglers" / f"rank-{rank}.json").read_text())


def test_step_timer_windows_and_publishing(tmp_path: Path) -> None:
    clock = FakeClock()
    timer = StepTimer(10.0, rank=3, node="nA", run_dir=tmp_path, clock=clock)
    assert timer.window() is None
    for seconds in (0.5, 0.25, 0.75):  # exact in binary: the fake clock adds exactly
        with timer.step():
            clock.advance(seconds)
    timer.record(0.375)
    window = timer.window()
    assert window is not None
    assert (window.rank, window.node, window.samples) == (3, "nA", 4)
    assert window.median_s == 0.4375
    assert not timer.maybe_publish()  # 1.5 s of the 10 s window so far
    assert not (tmp_path / "stragglers").exists()

    clock.advance(8.5)
    assert timer.maybe_publish()
    first = rank_file(tmp_path, 3)
    assert {k: first[k] for k in ("rank", "node", "samples", "window_index", "previous")} == {
        "rank": 3,
        "node": "nA",
        "samples": 4,
        "window_index": 0,
        "previous": None,
    }
    assert first["median_s"] == 0.4375
    assert abs(first["window_end"] - time.time()) < 60
    assert timer.window() is None  # the window restarted
    assert not timer.maybe_publish()

    with pytest.raises(RuntimeError), timer.step():
        clock.advance(5.0)
        raise RuntimeError("a failed step is not timed")
    assert timer.window() is None
    timer.record(1.0)
    clock.advance(5.0)
    assert timer.maybe_publish()
    second = rank_file(tmp_path, 3)
    assert (second["window_index"], second["samples"], second["median_s"]) == (1, 1, 1.0)
    assert second["previous"]["window_index"] == 0
    assert second["previous"]["median_s"] == 0.4375

    clock.advance(20.0)  # an empty window is not published
    assert not timer.maybe_publish()
    assert rank_file(tmp_path, 3)["window_index"] == 1


def test_step_timer_defaults_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "SLURM_PROCID", "SLURMD_NODENAME", "FTSLURM_RUN_DIR"):
        monkeypatch.delenv(name, raising=False)
    clock = FakeClock()
    quiet = StepTimer(1.0, clock=clock)
    quiet.record(0.1)
    clock.advance(2.0)
    assert quiet.rank == 0 and not quiet.maybe_publish()  # no run directory: nothing written
    assert quiet.window() is None

    monkeypatch.setenv("FTSLURM_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv("FTSLURM_ATTEMPT", "2")
    timer = StepTimer(1.0, clock=clock)
    timer.record(0.1)
    clock.advance(2.0)
    assert timer.maybe_publish()
    data = rank_file(tmp_path, 5)
    assert (data["rank"], data["node"], data["attempt"]) == (5, "node7", 2)


# --------------------------------------------------------------------------- collector
class Ranks:
    """Several StepTimers under one fake clock, as if on several nodes."""

    def __init__(self, run_dir: Path, nodes: list[str]) -> None:
        self.clock = FakeClock()
        self.timers = [
            StepTimer(10.0, rank=r, node=node, run_dir=run_dir, clock=self.clock)
            for r, node in enumerate(nodes)
        ]

    def window(self, step_s: list[float], publish: list[int] | None = None) -> None:
        for timer, seconds in zip(self.timers, step_s, strict=True):
            for _ in range(5):
                timer.record(seconds)
        self.clock.advance(10.0)
        for rank in range(len(self.timers)) if publish is None else publish:
            assert self.timers[rank].maybe_publish()


def test_collect_report_scores_persists_and_is_idempotent(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, ["nA", "nA", "nB", "nB"])
    assert collect_report(tmp_path)["window_index"] is None  # nothing published yet
    for window in range(3):
        ranks.window([1.0, 1.0, 1.0, 2.0])
        report = collect_report(tmp_path, persistent_windows=3)
        assert report["window_index"] == window
        assert [(s["rank"], s["node"]) for s in report["stragglers"]] == [(3, "nB")]
        assert report["stragglers"][0]["relative"] == pytest.approx(0.5)
        assert report["persistent_nodes"] == ([] if window < 2 else ["nB"])
        assert json.loads((tmp_path / "stragglers" / "report.json").read_text()) == report
    state = json.loads((tmp_path / "stragglers" / "state.json").read_text())
    again = collect_report(tmp_path, persistent_windows=3)
    assert {k: v for k, v in again.items() if k != "updated_at"} == {
        k: v for k, v in report.items() if k != "updated_at"
    }
    assert json.loads((tmp_path / "stragglers" / "state.json").read_text()) == state
    assert set(report) >= {
        "window_index",
        "reference",
        "threshold",
        "scores",
        "stragglers",
        "persistent_nodes",
        "updated_at",
    }
    assert set(report["scores"][0]) == {"rank", "node", "relative", "individual", "median_s"}
    assert set(report["stragglers"][0]) == {"rank", "node", "relative", "individual"}

    # every rank gets slower than it was: their individual scores drop
    ranks.window([2.0, 2.0, 2.0, 2.0])
    report = collect_report(tmp_path, persistent_windows=3)
    assert [(s["rank"], s["relative"], s["individual"]) for s in report["stragglers"]] == [
        (0, 1.0, 0.5),
        (1, 1.0, 0.5),
        (2, 1.0, 0.5),
    ]
    assert report["persistent_nodes"] == ["nB"]
    # only rank 0 is slow: nB is clean for a window, its count restarts
    ranks.window([2.0, 1.0, 1.0, 1.0])
    report = collect_report(tmp_path, persistent_windows=3)
    assert [(s["rank"], s["relative"], s["individual"]) for s in report["stragglers"]] == [
        (0, 0.5, 0.5)
    ]
    assert report["persistent_nodes"] == []


def test_collect_report_scores_the_latest_window_every_rank_finished(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, ["nA", "nB", "nC"])
    ranks.window([1.0, 1.0, 1.0])
    ranks.window([1.0, 3.0, 1.0], publish=[0, 2])  # rank 1 has not published window 1 yet
    report = collect_report(tmp_path, reference="median")
    assert report["window_index"] == 0 and report["stragglers"] == []
    assert ranks.timers[1].maybe_publish()
    report = collect_report(tmp_path, reference="median")
    assert report["window_index"] == 1
    assert [s["rank"] for s in report["stragglers"]] == [1]

    # a rank two windows behind is stale and skipped; under-sampled ranks are skipped too
    for _ in range(2):
        ranks.window([1.0, 1.0, 1.0], publish=[0, 1])
    report = collect_report(tmp_path, reference="median")
    assert report["window_index"] == 3 and report["skipped_ranks"] == [2]
    assert [s["rank"] for s in report["scores"]] == [0, 1]
    ranks.timers[0].record(1.0)
    ranks.timers[1].record(9.0)
    ranks.clock.advance(10.0)
    assert ranks.timers[0].maybe_publish() and ranks.timers[1].maybe_publish()
    report = collect_report(tmp_path, reference="median", min_samples=1)
    assert [s["rank"] for s in report["stragglers"]] == [1]
    assert collect_report(tmp_path)["window_index"] == 4  # repeat with the default min_samples
    assert collect_report(tmp_path)["skipped_ranks"] == [0, 1, 2]


def test_collect_report_follows_the_latest_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = Ranks(tmp_path, ["nA", "nB", "nB"])
    for _ in range(4):
        ranks.window([1.0, 1.0, 1.0])
    assert collect_report(tmp_path)["window_index"] == 3
    monkeypatch.setenv("FTSLURM_ATTEMPT", "1")  # a continuation with two ranks, new indices
    clock = FakeClock()
    again = [
        StepTimer(10.0, rank=r, node=n, run_dir=tmp_path, clock=clock)
        for r, n in enumerate(["nC", "nA"])
    ]
    for timer, seconds in zip(again, [1.0, 4.0], strict=True):
        for _ in range(5):
            timer.record(seconds)
    clock.advance(10.0)
    assert all(timer.maybe_publish() for timer in again)
    report = collect_report(tmp_path, state=tmp_path / "elsewhere.json")
    assert (report["attempt"], report["window_index"]) == (1, 0)
    assert [s["node"] for s in report["scores"]] == ["nC", "nA"]
    assert [s["rank"] for s in report["stragglers"]] == [1]
    assert (tmp_path / "elsewhere.json").exists()


def test_collect_report_after_an_in_job_restart_and_in_a_new_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = Ranks(tmp_path, ["nA", "nB"])
    for _ in range(2):
        ranks.window([1.0, 2.0])
        report = collect_report(tmp_path, persistent_windows=2)
    assert report["persistent_nodes"] == ["nB"]
    # an in-job restart: new processes count their windows from 0 again; still scored
    again = Ranks(tmp_path, ["nA", "nB"])
    again.window([1.0, 1.0])
    report = collect_report(tmp_path, persistent_windows=2)
    assert report["window_index"] == 0 and report["stragglers"] == []
    assert report["persistent_nodes"] == []  # nB was scored clean: its count restarted
    again.window([1.0, 2.0])
    assert collect_report(tmp_path, persistent_windows=1)["persistent_nodes"] == ["nB"]
    # a new attempt: the counts of the previous one do not carry over
    monkeypatch.setenv("FTSLURM_ATTEMPT", "1")
    later = Ranks(tmp_path, ["nB", "nC"])
    later.window([1.0, 1.0])
    report = collect_report(tmp_path, persistent_windows=1)
    assert (report["attempt"], report["persistent_nodes"]) == (1, [])


def test_rank_agent_times_compute_sections_for_straggler_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps are timed until a "compute" section shows up; from then on only compute
    sections (a rank waiting in a collective for a slow peer must not look slow)."""
    from ftslurm.agent.rank import RankAgent

    agent = RankAgent(
        {
            "RANK": "3",
            "FTSLURM_RUN_DIR": str(tmp_path),
            "FTSLURM_STRAGGLER_INTERVAL_S": "1000",
            "SLURMD_NODENAME": "nX",
        }
    )
    assert agent._timer is not None and agent._timer.node == "nX"
    with agent.section("step"):
        pass
    assert len(agent._timer._samples) == 1
    with agent.section("step"):
        with agent.section("compute"):
            pass
    assert len(agent._timer._samples) == 1  # the step samples were dropped, compute kept
    with agent.section("checkpointing"):
        pass
    assert len(agent._timer._samples) == 1
    agent._timer.report_interval_s = 1e-9
    with agent.section("compute"):
        pass
    published = json.loads((tmp_path / "stragglers" / "rank-3.json").read_text())
    assert (published["rank"], published["node"], published["samples"]) == (3, "nX", 2)


def test_rank_agent_nested_sections_resume_the_outer_one(tmp_path: Path) -> None:
    from ftslurm.agent.heartbeat import read_beat
    from ftslurm.agent.rank import RankAgent

    agent = RankAgent({"FTSLURM_HEARTBEAT_DIR": str(tmp_path), "LOCAL_RANK": "0"})
    try:
        with agent.section("step"):
            outer = read_beat(tmp_path, 0)
            with agent.section("compute"):
                assert read_beat(tmp_path, 0).section == "compute"
            beat = read_beat(tmp_path, 0)
            assert beat.section == "step"
            assert beat.section_start == outer.section_start  # its own start kept
        assert read_beat(tmp_path, 0).section is None
    finally:
        agent.close()


# --------------------------------------------------------------------------- end to end
CHILD = """
import os, sys, time
from pathlib import Path
from ftslurm.agent.straggler import StepTimer
run_dir, step_s, interval, windows = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), \\
    int(sys.argv[4])
(run_dir / f"ready-{os.environ['RANK']}").touch()
deadline = time.monotonic() + 60
while not (run_dir / "go").exists() and not (run_dir / "stop").exists():
    if time.monotonic() > deadline:
        sys.exit(2)
    time.sleep(0.005)
timer = StepTimer(interval)  # rank, node and run directory from the environment
published = 0
while published < windows and not (run_dir / "stop").exists():
    with timer.step():
        time.sleep(step_s)
    published += timer.maybe_publish()
"""


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_end_to_end_names_the_slow_node(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    layout = [("nA", 0.01), ("nA", 0.01), ("nB", 0.03), ("nB", 0.01)]  # rank 2 is slow
    windows, persistent = 10, 3
    for rank, (node, step_s) in enumerate(layout):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM", "FTSLURM_")) and k != "RANK"
        }
        env.update(
            RANK=str(rank),
            SLURMD_NODENAME=node,
            FTSLURM_RUN_DIR=str(tmp_path),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(tmp_path), str(step_s), "0.4", str(windows)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    wait_for(
        lambda: all((tmp_path / f"ready-{r}").exists() for r in range(4)),
        timeout=30,
        what="the ranks to start",
    )
    (tmp_path / "go").touch()

    reports: dict[int, dict[str, Any]] = {}

    def persistent_nb() -> bool:
        report = collect_report(tmp_path, reference="median", persistent_windows=persistent)
        if report["window_index"] is not None:
            reports[report["window_index"]] = report
        return "nB" in report["persistent_nodes"]

    try:
        wait_for(persistent_nb, timeout=60, what="nB to be a persistent straggler")
    finally:
        (tmp_path / "stop").touch()
    for proc in children:
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""

    assert len(reports) >= persistent
    for report in reports.values():
        assert [(s["rank"], s["node"]) for s in report["stragglers"]] == [(2, "nB")]
        assert report["stragglers"][0]["relative"] < 0.5
        assert report["persistent_nodes"] in ([], ["nB"])
        assert [s["rank"] for s in report["scores"]] == [0, 1, 2, 3]
