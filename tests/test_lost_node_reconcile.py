"""The daemon acts on a launcher's peer-loss report at once (`attempts/<k>/recovery/`):
driven on the mock's pure model with a virtual clock, the job still RUNNING as Slurm
would show it until SlurmdTimeout. The crash between recording the decision and cancelling
the old job is forced (the daemon dies at the cancel), never hoped for."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftslurm.core.contract import RunDir
from ftslurm.core.leases import Lease, daemon_timeout
from ftslurm.core.settings import FtSettings
from ftslurm.daemon import reconcile
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import AttemptState
from ftslurm.daemon.store import Store
from ftslurm.fsutil import write_json_atomic

from .test_reconcile_property import DaemonCrash, ModelBackend, running_on_the_model
from .test_reconcile_quiet import Counted


def two_nodes(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelBackend, Store, Reconciler]:
    monkeypatch.setattr(reconcile, "_RACY_NS", -3600 * 10**9, raising=False)  # settled at once
    backend, store, rec = running_on_the_model(
        tmp, 2, FtSettings(num_job_retries_on_failure=2, preempt_time=0), cycles=3
    )
    assert store.latest_attempt("r0").state is AttemptState.RUNNING  # type: ignore[union-attr]
    return backend, store, rec


def report_lost(tmp: Path, store: Store, node_rank: int) -> str:
    """The launchers' report that node `node_rank` of attempt 0 fell silent; its name."""
    nodes = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    lost = nodes[node_rank]
    RunDir(tmp / "run").recovery(0).mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        RunDir(tmp / "run").peer_lost(0, node_rank),
        {
            "lost_node_rank": node_rank,
            "lost_node": lost,
            "last_heard": 1.0,
            "lease_time": 1.0,
            "silent_s": 21.0,
            "peer_timeout_s": 20.0,
            "reported_by": nodes[1 - node_rank],
            "reported_by_node_rank": 1 - node_rank,
            "time": 22.0,
            "job_id": "1",
            "attempt": 0,
        },
    )
    return lost


def commands(backend: ModelBackend, since: int) -> list[tuple[str, str]]:
    return [
        (method, key)
        for _, method, key in backend.log[since:]
        if method in ("cancel", "submit", "requeue")
    ]


@pytest.mark.parametrize("node_rank", [1, 0], ids=["other", "batch-host"])
def test_a_report_ends_the_job_and_a_fresh_one_runs_without_the_node(
    tmp_path, monkeypatch, node_rank
):
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    old = store.latest_attempt("r0").job_id  # type: ignore[union-attr]
    lost = report_lost(tmp_path, store, node_rank)
    mark = len(backend.log)
    rec.cycle()  # one poll after the report, Slurm has noticed nothing
    assert commands(backend, mark) == [("cancel", old), ("submit", "ftslurm:r0:1")]
    first, second = store.attempts("r0")
    assert (first.state, first.cause, first.lost_nodes) == (
        AttemptState.NODE_FAIL,
        "node_fail",
        [lost],
    )
    new = backend.st.jobs[second.job_id or ""]
    assert lost in new.exclude and lost not in new.nodes
    assert lost in {f.node for f in store.node_flags()}
    (event,) = [e for e in store.events("r0") if e.kind == "node_lost"]
    assert (event.data["source"], event.data["detection_s"], event.data["recovery"]) == (
        "peer",
        21.0,
        "new_job",
    )
    assert store.get_run("r0").job_retries_used == 1  # type: ignore[union-attr]


def test_the_old_job_is_cancelled_before_the_new_one_after_a_crash_at_the_cancel(
    tmp_path, monkeypatch
):
    """The daemon dies right after recording the decision, before the cancel: the restarted
    daemon cancels the old job before it submits, so two jobs never train at once."""
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    old = store.latest_attempt("r0").job_id  # type: ignore[union-attr]
    report_lost(tmp_path, store, 1)
    real_cancel = backend.cancel

    def dies(job_id: str) -> None:
        raise DaemonCrash()

    backend.cancel = dies  # type: ignore[method-assign]
    with pytest.raises(DaemonCrash):
        rec.cycle()
    first, second = store.attempts("r0")
    assert first.state is AttemptState.NODE_FAIL and second.state is AttemptState.SUBMITTING
    assert backend.running() == [old]  # recorded, not cancelled, nothing new submitted
    backend.cancel = real_cancel  # type: ignore[method-assign]
    mark = len(backend.log)
    restarted = Reconciler(store, lambda _kind: backend, clock=lambda: backend.now)
    restarted.cycle()
    assert commands(backend, mark) == [("cancel", old), ("submit", "ftslurm:r0:1")]
    assert old not in backend.running()
    assert backend.submitted["ftslurm:r0:1"] == 1


