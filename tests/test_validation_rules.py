"""Result validation's decisions (`ftslurm.agent.validation_rules`, pure): the checks, the
classification table after a re-run in place, the group's agreement and the injected
result faults."""

from __future__ import annotations

import math

import pytest

from ftslurm.agent import validation_rules as rules
from ftslurm.agent.validation_rules import (
    Action,
    Finding,
    Mode,
    Recent,
    Settings,
    Suspect,
    Verdict,
)
from ftslurm.core.inject import parse_injection

NAN, INF = math.nan, math.inf
WARM = Recent(tuple([1.0] * 10))  # ten accepted results of 1.0: the median is 1


@pytest.mark.parametrize(
    ("value", "recent", "finding"),
    [
        (NAN, WARM, Finding.NAN),
        (INF, WARM, Finding.INF),
        (-INF, Recent(), Finding.INF),
        (NAN, Recent(), Finding.NAN),  # no warm-up for NaN/Inf
        (10.5, WARM, Finding.SPIKE),  # above 10 x the median
        (10.0, WARM, Finding.OK),  # not above
        (1000.0, Recent(tuple([1.0] * 9)), Finding.OK),  # still warming up
        (1000.0, Recent(tuple([-1.0] * 10)), Finding.OK),  # a negative median: no spikes
        (0.5, WARM, Finding.OK),
    ],
)
def test_check(value, recent, finding):
    assert rules.check(value, recent, Settings()) is finding


def test_no_spike_check_with_factor_zero():
    assert rules.check(1e9, WARM, Settings(spike_factor=0)) is Finding.OK


def test_the_statistic_is_the_median_of_the_window_and_skips_non_finite_values():
    r = Recent()
    for v in [1.0, 2.0, 100.0, NAN, INF, 3.0]:
        r = r.add(v, window=3)
    assert r.values == (2.0, 100.0, 3.0) and r.reference == 3.0


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [(NAN, NAN, True), (1.0, 1.0, True), (1.0, 1.0 + 2**-52, False), (NAN, 1.0, False),
     (0.0, -0.0, False), (INF, INF, True)],
)  # fmt: skip
def test_same_is_bit_for_bit(a, b, same):
    assert rules.same(a, b) is same


# The classification table (module doc): (first finding, first value, re-run value,
# re-runs so far, mode, disambiguating) -> verdict.
S, RS = Mode.ENFORCE, Mode.REPORT_STATS
TABLE = [
    # a suspicious result whose re-run differs and is sane: transient
    (Finding.NAN, NAN, 0.4, 0, S, False, Verdict.TRANSIENT),
    (Finding.SPIKE, 500.0, 0.4, 0, S, False, Verdict.TRANSIENT),
    (Finding.NAN, NAN, 0.4, 0, S, True, Verdict.TRANSIENT),  # in a disambiguation run too
    # it reproduces bit for bit: persistent (exit 16)
    (Finding.NAN, NAN, NAN, 0, S, False, Verdict.PERSISTENT),
    (Finding.INF, INF, INF, 0, S, False, Verdict.PERSISTENT),
    (Finding.SPIKE, 500.0, 500.0, 0, S, False, Verdict.PERSISTENT),
    # and again in the disambiguation run at that step: the model's (17), or a correct spike
    (Finding.NAN, NAN, NAN, 0, S, True, Verdict.MODEL),
    (Finding.INF, INF, INF, 0, S, True, Verdict.MODEL),
    (Finding.SPIKE, 500.0, 500.0, 0, S, True, Verdict.CORRECT),
    # wrong again but differently: once more, then the node is not to be trusted
    (Finding.SPIKE, 500.0, NAN, 0, S, False, Verdict.RERUN),
    (Finding.SPIKE, 500.0, 600.0, 1, S, False, Verdict.RERUN),
    (Finding.SPIKE, 500.0, 600.0, 2, S, False, Verdict.PERSISTENT),
    # a sane first result (re-run because a peer's was not): fine, unless its re-run broke
    (Finding.SAMPLED, 0.4, 0.4, 0, S, False, Verdict.OK),
    (Finding.SAMPLED, 0.4, 0.41, 0, S, False, Verdict.OK),  # non-deterministic: counted
    (Finding.SAMPLED, 0.4, NAN, 0, S, False, Verdict.RERUN),
    (Finding.SAMPLED, 0.4, NAN, 2, S, False, Verdict.PERSISTENT),
    # report_stats: counted, never acted on
    (Finding.NAN, NAN, NAN, 0, RS, False, Verdict.COUNTED),
    (Finding.NAN, NAN, 0.4, 0, RS, False, Verdict.COUNTED),
    (Finding.NAN, NAN, NAN, 0, RS, True, Verdict.COUNTED),
    (Finding.SPIKE, 500.0, NAN, 2, RS, False, Verdict.COUNTED),
    (Finding.SAMPLED, 0.4, 0.4, 0, RS, False, Verdict.OK),
]


