"""A cancel is final whatever the timing (issue: a cancel could be lost).

The CLI only records a request (`Store.request_cancel`); the daemon never writes the flag
back and reads it again where it matters. The timing is forced: the real CLI `cancel`
runs exactly while the daemon decides how a node failure ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from ftslurm.backends.mock import MockScheduler, model
from ftslurm.backends.mock.model import MockConfig, MockState
from ftslurm.cli.main import main
from ftslurm.core.types import JobOptions, JobState
from ftslurm.daemon import policy
from ftslurm.daemon.reconcile import Reconciler, new_run_record
from ftslurm.daemon.records import Run, RunState
from ftslurm.daemon.store import DaemonLock, Store
from ftslurm.daemon.submission import make_spec
from ftslurm.recipe import load_recipe

from .conftest import wait_for
from .daemon_scenarios import Cli, write_train

T0 = 1_000.0


# ---------------------------------------------------------------------------- the store
def test_update_run_does_not_clear_a_cancel_request(tmp_path):
    store = Store(tmp_path / "home")
    run = Run("r1", "n", RunState.RUNNING, 1.0, spec={}, settings={})
    store.add_run(run)
    stale = store.get_run("r1")  # the daemon's copy, read before the request
    requested, latest = store.request_cancel("r1", 2.0)
    assert requested and latest is None
    store.update_run(replace(stale, job_retries_used=1, reason="node_fail: retry 1/2"))
    now = store.get_run("r1")
    assert now.cancel_requested and now.job_retries_used == 1  # both changes kept
    assert [e.kind for e in store.events("r1")] == ["cancel_requested"]


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


def test_cancel_while_the_daemon_decides_a_node_failure_is_final(mock_cluster, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    home, mock_home = tmp_path / "home", tmp_path / "mock"
    monkeypatch.setenv("FTSLURM_HOME", str(home))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(mock_home))
    monkeypatch.chdir(tmp_path)
    train = write_train(tmp_path)
    recipe = load_recipe(train, ["400", "0.1", "5"]).with_overrides(
        nodes=2, num_job_retries_on_failure=2)
    run_dir = home / "runs" / "race1"
    (run_dir / "logs").mkdir(parents=True)
    spec = make_spec(recipe, run_dir=run_dir, backend="mock", workdir=str(tmp_path),
                     inject=("node_fail@2",), mock_home=mock_home)  # fmt: skip
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
        seen_running.update(a.attempt for a in store.attempts("race1")
                            if a.state == JobState.RUNNING.value)  # fmt: skip
        return store.get_run("race1").state.is_terminal

    try:
        wait_for(cycle_until_ended, timeout=120, what="the run to end")
    finally:
        lock.release()
    assert cancelled == [0]
    final = store.get_run("race1")
    assert final.state is RunState.CANCELLED and final.reason == "cancelled by the user"
    assert final.cancel_requested  # the request was not written over
    assert final.job_retries_used == 1  # the node failure's retry stays counted
    attempts = store.attempts("race1")
    assert attempts[0].cause == "node_fail"
    assert seen_running <= {0}  # no later attempt ever reached RUNNING
    running = [e.data["attempt"] for e in store.events("race1") if e.kind == "running"]
    assert running == [0]
    jobs = {a.job_id for a in attempts if a.job_id}
    tags = {a.tag for a in attempts}
    infos = list(backend.query(sorted(jobs)).values())
    infos += [j for t in tags for j in backend.find_jobs(t)]
    assert infos and not [i for i in infos if i.state.is_active], infos
