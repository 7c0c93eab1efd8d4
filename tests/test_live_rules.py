"""Live recovery's pure decisions (`ftslurm.agent.live_rules`) as tables."""

from __future__ import annotations

import pytest

from ftslurm.agent import live_rules as rules
from ftslurm.agent.live_rules import (
    Decision,
    Fallback,
    Handover,
    Join,
    Stuck,
    commit_decision,
    fallback,
    join_state,
    member_step,
    rejoin_round,
    stuck,
)

W = 4


@pytest.mark.parametrize(
    "votes, failed, waited, want",
    [
        (4, False, 0.0, Decision.COMMIT),  # every rank finished the step
        (4, True, 0.0, Decision.COMMIT),  # a failure after the last vote is the next step's
        (4, False, 99.0, Decision.COMMIT),
        (3, False, 0.0, Decision.WAIT),
        (3, True, 0.0, Decision.ABORT),  # a rank failed or was restarted: nobody commits
        (3, False, 10.0, Decision.ABORT),  # a vote that never came
        (0, True, 0.0, Decision.ABORT),
    ],
)
def test_commit_decision(votes, failed, waited, want):
    assert commit_decision(votes, W, failed=failed, waited_s=waited, timeout_s=10.0) is want


@pytest.mark.parametrize(
    "joined, failed, waited, want",
    [
        (4, False, 0.0, Join.READY),
        (3, False, 0.0, Join.WAIT),
        (3, False, 30.0, Join.TIMED_OUT),
        (4, True, 0.0, Join.FAILED),  # declared failed while forming: the next round
        (1, True, 30.0, Join.FAILED),
    ],
)
def test_join_state(joined, failed, waited, want):
    assert join_state(joined, W, failed=failed, waited_s=waited, timeout_s=30.0) is want


@pytest.mark.parametrize(
    "members, want",
    [
        ({0: None, 1: None, 2: None}, None),  # a fresh start: nobody sends
        ({0: 5, 1: 5, 2: 5}, Handover(0, 5, frozenset())),  # all hold it: nothing to send
        ({0: None, 1: 25, 2: 25}, Handover(1, 25, frozenset({0}))),  # rank 0 restarted
        ({0: 25, 1: None, 2: 25}, Handover(0, 25, frozenset({1}))),
        ({0: 20, 1: 25, 2: None}, Handover(1, 25, frozenset({0, 2}))),  # the newest wins
        ({0: 3, 1: 3, 2: 3, 3: None}, Handover(0, 3, frozenset({3}))),
    ],
)
def test_a_replicated_state_comes_from_the_lowest_rank_holding_the_newest_step(members, want):
    plans, stranded = rules.shard_handovers(members, 1)  # one part: every rank holds it all
    assert plans == ((want,) if want is not None and want.receivers else ()) and not stranded


@pytest.mark.parametrize(
    "current, was_member, failed, want",
    [
        (0, True, False, (1, True)),  # its former process was in round 0: declare it failed
        (0, True, True, (1, False)),  # already declared by a survivor
        (1, False, False, (1, False)),  # round 1 is forming and waits for it
        (1, False, True, (2, False)),  # round 1 failed while forming
    ],
)
def test_rejoin_round(current, was_member, failed, want):
    assert rejoin_round(current, was_member=was_member, failed=failed) == want


def test_fallback_after_too_many_rounds_in_a_row():
    assert fallback(3, 3) is None
    assert fallback(4, 3) is Fallback.TOO_MANY_ROUNDS


@pytest.mark.parametrize("raw, want", [(b"", None), (b"12", 12), ("0", 0), (b"-1", None)])
def test_member_step(raw, want):
    assert member_step(raw) == want


