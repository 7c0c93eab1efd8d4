"""A cancel is final whatever the timing (issue: a cancel could be lost).

The CLI only records a request (`Store.request_cancel`); the daemon never writes the flag
back and reads it again where it matters. The timing is forced: the real CLI `cancel`
runs exactly while the daemon decides how a node failure ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockScheduler, model
from ftslurm.backends.mock.model import MockConfig, MockState
from ftslurm.cli.main import main
from ftslurm.core.types import JobOptions, JobState
from ftslurm.daemon import policy
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import AttemptState, Run, RunState, new_run_record
from ftslurm.daemon.store import DaemonLock, StaleRecord, Store
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.recipe import load_recipe

from .conftest import wait_for
from .daemon_scenarios import Cli, write_train

T0 = 1_000.0


# ---------------------------------------------------------------------------- the store
def test_a_copy_read_before_a_cancel_request_cannot_be_written_back(tmp_path):
    store = Store(tmp_path / "home")
    run = Run("r1", "n", RunState.RUNNING, 1.0, spec={}, settings={})
    store.add_run(run)
    stale = store.get_run("r1")  # the daemon's copy, read before the request
    requested, latest = store.request_cancel("r1", 2.0)
    assert requested and latest is None
    with pytest.raises(StaleRecord):  # decided without the cancel: decide again
        store.update_run(replace(stale, job_retries_used=1, reason="node_fail: retry 1/2"))
    assert store.get_run("r1").job_retries_used == 0
    fresh = store.get_run("r1")  # read again: it knows the cancel, and writing it keeps it
    store.update_run(replace(fresh, job_retries_used=1, cancel_requested=False))
    now = store.get_run("r1")
    assert now.cancel_requested and now.job_retries_used == 1  # both changes kept
    assert store.request_cancel("r1", 3.0)[0]  # asked again: still requested, and a copy
    store.update_run(now)  # read after the first request is not stale for a repeat
    assert [e.kind for e in store.events("r1")] == ["cancel_requested", "cancel_requested"]


def test_the_daemons_own_writes_in_one_pass_do_not_make_it_stale(tmp_path):
    """One step's intents may write the same records twice (the job seen running: its
    record and the run's state; the checkpoint signal due at once: the record again), each
    from a copy carrying the version read at the start of the pass. The daemon's own first
    write must not make the second stale, or every pass would end there."""
    from ftslurm.core.settings import FtSettings
    from ftslurm.recipe import Recipe

    from .test_reconcile_property import ModelBackend

    backend = ModelBackend()
    store = Store(tmp_path / "home")
    ft = FtSettings(preempt_time=120)
    spec = make_spec(
        Recipe(command=["true"], nodes=1, time="5:00"),
        run_dir=tmp_path / "run",
        backend="mock",
        workdir=str(tmp_path),
        mock_home=tmp_path / "mock",
    )
    run, first = new_run_record("r0", "r0", spec, ft, backend.now)
    store.add_run(run)
    store.add_attempt(first)
    script, options = build_attempt("r0", run.spec, run.settings, 0, ())
    job_id = backend.submit(script, options)  # it starts at once on the idle model
    store.update_attempt(replace(first, job_id=job_id, state=AttemptState.PENDING))
    backend.now += 200  # first seen running when the signal is due (300 s - 120 s lead)
    rec = Reconciler(store, lambda _kind: backend, clock=lambda: backend.now)
    for _ in range(3):
        rec.cycle()
    (a,) = store.attempts("r0")
    assert a.state == JobState.RUNNING.value and a.checkpoint_signal_at is not None
    assert store.get_run("r0").state is RunState.RUNNING
    assert [m for _, m, _ in backend.log if m == "signal"] == ["signal"]
    kinds = [e.kind for e in store.events("r0")]
    assert kinds.count("running") == 1 and kinds.count("checkpoint_signal") == 1


def test_request_cancel_reads_the_latest_attempt_and_refuses_an_ended_run(tmp_path):
    from ftslurm.daemon.records import Attempt

    store = Store(tmp_path / "home")
    store.add_run(Run("r1", "n", RunState.RUNNING, 1.0, spec={}, settings={}))
    store.add_attempt(Attempt("r1", 0, "FAILED", job_id="7"))
    store.add_attempt(Attempt("r1", 1, "PENDING", job_id="8"))
    requested, latest = store.request_cancel("r1", 2.0)
    assert requested and latest is not None and latest.job_id == "8"
    store.add_run(Run("r2", "n", RunState.COMPLETED, 1.0, spec={}, settings={}))
    assert store.request_cancel("r2", 2.0) == (False, None)
    assert not store.get_run("r2").cancel_requested
    assert store.request_cancel("nope", 2.0) == (False, None)


# ---------------------------------------------------------------------------- the mock
def test_the_mock_cancels_a_job_in_the_middle_of_a_requeue():
    """As Slurm (scancel of a requeued job still completing prevents the requeue): the job
    ends CANCELLED instead of coming back held."""
    st = MockState.create(MockConfig())
    job = model.submit(st, "#!/bin/bash\ntrue\n", JobOptions(), T0)
    model.advance(st, T0, {})
    model.requeue(st, job, True, T0 + 1)
    assert st.jobs[job].state is JobState.COMPLETING
    model.cancel(st, job, T0 + 2)
    model.advance(st, T0 + 3, {job: (0, 15)})  # its processes are gone
    assert st.jobs[job].state is JobState.CANCELLED
    model.release(st, job)
    assert model.advance(st, T0 + 500, {}) == []  # never launched again


def test_the_mock_cancels_a_job_held_after_a_requeue():
    st = MockState.create(MockConfig())
    job = model.submit(st, "#!/bin/bash\ntrue\n", JobOptions(), T0)
    model.advance(st, T0, {})
    model.requeue(st, job, True, T0 + 1)
    model.advance(st, T0 + 2, {job: (0, 15)})
    assert (st.jobs[job].state, st.jobs[job].held) == (JobState.PENDING, True)
    model.cancel(st, job, T0 + 3)
    assert st.jobs[job].state is JobState.CANCELLED


def test_the_mock_refuses_more_nodes_than_the_partition_has():
    from ftslurm.errors import SchedulerRejected

    st = MockState.create(MockConfig())
    with pytest.raises(SchedulerRejected):
        model.submit(st, "#!/bin/bash\ntrue\n", JobOptions(nodes=99), T0)
    assert st.jobs == {}


# ---------------------------------------------------------------------------- the daemon
@pytest.fixture
def mock_cluster(tmp_path) -> Iterator[Cli]:
    c = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    config = tmp_path / "mock.json"
    config.write_text('{"kill_wait_s": 5}')
    c("mock", "up", "--config", str(config), "--slurmd-timeout", "2", "--min-job-age", "60")
    yield c
    c("mock", "destroy", check=False)


def test_cancel_while_the_daemon_decides_a_node_failure_is_final(
    mock_cluster, tmp_path, monkeypatch
):
    home, mock_home = tmp_path / "home", tmp_path / "mock"
    monkeypatch.setenv("FTSLURM_HOME", str(home))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(mock_home))
    monkeypatch.chdir(tmp_path)
    train = write_train(tmp_path)
    recipe = load_recipe(train, ["400", "0.1", "5"]).with_overrides(
        nodes=2, num_job_retries_on_failure=2
    )
    run_dir = home / "runs" / "race1"
    (run_dir / "logs").mkdir(parents=True)
    spec = make_spec(
        recipe,
        run_dir=run_dir,
        backend="mock",
        workdir=str(tmp_path),
        inject=("node_fail@2",),
        mock_home=mock_home,
    )
    store = Store(home)
    run, attempt = new_run_record("race1", "race", spec, recipe.settings(), time.time())
    store.add_run(run)
    store.add_attempt(attempt)
    lock = DaemonLock(home)  # this test is the daemon: `cancel` must not start another
    lock.acquire()
    backend = MockScheduler(mock_home)
    rec = Reconciler(store, lambda _key: backend)

    real_decide = policy.decide
    cancelled: list[int] = []

    def decide(cause, ending, budget, settings, cancel_requested=False):  # type: ignore[no-untyped-def]
        if cause is policy.Cause.NODE_FAIL and not cancelled:
            cancelled.append(main(["cancel", "race1"]))  # the user, at the worst moment
        return real_decide(cause, ending, budget, settings, cancel_requested)

    monkeypatch.setattr(policy, "decide", decide)
    seen_running: set[int] = set()

    def cycle_until_ended() -> bool:
        rec.cycle()
        seen_running.update(
            a.attempt for a in store.attempts("race1") if a.state == JobState.RUNNING.value
        )
        return store.get_run("race1").state.is_terminal

    try:
        wait_for(cycle_until_ended, timeout=120, what="the run to end")
    finally:
        lock.release()
    assert cancelled == [0]
    final = store.get_run("race1")
    assert final.state is RunState.CANCELLED and final.reason == "cancelled by the user"
    assert final.cancel_requested  # the request was not written over
    # the decision taken without the cancel was not written (its copy was stale): decided
    # again knowing the cancel, so no retry was spent and no next attempt recorded
    assert final.job_retries_used == 0
    assert [e.data["verdict"] for e in store.events("race1") if e.kind == "ended"] == ["cancel"]
    attempts = store.attempts("race1")
    assert len(attempts) == 1
    # as seen when decided: Slurm's NODE_FAIL ending then the cancel is a cancel; the
    # surviving launcher's report of the lost node, read first, makes the loss the cause
    # (the node was lost before the cancel), and the cancel still ends the run
    expected = "node_fail" if attempts[0].lost_nodes else "cancelled"
    assert attempts[0].cause == expected, attempts[0]
    assert seen_running <= {0}  # no later attempt ever reached RUNNING
    running = [e.data["attempt"] for e in store.events("race1") if e.kind == "running"]
    assert running == [0]
    jobs = {a.job_id for a in attempts if a.job_id}
    tags = {a.tag for a in attempts}
    infos = list(backend.query(sorted(jobs)).values())
    infos += [j for t in tags for j in backend.find_jobs(t)]
    assert infos and not [i for i in infos if i.state.is_active], infos


# ------------------------------------------------------------ a cancel at every write point
class CancelAt:
    """Runs the real `ftslurm cancel` at one write point of the daemon's store: before or
    after the k-th write (k = 0: before the cycle begins; k = DECIDE: while the daemon
    decides, after it read the run and before it writes the decision). A write inside a
    transaction
    holds SQLite's write lock, so the command's own write gets in when that transaction
    ends, as it would from another process: the cancel runs then."""

    DECIDE = -2
    WRITES = (
        "update_attempt",
        "update_run",
        "add_attempt",
        "flag_node",
        "unflag_node",
        "append_event",
    )

    def __init__(self, store: Store, run_id: str, k: int, after: bool) -> None:
        self.store, self.run_id, self.k, self.after = store, run_id, k, after
        self.calls = 0
        self.fired_at: int | None = None  # the backend log's length when the cancel ran
        self.due = False  # fire when the current transaction ends
        self.log: list[tuple[str, str, str]] | None = None
        self.armed = False
        for name in self.WRITES:
            setattr(store, name, self._wrap(name, getattr(store, name)))
        real_transaction = store.transaction

        @contextmanager
        def transaction() -> Iterator[None]:
            outermost = store._depth == 0
            try:
                with real_transaction():
                    yield
            finally:
                if outermost and self.due:
                    self.fire()

        store.transaction = transaction  # type: ignore[method-assign]

    def _wrap(self, name: str, method):  # type: ignore[no-untyped-def]
        def write(*args, **kwargs):  # type: ignore[no-untyped-def]
            if not self.armed or self.fired_at is not None or self.due:
                return method(*args, **kwargs)
            self.calls += 1
            if self.calls != self.k:
                return method(*args, **kwargs)
            if self.store._depth:  # the command waits for this transaction to end
                self.due = True
                return method(*args, **kwargs)
            if not self.after:
                self.fire()
            result = method(*args, **kwargs)
            if self.after:
                self.fire()
            return result

        return write

    def fire(self) -> None:
        self.due = False
        assert self.log is not None
        self.fired_at = len(self.log)
        assert main(["cancel", self.run_id]) == 0


def _node_failure_run(tmp: Path):  # type: ignore[no-untyped-def]
    """A run of 2 nodes running on the mock's model (virtual clock) whose node just failed."""

    from .test_reconcile_property import running_on_the_model

    backend, store, rec = running_on_the_model(tmp, nodes=2)
    (a,) = store.attempts("r0")
    assert a.state == JobState.RUNNING.value and len(a.nodes) == 2
    node = a.nodes[1]
    backend._step(lambda: (None, model.fail_node(backend.st, node, backend.now)))
    backend.now += backend.st.config.slurmd_timeout_s + 5  # the scheduler notices
    return backend, store, rec


