"""The straggler threshold a run gets by default: sensitive where a straggler steps out to a
warm spare (live recovery with hot spares), today's elsewhere; a set threshold always wins.
The rule is pure (`ftslurm.core.settings.straggler_threshold`); the daemon hands its result
to every job it submits, and the launchers score with what the job was given."""

from __future__ import annotations

from typing import Any

import pytest

from ftslurm.core.contract import DEFAULT_STRAGGLER_THRESHOLD, JobEnv
from ftslurm.core.settings import (
    LIVE_STRAGGLER_THRESHOLD,
    FtSettings,
    straggler_move_threshold,
    straggler_threshold,
)
from ftslurm.daemon.policy import Budget, straggler_move, straggler_scores
from ftslurm.daemon.submission import build_attempt

from .conftest import job_spec, script_exports


@pytest.mark.parametrize(
    ("threshold", "live_recovery", "spare_nodes", "expected"),
    [
        pytest.param(None, False, 0, DEFAULT_STRAGGLER_THRESHOLD, id="plain"),
        pytest.param(None, False, 2, DEFAULT_STRAGGLER_THRESHOLD, id="spares-cold"),
        pytest.param(None, True, 0, DEFAULT_STRAGGLER_THRESHOLD, id="live-without-spares"),
        pytest.param(None, True, 1, LIVE_STRAGGLER_THRESHOLD, id="live-with-a-spare"),
        pytest.param(None, True, 5, LIVE_STRAGGLER_THRESHOLD, id="live-with-spares"),
        pytest.param(0.75, True, 5, 0.75, id="set-wins-over-live"),
        pytest.param(0.95, False, 0, 0.95, id="set-wins-plain"),
        pytest.param(0.5, True, 1, 0.5, id="set-lower"),
    ],
)
def test_the_threshold_follows_what_acting_costs(
    threshold: float | None, live_recovery: bool, spare_nodes: int, expected: float
) -> None:
    assert (
        straggler_threshold(threshold, live_recovery=live_recovery, spare_nodes=spare_nodes)
        == expected
    )


def test_the_live_threshold_is_the_more_sensitive_one() -> None:
    """A score is min(1, reference / median): 0.9 catches a node about 11% slower, 0.75
    one about 33% slower."""
    assert DEFAULT_STRAGGLER_THRESHOLD < LIVE_STRAGGLER_THRESHOLD < 1


def _job_env(script: str) -> JobEnv:
    return JobEnv.from_environ(script_exports(script))


_SPEC = job_spec(nodes=3, spare_nodes=1)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        pytest.param({"spare_nodes": 1}, DEFAULT_STRAGGLER_THRESHOLD, id="spares"),
        pytest.param(
            {"spare_nodes": 1, "live_recovery": True}, LIVE_STRAGGLER_THRESHOLD, id="live"
        ),
        pytest.param(
            {"spare_nodes": 1, "live_recovery": True, "straggler_threshold": 0.75},
            0.75,
            id="live-set-back",
        ),
        pytest.param(
            {"spare_nodes": 2, "live_recovery": True, "straggler_threshold": 0.8},
            0.8,
            id="live-set",
        ),
        pytest.param(
            {"spare_nodes": 2, "live_recovery": True, "use_launcher": False},
            DEFAULT_STRAGGLER_THRESHOLD,
            id="no-launcher",
        ),
    ],
)
def test_the_job_gets_the_rules_threshold(settings: dict[str, Any], expected: float) -> None:
    """What the launchers score with is what the daemon rendered into the job."""
    stored = FtSettings(**settings).model_dump(mode="json")
    script, _ = build_attempt("r1", _SPEC, stored, 0, ())
    assert _job_env(script).straggler_threshold == expected


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        pytest.param({}, DEFAULT_STRAGGLER_THRESHOLD, id="nothing-stored"),
        pytest.param(
            {"spare_nodes": 1, "live_recovery": True, "straggler_threshold": 0.75},
            0.75,
            id="a-run-stored-before-the-rule",
        ),
        pytest.param(
            {"spare_nodes": 1, "live_recovery": True}, LIVE_STRAGGLER_THRESHOLD, id="no-key"
        ),
    ],
)
def test_a_stored_runs_settings_keep_what_they_say(stored: dict[str, Any], expected: float) -> None:
    """A run stored before the rule holds the old default 0.75 explicitly and keeps it; a
    settings mapping without the key gets the rule's value."""
    script, _ = build_attempt("r1", _SPEC, stored, 0, ())
    assert _job_env(script).straggler_threshold == expected


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        pytest.param(None, DEFAULT_STRAGGLER_THRESHOLD, id="unset"),
        pytest.param(0.9, 0.9, id="set-higher"),
        pytest.param(0.6, 0.6, id="set-lower"),
    ],
)
def test_the_move_bar_is_todays_default_unless_set(
    threshold: float | None, expected: float
) -> None:
    assert straggler_move_threshold(threshold) == expected


_LIVE = {"stop_if_straggler": True, "live_recovery": True, "spare_nodes": 1}


@pytest.mark.parametrize(
    ("settings", "scores", "moves"),
    [
        pytest.param(_LIVE, {"n2": 0.83}, False, id="mild-flagged-not-moved"),
        pytest.param(_LIVE, {"n2": 0.6}, True, id="severe-moved"),
        pytest.param(_LIVE, {"n2": 0.75}, False, id="at-the-bar-not-moved"),
        pytest.param(_LIVE, {}, True, id="no-score-moved-as-before"),
        pytest.param(_LIVE, None, True, id="no-scores-given-as-before"),
        pytest.param({**_LIVE, "straggler_threshold": 0.9}, {"n2": 0.83}, True, id="set-0.9"),
        pytest.param({"stop_if_straggler": True}, {"n2": 0.7}, True, id="plain-below"),
        pytest.param({"stop_if_straggler": False}, {"n2": 0.1}, False, id="no-stop"),
    ],
)
def test_a_move_needs_a_score_below_the_move_bar(
    settings: dict[str, Any], scores: dict[str, float] | None, moves: bool
) -> None:
    """Live recovery's threshold flags milder slowdowns, worth a step-out to a warm spare;
    without a spare left, moving the whole job (every rank restarted from the last
    checkpoint, in a new allocation) needs today's bar."""
    d = straggler_move(["n2"], ["n1", "n2"], ["n2"], Budget(), FtSettings(**settings), scores)
    assert (d is not None) is moves


def test_straggler_scores_are_each_nodes_worst() -> None:
    report = {
        "attempt": 0,
        "threshold": 0.9,
        "persistent_nodes": ["b"],
        "scores": [
            {"rank": 0, "node": "a", "relative": 1.0, "individual": 1.0},
            {"rank": 1, "node": "b", "relative": 0.95, "individual": 0.85},
            {"rank": 2, "node": "b", "relative": 0.88, "individual": 1.0},
            {"rank": 3, "node": None, "relative": 0.1, "individual": 0.1},
        ],
    }
    assert straggler_scores(report) == {"a": 1.0, "b": 0.85}
    assert straggler_scores(None) == {}