@pytest.mark.parametrize(
    "declared, busy, interrupt, want",
    [
        (None, 10.0, True, Stuck.WAIT),  # the round did not fail
        ("error|rank 2: Connection closed", 0.5, True, Stuck.WAIT),  # its own error may come
        ("error|rank 2: Connection closed", 2.0, True, Stuck.INTERRUPT),  # keeps its state
        ("restart|rank 0 restarted", 2.0, True, Stuck.INTERRUPT),  # a peer went silent
        ("error|rank 2: Connection closed", 2.0, False, Stuck.LEAVE),  # rank 2 holds the state
        ("restart|rank 0 restarted", 30.0, False, Stuck.WAIT),  # maybe every rank is stuck
    ],
)
def test_a_rank_stuck_in_a_failed_round_ends_its_connections_or_leaves_if_another_holds_state(
    declared, busy, interrupt, want
):
    assert stuck(declared, busy, 2.0, interrupt) is want


def test_status_notes_the_latest_live_recoveries_oldest_first():
    from ftslurm.core.contract.reports import LiveRecovery
    from ftslurm.report.notes import live_notes

    def rec(at: float, **kw) -> LiveRecovery:
        return LiveRecovery(failed_at=at, why="rank 2: Connection closed", **kw)

    records = [
        rec(
            100.0,
            detected_by="error",
            first_commit_at=102.5,
            step=25,
            state_from=0,
            receivers=[1],
            took_over=1,
        ),
        rec(50.0, detected_by="restart", first_commit_at=51.0, step=10),
        rec(190.0, detected_by="error", step=40),  # still recovering
        rec(10.0),
        LiveRecovery(why="no time: left out"),
    ]
    notes = live_notes(records, now=200.0)
    assert len(notes) == 3
    assert notes[0].startswith("live recovery 2 min ago: rank 2: Connection closed")
    assert "(a rank came back)" in notes[0] and "step 10 run again" in notes[0]
    assert "(a collective failed)" in notes[1] and "training again 2 s later" in notes[1]
    assert "state from rank 0 to 1 (a warm spare's, in node rank 1's place)" in notes[1]
    assert notes[2].endswith("→ recovering, step 40 run again")


def test_a_nodes_ranks_read_back_and_a_damaged_record_is_none():
    record = rules.NodeRanks("ftslurm-live/r/0", 8, (2, 3))
    assert rules.NodeRanks.decode(record.encode().encode()) == record
    assert rules.NodeRanks.decode("x|y") is None
    assert rules.node_key("r", 1) != rules.node_key("r", 2)
    assert rules.exit_key(record.group).startswith(record.group)


def test_status_notes_a_fallback_once_per_round():
    from ftslurm.core.contract.reports import LiveRecovery
    from ftslurm.report.notes import live_notes

    gave_up = [
        LiveRecovery(round=2, rank=r, failed_at=150.0 + r, given_up=Fallback.JOIN_TIMEOUT.value)
        for r in (0, 2)
    ]
    (note,) = live_notes(gave_up, now=200.0)
    assert "given up" in note and "rank 0: a rank did not join the new round in time" in note
    assert note.endswith("every rank restarted (memory tier or disk)")


def test_a_rank_that_gives_up_records_why(tmp_path):
    """The fallback's record, one file per rank, read back with the recoveries."""
    from ftslurm.agent import live
    from ftslurm.core.contract import RunDir
    from ftslurm.core.contract.reports import Kind
    from ftslurm.runfiles import read_reports

    env = {"FTSLURM_RUN_DIR": str(tmp_path), "FTSLURM_ATTEMPT": "1", "RANK": "2"}
    group = live.LiveGroup(environ=env, live=False)
    err = group._give_up(Fallback.NO_STATE, "round 0")
    assert isinstance(err, live.LiveRecoveryFailed) and err.reason is Fallback.NO_STATE
    (record,) = read_reports(RunDir(tmp_path), Kind.LIVE, 1)
    assert record.given_up == Fallback.NO_STATE.value and record.rank == 2, record
    assert record.why == "round 0" and record.attempt == 1, record


LISTENERS = [("127.0.0.1", 40001), ("10.0.0.2", 40002), ("0.0.0.0", 40003)]