def test_an_unchanged_recovery_folder_costs_no_read_and_a_new_report_is_read_at_once(
    tmp_path, monkeypatch
):
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    RunDir(tmp_path / "run").recovery(0).mkdir(parents=True)
    for _ in range(2):  # the checkpoint interval written into the new folder, then read
        backend.now += 1
        rec.cycle()
    counted = Counted(monkeypatch)
    for _ in range(3):
        backend.now += 1
        rec.cycle()
        assert counted.take() == (0, 0)  # quiet: one stat of the folder, no read
    report_lost(tmp_path, store, 1)
    backend.now += 1
    rec.cycle()
    assert counted.take()[1] >= 1
    assert store.attempts("r0")[0].lost_nodes


def test_a_spent_budget_fails_the_run_with_the_reason_and_cancels_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "_RACY_NS", -3600 * 10**9, raising=False)
    backend, store, rec = running_on_the_model(
        tmp_path, 2, FtSettings(num_job_retries_on_failure=0, preempt_time=0), cycles=3
    )
    old = store.latest_attempt("r0").job_id  # type: ignore[union-attr]
    lost = report_lost(tmp_path, store, 1)
    rec.cycle()
    run = store.get_run("r0")
    assert run is not None and run.state.value == "FAILED"
    assert f"{lost} lost" in (run.reason or "") and "budget exhausted" in (run.reason or "")
    assert old not in backend.running() and len(store.attempts("r0")) == 1


def test_a_spare_run_ends_when_its_live_launchers_are_done_reading_no_lease(tmp_path, monkeypatch):
    """After a spare took a lost node's place, each poll lists the attempt's launcher
    reports (not the leases of every node: thousands on a large job; only the batch host's,
    which the daemon watches itself); once every live
    node's launcher reported, the run ends and the job, held by Slurm for the dead node, is
    cancelled."""
    monkeypatch.setattr(reconcile, "_RACY_NS", -3600 * 10**9, raising=False)
    backend, store, rec = running_on_the_model(
        tmp_path,
        2,
        FtSettings(num_job_retries_on_failure=2, preempt_time=0, spare_nodes=1),
        cycles=3,
    )
    job = store.latest_attempt("r0").job_id  # type: ignore[union-attr]
    lost = report_lost(tmp_path, store, 1)
    rec.cycle()
    assert store.latest_attempt("r0").lost_nodes == [lost]  # type: ignore[union-attr]
    read: list[str] = []
    real = reconcile.read_json
    monkeypatch.setattr(reconcile, "read_json", lambda p: read.append(str(p)) or real(p))
    mark = len(backend.log)
    rec.cycle()
    run = RunDir(tmp_path / "run")
    leases = {p for p in read if "peer-lease" in p}
    assert commands(backend, mark) == [] and leases <= {str(run.peer_lease(0, 0))}, leases
    write_json_atomic(
        run.node_report(0, 0),
        {"node_rank": 0, "outcome": "finished", "exit_code": 0, "ended_at": 30.0},
    )
    run.finished.write_text("")
    backend.now += 1
    rec.cycle()
    assert commands(backend, mark) == [("cancel", job)]
    assert store.get_run("r0").state.value == "COMPLETED"  # type: ignore[union-attr]


# ------------------------------------------- the daemon watches the batch host's lease
def write_lease(tmp: Path, node_rank: int, node: str, seq: int, ended: str | None = None) -> None:
    RunDir(tmp / "run").attempt(0).mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        RunDir(tmp / "run").peer_lease(0, node_rank),
        Lease(node_rank, node, 4242, seq, 1000.0 + seq, ended).to_json(),
    )


def test_a_silent_batch_host_that_no_launcher_reports_is_judged_by_the_daemon(
    tmp_path, monkeypatch
):
    """The survivors went down with the batch host (their rendezvous lived there): no
    report comes. The daemon, timing node 0's lease on its own clock, ends the job as a node
    failure `daemon_timeout` after the lease last changed and submits a fresh job without
    the node; until then a lease that keeps changing, or one quiet for less, changes
    nothing."""
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    old = store.latest_attempt("r0")
    assert old is not None
    batch = old.nodes[0]
    limit = daemon_timeout(FtSettings().peer_timeout_s)
    for seq in range(1, 9):  # alive: a new lease every 5 s, for longer than the limit
        write_lease(tmp_path, 0, batch, seq)
        backend.now += 5
        rec.cycle()
    assert store.latest_attempt("r0").attempt == 0  # type: ignore[union-attr]
    mark = len(backend.log)
    silent_since = backend.now
    while backend.now < silent_since + limit - 1:  # silent, not yet for long enough
        backend.now += 1
        rec.cycle()
    assert commands(backend, mark) == []
    backend.now += 2
    rec.cycle()
    assert commands(backend, mark) == [("cancel", old.job_id), ("submit", "ftslurm:r0:1")]
    first, second = store.attempts("r0")
    assert first.cause == "node_fail" and first.lost_nodes == [batch], first
    assert "reported by the daemon" in (first.reason or ""), first.reason
    new = backend.st.jobs[second.job_id or ""]
    assert batch in new.exclude and batch not in new.nodes
    (lost,) = [e.data for e in store.events("r0") if e.kind == "node_lost"]
    assert (lost["source"], lost["node"], lost["recovery"]) == ("daemon", batch, "new_job")
    assert lost["detection_s"] is not None and limit <= lost["detection_s"] < limit + 3, lost


