"""The launcher's decisions (`ftslurm.agent.launch_core`), pure: tables of what was
observed and what the launcher does, for every decision that otherwise only a launcher
running real ranks reaches."""

from __future__ import annotations

import ast
import signal
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftslurm.agent import launch_core as core
from ftslurm.agent import live_rules
from ftslurm.agent import spare_rules as sp
from ftslurm.agent.heartbeat import Beat, Timeouts, hang_reason
from ftslurm.agent.live_rules import Fallback
from ftslurm.core.contract import NAMED_EXITS, WITHHELD_RANKS, ExitCode
from ftslurm.core.contract.reports import Benched, HangClaim, PeerLost
from ftslurm.core.leases import Lease
from ftslurm.core.settings import (
    DEFAULT_INITIAL_S,
    DEFAULT_RUNNING_S,
    DEFAULT_SECTION_S,
    RECOVERY_SECTION,
)

TERM, INT, USR1, USR2 = signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2
PLAIN = core.Config(node_rank=1, nnodes=2, max_restarts=3, grace=30.0)
# Three nodes, one of them a spare: node ranks 0 and 1 train, 2 waits.
SPARES = core.Config(node_rank=1, nnodes=3, spares=1, max_restarts=3, grace=30.0)
TWO_SPARES = core.Config(node_rank=1, nnodes=4, spares=2, max_restarts=3, grace=30.0)
FAILED = (core.KillRanks(), core.EndRound(succeeded=False))


def lost(r: int) -> PeerLost:
    return PeerLost(lost_node_rank=r, lost_node=f"n{r}", job_id="7")


def benched(r: int, why: str = sp.HANG) -> Benched:
    return Benched(node_rank=r, node=f"n{r}", why=why, reason="local rank 0 hung: x")


def losses(gone: dict, roles: dict | None = None) -> core.Losses:
    """Reports, and the roles their leases said (active unless told)."""
    return core.Losses(gone=gone, roles={r: sp.ACTIVE for r in gone} | (roles or {}))


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


# ----------------------------------------------------------------------------- signals
@pytest.mark.parametrize(
    "before,sig,live,joining,after,route",
    [
        pytest.param(
            core.Signals(),
            USR1,
            False,
            False,
            core.Signals(),
            (False, True, False, False),
            id="usr1-before-ranks: kept for them, nothing else",
        ),
        pytest.param(
            core.Signals(),
            USR2,
            True,
            False,
            core.Signals(signalled=True, asked=1, checkpoint_asked=True),
            (True, False, False, False),
            id="checkpoint-signal-while-live: delivered, every later round gets it",
        ),
        pytest.param(
            core.Signals(),
            TERM,
            True,
            False,
            core.Signals(stop=TERM, signalled=True, asked=1, stop_at=130.0),
            (True, False, False, True),
            id="term-while-live: delivered, grace deadline set, leaving",
        ),
        pytest.param(
            core.Signals(),
            TERM,
            False,
            True,
            core.Signals(stop=TERM, signalled=True, asked=1, stop_at=130.0),
            (False, True, True, True),
            id="term-in-the-rendezvous-join: ends the join",
        ),
        pytest.param(
            core.Signals(),
            INT,
            False,
            False,
            core.Signals(stop=INT, signalled=True, asked=1),
            (False, True, False, True),
            id="int-between-rounds: kept, no grace deadline",
        ),
        pytest.param(
            core.Signals(stop=INT, signalled=True, asked=1),
            TERM,
            False,
            False,
            core.Signals(stop=INT, signalled=True, asked=2, stop_at=130.0),
            (False, True, False, True),
            id="second-stop: the first stays, TERM still sets the deadline",
        ),
        pytest.param(
            core.Signals(stop=TERM, signalled=True, asked=1, stop_at=50.0),
            TERM,
            True,
            False,
            core.Signals(stop=TERM, signalled=True, asked=2, stop_at=50.0),
            (True, False, False, True),
            id="term-again: the deadline does not move",
        ),
    ],
)
def test_what_a_signal_changes_and_where_it_goes(before, sig, live, joining, after, route):
    signals, got = core.on_signal(before, sig, PLAIN, 100.0, live=live, joining=joining)
    assert signals == after
    assert (got.deliver, got.keep, got.abort_join, got.leaving) == route


@pytest.mark.parametrize(
    "came,signals,expected",
    [
        pytest.param([USR1], core.Signals(), (USR1,), id="what-came-before"),
        pytest.param([], core.Signals(checkpoint_asked=True), (USR2,), id="checkpoint-again"),
        pytest.param([USR2], core.Signals(checkpoint_asked=True), (USR2,), id="once"),
    ],
)
def test_the_signals_a_new_round_gets(came, signals, expected):
    assert core.for_new_round(came, signals, PLAIN) == expected


# ------------------------------------------------------------------------------- ticks
def tick(state, **kw) -> tuple[core.LauncherState, tuple]:
    return core.on_tick(state, core.Tick(now=kw.pop("now", 100.0), restarts_left=2, **kw))


@pytest.mark.parametrize(
    "cfg,known,gone,roles,straggler,budget,kept",
    [
        pytest.param(
            SPARES,
            set(),
            {1: lost(1)},
            {},
            None,
            core.Budget.KEEP,
            {"swaps": 1},
            id="active-node-lost: swap, no restart used",
        ),
        pytest.param(
            SPARES,
            set(),
            {2: lost(2)},
            {2: sp.SPARE},
            None,
            None,
            {"swaps": 0},
            id="spare-lost: nothing now",
        ),
        pytest.param(
            SPARES,
            set(),
            {0: lost(0)},
            {},
            None,
            core.Budget.SPENT,
            {"new_job": True},
            id="batch-host-lost: new job",
        ),
        pytest.param(
            SPARES, {0}, {0: lost(0)}, {}, None, None, {"swaps": 0}, id="known-loss: nothing again"
        ),
        pytest.param(
            SPARES,
            set(),
            {1: lost(1), 3: benched(3)},
            {},
            None,
            core.Budget.SPENT,
            {"new_job": True},
            id="two-losses-one-spare: new job",
        ),
        pytest.param(
            TWO_SPARES,
            set(),
            {1: lost(1), 3: benched(3)},
            {},
            None,
            core.Budget.KEEP,
            {"swaps": 1},
            id="two-losses-two-spares: one swap",
        ),
        pytest.param(
            SPARES,
            {2},
            {2: lost(2), 3: lost(3)},
            {},
            None,
            core.Budget.SPENT,
            {"new_job": True},
            id="second-loss-after-the-spare-went: new job",
        ),
        pytest.param(
            SPARES,
            set(),
            {},
            {},
            "persistent straggler: score 0.40 below 0.7",
            core.Budget.SPENT,
            {"benched": sp.STRAGGLER},
            id="straggler-with-a-spare-left: steps out",
        ),
        pytest.param(
            SPARES,
            {2},
            {2: lost(2)},
            {},
            "persistent straggler",
            None,
            {"benched": None},
            id="straggler-no-spare-left: trains on",
        ),
        pytest.param(
            replace(SPARES, node_rank=0),
            set(),
            {},
            {},
            "persistent straggler",
            None,
            {"benched": None},
            id="straggler-batch-host: never steps out",
        ),
    ],
)
def test_news_of_lost_and_slow_nodes_at_a_tick(cfg, known, gone, roles, straggler, budget, kept):
    state = core.LauncherState(cfg=cfg, lost=frozenset(known))
    state, actions = tick(state, losses=losses(gone, roles), straggler=straggler)
    accounts = [a.budget for a in actions if isinstance(a, core.Account)]
    assert accounts == ([budget] if budget else [])
    assert (actions[-2:] == FAILED) is (budget is not None)
    for key, value in kept.items():
        assert getattr(state, key) == value, key
    if state.benched:
        assert core.StepOut(sp.STRAGGLER, straggler) in actions