def test_a_cancel_at_any_write_point_of_a_node_failure_is_never_lost(tmp_path, monkeypatch):
    from ftslurm.cli import submit as submit_cli

    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    # the command cancels the job on the same simulated cluster; it need not wait for a
    # submission under way (this test is the daemon, and answers only when it returns)
    monkeypatch.setattr(submit_cli, "SUBMIT_WAIT_S", 0.0)

    # how many writes the daemon makes handling the failure, up to the next attempt running
    backend, store, rec = _node_failure_run(tmp_path / "count")
    counter = CancelAt(store, "r0", k=-1, after=False)
    counter.armed, counter.log = True, backend.log
    for _ in range(10):
        rec.cycle()
        backend.now += 1
        if store.latest_attempt("r0").state == JobState.RUNNING.value:
            break
    assert store.latest_attempt("r0").attempt == 1 and store.get_run("r0").job_retries_used == 1
    points = counter.calls
    assert points >= 5, points

    real_decide = policy.decide

    def decide(*args, **kwargs):  # type: ignore[no-untyped-def]
        if cancel.k == CancelAt.DECIDE and cancel.fired_at is None:
            cancel.fire()  # the user, at the worst moment
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(policy, "decide", decide)
    moments = [*range(points + 1), CancelAt.DECIDE]
    for i in range(50):
        k, after = moments[i % len(moments)], (i // len(moments)) % 2 == 1
        tmp = tmp_path / str(i)
        backend, store, rec = _node_failure_run(tmp)
        monkeypatch.setenv("FTSLURM_HOME", str(tmp / "home"))
        monkeypatch.setattr(submit_cli, "create_backend", lambda *_a, b=backend, **_k: b)
        lock = DaemonLock(tmp / "home")  # the test is the daemon: `cancel` starts none
        lock.acquire()
        try:
            cancel = CancelAt(store, "r0", k, after)
            cancel.log = backend.log
            if k == 0:
                cancel.fire()
            cancel.armed = True
            for _ in range(30):
                rec.cycle()
                if store.get_run("r0").state.is_terminal:
                    break
                backend.now += 31
        finally:
            lock.release()
        where = f"cancel {'after' if after else 'before'} write {k} of {points}"
        requested = [e.event_id for e in store.events("r0") if e.kind == "cancel_requested"]
        decided = [
            e.data["verdict"]
            for e in store.events("r0", since_id=requested[0])
            if e.kind == "ended"
        ]
        assert set(decided) <= {"cancel"}, (where, decided)  # none taken without the cancel
        assert cancel.fired_at is not None, where
        final = store.get_run("r0")
        assert final.state is RunState.CANCELLED, (where, final)
        assert final.reason == "cancelled by the user" and final.cancel_requested, where
        assert final.job_retries_used <= 1, where
        jobs = {a.job_id for a in store.attempts("r0") if a.job_id}
        tags = {a.tag for a in store.attempts("r0")}
        late = [
            (m, key)
            for _, m, key in backend.log[cancel.fired_at :]
            if m in ("submit", "release", "start_now") and (key in jobs or key in tags)
        ]
        assert not late, (where, late)  # nothing brought back after the cancel
        assert backend.active_by_comment_prefix("ftslurm:r0:") == [], where
        ended = [e.data["attempt"] for e in store.events("r0") if e.kind == "ended"]
        assert ended == sorted(set(ended)), (where, ended)  # each attempt decided once
        store.close()