def test_an_ended_batch_host_lease_or_another_nodes_silence_is_left_to_the_launchers(
    tmp_path, monkeypatch
):
    """A lease marked ended (its launcher left on its own) is never lost; the daemon judges
    the batch host only: the other nodes' leases are the launchers' to watch."""
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    nodes = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    write_lease(tmp_path, 0, nodes[0], 1, ended="finished")
    write_lease(tmp_path, 1, nodes[1], 1)
    mark = len(backend.log)
    for _ in range(100):
        backend.now += 1
        rec.cycle()
    assert commands(backend, mark) == []
    assert store.latest_attempt("r0").attempt == 0  # type: ignore[union-attr]


def test_after_a_spare_swap_a_silent_batch_host_still_ends_the_job(tmp_path, monkeypatch):
    """A spare took node 1's place (the attempt acted on that loss); the batch host then
    falls silent with no report: the daemon's deadline still comes and the run goes on in a
    fresh job."""
    monkeypatch.setattr(reconcile, "_RACY_NS", -3600 * 10**9, raising=False)
    backend, store, rec = running_on_the_model(
        tmp_path,
        2,
        FtSettings(num_job_retries_on_failure=2, preempt_time=0, spare_nodes=1),
        cycles=3,
    )
    a = store.latest_attempt("r0")
    assert a is not None
    batch = a.nodes[0]
    write_lease(tmp_path, 0, batch, 1)
    lost = report_lost(tmp_path, store, 1)
    backend.now += 1
    rec.cycle()
    assert store.latest_attempt("r0").lost_nodes == [lost]  # type: ignore[union-attr]
    mark = len(backend.log)
    for _ in range(int(daemon_timeout(FtSettings().peer_timeout_s)) + 3):
        backend.now += 1
        rec.cycle()
    assert commands(backend, mark)[:2] == [("cancel", a.job_id), ("submit", "ftslurm:r0:1")]
    assert store.attempts("r0")[0].lost_nodes == [lost, batch]


# ------------------------------------- the look between cycles: no wait for the back-off
def test_between_cycles_the_look_sees_a_report_and_a_silent_batch_host_without_a_query(
    tmp_path, monkeypatch
):
    """However long the daemon backs off between cycles (up to a minute), its look every
    second sees a loss report, a launcher's node report and the batch host's lease falling
    silent, with no scheduler command: the daemon runs a cycle at once."""
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    nodes = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    write_lease(tmp_path, 0, nodes[0], 1)
    rec.cycle()
    mark = len(backend.log)
    limit = daemon_timeout(FtSettings().peer_timeout_s)
    for seq in range(2, 12):  # alive: nothing to do
        write_lease(tmp_path, 0, nodes[0], seq)
        backend.now += 3
        assert not rec.look()
    silent_since = backend.now
    while backend.now < silent_since + limit - 1:  # silent, not for long enough
        backend.now += 1
        assert not rec.look()
    backend.now += 2
    assert rec.look()  # the batch host's lease would be judged silent now
    assert backend.log[mark:] == []  # not one scheduler command
    write_lease(tmp_path, 0, nodes[0], 99)
    backend.now += 1
    assert not rec.look()
    (RunDir(tmp_path / "run").attempt(0) / "node-1.json").write_text("{}")  # a launcher left
    assert rec.look()
    assert not rec.look()  # once
    report_lost(tmp_path, store, 1)
    assert rec.look() and rec.look()  # until a cycle has read it
    assert backend.log[mark:] == []
    rec.cycle()
    assert store.latest_attempt("r0").attempt == 1  # type: ignore[union-attr]