@pytest.mark.parametrize(("finding", "first", "rerun", "reruns", "mode", "dis", "verdict"), TABLE)
def test_classification_table(finding, first, rerun, reruns, mode, dis, verdict):
    settings = Settings(mode=mode)
    got = rules.classify(
        Suspect(7, first, finding, reruns), rerun, rules.check(rerun, WARM, settings), settings, dis
    )
    assert got is verdict


@pytest.mark.parametrize(
    ("verdict", "action"),
    [
        (Verdict.OK, Action.GO_ON),
        (Verdict.TRANSIENT, Action.GO_ON),
        (Verdict.CORRECT, Action.GO_ON),
        (Verdict.COUNTED, Action.GO_ON),
        (Verdict.RERUN, Action.RERUN),
        (Verdict.PERSISTENT, Action.EXIT_16),
        (Verdict.MODEL, Action.EXIT_17),
    ],
)
def test_each_verdict_has_its_action(verdict, action):
    assert rules.ACTION[verdict] is action


def test_the_group_does_the_most_severe_wish():
    assert rules.agree([]) is Action.GO_ON
    assert rules.agree([Action.GO_ON, Action.RERUN, Action.GO_ON]) is Action.RERUN
    assert rules.agree([Action.EXIT_16, Action.RERUN]) is Action.EXIT_16
    assert rules.agree([0, 3, 2]) is Action.EXIT_17


def test_first_action_reruns_a_suspicious_or_sampled_step():
    assert rules.first_action(Finding.OK, 10, Settings()) is Action.GO_ON
    assert rules.first_action(Finding.SPIKE, 10, Settings()) is Action.RERUN
    stats = Settings(mode=Mode.REPORT_STATS, stats_every=5)
    assert rules.first_action(Finding.OK, 10, stats) is Action.RERUN
    assert rules.first_action(Finding.OK, 11, stats) is Action.GO_ON
    assert rules.first_action(Finding.OK, 10, Settings(stats_every=5)) is Action.GO_ON


def test_the_disambiguated_step():
    assert not rules.disambiguated_step(15, False, ())
    assert rules.disambiguated_step(15, True, ())  # the step unknown: any
    assert rules.disambiguated_step(15, True, (15,))
    assert not rules.disambiguated_step(16, True, (15,))  # another step: judged as usual


@pytest.mark.parametrize(
    "kwargs",
    [{"spike_factor": 1.0}, {"window": 5, "warmup": 6}, {"warmup": 0}, {"max_reruns": 0},
     {"stats_every": -1}, {"mode": "sometimes"}],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Settings(**kwargs)


# ----------------------------------------------------------------------------- injection
def _fires(spec, *, rank=1, node="n2", since=5.0, fired=(), spoiled=None, rerun=False):
    return rules.fires(
        parse_injection(spec),
        rank=rank,
        node=node,
        since_start_s=since,
        fired=set(fired),
        spoiled=spoiled or {},
        rerun=rerun,
    )


def test_a_transient_injection_fires_once_on_its_rank_from_its_time():
    assert _fires("nan@3:1")
    assert not _fires("nan@3:1", since=2.9)
    assert not _fires("nan@3:1", rank=0)
    assert not _fires("nan@3:1", fired=["nan@3:1"])
    assert _fires("spike@0", rank=0)  # rank 0 by default
    assert not _fires("spike@0", rank=1)


def test_a_transient_injection_never_spoils_a_re_run_and_a_persistent_one_does():
    """Two transient faults due at once strike two steps, each re-run computing right (two
    transient verdicts), not a step and its re-run (which would read as reproduced)."""
    assert not _fires("nan@3:1", rerun=True)
    assert not _fires("spike@3:1", rerun=True)
    spec = "nan@3:1:persistent"
    assert _fires(spec, rerun=True, fired=[spec], spoiled={spec: "n2"})


def test_a_persistent_injection_stays_on_the_node_it_spoiled():
    spec = "nan@3:1:persistent"
    assert _fires(spec, fired=[spec])  # its rank, before any node is known: every time
    assert _fires(spec, spoiled={spec: "n2"}, fired=[spec])  # on that node, again
    assert _fires(spec, rank=0, spoiled={spec: "n2"})  # any rank on that node
    assert not _fires(spec, node="n3", spoiled={spec: "n2"})  # its rank elsewhere: right
    assert not _fires(spec, since=1.0, spoiled={spec: "n2"})


def test_an_injected_spike_waits_for_the_spike_checks_warm_up():
    assert not rules.fires(
        parse_injection("spike@0:1"), rank=1, node="n", since_start_s=1, fired=(), spoiled={},
        warm=False,
    )  # fmt: skip
    assert rules.fires(
        parse_injection("nan@0:1"), rank=1, node="n", since_start_s=1, fired=(), spoiled={},
        warm=False,
    )  # fmt: skip


def test_a_crash_is_not_a_result_fault():
    assert not _fires("crash@0:1")


def test_corrupt():
    assert math.isnan(rules.corrupt(0.5, parse_injection("nan@0")))
    assert rules.corrupt(0.5, parse_injection("spike@0")) == 500.0
    assert rules.corrupt(0.0, parse_injection("spike@0")) == rules.SPIKE_INJECTED