def test_a_swap_says_which_node_and_how_many_spares_are_left():
    state, actions = tick(core.LauncherState(cfg=TWO_SPARES), losses=losses({1: lost(1)}))
    text = "node n1 lost or stepped out: restarting the ranks with a spare (1 left)"
    assert actions[0] == core.Log("warning", text)
    assert state.swap_why == "node n1 lost: a spare takes its place"
    state, why = core.round_why(state, None)
    assert why == "node n1 lost: a spare takes its place" and state.swap_why is None
    assert core.round_why(state, None)[1] == "in-job restart"


@pytest.mark.parametrize(
    "closed,stop_at,now,expected",
    [
        pytest.param(
            True,
            None,
            100.0,
            [
                core.Log("warning", "another node's launcher ended the run: stopping the ranks"),
                core.Account(core.Budget.SPENT),
                *FAILED,
            ],
            id="rendezvous-closed-by-another-node: stop, no restart",
        ),
        pytest.param(
            False,
            90.0,
            100.0,
            [
                core.Log("warning", "ranks did not exit within the 30s grace period: killing them"),
                *FAILED,
            ],
            id="grace-deadline-passed: kill",
        ),
        pytest.param(False, 100.0, 100.0, [], id="grace-deadline-not-passed"),
        pytest.param(False, None, 100.0, [], id="nothing"),
    ],
)
def test_the_run_ended_elsewhere_or_the_grace_period_ran_out(closed, stop_at, now, expected):
    state = core.LauncherState(cfg=PLAIN)
    _, actions = tick(state, now=now, closed=closed, signals=core.Signals(stop_at=stop_at))
    assert list(actions) == expected


def test_a_signal_asks_once_for_a_look_at_ranks_that_look_hung():
    state = core.LauncherState(cfg=PLAIN)
    signals = core.Signals(signalled=True, asked=1)
    state, actions = tick(state, signals=signals)
    assert actions == (core.LookAtStop(),)
    assert tick(state, signals=signals)[1] == ()
    assert tick(state, signals=replace(signals, asked=2))[1] == (core.LookAtStop(),)


@pytest.mark.parametrize(
    "cfg,now,reads",
    [
        pytest.param(PLAIN, 0.0, core.Reads(closed=True), id="no-spares: the rendezvous only"),
        pytest.param(
            SPARES,
            0.0,
            core.Reads(losses=True, straggler=True, closed=True),
            id="spares: losses and the straggler report",
        ),
        pytest.param(
            replace(PLAIN, collect_every=5.0),
            0.0,
            core.Reads(closed=True, collect=True),
            id="node-0: the collector",
        ),
    ],
)
def test_what_a_tick_reads_and_when_again(cfg, now, reads):
    state, got = core.due(core.LauncherState(cfg=cfg), now)
    assert got == reads
    assert core.due(state, now + 0.5)[1] == core.Reads()  # nothing due again so soon
    assert core.due(state, now + core.PEER_CHECK_S)[1].closed


# ------------------------------------------------------------------------------- hangs
TIMEOUTS = Timeouts(
    sections={"step": 10.0, "checkpointing": None}, out_of_section=5.0, initial=60.0
)
HUNG_BEATS = {
    "in-a-section": (Beat(None, "step", 100.0, 5, 90.0, 1), 111.0),
    "out-of-section": (Beat(100.0, None, None, 5, 90.0, 1), 106.0),
    "initial": (Beat(None, None, None, None, 40.0, 1), 101.0),
}


@pytest.mark.parametrize("where", list(HUNG_BEATS))
def test_a_hang_anywhere_without_spares_restarts_the_ranks_in_place(where):
    beat, now = HUNG_BEATS[where]
    why = hang_reason(beat, TIMEOUTS, now)
    assert why
    hang = core.Hang(0, why, beat.step, 1e9)
    state, actions = core.on_hang(core.LauncherState(cfg=PLAIN), hang, None, 2, now, now + 5)
    text = f"local rank 0 hung: {why}; restarting the ranks"
    assert list(actions) == [core.Log("warning", text), *FAILED]
    assert state.hangs == (hang,) and state.hung_round


HANG = core.Hang(0, "no sign of life for 6.0s outside any section (timeout 5s)", 5, 1e9)


@pytest.mark.parametrize(
    "cfg,known,gone,now,expected,recorded",
    [
        pytest.param(
            SPARES,
            set(),
            {},
            100.0,
            ["Log", "StepOut", "Account", "KillRanks", "EndRound"],
            True,
            id="may-step-out: this node leaves",
        ),
        pytest.param(
            SPARES,
            set(),
            {0: benched(0)},
            100.0,
            ["Log", "Account", "KillRanks", "EndRound"],
            True,
            id="batch-host-stepped-out: new job",
        ),
        pytest.param(
            TWO_SPARES,
            set(),
            {3: benched(3)},
            100.0,
            ["Log", "Account", "KillRanks", "EndRound"],
            False,
            id="peer-stepped-out-spare-left: swap, the hang was the peer's",
        ),
        pytest.param(
            SPARES,
            {2},
            {2: lost(2), 3: benched(3)},
            100.0,
            ["Log", "Account", "KillRanks", "EndRound"],
            True,
            id="peer-stepped-out-no-spare-left: new job",
        ),
        pytest.param(
            replace(SPARES, node_rank=0),
            set(),
            {},
            100.0,
            ["Wait"],
            False,
            id="batch-host-may-not-step-out: waits for a peer",
        ),
        pytest.param(
            replace(SPARES, node_rank=0),
            set(),
            {},
            106.0,
            ["Log", "KillRanks", "EndRound"],
            True,
            id="batch-host-nobody-stepped-out: restarts in place",
        ),
        pytest.param(
            SPARES,
            {2},
            {2: lost(2)},
            106.0,
            ["Log", "KillRanks", "EndRound"],
            True,
            id="no-spare-left: restarts in place after the wait",
        ),
    ],
)
def test_a_hang_with_spares(cfg, known, gone, now, expected, recorded):
    state = core.LauncherState(cfg=cfg, lost=frozenset(known))
    state, actions = core.on_hang(state, HANG, losses(gone), 2, now, 105.0)
    assert kinds(actions) == expected
    assert (state.hangs == (HANG,)) is recorded
    budget = [a.budget for a in actions if isinstance(a, core.Account)]
    if "StepOut" in expected:
        assert state.benched == sp.HANG
        assert budget == [core.Budget.SPENT]
    elif budget:
        assert budget == [core.Budget.SPENT if state.new_job else core.Budget.KEEP]