def test_once_every_launcher_left_the_look_wakes_a_cycle_each_time_until_the_job_ended(
    tmp_path, monkeypatch
):
    """The scheduler's end of a job can lag its launchers' node reports (the batch
    script's last lines, an epilog): once every launcher left its report, every look wakes
    a cycle (for `ENDING_LOOK_S` at most), not only the first, so that the ending is seen
    within a second or two of the job's, not at the backed-off cycle a minute later."""
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    nodes = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    write_lease(tmp_path, 0, nodes[0], 1)
    rec.cycle()
    mark = len(backend.log)
    folder = RunDir(tmp_path / "run").attempt(0)
    assert not rec.look()
    (folder / "node-1.json").write_text("{}")
    assert rec.look()
    assert not rec.look()  # one of two launchers left: once
    write_lease(tmp_path, 0, nodes[0], 2, ended="finished")
    (folder / "node-0.json").write_text("{}")
    for _ in range(5):  # both left, the job still runs: every look
        assert rec.look()
        backend.now += 1
    assert backend.log[mark:] == []  # looks, not one scheduler command
    rec.cycle()  # the scheduler still runs the job
    assert store.attempts("r0")[0].state is AttemptState.RUNNING
    assert rec.look()
    backend.now += reconcile.ENDING_LOOK_S
    assert not rec.look()  # at most ENDING_LOOK_S: then the cycles' own pace
    (job,) = backend.running()
    backend.exited[job] = (0, None)  # the job ends
    rec.cycle()
    assert store.attempts("r0")[0].state is AttemptState.COMPLETED
    assert not rec.look()


# ------------------------------------------------------ a job of one node keeps a lease
def test_a_one_node_jobs_silent_lease_ends_it_within_the_peer_timeout(tmp_path, monkeypatch):
    """A job of one node has no peer to report it: the daemon judges its lease itself,
    after `peer_timeout_s` (no survivor's report to wait for), and runs a fresh job."""
    monkeypatch.setattr(reconcile, "_RACY_NS", -3600 * 10**9, raising=False)
    backend, store, rec = running_on_the_model(
        tmp_path, 1, FtSettings(num_job_retries_on_failure=2, preempt_time=0), cycles=3
    )
    old = store.latest_attempt("r0")
    assert old is not None and len(old.nodes) == 1
    node = old.nodes[0]
    timeout = FtSettings().peer_timeout_s
    assert daemon_timeout(timeout, 1) == timeout
    for seq in range(1, 9):
        write_lease(tmp_path, 0, node, seq)
        backend.now += 3
        rec.cycle()
    mark = len(backend.log)
    silent_since = backend.now
    while backend.now < silent_since + timeout - 1:
        backend.now += 1
        rec.cycle()
    assert commands(backend, mark) == []
    backend.now += 2
    assert rec.look()
    rec.cycle()
    assert commands(backend, mark) == [("cancel", old.job_id), ("submit", "ftslurm:r0:1")]
    first, second = store.attempts("r0")
    assert first.cause == "node_fail" and first.lost_nodes == [node], first
    assert node in backend.st.jobs[second.job_id or ""].exclude


def test_a_batch_host_launcher_that_never_started_is_judged_by_the_look_and_a_cycle(
    tmp_path, monkeypatch
):
    """No lease of node rank 0 ever comes: nothing is judged before the batch script marks
    the step's start (the setup lines may run long), then `launcher_start_timeout_s` after
    the daemon first saw the mark its look wakes a cycle (no scheduler command before),
    which ends the attempt saying the launcher never started, and a fresh job follows."""
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    nodes = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    rec.cycle()
    mark = len(backend.log)
    for _ in range(10):  # no mark: the setup lines still run, however long
        backend.now += 10
        assert not rec.look()
    run = RunDir(tmp_path / "run")
    run.attempt(0).mkdir(parents=True, exist_ok=True)
    run.launched(0).touch()
    timeout = FtSettings().launcher_start_timeout_s
    assert not rec.look()  # seen now: the timer starts
    backend.now += timeout - 1
    assert not rec.look()  # a slow import of torch: not yet
    backend.now += 2
    assert rec.look()
    assert backend.log[mark:] == []  # looks, not one scheduler command
    rec.cycle()
    (first, second) = store.attempts("r0")
    assert first.state is AttemptState.FAILED, first
    assert first.reason.startswith(
        f"the launcher never started on node {nodes[0]} (node rank 0): no sign of it"
    ), first.reason
    assert second.attempt == 1


def test_a_batch_host_lease_once_read_is_a_start(tmp_path, monkeypatch):
    backend, store, rec = two_nodes(tmp_path, monkeypatch)
    nodes = store.latest_attempt("r0").nodes  # type: ignore[union-attr]
    run = RunDir(tmp_path / "run")
    run.attempt(0).mkdir(parents=True, exist_ok=True)
    run.launched(0).touch()
    rec.cycle()
    for seq in range(1, 100):  # alive long past the start timeout
        write_lease(tmp_path, 0, nodes[0], seq)
        backend.now += 3
        assert not rec.look()
    rec.cycle()
    assert store.latest_attempt("r0").state is AttemptState.RUNNING  # type: ignore[union-attr]
