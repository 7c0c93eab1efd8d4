"""Quiet attempts: the reconcile loop skips `step` for an attempt whose inputs are unchanged
(reconcile's module doc), and never skips one whose inputs changed: a state change, a new
version of the run (a cancel request), a rewritten straggler report or progress file, a
node flag, a deadline reached. Driven on the mock's pure model with a virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftslurm.backends.mock import model
from ftslurm.core.contract import RunDir
from ftslurm.core.settings import FtSettings
from ftslurm.daemon import reconcile
from ftslurm.daemon import step as core
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import AttemptState
from ftslurm.daemon.store import Store
from ftslurm.daemon.user_requests import nodes_add
from ftslurm.fsutil import write_json_atomic

from .test_reconcile_property import ModelBackend, running_on_the_model


class Counted:
    """Counts the steps the loop takes and the run files it reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = self.reads = 0
        real_step, real_read = core.step, reconcile.read_run_files

        def step(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.steps += 1
            return real_step(*args, **kwargs)

        def read(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.reads += 1
            return real_read(*args, **kwargs)

        monkeypatch.setattr(core, "step", step)
        monkeypatch.setattr(reconcile, "read_run_files", read)

    def take(self) -> tuple[int, int]:
        taken = (self.steps, self.reads)
        self.steps = self.reads = 0
        return taken


def watched_run(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, **settings: object
) -> tuple[ModelBackend, Store, Reconciler, RunDir]:
    """Run "r0" (one node, 10 minutes) seen running on the mock's model by an in-process
    daemon; files count as settled at once (no file is changed within a timestamp tick
    here: each rewrite is a new file)."""
    monkeypatch.setattr(reconcile, "_RACY_NS", -3600 * 10**9, raising=False)
    settings.setdefault("checkpoint_interval", "off")  # its file: a test of its own below
    backend, store, rec = running_on_the_model(tmp, 1, FtSettings(**settings), cycles=3)
    assert store.latest_attempt("r0").state is AttemptState.RUNNING  # type: ignore[union-attr]
    run_dir = RunDir(tmp / "run")
    run_dir.stragglers.mkdir(parents=True)  # the model runs no process that would make it
    return backend, store, rec, run_dir


def started(store: Store) -> float:
    a = store.latest_attempt("r0")
    assert a is not None and a.start is not None
    return a.start


def test_a_steady_cycle_steps_no_unchanged_attempt_and_reads_no_file(tmp_path, monkeypatch):
    backend, store, rec, run_dir = watched_run(tmp_path, monkeypatch, preempt_time=60)
    write_json_atomic(run_dir.progress, {"step": 5, "max_checkpoint_save_s": 1.0})
    counted = Counted(monkeypatch)
    rec.cycle()  # reads the new file once
    assert counted.take() == (2, 1)  # the files asked for, then the decision
    for _ in range(3):
        backend.now += 1
        rec.cycle()
        assert counted.take() == (0, 0)
    # its deadlines count as the step's would: the signal due, the report's look a period on
    assert rec.next_deadline == min(started(store) + 600 - 60, backend.now + 60)


def test_next_deadline_is_the_signal_due_while_the_attempt_is_quiet(tmp_path, monkeypatch):
    backend, store, rec, _ = watched_run(
        tmp_path, monkeypatch, preempt_time=60, exclude_stragglers=False
    )
    due = started(store) + 600 - 60
    counted = Counted(monkeypatch)
    for _ in range(2):
        backend.now += 1
        rec.cycle()
        assert rec.next_deadline == due
    assert counted.take()[0] == 0


def test_a_rewritten_straggler_report_is_acted_on_in_the_next_cycle(tmp_path, monkeypatch):
    backend, store, rec, run_dir = watched_run(
        tmp_path, monkeypatch, preempt_time=0, stop_if_straggler=True
    )
    (node,) = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    write_json_atomic(
        run_dir.straggler_report, {"attempt": 0, "persistent_nodes": [], "threshold": 0.75}
    )
    counted = Counted(monkeypatch)
    rec.cycle()
    backend.now += 1
    rec.cycle()
    assert counted.take()[0] == 2  # quiet since the first of these cycles
    write_json_atomic(
        run_dir.straggler_report, {"attempt": 0, "persistent_nodes": [node], "threshold": 0.75}
    )
    backend.now += 1  # well before the report's next look (60 s)
    rec.cycle()
    assert node in {f.node for f in store.node_flags()}
    assert [e.data["nodes"] for e in store.events("r0") if e.kind == "straggler"] == [[node]]
    moved = store.attempts("r0")
    assert moved[0].cause == "straggler" and moved[-1].attempt == 1  # moved off the node


def test_a_rewritten_progress_file_moves_the_checkpoint_signal_in_the_next_cycle(
    tmp_path, monkeypatch
):
    backend, store, rec, run_dir = watched_run(
        tmp_path, monkeypatch, preempt_time=60, exclude_stragglers=False
    )
    write_json_atomic(run_dir.progress, {"step": 5, "max_checkpoint_save_s": 1.0})
    backend.now = started(store) + 300  # the signal is due at 540 s
    counted = Counted(monkeypatch)
    rec.cycle()
    backend.now += 1
    rec.cycle()
    assert counted.take()[0] == 2 and not [m for _, m, _ in backend.log if m == "signal"]
    # saves now take 200 s: the signal is due 405 s before the limit, at 195 s: now
    write_json_atomic(run_dir.progress, {"step": 6, "max_checkpoint_save_s": 200.0})
    backend.now += 1
    rec.cycle()
    assert [m for _, m, _ in backend.log if m == "signal"] == ["signal"]


def test_a_deadline_reached_is_acted_on(tmp_path, monkeypatch):
    backend, store, rec, _ = watched_run(tmp_path, monkeypatch, preempt_time=60)
    backend.now += 1
    rec.cycle()
    due = started(store) + 600 - 60
    counted = Counted(monkeypatch)
    backend.now = due - 1
    rec.cycle()
    assert counted.take()[0] == 0 and "signal" not in [m for _, m, _ in backend.log]
    backend.now = due
    rec.cycle()
    assert "signal" in [m for _, m, _ in backend.log]


@pytest.mark.parametrize("connection", ["another", "the daemon's"])
def test_a_cancel_request_between_two_quiet_cycles_is_acted_on_in_the_next(
    tmp_path, monkeypatch, connection
):
    backend, store, rec, _ = watched_run(tmp_path, monkeypatch, preempt_time=0)
    counted = Counted(monkeypatch)
    backend.now += 1
    rec.cycle()
    assert counted.take()[0] == 0
    job = store.latest_attempt("r0").job_id  # type: ignore[union-attr]
    if connection == "another":  # as `ftslurm cancel` does, from its own process
        with Store(tmp_path / "home") as command:
            command.request_cancel("r0", backend.now)
    else:
        store.request_cancel("r0", backend.now)
    backend.now += 1
    rec.cycle()
    assert ("cancel", job) in [(m, k) for _, m, k in backend.log]


def test_a_state_change_and_a_node_flag_are_stepped(tmp_path, monkeypatch):
    backend, store, rec, _ = watched_run(tmp_path, monkeypatch, preempt_time=0)
    counted = Counted(monkeypatch)
    backend.now += 1
    rec.cycle()
    assert counted.take()[0] == 0
    store.add_request(*nodes_add(["n9"], "maintenance", 100.0), backend.now)
    backend.now += 1
    rec.cycle()  # the flags changed: stepped again, then quiet
    assert counted.take()[0] > 0
    backend.now += 1
    rec.cycle()
    assert counted.take()[0] == 0
    backend.now += 100  # the flag expired: stepped again
    rec.cycle()
    assert counted.take()[0] > 0
    (job,) = backend.running()
    backend.exited[job] = (0, None)  # the job ends
    backend.now += 1
    rec.cycle()
    assert store.attempts("r0")[0].state is AttemptState.COMPLETED


def test_a_failed_node_is_seen_through_a_quiet_attempt(tmp_path, monkeypatch):
    backend, store, rec, _ = watched_run(tmp_path, monkeypatch, preempt_time=0)
    backend.now += 1
    rec.cycle()
    (node,) = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    backend._step(lambda: (None, model.fail_node(backend.st, node, backend.now)))
    backend.now += backend.st.config.slurmd_timeout_s + 5
    rec.cycle()
    assert store.attempts("r0")[0].cause == "node_fail"


def test_the_hung_rank_named_is_the_first_silent_whatever_node_judged_later(tmp_path):
    """Each node's launcher judges its ranks when the stop reaches it: a node that judged
    3 s later sees its rank (stuck behind the hung one) silent longer, though it went
    silent after. The rank named is the one whose last sign of life came first."""
    from ftslurm.core.contract.reports import Kind
    from ftslurm.daemon.reconcile import hung_at_stop
    from ftslurm.runfiles import read_reports

    paths = RunDir(tmp_path)
    folder = paths.attempt(0)
    folder.mkdir(parents=True)
    write_json_atomic(
        folder / paths.hung_node(0, 0).name,
        {
            "node_rank": 0,
            "node": "n1",
            "time": 1000.0,
            "hung": [
                {
                    "rank": 1,
                    "local_rank": 1,
                    "section": "step",
                    "reason": "silent",
                    "silent_s": 10.0,
                }
            ],
        },
    )  # last sign of life at 990
    write_json_atomic(
        folder / paths.hung_node(0, 1).name,
        {
            "node_rank": 1,
            "node": "n2",
            "time": 1003.0,
            "hung": [
                {
                    "rank": 3,
                    "local_rank": 1,
                    "section": "step",
                    "reason": "silent",
                    "silent_s": 12.0,
                }
            ],
        },
    )  # last sign of life at 991
    reports = read_reports(paths, Kind.HUNG_NODE, 0)
    assert hung_at_stop(reports).startswith("rank 1 (node n1) hung in section 'step'")


def test_a_tuned_interval_is_written_once_and_the_attempt_goes_quiet_again(tmp_path, monkeypatch):
    """The daemon writes the run's checkpoint interval (one read of it after the write),
    rewrites it when a measured save moves it, and is quiet in between."""
    backend, store, rec, run_dir = watched_run(tmp_path, monkeypatch, checkpoint_interval="auto")
    counted = Counted(monkeypatch)
    for _ in range(2):
        backend.now += 1
        rec.cycle()
    written = json.loads(run_dir.cadence.read_text())
    assert written["how"] == "tuned" and written["save_measured"] is False
    counted.take()
    for _ in range(3):
        backend.now += 1
        rec.cycle()
        assert counted.take() == (0, 0)
    write_json_atomic(run_dir.progress, {"step": 9, "checkpoint_save_s": 2.0})
    backend.now += 1
    rec.cycle()
    again = json.loads(run_dir.cadence.read_text())
    assert again["save_measured"] is True and again["interval_s"] < written["interval_s"] / 4
    assert [e.data["interval_s"] for e in store.events("r0") if e.kind == "cadence"] == [
        written["interval_s"],
        again["interval_s"],
    ]