# A hung rank blocks its peers in their next collective, so several launchers judge a hang at
# once. Three training nodes (0: the batch host, 1, 2) and spares; each node's claim: the
# evidence of its hung rank (F frozen: stopped, stuck in the kernel, it waits on no peer;
# R running) and the step it was at (5 unless told).
F, R = "frozen", "running"


def claim(node_rank: int, evidence: str | None = R, step: int | None = 5, at: float = 1000.0):
    return HangClaim(node_rank=node_rank, evidence=evidence, step=step, time=at)


def claims_of(shown: dict) -> dict[int, HangClaim]:
    """node rank -> evidence, or (evidence, step)."""
    return {r: claim(r, *(v if isinstance(v, tuple) else (v,))) for r, v in shown.items()}


@pytest.mark.parametrize(
    "shown, gone, spares, culprit",
    [
        pytest.param({1: F, 2: R, 0: R}, (), 1, 1, id="the-frozen-rank's-node"),
        pytest.param({2: F, 1: R, 0: R}, (), 1, 2, id="the-frozen-rank's-node-whoever-judged"),
        pytest.param({1: R, 2: R, 0: R}, (), 1, None, id="two-non-batch-alike: nobody"),
        pytest.param({1: R, 2: R}, (), 2, None, id="alike-even-with-two-spares: nobody"),
        pytest.param({1: R, 0: R}, (), 1, 1, id="one-non-batch-and-the-batch-host: as today"),
        pytest.param({2: R}, (), 1, 2, id="alone-to-judge: as today"),
        pytest.param({0: F, 1: R, 2: R}, (), 1, None, id="the-batch-host's-rank: nobody"),
        pytest.param({1: F, 2: F}, (), 1, None, id="two-frozen: nobody"),
        pytest.param({1: F, 2: R}, (), 0, None, id="no-spare: nobody"),
        pytest.param({1: F, 2: R}, (3,), 1, None, id="the-spare-gone: nobody"),
        pytest.param({1: R, 2: R}, (2,), 2, 1, id="a-claimant-gone-already: left out"),
        pytest.param({1: None, 2: F}, (), 1, 2, id="unknown-evidence-is-the-weakest"),
        pytest.param(
            {1: (R, 7), 2: (R, 6), 0: (R, 7)}, (), 1, 2, id="alike-but-behind: the one behind"
        ),
        pytest.param({1: (R, 6), 2: (R, 6), 0: (R, 7)}, (), 1, None, id="two-behind-alike: nobody"),
        pytest.param(
            {1: (R, 7), 2: (R, None), 0: (R, 7)}, (), 1, None, id="a-step-unknown: nobody"
        ),
        pytest.param({1: (F, 7), 2: (R, 6)}, (), 1, 1, id="frozen-before-behind: the frozen one"),
        pytest.param({}, (), 1, None, id="no-claim"),
    ],
)
def test_which_node_steps_out_for_a_hang_several_judged(shown, gone, spares, culprit):
    assert sp.hang_culprit(claims_of(shown), gone, spares) == culprit


def test_only_the_claims_of_the_same_hang_count():
    """A node's file holds its latest claim: one much older is an earlier hang's."""
    mine = claim(1, at=1000.0)
    found = {
        0: claim(0, F, at=1000.0 - sp.HANG_CLAIM_WINDOW_S - 1),  # an earlier hang
        2: claim(2, F, at=1001.5),  # the same hang, claimed later
        3: HangClaim(node_rank=3, evidence=F),  # no time: not placed
        1: claim(1, F, at=900.0),  # this node's earlier claim, read before its new one landed
    }
    assert sp.same_hang(found, mine) == {2: found[2], 1: mine}


# Node rank 1 of 0, 1, 2 training and a spare (node rank 3), its rank judged hung at 100;
# the claims are due at 102, the wait for a peer's bench record ends at 107.
THREE = core.Config(node_rank=1, nnodes=4, spares=1, max_restarts=3, grace=30.0)


@pytest.mark.parametrize(
    "shown, gone, now, expected",
    [
        pytest.param({1: R}, {}, 101.0, ["Wait"], id="claims-not-due: waits"),
        pytest.param(
            {1: F, 2: R, 0: R},
            {},
            102.0,
            ["Log", "StepOut", "Account", "KillRanks", "EndRound"],
            id="its-rank-frozen: steps out",
        ),
        pytest.param(
            {1: R, 2: F, 0: R}, {}, 102.0, ["Wait"], id="another's-rank-frozen: waits for it"
        ),
        pytest.param(
            {1: R, 2: F, 0: R},
            {2: benched(2)},
            103.0,
            ["Log", "Account", "KillRanks", "EndRound"],
            id="that-node-stepped-out: swap",
        ),
        pytest.param({1: R, 2: R, 0: R}, {}, 102.0, ["Wait"], id="alike: waits, does not step out"),
        pytest.param(
            {1: R, 2: R, 0: R},
            {},
            108.0,
            ["Log", "KillRanks", "EndRound"],
            id="alike-nobody-stepped-out: restarts in place",
        ),
        pytest.param(
            {1: R, 0: R},
            {},
            102.0,
            ["Log", "StepOut", "Account", "KillRanks", "EndRound"],
            id="only-it-may: steps out as today",
        ),
    ],
)
def test_a_hang_with_the_other_nodes_claims(shown, gone, now, expected):
    state = core.LauncherState(cfg=THREE)
    start = 100.0
    due, deadline = core.claims_until(start), core.hang_deadline(start)
    assert (due, deadline) == (102.0, 107.0)
    state, actions = core.on_hang(
        state, HANG, losses(gone), 2, now, deadline, claims=claims_of(shown), claims_due=due
    )
    assert kinds(actions) == expected


# The default sections with their own limit (`DEFAULT_SECTION_S`): a rank in one is judged by
# that limit, never by the running one. "recovery" (a live recovery: the group re-forms, a
# restarted peer starts) is also never tightened from what earlier attempts saw.
DEFAULTS = Timeouts(
    sections=dict(DEFAULT_SECTION_S), out_of_section=DEFAULT_RUNNING_S, initial=DEFAULT_INITIAL_S
)


@pytest.mark.parametrize("section", ["setup", "checkpointing", RECOVERY_SECTION])
def test_a_hang_in_each_default_section_is_judged_by_its_own_limit(section):
    assert section in DEFAULT_SECTION_S
    beat = Beat(100.0, section, 100.0, 5, 90.0, 1)
    limit = DEFAULT_SECTION_S[section]
    assert limit is not None and limit > DEFAULT_RUNNING_S
    assert hang_reason(beat, DEFAULTS, 100.0 + DEFAULT_RUNNING_S + 1) is None  # not the running
    now = 100.0 + limit + 1
    why = hang_reason(beat, DEFAULTS, now)
    assert why == f"section {section!r} open for {limit + 1:.1f}s (timeout {limit:g}s)"
    hang = core.Hang(0, why, beat.step, 1e9)
    state, actions = core.on_hang(core.LauncherState(cfg=PLAIN), hang, None, 2, now, now + 5)
    text = f"local rank 0 hung: {why}; restarting the ranks"
    assert list(actions) == [core.Log("warning", text), *FAILED]
    assert state.hangs == (hang,) and state.hung_round


