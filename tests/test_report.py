"""`ftslurm report`: the goodput breakdown (pure, `ftslurm.report.goodput`) and its command."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftslurm.cli.main import main
from ftslurm.cli.report import read_compute_facts
from ftslurm.core.contract.reports import RoundRecord
from ftslurm.daemon.records import Attempt, Event, Run, RunState
from ftslurm.daemon.store import Store
from ftslurm.fsutil import write_json_atomic
from ftslurm.report.goodput import (
    CATEGORIES,
    AttemptFacts,
    CheckpointRecord,
    ComputeFacts,
    goodput,
)

from .test_architecture import FORBIDDEN_IN_CORE, PACKAGE, imported_modules

ALL = -math.inf  # checkpoint records complete for the whole run
NONE = math.inf  # no guarantee at all


def make_run(
    state: RunState = RunState.COMPLETED,
    ended_at: float | None = None,
    run_dir: str = "/nonexistent",
) -> Run:
    return Run(
        run_id="r1",
        name="train",
        state=state,
        created_at=0.0,
        spec={"run_dir": run_dir},
        settings={},
        ended_at=ended_at,
    )


def attempt(
    k: int,
    start: float | None,
    end: float | None,
    cause: str | None,
    state: str = "COMPLETED",
    **kw,
) -> Attempt:
    return Attempt(
        "r1",
        k,
        state,
        job_id=str(100 + k),
        nodes=[f"n{k + 1}"],
        start=start,
        end=end,
        cause=cause,
        **kw,
    )


def ended(eid: int, t: float, k: int, cause: str, verdict: str) -> Event:
    return Event(eid, t, "r1", "ended", {"attempt": k, "cause": cause, "verdict": verdict})


def ckpt(t: float, save_s: float | None, step: int = 0) -> CheckpointRecord:
    return CheckpointRecord(step, t, save_s)


@dataclass
class Case:
    run: Run
    attempts: list[Attempt]
    events: list[Event]
    facts: ComputeFacts
    expected: dict[str, float]  # categories not named: 0
    wall: float
    notes: tuple[str, ...] = ()  # fragments some note must contain
    now: float = 1e9
    extra: dict = field(default_factory=dict)


CASES = {
    # created 0, queued 60 s, ran 3600 s with two 60 s saves, finished; seen 5 s later
    "clean single attempt": Case(
        make_run(ended_at=3665.0),
        [attempt(0, 60.0, 3660.0, "finished")],
        [ended(1, 3665.0, 0, "finished", "complete")],
        ComputeFacts((ckpt(1260.0, 60.0), ckpt(2460.0, 60.0)), ALL),
        {"queueing": 60, "productive": 3480, "checkpointing": 120, "detection": 5},
        wall=3665,
    ),
    # attempt 0 saved at 1000 (50 s) and its node died at 1600, seen at 1630; attempt 1
    # (a fresh submission) started at 1700 and finished at 2700, seen at 2702
    "node failure then retry": Case(
        make_run(ended_at=2702.0),
        [
            attempt(
                0, 100.0, 1600.0, "node_fail", "NODE_FAIL", failure_seen_at=1630.0, submitted_at=1.0
            ),
            attempt(1, 1700.0, 2700.0, "finished", submitted_at=1630.5),
        ],
        [ended(1, 1630.0, 0, "node_fail", "retry"), ended(2, 2702.0, 1, "finished", "complete")],
        ComputeFacts((ckpt(1000.0, 50.0, step=900),), ALL),
        {
            "queueing": 100 + 70,
            "productive": 850 + 1000,
            "checkpointing": 50,
            "lost": 600,
            "detection": 30 + 2,
        },
        wall=2702,
    ),
    # the same failure when no checkpoint record covers attempt 0: its fate is unknown
    "node failure without checkpoint records": Case(
        make_run(ended_at=2702.0),
        [
            attempt(0, 100.0, 1600.0, "node_fail", "NODE_FAIL"),
            attempt(1, 1700.0, 2700.0, "finished"),
        ],
        [ended(1, 1630.0, 0, "node_fail", "retry"), ended(2, 2702.0, 1, "finished", "complete")],
        ComputeFacts((CheckpointRecord(900, None, 50.0),), NONE),
        {"queueing": 170, "productive": 1000, "unattributed": 1500, "detection": 32},
        wall=2702,
        notes=("attempt 0: 25m00s unattributed", "step 900 took 50.0s to save"),
    ),
    # a failure with complete records and no checkpoint in the attempt: all of it is lost
    "crash before any checkpoint": Case(
        make_run(RunState.FAILED, ended_at=410.0),
        [attempt(0, 10.0, 400.0, "crash", "FAILED")],
        [ended(1, 410.0, 0, "crash", "fail")],
        ComputeFacts((), ALL),
        {"queueing": 10, "lost": 390, "detection": 10},
        wall=410,
    ),
    # attempt 0 got the checkpoint signal, saved at 1000 (30 s) and exited at 1010;
    # attempt 1 (the same job requeued: no submission time) ran 1100-2100
    "checkpoint continuation": Case(
        make_run(ended_at=2101.0),
        [
            attempt(0, 10.0, 1010.0, "checkpointed", failure_seen_at=1012.0),
            attempt(1, 1100.0, 2100.0, "finished"),
        ],
        [
            ended(1, 1012.0, 0, "checkpointed", "continue"),
            ended(2, 2101.0, 1, "finished", "complete"),
        ],
        ComputeFacts((ckpt(1000.0, 30.0),), ALL),
        {
            "queueing": 10 + 88,
            "productive": 960 + 1000,
            "checkpointing": 30,
            "lost": 10,
            "detection": 2 + 1,
        },
        wall=2101,
    ),
    # without a record of its save, a continuation is taken to have saved at its end
    "checkpoint continuation without records": Case(
        make_run(ended_at=2101.0),
        [attempt(0, 10.0, 1010.0, "checkpointed"), attempt(1, 1100.0, 2100.0, "finished")],
        [
            ended(1, 1012.0, 0, "checkpointed", "continue"),
            ended(2, 2101.0, 1, "finished", "complete"),
        ],
        ComputeFacts((), NONE),
        {"queueing": 98, "productive": 2000, "detection": 3},
        wall=2101,
        notes=("attempt 0 ended checkpointed",),
    ),
    # the daemon failed a continuation that made no checkpoint progress: nothing was kept
    "stalled continuation": Case(
        make_run(RunState.FAILED, ended_at=1012.0),
        [attempt(0, 10.0, 1010.0, "checkpointed")],
        [ended(1, 1012.0, 0, "checkpointed", "fail")],
        ComputeFacts((), NONE),
        {"queueing": 10, "lost": 1000, "detection": 2},
        wall=1012,
    ),
    # saved at 500 (20 s), a rank died, the ranks ran again from 700; saved at 1200 (20 s)
    "in-job restart": Case(
        make_run(ended_at=1503.0),
        [attempt(0, 20.0, 1500.0, "finished", in_job_restarts=1)],
        [ended(1, 1503.0, 0, "finished", "complete")],
        ComputeFacts((ckpt(500.0, 20.0), ckpt(1200.0, 20.0)), ALL, {0: AttemptFacts(1, (700.0,))}),
        {
            "queueing": 20,
            "productive": 460 + 480 + 300,
            "checkpointing": 40,
            "restarts": 200,
            "detection": 3,
        },
        wall=1503,
    ),
    # the same run when the time the ranks ran again is not recorded
    "in-job restart at an unrecorded time": Case(
        make_run(ended_at=1503.0),
        [attempt(0, 20.0, 1500.0, "finished", in_job_restarts=1)],
        [ended(1, 1503.0, 0, "finished", "complete")],
        ComputeFacts((ckpt(500.0, 20.0), ckpt(1200.0, 20.0)), ALL),
        {"queueing": 20, "checkpointing": 40, "unattributed": 1440, "detection": 3},
        wall=1503,
        notes=("attempt 0: 1 in-job restart(s) at unrecorded times: 24m00s unattributed",),
    ),
    # two restarts, only the last one's round start known, no checkpoint before it: all of
    # [start, last round start) is restart cost, whatever the earlier restart's time
    "two in-job restarts before any checkpoint": Case(
        make_run(ended_at=1000.0),
        [attempt(0, 0.0, 1000.0, "finished", in_job_restarts=2)],
        [ended(1, 1000.0, 0, "finished", "complete")],
        ComputeFacts((), ALL, {0: AttemptFacts(2, (300.0,))}),
        {"restarts": 300, "productive": 700},
        wall=1000,
    ),
    # a live run: the work since the last checkpoint is not kept yet
    "running attempt": Case(
        make_run(RunState.RUNNING),
        [attempt(0, 100.0, None, None, "RUNNING")],
        [],
        ComputeFacts((ckpt(600.0, 0.0),), ALL),
        {"queueing": 100, "productive": 500, "unattributed": 400},
        wall=1000,
        now=1000.0,
        notes=("attempt 0 is running: 6m40s",),
    ),
    # still in the queue
    "pending": Case(
        make_run(RunState.PENDING),
        [attempt(0, None, None, None, "PENDING")],
        [],
        ComputeFacts(),
        {"queueing": 50},
        wall=50,
        now=50.0,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_breakdown(name):
    case = CASES[name]
    rep = goodput(case.run, case.attempts, case.events, case.facts, case.now)
    got = rep.breakdown.seconds()
    assert got == {c: pytest.approx(case.expected.get(c, 0.0)) for c in CATEGORIES}, got
    assert rep.breakdown.wall_s == pytest.approx(case.wall)
    assert sum(got.values()) == pytest.approx(case.wall)
    segs = rep.segments
    assert all(a.end == pytest.approx(b.start) for a, b in zip(segs, segs[1:], strict=False))
    for fragment in case.notes:
        assert any(fragment in n for n in rep.notes), rep.notes
    if not case.notes:
        assert rep.notes == ()


def test_shares_and_goodput():
    case = CASES["node failure then retry"]
    b = goodput(case.run, case.attempts, case.events, case.facts, case.now).breakdown
    assert b.goodput == pytest.approx(1850 / 2702)
    assert b.share("lost") == pytest.approx(600 / 2702)


def test_timeline_lists_attempts_restarts_and_checkpoints_in_order():
    case = CASES["in-job restart"]
    rep = goodput(case.run, case.attempts, case.events, case.facts, case.now)
    kinds = [(e.time, e.kind) for e in rep.timeline]
    assert kinds == [
        (0.0, "created"),
        (20.0, "started"),
        (500.0, "checkpoint"),
        (700.0, "restart"),
        (1200.0, "checkpoint"),
        (1500.0, "ended"),
        (1503.0, "run_ended"),
    ]
    texts = {e.kind: e.text for e in rep.timeline}
    assert texts["ended"] == "attempt 0 ended after 24m40s: COMPLETED, finished -> complete"
    assert texts["restart"] == "attempt 0: ranks running again after in-job restart 1"


def test_timeline_from_events():
    case = CASES["node failure then retry"]
    events = [
        *case.events,
        Event(3, 1630.2, "r1", "submitted", {"attempt": 1, "job_id": "101", "exclude": ["n1"]}),
        Event(4, 1701.0, "r1", "recovered", {"attempt": 1, "latency_s": 71.0}),
        Event(5, 900.0, "r1", "checkpoint_signal", {"attempt": 0, "signal": "USR2", "lead_s": 60}),
    ]
    rep = goodput(case.run, case.attempts, events, case.facts, case.now)
    texts = [e.text for e in rep.timeline]
    assert "attempt 1 submitted as job 101, excluding n1" in texts
    assert "attempt 1 running 1m11s after the previous ending was seen" in texts
    assert "checkpoint signal USR2 sent to attempt 0 (60s before the wall limit)" in texts
    assert "attempt 0 ended after 25m00s: NODE_FAIL, node_fail -> retry" in texts


def test_timeline_shows_the_result_validation_events():
    """Exit 16 (the nodes flagged, the disambiguation run) and exit 17's verdict (the nodes
    unflagged), as the daemon's step records them (issue 30)."""
    case = CASES["node failure then retry"]
    flagged = {"attempt": 0, "job_id": "100", "exit_code": 16, "verdict": "disambiguate"}
    reproduced = {"attempt": 1, "job_id": "101", "exit_code": 17, "verdict": "reproduced"}
    events = [
        *case.events,
        Event(3, 1600.0, "r1", "validation", {**flagged, "flagged": ["n1", "n2"]}),
        Event(4, 1900.0, "r1", "validation", {**reproduced, "unflagged": ["n1", "n2"]}),
    ]
    rep = goodput(case.run, case.attempts, events, case.facts, case.now)
    texts = [e.text for e in rep.timeline if e.kind == "validation"]
    assert texts == [
        "attempt 0 exited 16 (a result it could not trust): nodes flagged (result "
        "validation): n1, n2; disambiguation run on other nodes",
        "attempt 1 exited 17: the result reproduced on different hardware, the model's "
        "fault, not the machine's; nodes unflagged: n1, n2",
    ]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 500),
            st.floats(0, 2000),
            st.booleans(),
            st.sampled_from(["finished", "checkpointed", "crash", None]),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.tuples(st.floats(0, 12000), st.floats(0, 100)), max_size=5),
    st.sampled_from([ALL, NONE, 3000.0]),
    st.booleans(),
)
def test_categories_always_add_up_to_the_wall_time(spans, saves, complete_from, active):
    t, attempts, events = 0.0, [], []
    for k, (queue, run_s, ends, cause, restarts) in enumerate(spans):
        start = t + queue
        end = start + run_s if ends or k < len(spans) - 1 else None
        attempts.append(
            attempt(k, start, end, cause if end is not None else None, in_job_restarts=restarts)
        )
        if end is not None:
            events.append(ended(k + 1, end + 1, k, cause or "crash", "retry"))
        t = (start if end is None else end) + 1
    run = make_run(
        RunState.RUNNING if active else RunState.FAILED, ended_at=None if active else t + 5
    )
    facts = ComputeFacts(
        tuple(ckpt(a, b) for a, b in saves),
        complete_from,
        {0: AttemptFacts(1, (attempts[0].start + 1,))},
    )
    rep = goodput(run, attempts, events, facts, now=t + 50)
    got = rep.breakdown.seconds()
    assert all(v >= 0 for v in got.values())
    assert sum(got.values()) == pytest.approx(rep.breakdown.wall_s)


