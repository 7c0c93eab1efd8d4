"""The daemon carries out a cycle's requeues, exclusions, releases and start-nows at its
end, each kind as one batch action for all its jobs: a cycle in which many runs end costs a
constant number of scheduler commands. Driven on the daemon-scale benchmark's in-memory
scheduler, every protocol call counted as one command."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import daemon_scale
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import AttemptState, RunState
from ftslurm.errors import JobStateConflict

RUNS = 100  # half of them running: 50 jobs lose their node


def churn(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The benchmark's state after two quiet cycles, then every running job's node dies."""
    store, backend, inner, running = daemon_scale.build(tmp_path, RUNS, "memory")
    rec = Reconciler(store, lambda _kind: backend)  # type: ignore[arg-type,return-value]
    for _ in range(2):
        rec.cycle()
    backend.take()
    now = time.time()
    for job in running:
        inner.fail_node_of(job, now)
    runs = {
        a.job_id: r.run_id
        for r in store.list_runs()
        if (a := store.latest_attempt(r.run_id)) is not None
    }
    return store, backend, inner, running, rec, runs


def test_fifty_endings_cost_one_requeue_then_one_of_each_batch_action(tmp_path):
    store, backend, inner, running, rec, runs = churn(tmp_path)
    assert len(running) == 50
    rec.cycle()  # sees the 50 endings: records the intents, then one requeue for all
    assert backend.take()[0] == {"nodes": 1, "query": 1, "requeue_many": 1}
    assert all(inner.jobs[j].restart_count == 1 and inner.jobs[j].held for j in running)
    rec.cycle()  # brings them back: one exclusion (one node list for all), release, start
    assert backend.take()[0] == {
        "nodes": 1,
        "query": 1,
        "release_many": 1,
        "start_now_many": 1,
        "update_excluded_nodes_many": 1,
    }
    excluded = {inner.jobs[j].exclude for j in running}
    assert len(excluded) == 1 and excluded != {()}
    assert not any(inner.jobs[j].held for j in running)
    for job in running:
        a = store.latest_attempt(runs[job])
        assert (a.attempt, a.state, a.job_id) == (1, AttemptState.PENDING, job)
        assert [e.kind for e in store.events(runs[job])].count("requeued") == 1
    rec.cycle()  # nothing left to do: the steady cycle again
    assert backend.take()[0] == {"query": 1}


def test_a_refused_release_waits_for_the_next_cycle_and_the_others_go_on(tmp_path, monkeypatch):
    store, backend, inner, running, rec, runs = churn(tmp_path)
    rec.cycle()
    backend.take()
    refusing = running[7]
    real_release = inner.release

    def release(job_id: str) -> None:
        if job_id == refusing:
            raise JobStateConflict(f"Job is no longer pending execution for job {job_id}")
        real_release(job_id)

    monkeypatch.setattr(inner, "release", release)
    started: list[str] = []
    monkeypatch.setattr(inner, "start_now", started.append)
    rec.cycle()
    commands = backend.take()[0]
    assert commands["release_many"] == commands["start_now_many"] == 1
    assert sorted(started) == sorted(j for j in running if j != refusing)  # not the refused
    assert inner.jobs[refusing].held
    assert store.latest_attempt(runs[refusing]).state is AttemptState.REQUEUING
    for job in running:
        if job != refusing:
            assert store.latest_attempt(runs[job]).state is AttemptState.PENDING
    monkeypatch.setattr(inner, "release", real_release)
    rec.cycle()  # the next cycle brings it back
    assert not inner.jobs[refusing].held and refusing in started
    assert store.latest_attempt(runs[refusing]).state is AttemptState.PENDING


def test_a_refused_requeue_steps_its_attempt_again_the_others_are_requeued(tmp_path, monkeypatch):
    store, backend, inner, running, rec, runs = churn(tmp_path)
    refusing = running[3]
    real_requeue = inner.requeue

    def requeue(job_id: str, *, hold: bool = False) -> None:
        if job_id == refusing:  # e.g. the controller forgot it: it cannot come back
            raise JobStateConflict(f"Requested operation is presently disabled for job {job_id}")
        real_requeue(job_id, hold=hold)

    monkeypatch.setattr(inner, "requeue", requeue)
    rec.cycle()
    commands = backend.take()[0]
    # one requeue for all; the refused one is looked at again (one query) and submitted afresh
    assert commands == {"nodes": 1, "query": 2, "requeue_many": 1, "submit": 1}
    assert all(inner.jobs[j].restart_count == 1 for j in running if j != refusing)
    assert inner.jobs[refusing].restart_count == 0
    a = store.latest_attempt(runs[refusing])
    assert a.attempt == 1 and a.state is AttemptState.PENDING and a.job_id != refusing
    assert store.get_run(runs[refusing]).state is not RunState.FAILED


def test_a_cancel_requested_before_the_batch_release_keeps_the_job_held(tmp_path, monkeypatch):
    store, backend, inner, running, rec, runs = churn(tmp_path)
    rec.cycle()
    backend.take()
    cancelled = running[5]
    real_update = inner.update_excluded_nodes

    def update(job_id: str, nodes) -> None:  # type: ignore[no-untyped-def]
        if job_id == cancelled:  # the user cancels while the daemon acts on the batch
            store.request_cancel(runs[cancelled], time.time())
        real_update(job_id, nodes)

    monkeypatch.setattr(inner, "update_excluded_nodes", update)
    rec.cycle()
    assert inner.jobs[cancelled].held  # never released
    assert inner.jobs[cancelled].state.is_terminal  # stepped again: cancelled
    assert not any(inner.jobs[j].held for j in running if j != cancelled)
    for _ in range(2):
        rec.cycle()
    assert store.get_run(runs[cancelled]).state is RunState.CANCELLED