def test_the_recovery_section_keeps_its_limit_after_a_short_recovery_was_seen():
    """Setup and recovery are what an attempt met, not a pace: never tightened (the others
    are, from what earlier attempts observed)."""
    from ftslurm.agent.launch import tightened

    seen = [{section: 2.0 for section in DEFAULT_SECTION_S}]
    got = tightened(DEFAULTS, seen, factor=3.0, floor_s=5.0).sections
    assert got["setup"] == got[RECOVERY_SECTION] == 1800.0
    assert got["checkpointing"] == 6.0


# A hang on a node whose ranks recover live (`live_ranks`), with warm spares.
LIVE_HOST = core.Config(node_rank=0, nnodes=4, spares=2, max_restarts=2, live=True)


@pytest.mark.parametrize(
    "cfg,gone,live_ranks,expected,recorded",
    [
        pytest.param(
            LIVE_HOST,
            {1: lost(1)},
            True,
            ["Log"],
            False,
            id="peer-lost-live: a warm spare takes it over, only the words",
        ),
        pytest.param(
            LIVE_HOST,
            {1: lost(1)},
            False,
            ["Log", "Account", "KillRanks", "EndRound"],
            False,
            id="peer-lost-not-live: swap, the hang was the peer's",
        ),
        pytest.param(
            replace(LIVE_HOST, node_rank=1),
            {},
            True,
            ["Log", "StepOut", "Account", "KillRanks", "EndRound"],
            True,
            id="nobody-lost-live: this node steps out",
        ),
    ],
)
def test_a_hang_with_live_ranks(cfg, gone, live_ranks, expected, recorded):
    state = core.LauncherState(cfg=cfg)
    state, actions = core.on_hang(state, HANG, losses(gone), 2, 100.0, 105.0, live_ranks=live_ranks)
    assert kinds(actions) == expected
    assert (state.hangs == (HANG,)) is recorded
    if expected == ["Log"]:
        assert "keep running" in actions[0].text
        assert state.lost == {1} and state.swaps == 0 and not state.hung_round
    if "StepOut" in expected:
        assert state.benched == sp.HANG


# ---------------------------------------------------------------------------- failures
VERDICT_16 = [
    core.Log("warning", "a rank exited 16 (resume_elsewhere): no in-job restart on these nodes"),
    core.Account(core.Budget.SPENT),
]


@pytest.mark.parametrize(
    "failures,stopped,signalled,cfg,expected,teardown",
    [
        pytest.param(
            {0: -6, 1: 1},
            {0: "checkpointed", 1: "checkpointed"},
            True,
            PLAIN,
            [core.EndRound(succeeded=True)],
            ((0, -6), (1, 1)),
            id="teardown-only-after-every-rank-saved: success",
        ),
        pytest.param(
            {0: -6},
            {1: "checkpointed"},
            True,
            PLAIN,
            [],
            (),
            id="a-rank-died-before-its-save: the failure stands",
        ),
        pytest.param(
            {0: int(ExitCode.RESUME_ELSEWHERE)},
            {0: "checkpointed", 1: "checkpointed"},
            True,
            PLAIN,
            VERDICT_16,
            (),
            id="a-named-exit-is-never-teardown",
        ),
        pytest.param(
            {0: int(ExitCode.RESUME_ELSEWHERE), 1: -15},
            {},
            False,
            PLAIN,
            VERDICT_16,
            (),
            id="a-ranks-verdict: no in-job restart on the same nodes",
        ),
        pytest.param(
            {0: int(ExitCode.FAILED_VALIDATION), 1: int(ExitCode.RESUME_ELSEWHERE)},
            {},
            False,
            SPARES,
            [
                core.Log(
                    "warning",
                    "a rank exited 16 (resume_elsewhere), 17 (failed_validation): no in-job "
                    "restart on these nodes",
                ),
                core.Account(core.Budget.SPENT),
            ],
            (),
            id="a-verdict-with-spares: no node loss to wait for",
        ),
        pytest.param(
            {0: 1},
            {},
            False,
            SPARES,
            [core.AwaitVerdict()],
            (),
            id="spares: was a node lost under the failure?",
        ),
        pytest.param({0: 1}, {}, True, SPARES, [], (), id="spares-signalled: the failure stands"),
        pytest.param(
            {0: -15},
            {},
            True,
            replace(SPARES, live=True),
            [core.LossesUnderStop()],
            (),
            id="spares-signalled-with-live-recovery: a loss it cannot serve is still said",
        ),
    ],
)
def test_the_ranks_failed(failures, stopped, signalled, cfg, expected, teardown):
    state = core.LauncherState(cfg=cfg, ranks=frozenset({0, 1}))
    state, actions = core.on_failed(state, failures, stopped, signalled)
    assert list(actions) == expected
    assert state.teardown == teardown


def lease(r: int, seq: int, ended: str | None = None) -> Lease:
    return Lease(node_rank=r, node=f"n{r}", pid=1, seq=seq, time=0.0, ended=ended, role=sp.ACTIVE)


@pytest.mark.parametrize(
    "gone,first,leases,now,expected",
    [
        pytest.param(
            {0: lost(0)},
            (),
            {0: lease(0, 3)},
            1.0,
            [core.Account(core.Budget.SPENT)],
            id="batch-host-lost: new job",
        ),
        pytest.param(
            {},
            ((0, 3),),
            {0: lease(0, 5)},
            1.0,
            [],
            id="the-peers-live: the failure is the ranks' own",
        ),
        pytest.param(
            {}, ((0, 3),), {0: lease(0, 4)}, 1.0, [core.Wait()], id="not-heard-twice-yet: wait"
        ),
        pytest.param(
            {}, ((0, 3),), {0: lease(0, 4)}, 11.0, [], id="deadline: the failure is the ranks' own"
        ),
        pytest.param(
            {},
            ((0, 3),),
            {0: lease(0, 3, ended="failed")},
            1.0,
            [],
            id="a-peer-ended: no news to wait for",
        ),
    ],
)
def test_after_a_failure_with_spares_was_a_node_lost(gone, first, leases, now, expected):
    state = core.LauncherState(cfg=replace(SPARES, node_rank=1))
    wait = core.Verdict(deadline=10.0, first=first)
    state, _, actions = core.on_verdict_poll(state, wait, losses(gone), leases, now)
    assert [a for a in actions if not isinstance(a, core.Log)] == expected


def test_a_loss_under_the_failure_swaps_with_no_restart_used():
    state = core.LauncherState(cfg=TWO_SPARES)
    state, _, actions = core.on_verdict_poll(
        state, core.Verdict(deadline=10.0), losses({3: lost(3)}), {}, 1.0
    )
    assert actions[-1] == core.Account(core.Budget.KEEP) and state.swaps == 1