@pytest.mark.parametrize(
    "local, peer, want",
    [
        (("127.0.0.1", 40001), ("127.0.0.1", 51234), True),  # accepted by this rank's listener
        (("127.0.0.1", 51000), ("::ffff:127.0.0.1", 40001), True),  # to a peer's listener
        (("10.0.0.1", 51000), ("10.0.0.2", 40002), True),
        (("10.0.0.1", 51000), ("10.0.0.9", 40002), False),  # that port on another host
        (("10.0.0.1", 51000), ("10.0.0.9", 40003), True),  # a wildcard listener: the port
        (("127.0.0.1", 51000), ("127.0.0.1", 29500), False),  # the coordinator store
    ],
)
def test_a_rounds_connections_are_told_from_the_processs_others(local, peer, want):
    assert rules.round_connection(local, peer, LISTENERS, own={40001}) is want


@pytest.mark.parametrize(
    "members, parts, plans, stranded",
    [
        ({0: None, 1: None}, 2, (), set()),  # nobody holds a state
        ({0: 25, 1: 25, 2: 25}, 3, (), set()),  # sharded, nobody lacks it: live all the same
        ({0: 25, 1: None, 2: 25}, 1, (Handover(0, 25, frozenset({1})),), set()),  # replicated
        ({0: 25, 1: None, 2: 25}, 3, (), {1}),  # no replica: rank 1's part is lost
        # HSDP, 2 replicas of 2 parts: rank 1's part comes from rank 3 (the same part)
        ({0: 25, 1: None, 2: 25, 3: 25}, 2, (Handover(3, 25, frozenset({1})),), set()),
        # both parts lost in one replica: each from the other replica's rank
        (
            {0: None, 1: None, 2: 25, 3: 25},
            2,
            (Handover(2, 25, frozenset({0})), Handover(3, 25, frozenset({1}))),
            set(),
        ),
        ({0: 25, 1: None, 2: 25, 3: None}, 2, (), {1, 3}),  # part 1 lost in both replicas
        # an older step is a lack too; the lowest holder of the newest step sends
        ({0: 24, 1: 25, 2: 25, 3: 25}, 2, (Handover(2, 25, frozenset({0})),), set()),
    ],
)
def test_each_part_of_a_sharded_state_comes_from_a_rank_holding_that_part(
    members, parts, plans, stranded
):
    got, lost = rules.shard_handovers(members, parts)
    assert got == plans and lost == stranded
    assert rules.handover_fallback(lost) is (Fallback.SHARDED if stranded else None)


@pytest.mark.parametrize(
    "waited, want",
    [
        (0.01, None),  # a lost peer's closed sockets fail the piece at once: the next round
        (2.9, None),
        (3.0, Fallback.NO_ANSWER),  # waited the whole timeout: a replica that does not answer
        (3.5, Fallback.NO_ANSWER),
    ],
)
def test_a_handover_piece_that_waited_out_its_timeout_gives_live_recovery_up(waited, want):
    assert rules.handover_timed_out(waited, 3.0) is want


def test_the_handover_timeout_is_well_under_the_collective_timeout():
    from ftslurm.agent import live

    assert live.HANDOVER_TIMEOUT_S <= live.COLLECTIVE_TIMEOUT_S / 2


def test_status_notes_a_launchers_fallback_and_where_the_run_goes_on():
    """A launcher's fallback (`RunDir.live_fallback`): which node's launcher, why, and that
    the run goes on in a new job; once, however many launchers recorded it."""
    from ftslurm.core.contract.reports import LiveRecovery
    from ftslurm.report.notes import live_notes, moved_to_a_new_job

    fell_back = [
        LiveRecovery(
            node_rank=n,
            failed_at=150.0 + n,
            given_up=Fallback.NO_COORDINATOR.value,
            why="node n0 lost",
            recovery="new_job",
        )
        for n in (1, 2)
    ]
    other = LiveRecovery(rank=0, failed_at=100.0, given_up=Fallback.JOIN_TIMEOUT.value)
    assert moved_to_a_new_job([other, *fell_back]) == fell_back
    (note,) = live_notes(fell_back, now=200.0)
    assert "node rank 1's launcher: the coordinator store is gone" in note, note
    assert "(node n0 lost)" in note and note.endswith("→ the run goes on in a new job"), note
