"""Fault-injection specs: parsing, and what they do to the mock scheduler."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from ftslurm.backends.mock import MockConfig, MockScheduler, controller, model, procs
from ftslurm.backends.mock.model import KillNode, Launch, MockState, Signal, SignalRank
from ftslurm.core.inject import Injection, InjectKind, env_value, parse_duration, parse_injection
from ftslurm.core.types import JobOptions, JobState, SignalTarget
from ftslurm.errors import ConfigError

from .conftest import proc_state, wait_job

T0 = 1_000.0


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("node_fail@30", Injection(InjectKind.NODE_FAIL, 30)),
        ("node_fail@2m:n3", Injection(InjectKind.NODE_FAIL, 120, node="n3")),
        ("node_fail@1h:0", Injection(InjectKind.NODE_FAIL, 3600, node_index=0)),
        ("preempt@1.5m", Injection(InjectKind.PREEMPT, 90)),
        ("crash@10s", Injection(InjectKind.CRASH, 10, rank=0)),
        ("hang@10:3", Injection(InjectKind.HANG, 10, rank=3)),
        ("straggler@0", Injection(InjectKind.STRAGGLER, 0, factor=2.0)),
        ("straggler@5:n2*3.5", Injection(InjectKind.STRAGGLER, 5, node="n2", factor=3.5)),
        ("straggler@5:1.5", Injection(InjectKind.STRAGGLER, 5, factor=1.5)),
        ("timeout@1d", Injection(InjectKind.TIMEOUT, 86400)),
        ("unhealthy@0", Injection(InjectKind.UNHEALTHY, 0)),
        ("unhealthy@0:n2", Injection(InjectKind.UNHEALTHY, 0, node="n2")),
        ("unhealthy@30:1", Injection(InjectKind.UNHEALTHY, 30, node_index=1)),
        ("nan@20", Injection(InjectKind.NAN, 20, rank=0)),
        ("nan@20:3", Injection(InjectKind.NAN, 20, rank=3)),
        ("nan@20:1:persistent", Injection(InjectKind.NAN, 20, rank=1, persistent=True)),
        ("spike@1m:persistent", Injection(InjectKind.SPIKE, 60, rank=0, persistent=True)),
        ("spike@5:2", Injection(InjectKind.SPIKE, 5, rank=2)),
    ],
)
def test_specs_parse_and_round_trip(spec, expected):
    assert parse_injection(spec) == expected
    assert parse_injection(expected.spec()) == expected


@pytest.mark.parametrize(
    "spec,message",
    [
        ("meteor@5", "unknown injection kind 'meteor'; choose one of node_fail, preempt"),
        ("crash", "malformed --inject 'crash'"),
        ("crash@soon", "malformed duration 'soon'"),
        ("crash@5:n1", "the target of crash is a rank number"),
        ("preempt@5:n1", "preempt takes no target"),
        ("timeout@0", "longer than zero"),
        ("straggler@5:n1*0.5", "factor must be above 1"),
        ("straggler@5:n1*x", "must be a number"),
        ("nan@5:n1", "the target of nan is RANK or RANK:persistent"),
        ("spike@5:1:always", "the target of spike is RANK or RANK:persistent"),
    ],
)
def test_bad_specs_are_one_line_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        parse_injection(spec)
    assert "\n" not in err.value.user_message()


def test_durations_and_env_value():
    assert parse_duration("90") == 90 and parse_duration("2h") == 7200
    both = (parse_injection("crash@5:1"), parse_injection("node_fail@5"))
    assert env_value(both) == "crash@5:1"


def running(*inject: str, **config) -> tuple[MockState, str]:
    st = MockState.create(MockConfig(**config))
    job = model.submit(st, "#!/bin/bash\n", JobOptions(nodes=2, inject=inject), T0)
    assert model.advance(st, T0, {}) == [Launch(job)]
    return st, job


def test_node_fail_fires_at_its_time_on_the_last_node_by_default():
    st, job = running("node_fail@30", slurmd_timeout_s=10)
    assert model.next_event_time(st) == T0 + 30
    assert model.advance(st, T0 + 29, {}) == []
    assert model.advance(st, T0 + 30, {}) == [KillNode(job, "n2")]
    model.advance(st, T0 + 40, {})
    assert st.jobs[job].restart_count == 1 and st.nodes["n2"].status.value == "down"
    model.revive_node(st, "n2")
    model.start_now(st, job, T0 + 41)
    assert model.advance(st, T0 + 41, {}) == [Launch(job)]
    assert model.advance(st, T0 + 100, {}) == []  # fired once, not again in attempt 2


def test_preempt_requeues_or_ends_preempted():
    st, job = running("preempt@10")
    effects = model.advance(st, T0 + 10, {})
    assert Signal(job, signal.SIGTERM, SignalTarget.ALL) in effects
    model.advance(st, T0 + 11, {job: (0, 15)})
    assert (st.jobs[job].state, st.jobs[job].restart_count) == (JobState.PENDING, 1)
    st, job = running("preempt@10", preempt_requeue=False)
    model.advance(st, T0 + 10, {})
    model.advance(st, T0 + 11, {job: (0, 15)})
    assert st.jobs[job].state is JobState.PREEMPTED


def test_crash_and_hang_signal_one_rank():
    st, job = running("crash@5:1", "hang@7")
    assert model.advance(st, T0 + 5, {}) == [SignalRank(job, 1, signal.SIGKILL)]
    assert model.advance(st, T0 + 7, {}) == [SignalRank(job, 0, signal.SIGSTOP)]


def test_injected_timeout_is_this_attempts_wall_limit():
    st, job = running("timeout@60")
    assert st.jobs[job].time_limit_s == 60
    model.advance(st, T0 + 60, {})
    model.advance(st, T0 + 61, {job: (0, 15)})
    assert st.jobs[job].state is JobState.TIMEOUT
    model.requeue(st, job, False, T0 + 62)
    model.start_now(st, job, T0 + 62)
    model.advance(st, T0 + 62, {})
    assert st.jobs[job].time_limit_s is None  # the next attempt has its own limit again


def test_a_crash_or_hang_due_before_its_rank_runs_fires_once_it_runs():
    """No process for the rank yet (its step starts later): the injection is due again
    RANK_RETRY_S later, and fires then, once."""
    st, job = running("crash@5:1")
    [effect] = model.advance(st, T0 + 5, {})
    assert effect == SignalRank(job, 1, signal.SIGKILL)
    model.rank_not_running(st, effect, T0 + 5)
    assert model.next_event_time(st) == T0 + 5 + model.RANK_RETRY_S
    assert model.advance(st, T0 + 5.1, {}) == []
    assert model.advance(st, T0 + 5 + model.RANK_RETRY_S, {}) == [effect]
    assert model.advance(st, T0 + 9, {}) == []  # it reached the rank: once


def test_crash_and_hang_on_real_mock_processes(tmp_path):
    """The hang is due before the job's step starts its ranks (forced: the batch script
    waits first): it fires once they run (before, it was lost and rank 0 trained on); the
    crash then ends the job."""
    home = tmp_path / "mock"
    scheduler = MockScheduler(home)
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(home, 0.05, stop))
    thread.start()
    try:
        beats = tmp_path / "beats"
        script = (
            "#!/bin/bash\nsleep 3\nsrun -N2 --kill-on-bad-exit=1 bash -c "
            f"'while true; do date +%s.%N > {beats}.$SLURM_PROCID; sleep 0.1; done'\n"
        )
        job = scheduler.submit(
            script, JobOptions(nodes=2, inject=("hang@1:0", "crash@20:1"), workdir=str(tmp_path))
        )
        deadline = time.monotonic() + 30
        while _task_state(scheduler.store.job_dir(job), 0) != "T":
            assert time.monotonic() < deadline, "rank 0 was not stopped"
            time.sleep(0.05)
        beat0, beat1 = (Path(f"{beats}.{r}") for r in (0, 1))
        first = beat0.read_text() if beat0.exists() else None  # (stopped before its first)
        while not beat1.exists():
            assert time.monotonic() < deadline, "rank 1 did not beat"
            time.sleep(0.05)
        other = beat1.read_text()
        while beat1.read_text() == other:  # rank 1 beats on
            assert time.monotonic() < deadline, "rank 1 did not beat again"
            time.sleep(0.05)
        assert (beat0.read_text() if beat0.exists() else None) == first  # rank 0 does not
        info = wait_job(scheduler, job, lambda i: i.state.is_terminal, 60, "the crash to end it")
        assert info.state is JobState.FAILED  # srun returned the crashed rank's status
    finally:
        stop.set()
        thread.join()
        scheduler.cancel(job)


def _task_state(job_dir: Path, rank: int) -> str:
    """The process state of one rank's task, from the mock's step records."""
    for step in sorted(job_dir.glob("steps/*.json")):
        for task in (procs.read_json(step) or {}).get("tasks", []):
            if task.get("rank") == rank and task.get("pgid"):
                return proc_state(task["pgid"])
    return "?"


def test_a_dead_task_host_ends_the_job_in_node_fail_not_failed(tmp_path):
    """srun hears nothing from a host that died: even with --kill-on-bad-exit and a rank on
    a live node failing because its peer vanished, the job ends as Slurm records it,
    NODE_FAIL once the node is declared down, and the dead node is named."""
    home = tmp_path / "mock"
    scheduler = MockScheduler(home, MockConfig(slurmd_timeout_s=2, kill_wait_s=2))
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(home, 0.05, stop))
    thread.start()
    try:
        # rank 0 (on n1) fails once rank 1's heartbeat file is 3 s old (mtime: whole seconds)
        peer = tmp_path / "peer"
        body = (
            f"if [ $SLURM_PROCID = 1 ]; then while true; do touch {peer}; sleep 0.1; done; "
            f"else sleep 0.5; while [ $(( $(date +%s) - $(stat -c %Y {peer}) )) -lt 3 ]; "
            "do sleep 0.1; done; exit 3; fi"
        )
        script = f"#!/bin/bash\nsrun -N2 --kill-on-bad-exit=1 bash -c '{body}'\n"
        job = scheduler.submit(
            script,
            JobOptions(nodes=2, requeue=False, workdir=str(tmp_path), inject=("node_fail@1",)),
        )
        info = wait_job(scheduler, job, lambda i: i.state.is_terminal, 30, "the job to end")
        assert info.state is JobState.NODE_FAIL
        assert "n2" in info.nodes
        assert {n.name: n.state for n in scheduler.nodes()}["n2"].value == "DOWN"
    finally:
        stop.set()
        thread.join()


def test_an_attempt_reaches_the_schedulers_injections_it_ran_long_enough_for():
    """What the daemon counts as fired when an attempt ends: node_fail and preempt at their
    time, timeout (the wall limit) at the start; crash, hang, straggler are the ranks' to
    report; an attempt that never ran reached none."""
    from ftslurm.core.inject import parse_injections, reached

    injections = parse_injections(
        ["node_fail@10", "preempt@30", "timeout@5m", "crash@1", "straggler@0:1*3"]
    )
    assert reached(injections, None) == ()
    assert reached(injections, 9.5) == ("timeout@300",)
    assert reached(injections, 10.0) == ("node_fail@10", "timeout@300")
    assert reached(injections, 31.0) == ("node_fail@10", "preempt@30", "timeout@300")


def test_a_new_job_carries_what_did_not_fire_and_a_straggler_always():
    from ftslurm.core.inject import parse_injections, still_to_fire

    injections = parse_injections(
        ["node_fail@10", "crash@20:1", "straggler@0:1*3", "nan@5:1", "spike@5:0:persistent"]
    )
    fired = {i.spec() for i in injections}
    left = still_to_fire(injections, fired)
    assert [i.spec() for i in left] == ["straggler@0:1*3", "spike@5:0:persistent"]
    assert still_to_fire(injections, ()) == injections


def test_the_kinds_a_job_carries_out_itself_travel_to_it():
    from ftslurm.core.inject import parse_injections

    injections = parse_injections(
        ["node_fail@10", "preempt@5", "unhealthy@0:n1", "nan@3:1:persistent", "spike@4", "crash@1"]
    )
    assert env_value(injections) == "unhealthy@0:n1,nan@3:1:persistent,spike@4:0,crash@1:0"