# ------------------------------------------------------------------ a rank restarted alone
RUNNING = core.LauncherState(cfg=PLAIN, live=True)
ALONE = ["Log", "Account", "RestartAlone"]


@pytest.mark.parametrize(
    "state, code, live, stopped, left, stop, expected",
    [
        pytest.param(RUNNING, 3, True, False, 2, None, ALONE, id="live-crash"),
        pytest.param(RUNNING, -9, True, False, 1, None, ALONE, id="live-killed-last-restart"),
        pytest.param(RUNNING, 3, False, False, 2, None, [], id="not-live: torch stops all"),
        pytest.param(RUNNING, 0, True, False, 2, None, [], id="clean-exit"),
        pytest.param(RUNNING, 3, True, True, 2, None, [], id="died-in-teardown-after-its-stop"),
        pytest.param(RUNNING, 3, True, False, 2, TERM, [], id="a-stop-under-way"),
        pytest.param(RUNNING, 3, True, False, 0, None, ["Log"], id="no-restart-left"),
        pytest.param(
            RUNNING, ExitCode.REJOIN, True, False, 0, None, ["Log", "RestartAlone"], id="rejoin"
        ),
        pytest.param(RUNNING, ExitCode.REJOIN, False, False, 2, None, [], id="rejoin-not-live"),
        pytest.param(RUNNING, ExitCode.RESUME_ELSEWHERE, True, False, 2, None, ["Log"], id="16"),
        pytest.param(RUNNING, ExitCode.FAILED_VALIDATION, True, False, 2, None, ["Log"], id="17"),
        pytest.param(RUNNING, ExitCode.DO_NOT_RETRY, True, False, 2, None, ["Log"], id="93"),
        pytest.param(replace(RUNNING, live=False), 3, True, False, 2, None, [], id="between"),
        pytest.param(replace(RUNNING, new_job=True), 3, True, False, 2, None, [], id="new-job"),
        pytest.param(replace(RUNNING, benched="hang"), 3, True, False, 2, None, [], id="out"),
    ],
)
def test_a_failed_rank_that_recovers_live_is_restarted_alone(
    state, code, live, stopped, left, stop, expected
):
    signals = core.Signals(stop=stop)
    after, actions = core.on_rank_exit(
        state, 1, code, live=live, stopped=stopped, restarts_left=left, signals=signals
    )
    assert kinds(actions) == expected
    if expected == ALONE:
        assert actions[1:] == (core.Account(core.Budget.USE), core.RestartAlone(1))
        assert after.alone == state.alone + 1
    elif code in NAMED_EXITS and live:  # a rank's verdict: the round ends, nothing spent
        assert after == state and "the round ends" in actions[0].text
    elif expected:
        assert after.alone == state.alone + (expected[-1] == "RestartAlone")
    else:
        assert after == state


@pytest.mark.parametrize(
    "code, left, expected",
    [
        pytest.param(3, 2, ["Log", "Account", "AdoptStandby"], id="crash"),
        pytest.param(ExitCode.REJOIN, 0, ["Log", "AdoptStandby"], id="rejoin: no restart used"),
        pytest.param(3, 0, ["Log"], id="no-restart-left: no standby either"),
        pytest.param(0, 2, [], id="clean-exit"),
    ],
)
def test_a_ready_standby_takes_the_failed_ranks_place_instead_of_a_new_process(
    code, left, expected
):
    after, actions = core.on_rank_exit(
        RUNNING,
        1,
        code,
        live=True,
        stopped=False,
        restarts_left=left,
        signals=core.Signals(),
        standby_ready=True,
    )
    assert kinds(actions) == expected
    if "AdoptStandby" in expected:
        assert actions[-1] == core.AdoptStandby(1) and "warm standby" in actions[0].text
        assert after.alone == RUNNING.alone + 1


LIVE_RUNNING = core.LauncherState(cfg=replace(PLAIN, live=True), live=True)


@pytest.mark.parametrize(
    "state, live_ranks, have, failures, left, stop, wanted",
    [
        pytest.param(LIVE_RUNNING, True, False, 0, 2, None, True, id="wanted"),
        pytest.param(
            replace(LIVE_RUNNING, cfg=PLAIN), True, False, 0, 2, None, False, id="no-setting"
        ),
        pytest.param(LIVE_RUNNING, False, False, 0, 2, None, False, id="ranks-not-live"),
        pytest.param(LIVE_RUNNING, True, True, 0, 2, None, False, id="one-already"),
        pytest.param(LIVE_RUNNING, True, False, 3, 2, None, False, id="three-died-waiting"),
        pytest.param(LIVE_RUNNING, True, False, 2, 2, None, True, id="two-died-waiting"),
        pytest.param(LIVE_RUNNING, True, False, 0, 0, None, False, id="no-restart-left"),
        pytest.param(LIVE_RUNNING, True, False, 0, 2, TERM, False, id="a-stop-under-way"),
        pytest.param(
            replace(LIVE_RUNNING, live=False), True, False, 0, 2, None, False, id="between"
        ),
        pytest.param(
            replace(LIVE_RUNNING, warm=True), True, False, 0, 2, None, False, id="warm-spare"
        ),
        pytest.param(
            replace(LIVE_RUNNING, adopted=1), True, False, 0, 2, None, False, id="took-over"
        ),
        pytest.param(
            replace(LIVE_RUNNING, new_job=True), True, False, 0, 2, None, False, id="new-job"
        ),
        pytest.param(
            replace(LIVE_RUNNING, benched="hang"), True, False, 0, 2, None, False, id="out"
        ),
    ],
)
def test_when_a_node_keeps_a_warm_standby(state, live_ranks, have, failures, left, stop, wanted):
    signals = core.Signals(stop=stop)
    got = core.want_standby(
        state,
        live_ranks=live_ranks,
        have=have,
        failures=failures,
        restarts_left=left,
        signals=signals,
    )
    assert got is wanted


# ------------------------------------------------------------------ restarts, outcome
@pytest.mark.parametrize(
    "ranks_started,expected",
    [
        pytest.param(True, (core.Account(core.Budget.GIVE_BACK),), id="stop-before-a-restart"),
        pytest.param(False, (), id="stop-before-the-first-round"),
    ],
)
def test_a_stop_before_a_round_gives_back_the_restart_it_never_made(ranks_started, expected):
    assert core.on_stopped(core.LauncherState(ranks_started=ranks_started)) == expected


@pytest.mark.parametrize(
    "new_job,finished,waits",
    [
        pytest.param(False, False, True, id="a-spare-may-still-be-needed"),
        pytest.param(True, False, False, id="new-job: leave"),
        pytest.param(False, True, False, id="run-finished: leave"),
    ],
)
def test_a_spare_whose_join_timed_out(new_job, finished, waits):
    state = core.LauncherState(cfg=SPARES, new_job=new_job)
    assert core.wait_on_as_spare(state, finished=finished) is waits