def test_goodput_module_is_pure():
    bad = {
        m
        for m in imported_modules(PACKAGE / "report" / "goodput.py")
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE)
    }
    assert not bad, f"goodput.py imports {sorted(bad)}"


# ---------------------------------------------------------------------------- files and CLI
def write_run_files(run_dir: Path, checkpoint_dir: Path) -> None:
    """What the compute side leaves for the node-failure-then-retry run, attempt 1 having
    had one in-job restart after which its ranks ran from 2000."""
    checkpoint_dir.mkdir(parents=True)
    for step, t, save_s in ((900, 1000.0, 50.0), (1900, 2400.0, 40.0)):
        write_json_atomic(
            checkpoint_dir / f"step-{step:010d}.json", {"step": step, "time": t, "save_s": save_s}
        )
    write_json_atomic(
        run_dir / "progress.json",
        {"step": 2500, "checkpoint_step": 1900, "checkpoint_save_s": 40.0, "finished": True},
    )
    folder = run_dir / "attempts" / "1"
    folder.mkdir(parents=True)
    write_json_atomic(
        folder / "node-0.json",
        {
            "node": "n2",
            "in_job_restarts": 1,
            "outcome": "finished",
            "hangs": [{"local_rank": 0, "reason": "step section over 180 s", "time": 1950.0}],
        },
    )
    for rank, started in ((0, 2000.0), (1, 2000.5)):
        write_json_atomic(
            folder / f"rank-{rank}.json",
            {"rank": rank, "started_at": started, "outcome": "finished"},
        )


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A state directory holding run r1 (the node-failure-then-retry run) and its files."""
    home = tmp_path / "home"
    monkeypatch.setenv("FTSLURM_HOME", str(home))
    run_dir, checkpoint_dir = tmp_path / "runs" / "r1", tmp_path / "runs" / "r1" / "ckpt"
    case = CASES["node failure then retry"]
    run = make_run(ended_at=2702.0, run_dir=str(run_dir))
    run.spec["checkpoint_dir"] = str(checkpoint_dir)
    with Store(home) as store, store.transaction():
        store.add_run(run)
        for a in case.attempts:
            store.add_attempt(a)
        for e in case.events:
            store.append_event("r1", e.kind, e.data, e.time)
    write_run_files(run_dir, checkpoint_dir)
    return home


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_reading_the_run_files(home, tmp_path):
    with Store(home) as store:
        run = store.get_run("r1")
        assert run is not None
        facts = read_compute_facts(run, store.attempts("r1"))
    assert [(r.step, r.time, r.save_s) for r in facts.checkpoints] == [
        (900, 1000.0, 50.0),
        (1900, 2400.0, 40.0),
    ]
    assert facts.checkpoints_complete_from == 1000.0  # older ones may have been pruned
    one = facts.attempts[1]
    assert one.in_job_restarts == 1 and one.round_starts == (2000.0,)
    assert one.hangs == ((1950.0, "n2 local rank 0: step section over 180 s"),)
    assert facts.attempts[0] == AttemptFacts()


def test_round_start_is_not_read_from_reports_of_a_failed_round(home, tmp_path):
    write_json_atomic(
        tmp_path / "runs" / "r1" / "attempts" / "1" / "node-0.json",
        {"in_job_restarts": 1, "outcome": "restarts_exhausted"},
    )
    with Store(home) as store:
        run = store.get_run("r1")
        assert run is not None
        facts = read_compute_facts(run, store.attempts("r1"))
    assert facts.attempts[1].round_starts == ()


def test_an_asynchronous_save_counts_its_blocking_time_where_the_training_stood_still(
    home, tmp_path
):
    """A manifest with `blocking_s`: 2 s of its 30 s stood the training still, at the start;
    the state saved is the one of when training went on, 28 s before the manifest."""
    write_json_atomic(
        tmp_path / "runs" / "r1" / "ckpt" / f"step-{2200:010d}.json",
        {"step": 2200, "time": 2600.0, "save_s": 30.0, "blocking_s": 2.0},
    )
    with Store(home) as store:
        run = store.get_run("r1")
        assert run is not None
        facts = read_compute_facts(run, store.attempts("r1"))
    assert [(r.step, r.time, r.save_s) for r in facts.checkpoints][-1] == (2200, 2572.0, 2.0)


def test_progress_without_manifests(tmp_path):
    run_dir = tmp_path / "run"
    run = make_run(run_dir=str(run_dir))
    run_dir.mkdir()
    write_json_atomic(run_dir / "progress.json", {"step": 10})
    assert read_compute_facts(run, []).checkpoints_complete_from == -math.inf
    write_json_atomic(run_dir / "progress.json", {"checkpoint_step": 10, "checkpoint_save_s": 3})
    facts = read_compute_facts(run, [])
    assert facts.checkpoints == (CheckpointRecord(10, None, 3.0),)
    assert facts.checkpoints_complete_from == math.inf


def test_report_json(home, capsys):
    code, out, _ = run_cli(capsys, "report", "r1", "--json")
    assert code == 0
    data = json.loads(out)
    seconds = {c: v["seconds"] for c, v in data["breakdown"].items()}
    # attempt 1 saved nothing before its ranks ran again at 2000 (records are complete from
    # 1000 on): all of 1700-2000 is restart cost; then 2000-2360 productive, 2360-2400
    # saving, 2400-2700 kept (it finished)
    assert seconds == pytest.approx(
        {
            "productive": 850 + 360 + 300,
            "checkpointing": 50 + 40,
            "lost": 600,
            "restarts": 300,
            "queueing": 170,
            "detection": 32,
            "unattributed": 0,
        }
    )
    assert data["wall_s"] == 2702 and data["state"] == "COMPLETED" and data["name"] == "train"
    assert data["goodput"] == pytest.approx(1510 / 2702)
    kinds = [e["kind"] for e in data["timeline"]]
    assert kinds.count("checkpoint") == 2 and "hang" in kinds and "restart" in kinds
    assert data["notes"] == []


def test_report_table(home, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # no wrapping inside the table cells
    code, out, _ = run_cli(capsys, "report", "r1")
    assert code == 0
    assert "goodput 55.9% of 45m02s" in out
    assert "productive" in out and "1510.0" in out and "22.2" in out  # lost: 600/2702
    assert "timeline" in out and "checkpoint of step 1900 saved (40.0s)" in out
    assert "attempt 1: ranks running again after in-job restart 1" in out
    assert "note:" not in out


def test_unknown_run_is_a_one_line_error(home, capsys):
    code, out, err = run_cli(capsys, "report", "nope")
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: no run 'nope'"), err
    assert "Traceback" not in err


def test_plot_writes_a_png(home, tmp_path, capsys):
    path = tmp_path / "goodput.png"
    code, out, err = run_cli(capsys, "report", "r1", "--plot", str(path), "--json")
    assert code == 0 and json.loads(out)["run_id"] == "r1"
    assert "plot written" in err
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_plot_into_a_missing_folder_is_a_one_line_error(home, tmp_path, capsys):
    code, _, err = run_cli(capsys, "report", "r1", "--plot", str(tmp_path / "no" / "x.png"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert err.startswith("Error: cannot write") and "Traceback" not in err


# ------------------------------------------------------------- lost nodes (by source)
def _lost_history():  # type: ignore[no-untyped-def]
    from ftslurm.daemon.records import Attempt, Event

    attempts = [
        Attempt("r", 0, "NODE_FAIL", job_id="5", start=100.0, end=160.0),
        Attempt("r", 1, "RUNNING", job_id="6", start=163.0),
    ]
    events = [
        Event(
            1,
            160.0,
            "r",
            "node_lost",
            {
                "attempt": 0,
                "node": "n2",
                "source": "peer",
                "time": 159.0,
                "detection_s": 21.0,
                "recovery": "new_job",
            },
        ),
        Event(2, 163.5, "r", "running", {"attempt": 1, "job_id": "6"}),
        Event(
            3,
            200.0,
            "r",
            "node_lost",
            {
                "attempt": 1,
                "node": "n3",
                "source": "slurm",
                "time": 200.0,
                "detection_s": 300.0,
                "recovery": "new_job",
            },
        ),
    ]
    return attempts, events


def test_node_losses_count_detection_and_recovery_apart_by_source():
    from ftslurm.report.goodput import losses_by_source, node_losses

    attempts, events = _lost_history()
    peer, slurm = node_losses(attempts, events, {})
    assert (peer.source, peer.detection_s, peer.recovery_s) == ("peer", 21.0, 4.5)
    assert (slurm.source, slurm.detection_s, slurm.recovered_at) == ("slurm", 300.0, None)
    assert losses_by_source([peer, slurm]) == {
        "peer": {"count": 1, "detection_s": 21.0, "recovery_s": 4.5},
        "slurm": {"count": 1, "detection_s": 300.0, "recovery_s": None},
    }


def test_a_spare_recovers_when_its_round_runs_at_its_first_step():
    from ftslurm.daemon.records import Attempt, Event
    from ftslurm.report.goodput import node_losses

    events = [
        Event(
            1,
            50.0,
            "r",
            "node_lost",
            {
                "attempt": 0,
                "node": "n2",
                "source": "peer",
                "time": 49.0,
                "detection_s": 20.0,
                "recovery": "spare",
            },
        )
    ]
    rounds = {
        0: (
            RoundRecord(round=1, started_at=40.0),
            RoundRecord(round=2, started_at=52.0, first_step_at=58.0),
        )
    }
    (loss,) = node_losses([Attempt("r", 0, "RUNNING", job_id="5")], events, rounds)
    assert (loss.recovered_at, loss.recovery_s) == (58.0, 9.0)


def test_status_says_a_node_was_lost_and_what_recovers_it():
    from ftslurm.daemon.records import Attempt, Event
    from ftslurm.report.notes import recovery_notes

    attempts, events = _lost_history()
    queued = [attempts[0], Attempt("r", 1, "PENDING", job_id="45")]
    assert recovery_notes(queued, events[:1], {}, 180.0) == [
        "n2 lost 21 s ago (peer report) → new job 45 queued"
    ]
    assert recovery_notes(attempts, events[:1], {}, 180.0) == [
        "n2 lost 21 s ago (peer report) → new job 6 running 4 s later"
    ]
    spare = [
        Event(
            1,
            50.0,
            "r",
            "node_lost",
            {"attempt": 0, "node": "n2", "source": "peer", "time": 49.0, "recovery": "spare"},
        )
    ]
    running = [Attempt("r", 0, "RUNNING", job_id="5")]
    assert recovery_notes(running, spare, {}, 60.0) == [
        "n2 lost 11 s ago (peer report) → spare: ranks restarting"
    ]
    assert recovery_notes(running, spare, {0: [RoundRecord(started_at=53.0)]}, 60.0) == [
        "n2 lost 11 s ago (peer report) → spare: ranks restarted 4 s later"
    ]


@pytest.mark.parametrize(
    "role, left, said",
    [
        ("spare", 0, "idle spare lost: nothing restarted, no spare left"),
        ("warm_spare", 1, "warm spare lost: nothing restarted, 1 spare left"),
        ("warm_spare", 2, "warm spare lost: nothing restarted, 2 spares left"),
        ("spare", None, "idle spare lost: nothing restarted"),
    ],
)
def test_a_spare_lost_while_it_waited_restarted_nothing(role, left, said):
    """A spare still waiting (idle or warm) lost: `status` and `report` say nothing
    restarted and how many spares are left, not "ranks restarting" (nothing does); its
    loss has no recovery time, and a later round is not its recovery."""
    from ftslurm.daemon.records import Attempt, Event
    from ftslurm.report.goodput import SPARE_LOST, _node_lost_text, node_losses
    from ftslurm.report.notes import recovery_notes

    data = {"attempt": 0, "node": "n3", "source": "peer", "time": 49.0, "recovery": "spare"}
    data.update(role=role, **({} if left is None else {"spares_remaining": left}))
    events = [Event(1, 50.0, "r", "node_lost", data)]
    running = [Attempt("r", 0, "RUNNING", job_id="5")]
    rounds = {0: [RoundRecord(started_at=53.0)]}  # another node's swap, later
    assert recovery_notes(running, events, rounds, 60.0) == [
        f"n3 lost 11 s ago (peer report) → {said}"
    ]
    assert _node_lost_text(data, 0, running) == f"n3 lost (seen by peer None): {said}"
    (loss,) = node_losses(running, events, rounds)
    assert (loss.how, loss.recovered_at, loss.recovery_s) == (SPARE_LOST, None, None)
    # a training node's loss, and a spare's under a new job, are told as before
    active = {**data, "role": "active"}
    assert recovery_notes(running, [Event(1, 50.0, "r", "node_lost", active)], rounds, 60.0) == [
        "n3 lost 11 s ago (peer report) → spare: ranks restarted 4 s later"
    ]
    assert "new job" in _node_lost_text({**data, "recovery": "new_job"}, 0, running)


def test_the_lost_nodes_table_and_the_timeline_agree_on_a_requeue(home, capsys, monkeypatch):
    """Slurm's verdict on a lost node (NODE_FAIL) is recorded with the recovery "new_job",
    but Slurm requeued the same job: the lost-nodes table and the timeline both say so."""
    from ftslurm.report.goodput import node_losses

    attempts = [
        Attempt("r", 0, "NODE_FAIL", job_id="1", start=100.0, end=160.0),
        Attempt("r", 1, "RUNNING", job_id="1", start=170.0),
    ]
    events = [
        Event(
            1,
            165.0,
            "r",
            "node_lost",
            {"attempt": 0, "node": "n2", "source": "slurm", "time": 165.0, "recovery": "new_job"},
        ),
        Event(2, 166.0, "r", "requeued", {"attempt": 1, "job_id": "1"}),
        Event(3, 170.5, "r", "running", {"attempt": 1, "job_id": "1"}),
    ]
    (loss,) = node_losses(attempts, events, {})
    assert loss.how == "requeue"
    fresh = [attempts[0], Attempt("r", 1, "RUNNING", job_id="2", start=170.0)]
    assert node_losses(fresh, events, {})[0].how == "new_job"
    assert node_losses(attempts[:1], events, {})[0].how is None  # nothing after it yet
    with Store(home) as store, store.transaction():
        run = make_run(state=RunState.RUNNING)
        store.add_run(Run(**{**run.__dict__, "run_id": "r"}))
        for a in attempts:
            store.add_attempt(a)
        for e in events:
            store.append_event("r", e.kind, e.data, e.time)
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_cli(capsys, "report", "r")
    assert code == 0, err
    assert "job requeued" in out and "new job" not in out, out
    assert "n2 lost (seen by Slurm): the job is requeued" in out
    code, out, _ = run_cli(capsys, "report", "r", "--json")
    assert json.loads(out)["node_losses"][0]["how"] == "requeue"


def test_timeline_shows_each_live_recovery_and_a_fallback_once():
    """The live recoveries the ranks recorded (and a fallback, once per round) are in the
    timeline at the time the step failed, in the words `status` uses."""
    from dataclasses import replace

    from ftslurm.core.contract.reports import LiveRecovery

    case = CASES["in-job restart"]
    live = (
        LiveRecovery(
            failed_at=800.0,
            first_commit_at=801.5,
            why="rank 3: Connection closed",
            detected_by="error",
            step=40,
            state_from=0,
            receivers=[2, 3],
            took_over=1,
        ),
        *(LiveRecovery(round=2, rank=r, failed_at=900.0 + r, given_up="x") for r in (0, 1)),
    )
    facts = replace(case.facts, live={0: live})
    rep = goodput(case.run, case.attempts, case.events, facts, case.now)
    said = [(e.time, e.text) for e in rep.timeline if e.kind == "live"]
    assert said == [
        (
            800.0,
            "attempt 0: live recovery: rank 3: Connection closed (a collective failed) → "
            "training again 2 s later, step 40 run again, state from rank 0 to 2, 3 (a warm "
            "spare's, in node rank 1's place)",
        ),
        (
            900.0,
            "attempt 0: live recovery given up: rank 0: x → every rank restarted "
            "(memory tier or disk)",
        ),
    ]