def test_a_round_start_forgets_the_losses_before_it():
    state = core.on_round_start(core.LauncherState(cfg=SPARES, hung_round=True), {2: lost(2)})
    assert state.trained and state.lost == {2} and state.ranks_started and not state.hung_round
    assert core.on_tick(state, core.Tick(0.0, 2, losses=losses({2: lost(2)})))[1] == ()


@pytest.mark.parametrize(
    "kw,code,outcome",
    [
        pytest.param(
            {"failures": {0: 1}},
            ExitCode.RESTARTS_EXHAUSTED,
            "restarts_exhausted",
            id="restarts-used-up",
        ),
        pytest.param(
            {"failures": {0: -9}, "hung_round": True},
            ExitCode.RESTARTS_EXHAUSTED,
            "hung",
            id="restarts-used-up-by-a-hang",
        ),
        pytest.param(
            {"failures": {}, "succeeded": True, "signalled": True},
            ExitCode.CONTINUE,
            "checkpointed",
            id="signalled-and-saved",
        ),
        pytest.param(
            {
                "failures": {},
                "teardown": ((0, -6),),
                "succeeded": True,
                "stopped": {0: "checkpointed"},
            },
            ExitCode.CONTINUE,
            "checkpointed",
            id="teardown-only",
        ),
    ],
)
def test_the_outcome_of_a_node_whose_ranks_trained(kw, code, outcome):
    kw = dict(kw)
    state = core.LauncherState(
        cfg=PLAIN,
        ranks=frozenset({0}),
        hung_round=kw.pop("hung_round", False),
        teardown=kw.pop("teardown", ()),
    )
    decided = core.ranks_outcome(
        state,
        succeeded=kw.pop("succeeded", False),
        failures=kw.pop("failures"),
        stopped=kw.pop("stopped", {}),
        signalled=kw.pop("signalled", False),
        finished=False,
    )
    assert (decided.code, decided.outcome) == (code, outcome)


# ------------------------------------------------------------------------------ report
WHO = core.NodeId(node_rank=1, node="n1", job_id="7", attempt=2, max_restarts=3, started_at=10.0)
IDENT = ["node_rank", "node", "job_id", "attempt"]
TAIL = ["started_at", "ended_at", "peers_lost"]


@pytest.mark.parametrize(
    "end,keys,values",
    [
        pytest.param(
            core.LauncherFailed("TimeoutError: x", "rendezvous", 11.0),
            [
                *IDENT,
                "error",
                "phase",
                "exit_code",
                "time",
                "outcome",
                "in_job_restarts",
                "max_restarts",
                *TAIL,
            ],
            {"outcome": "launcher_failed", "exit_code": 1, "in_job_restarts": 0},
            id="launcher-failed",
        ),
        pytest.param(
            core.StoppedBeforeRanks("SIGTERM", 143, "stopped"),
            [*IDENT, "outcome", "signal", "exit_code", "in_job_restarts", "max_restarts", *TAIL],
            {"outcome": "stopped", "signal": "SIGTERM", "exit_code": 143},
            id="stopped-before-ranks",
        ),
        pytest.param(
            core.SpareNeverNeeded(),
            [*IDENT, "role", "outcome", "exit_code", "in_job_restarts", "spare_swaps", *TAIL],
            {"role": "spare", "outcome": "spare", "exit_code": 0},
            id="spare-never-needed",
        ),
        pytest.param(
            core.SteppedOut(
                core.LauncherState(cfg=SPARES, benched="hang", swaps=1, hangs=(HANG,)),
                True,
                1,
            ),
            [
                *IDENT,
                "role",
                "outcome",
                "exit_code",
                "benched",
                "in_job_restarts",
                "max_restarts",
                "spare_swaps",
                "hangs",
                "heartbeats",
                *TAIL,
            ],
            {
                "role": "active",
                "outcome": "benched",
                "in_job_restarts": 2,
                "hangs": [HANG.report().to_json()],
            },
            id="benched",
        ),
        pytest.param(
            core.RanksEnded(
                core.LauncherState(cfg=SPARES, swaps=1, new_job=True),
                core.NodeOutcome(75, "checkpointed", ("w",)),
                2,
                {"initial": None},
                False,
                [1],
            ),
            [
                *IDENT,
                "in_job_restarts",
                "max_restarts",
                "spare_swaps",
                "role",
                "recovery",
                "hangs",
                "outcome",
                "exit_code",
                "teardown_failures",
                "started_at",
                "ended_at",
                "timeouts",
                "heartbeats",
                "peers_lost",
                WITHHELD_RANKS,
            ],
            {
                "in_job_restarts": 3,
                "recovery": "new_job",
                "role": "active",
                "teardown_failures": ["w"],
                WITHHELD_RANKS: [1],
            },
            id="ranks-ended",
        ),
    ],
)
def test_one_node_report_for_every_ending(end, keys, values):
    report = core.node_report(end, WHO, ended_at=12.0, peers_lost=[2]).to_json()
    assert sorted(report) == sorted(keys)  # the file's keys (in the model's order)
    assert report["started_at"] == 10.0 and report["ended_at"] == 12.0
    assert report["peers_lost"] == [2]
    assert {k: report[k] for k in values} == values


# -------------------------------------------------------------- the restart budget
@pytest.mark.parametrize(
    "budget,left,expected",
    [
        pytest.param(core.Budget.KEEP, 1, 2, id="swap: torch's count undone"),
        pytest.param(core.Budget.SPENT, 2, 0, id="new-job-or-step-out: none left"),
        pytest.param(core.Budget.GIVE_BACK, 1, 2, id="stopped-before-a-restart: given back"),
        pytest.param(core.Budget.GIVE_BACK, 3, 3, id="never-above-the-maximum"),
    ],
)
def test_the_agent_applies_the_budget(budget, left, expected):
    elastic = pytest.importorskip("ftslurm.agent.elastic")
    agent = elastic.Agent.__new__(elastic.Agent)  # no torch agent needed to count
    agent.node = SimpleNamespace(cfg=core.Config(max_restarts=3))
    agent._remaining_restarts = left
    agent.spent_used = None
    agent.account(budget)
    assert agent._remaining_restarts == expected
    # the node report's count: the restarts made; those a spent budget drops are not
    assert agent.restarts_used() == (3 - left if budget is core.Budget.SPENT else 3 - expected)


def test_torchs_restart_counter_moves_in_one_place():
    """Only `Agent.account` writes torch's private `_remaining_restarts`."""
    writers = []
    for path in sorted((Path(core.__file__).parent).glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AugAssign)
                    else []
                )
                if any(
                    isinstance(t, ast.Attribute) and t.attr == "_remaining_restarts"
                    for t in targets
                ):
                    writers.append((path.name, func.name))
    assert set(writers) == {("elastic.py", "account")}


# ------------------------------------------------------- joining, leaving, the host
def first_lease(role: str | None = sp.ACTIVE, ended: str | None = None) -> Lease:
    return Lease(node_rank=0, node="n0", pid=1, seq=1, time=0.0, ended=ended, role=role)


@pytest.mark.parametrize(
    "leases,gone,expected",
    [
        pytest.param({0: first_lease(), 1: first_lease()}, {}, True, id="every-first-node-trains"),
        pytest.param({0: first_lease(), 1: None}, {}, None, id="one-not-started: wait"),
        pytest.param({0: first_lease(), 1: None}, {1: lost(1)}, True, id="one-lost: join now"),
        pytest.param(
            {0: first_lease(ended="finished"), 1: first_lease()}, {}, False, id="training-over"
        ),
        pytest.param(
            {0: first_lease(), 1: first_lease(ended=sp.BENCHED)},
            {1: benched(1)},
            True,
            id="one-stepped-out: needed",
        ),
    ],
)
def test_a_spare_waiting_to_join(leases, gone, expected):
    assert core.spare_join(SPARES, leases, gone) is expected


@pytest.mark.parametrize(
    "kw,expected",
    [
        pytest.param({"stop": TERM}, "told to stop", id="told-to-stop"),
        pytest.param(
            {"host_failed": {"job_id": "7", "error": "OSError: x"}},
            "the rendezvous host's launcher (node rank 0) failed: OSError: x",
            id="host-failed",
        ),
        pytest.param(
            {"host_failed": {"job_id": "6", "error": "old"}}, None, id="another-jobs-failure"
        ),
        pytest.param(
            {"host_lease": first_lease(ended="stopped")},
            "the rendezvous host's launcher (node rank 0) was told to stop",
            id="host-stopped",
        ),
        pytest.param(
            {"host_lost": {"job_id": "7"}},
            "the rendezvous host (node rank 0) was reported lost",
            id="host-lost",
        ),
        pytest.param({}, None, id="nothing: wait on"),
    ],
)
def test_why_to_stop_waiting_for_the_rendezvous_host(kw, expected):
    base = {"stop": None, "host_failed": None, "host_lease": None, "host_lost": None}
    assert core.abandon_reason(job="7", stopped="stopped", **{**base, **kw}) == expected


@pytest.mark.parametrize(
    "state,error,leave,ending",
    [
        pytest.param(
            core.LauncherState(cfg=SPARES),
            core.AfterError.SPARE_LEAVES,
            core.Leave.NOTHING,
            core.SpareNeverNeeded,
            id="spare-never-needed",
        ),
        pytest.param(
            core.LauncherState(cfg=SPARES, trained=True, ranks_started=True, benched=sp.HANG),
            core.AfterError.RAISE,
            core.Leave.QUIETLY,
            core.SteppedOut,
            id="stepped-out",
        ),
        pytest.param(
            core.LauncherState(cfg=PLAIN),
            core.AfterError.FAILED,
            core.Leave.CLOSE,
            type(None),
            id="failed-in-the-rendezvous",
        ),
        pytest.param(
            core.LauncherState(cfg=PLAIN, ranks_started=True),
            core.AfterError.RAISE,
            core.Leave.CLOSE,
            type(None),
            id="ranks-ended",
        ),
    ],
)
def test_how_a_launcher_leaves(state, error, leave, ending):
    assert core.after_error(state) is error
    assert core.how_to_leave(state) is leave
    assert isinstance(core.out_of_training(state, heartbeats=True, used=0), ending)


@pytest.mark.parametrize("benched, leave", [(True, core.Leave.QUIETLY), (False, core.Leave.CLOSE)])
def test_a_node_that_fails_its_check_between_rounds_leaves_quietly_only_for_a_spare(benched, leave):
    """Between in-job rounds (issue 30): with a spare taking its place the others go on
    (the rendezvous stays open); without one the rendezvous is closed: the attempt ends."""
    state = core.LauncherState(cfg=SPARES, trained=True, ranks_started=True)
    after = core.on_failed_health(state, benched)
    assert core.how_to_leave(after) is leave
    assert (after.benched == sp.UNHEALTHY) is benched
    assert core.health_exit(benched) == (0 if benched else 1)


# ------------------------------------------------------------------- live recovery: spares
LIVE = core.Config(node_rank=0, nnodes=4, spares=2, max_restarts=2, live=True)


def test_with_live_ranks_a_swap_keeps_them_running():
    """A survivor whose ranks recover live kills nothing when a peer is lost: a warm
    spare's ranks take the lost ones over; no swap is counted (nothing restarted here)."""
    state, actions = tick(
        core.LauncherState(cfg=LIVE), losses=losses({1: lost(1)}), live_ranks=True
    )
    assert kinds(actions) == ["Log"] and "keep running" in actions[0].text
    assert state.lost == {1} and state.swaps == 0 and state.gone_order == ((1, sp.ACTIVE),)
    # the same without live ranks (the script did not opt in): today's swap
    _, actions = tick(core.LauncherState(cfg=LIVE), losses=losses({1: lost(1)}))
    assert kinds(actions) == ["Log", "Account", "KillRanks", "EndRound"]


@pytest.mark.parametrize(
    "me,gone,expected",
    [
        pytest.param(2, {1: lost(1)}, 1, id="the-first-spare-takes-the-first-loss"),
        pytest.param(3, {1: lost(1)}, None, id="the-second-waits"),
        pytest.param(3, {2: lost(2), 1: lost(1)}, 1, id="a-spare-lost-while-waiting"),
    ],
)
def test_a_warm_spare_takes_over_the_node_the_pairing_gives_it(me, gone, expected):
    cfg = replace(LIVE, node_rank=me)
    roles = {r: (sp.SPARE if r >= 2 else sp.ACTIVE) for r in gone}
    gone = {r: rep.model_copy(update={"time": float(i)}) for i, (r, rep) in enumerate(gone.items())}
    state, actions = tick(core.LauncherState(cfg=cfg, warm=True), losses=losses(gone, roles))
    if expected is None:
        assert actions == () and state.warm and not state.trained
    else:
        assert kinds(actions) == ["Log", "TakeOver"] and actions[1].node_rank == expected
        assert not state.warm and state.trained and state.adopted == expected


def test_a_warm_spare_whose_ranks_start_has_not_trained():
    state = core.on_round_start(core.LauncherState(cfg=LIVE, warm=True), {})
    assert not state.trained and core.never_trained(state)


def test_a_warm_spare_leaves_when_no_spare_can_help_or_the_run_closed():
    cfg = replace(LIVE, node_rank=2)
    state, actions = tick(core.LauncherState(cfg=cfg, warm=True), losses=losses({0: lost(0)}))
    assert state.new_job and kinds(actions)[-3:] == ["Account", "KillRanks", "EndRound"]
    _, actions = tick(core.LauncherState(cfg=cfg, warm=True), closed=True)
    assert kinds(actions)[-2:] == ["KillRanks", "EndRound"]


def test_a_spare_that_took_over_lets_its_ranks_end_a_finished_run():
    """It is in no exit barrier of the others: the rendezvous may close first."""
    state = core.LauncherState(cfg=replace(LIVE, node_rank=2), adopted=1, trained=True)
    assert tick(state, closed=True, finished=True)[1] == ()
    assert kinds(tick(state, closed=True)[1])[-2:] == ["KillRanks", "EndRound"]


@pytest.mark.parametrize(
    "gone,expected",
    [
        pytest.param([(1, sp.ACTIVE)], {1: 2}, id="one-loss"),
        pytest.param([(1, sp.ACTIVE), (0, sp.ACTIVE)], {1: 2, 0: 3}, id="in-the-order-they-went"),
        pytest.param([(2, sp.SPARE), (1, sp.ACTIVE)], {1: 3}, id="a-lost-spare-takes-none"),
        pytest.param(
            [(1, sp.ACTIVE), (2, sp.ACTIVE)], {1: 2, 2: 3}, id="a-spare-that-took-over-lost"
        ),
        pytest.param([(1, sp.ACTIVE), (0, None), (3, sp.SPARE)], {1: 2}, id="none-left"),
    ],
)
def test_the_pairing_of_lost_nodes_and_warm_spares(gone, expected):
    assert sp.takeovers(gone, nnodes=4, spare_nodes=2) == expected


def test_a_takeover_that_cannot_be_handed_over_ends_the_warm_ranks():
    """The coordinator does not know the lost node's ranks: the warm ranks end and the
    launcher waits as a spare without live recovery (it has not trained)."""
    state = core.LauncherState(cfg=replace(LIVE, node_rank=2), adopted=1, trained=True)
    state, actions = core.take_over_failed(state)
    assert kinds(actions) == ["Log", "RecordFallback", "Account", "KillRanks", "EndRound"]
    assert actions[1].why is Fallback.TAKEOVER_FAILED and "node rank 1" in actions[1].detail
    assert actions[2].budget is core.Budget.SPENT and not actions[4].succeeded
    assert not state.trained and state.adopted is None and core.never_trained(state)


# Three nodes, one a spare, with live recovery: which losses the launchers fall back on, and
# why (the record `status` and `report` show).
LIVE_ONE_SPARE = core.Config(node_rank=1, nnodes=3, spares=1, max_restarts=2, live=True)


@pytest.mark.parametrize(
    "cfg,known,gone,live_ranks,warm,why",
    [
        pytest.param(
            LIVE_ONE_SPARE,
            set(),
            {0: lost(0)},
            True,
            False,
            Fallback.NO_COORDINATOR,
            id="the-batch-host-lost",
        ),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=2),
            set(),
            {0: lost(0)},
            False,
            True,
            Fallback.NO_COORDINATOR,
            id="the-batch-host-lost-seen-by-the-warm-spare",
        ),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=0),
            {2},
            {2: lost(2), 1: lost(1)},
            True,
            False,
            Fallback.NO_SPARE,
            id="the-spare-lost-while-waiting-then-a-node",
        ),
        pytest.param(
            replace(LIVE, node_rank=0),
            set(),
            {1: lost(1), 2: lost(2), 3: lost(3)},
            True,
            False,
            Fallback.NO_SPARE,
            id="more-losses-than-spares-at-once",
        ),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=0),
            set(),
            {1: benched(1)},
            True,
            False,
            None,
            id="a-node-stepped-out-with-a-spare-left: served live",
        ),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=0),
            set(),
            {1: lost(1)},
            True,
            False,
            None,
            id="a-node-lost-with-a-spare-left: served live",
        ),
        pytest.param(
            replace(SPARES, node_rank=1),
            set(),
            {0: lost(0)},
            False,
            False,
            None,
            id="without-live-recovery: today's path, nothing to fall back from",
        ),
    ],
)
def test_a_loss_live_recovery_cannot_serve_records_why(cfg, known, gone, live_ranks, warm, why):
    roles = {r: sp.SPARE for r in known}
    state = core.LauncherState(cfg=cfg, warm=warm, lost=frozenset(known))
    state, actions = tick(state, losses=losses(gone, roles), live_ranks=live_ranks)
    fell_back = [a for a in actions if isinstance(a, core.RecordFallback)]
    if why is None:
        assert not fell_back, actions
        return
    (record,) = fell_back
    assert record.why is why and record.recovery == "new_job" and state.new_job, actions
    assert record.detail.startswith("node ") and record.detail.endswith(" lost"), record
    assert kinds(actions)[-3:] == ["Account", "KillRanks", "EndRound"], actions
    # Said once: the same news again (a later tick, the verdict after the ranks failed)
    # records nothing more.
    more = losses({**gone, 9: lost(9)}, roles)
    _, again = core.on_verdict_poll(state, core.Verdict(deadline=0.0), more, {}, 200.0)[::2]
    assert not [a for a in again if isinstance(a, core.RecordFallback)], again


@pytest.mark.parametrize(
    "cfg,known,gone,why",
    [
        pytest.param(LIVE_ONE_SPARE, set(), {0: lost(0)}, Fallback.NO_COORDINATOR, id="batch-host"),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=2),
            set(),
            {0: lost(0)},
            Fallback.NO_COORDINATOR,
            id="batch-host-seen-by-the-warm-spare",
        ),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=0),
            {2},
            {2: lost(2), 1: lost(1)},
            Fallback.NO_SPARE,
            id="the-spare-lost-then-a-node",
        ),
        pytest.param(LIVE_ONE_SPARE, {0}, {0: lost(0)}, None, id="said-at-a-tick-already"),
        pytest.param(
            replace(LIVE_ONE_SPARE, node_rank=0), set(), {1: lost(1)}, None, id="a-spare-serves"
        ),
        pytest.param(LIVE_ONE_SPARE, set(), {}, None, id="no-loss: a plain stop"),
    ],
)
def test_a_loss_live_recovery_cannot_serve_is_recorded_when_a_stop_came_first(
    cfg, known, gone, why
):
    """The batch host's loss ends the job at once: the stop can reach a surviving launcher
    before its next look at the losses. When its ranks then fail under the stop, it reads
    them once and records the fallback as its tick would have (said once)."""
    state = core.LauncherState(cfg=cfg, lost=frozenset(known), ranks=frozenset({1}))
    _, asked = core.on_failed(state, {1: -15}, {}, True)
    assert list(asked) == [core.LossesUnderStop()]
    after, actions = core.losses_under_stop(state, losses(gone, {r: sp.SPARE for r in known}))
    fell_back = [a for a in actions if isinstance(a, core.RecordFallback)]
    if why is None:
        assert not actions and after == state, actions
        return
    (record,) = fell_back
    assert record.why is why and record.recovery == "new_job" and after.new_job, actions
    assert kinds(actions) == ["Log", "RecordFallback"], actions  # nothing killed: a stop
    assert core.losses_under_stop(after, losses(gone))[1] == ()  # said once


@pytest.mark.parametrize(
    "lost_nodes,spares,why",
    [
        ({1}, 1, None),
        ({0}, 1, Fallback.NO_COORDINATOR),  # the batch host hosts the coordinator store
        ({0, 1}, 2, Fallback.NO_COORDINATOR),
        ({1, 2}, 1, Fallback.NO_SPARE),
        ({1, 2}, 2, None),
        ({1}, 0, Fallback.NO_SPARE),
    ],
)
def test_the_launchers_fallback_from_live_recovery(lost_nodes, spares, why):
    assert live_rules.loss_fallback(lost_nodes, spares) is why
