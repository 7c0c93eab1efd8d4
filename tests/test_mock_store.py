"""The mock cluster's store: what an operation reads, parses and writes, and what it keeps
apart (batch scripts), with several stores and processes sharing one cluster."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from ftslurm.backends.mock import MockConfig, MockNodeSpec, MockScheduler, model, procs
from ftslurm.backends.mock import store as mock_store
from ftslurm.backends.mock.model import MockState
from ftslurm.backends.mock.store import DB_FILE, MockStore
from ftslurm.core.types import JobInfo, JobOptions, JobState
from ftslurm.errors import ConfigError, FtslurmError

from .conftest import wait_for

T0 = 1_000.0
SCRIPT = "#!/bin/bash\n" + "# a line of a rendered batch script\n" * 50


def scheduler(home: Path, config: MockConfig | None = None) -> MockScheduler:
    return MockScheduler(home, config, clock=lambda: T0)  # time stands still: no timed events


def held(s: MockScheduler, comment: str = "c") -> str:
    return s.submit(SCRIPT, JobOptions(comment=comment, hold=True, env={"A": "1"}))


def data_version(conn: sqlite3.Connection) -> int:
    """SQLite's counter of commits by other connections than `conn`."""
    return conn.execute("PRAGMA data_version").fetchone()[0]


def test_read_only_operations_write_nothing(tmp_path, monkeypatch):
    s = scheduler(tmp_path)
    job = held(s)
    watcher = sqlite3.connect(tmp_path / DB_FILE)
    before = data_version(watcher)
    dumps = []
    real = MockState.model_dump_json

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        dumps.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MockState, "model_dump_json", counting)
    assert s.query([job])[job].state is JobState.PENDING
    assert [n.name for n in s.nodes()] == ["n1", "n2", "n3", "n4"]
    assert [j.job_id for j in s.find_jobs("c")] == [job]
    assert [j.job_id for j in s.active_jobs()] == [job]
    assert s.cluster_facts().version == "mock"
    s.tick()
    assert dumps == [] and data_version(watcher) == before  # not even serialised
    s.release(job)  # a change is written
    assert dumps == [1] and data_version(watcher) != before


def test_the_state_is_parsed_again_only_after_another_store_wrote(tmp_path, monkeypatch):
    reader, writer = scheduler(tmp_path), scheduler(tmp_path)
    job = held(writer)
    parses = []
    real = MockState.model_validate_json.__func__

    def counting(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        parses.append(1)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(MockState, "model_validate_json", classmethod(counting))
    reader.query([job])
    parses.clear()
    assert reader.query([job])[job].state is JobState.PENDING
    assert parses == []  # nothing changed: the cached state serves
    writer.cancel(job)
    parses.clear()
    assert reader.query([job])[job].state is JobState.CANCELLED
    assert parses == [1]


def test_a_change_made_by_another_process_is_seen(tmp_path):
    reader = scheduler(tmp_path)
    job = held(reader)
    assert reader.query([job])[job].reason == "JobHeldUser"
    code = (
        "import sys; from ftslurm.backends.mock import MockScheduler; "
        "MockScheduler(sys.argv[1]).update_excluded_nodes(sys.argv[2], ['n2'])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path), job], check=True, timeout=60)
    with reader.store.transaction() as st:
        assert st.jobs[job].exclude == ["n2"]


def test_a_cluster_destroyed_and_created_again_is_not_taken_for_the_cached_one(tmp_path):
    first = scheduler(tmp_path, MockConfig(first_job_id=1))
    old = held(first, comment="old")
    assert [j.job_id for j in first.find_jobs("old")] == [old]
    for name in (DB_FILE, DB_FILE + "-wal", DB_FILE + "-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    again = scheduler(tmp_path, MockConfig(first_job_id=1))
    assert held(again, comment="new") == old  # the same job id, in another cluster
    assert first.find_jobs("old") == []
    assert [j.comment for j in first.active_jobs()] == ["new"]


def test_each_mock_cluster_numbers_its_jobs_from_an_id_of_its_own(tmp_path, monkeypatch):
    """Two mock clusters on one machine: their job ids differ (each starts at a block of
    1000 ids of its own, from 100000), unless a config names Slurm's FirstJobId."""
    monkeypatch.setattr(mock_store, "id_counter_dir", lambda: tmp_path / "ids", raising=False)
    firsts = {held(scheduler(tmp_path / f"c{k}")) for k in range(3)}
    assert len(firsts) == 3 and all(int(j) >= 100000 and int(j) % 1000 == 0 for j in firsts)
    fixed = scheduler(tmp_path / "fixed", MockConfig(first_job_id=1))
    assert [held(fixed) for _ in range(3)] == ["1", "2", "3"]


def test_two_mock_clusters_get_disjoint_ids_though_both_would_start_at_one_point(
    tmp_path, monkeypatch
):
    """Chance forced to pick the same starting point for both: the machine-wide counter
    still gives each cluster a block of its own, taken under a lock (several processes)."""
    monkeypatch.setattr(mock_store, "id_counter_dir", lambda: tmp_path / "ids", raising=False)
    monkeypatch.setattr(mock_store.secrets, "randbelow", lambda n: 0)
    a, b = scheduler(tmp_path / "a"), scheduler(tmp_path / "b")
    ids_a = {held(a) for _ in range(5)}
    ids_b = {held(b) for _ in range(5)}
    assert not ids_a & ids_b
    assert min(map(int, ids_a)) == 100000 and min(map(int, ids_b)) == 101000
    # other processes take the next blocks from the same counter, none twice
    code = (
        "import sys; from pathlib import Path; from ftslurm.backends.mock import store; "
        "print(store.first_job_id(Path(sys.argv[1])))"
    )
    procs_ = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "ids")], stdout=subprocess.PIPE
        )
        for _ in range(4)
    ]
    try:
        got = [int(p.communicate(timeout=60)[0]) for p in procs_]
    finally:
        for p in procs_:
            p.kill()
            p.wait()
    assert sorted(got) == [102000, 103000, 104000, 105000]


def test_a_damaged_or_unusable_id_counter_still_gives_a_first_id(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(mock_store.secrets, "randbelow", lambda n: 7)
    ids = tmp_path / "ids"
    assert mock_store.first_job_id(ids) == 107000  # a new counter starts at random
    (ids / "next.json").write_text("{not json")
    with caplog.at_level("WARNING", logger=mock_store.__name__):
        again = mock_store.first_job_id(ids)
    assert "damaged" in caplog.text and again == 107000  # started again, at random
    assert mock_store.first_job_id(ids) == 108000  # the counter was written again, whole
    assert json.loads((ids / "next.json").read_text()) == {"next_block": 109}
    (ids / "next.json").write_text('{"next_block": 99999999}')  # out of range: damaged
    assert mock_store.first_job_id(ids) == 107000
    caplog.clear()
    (tmp_path / "a-file").write_text("")
    with caplog.at_level("WARNING", logger=mock_store.__name__):
        fallback = mock_store.first_job_id(tmp_path / "a-file" / "ids")  # cannot be made
    assert fallback % 1000 == 0 and 100000 <= fallback <= 60000000
    assert len(caplog.records) == 1 and "no machine-wide counter" in caplog.text


def test_scripts_and_environments_are_kept_apart_from_the_state(tmp_path):
    s = scheduler(tmp_path)
    job = held(s)
    with sqlite3.connect(tmp_path / DB_FILE) as conn:
        body = conn.execute("SELECT body FROM state").fetchone()[0]
        script, env = conn.execute(
            "SELECT script, env FROM launch WHERE job_id = ?", (job,)
        ).fetchone()
    assert "a rendered batch script" not in body and '"A"' not in body
    assert script == SCRIPT and json.loads(env)["A"] == "1"
    with s.store.transaction() as st:
        assert s.store.launch_spec(st.jobs[job]) == (SCRIPT, json.loads(env))


def test_a_cluster_of_the_previous_schema_is_brought_to_this_one(tmp_path):
    st = MockState.create()
    job = model.submit(st, SCRIPT, JobOptions(hold=True, env={"A": "1"}), T0)
    with sqlite3.connect(tmp_path / DB_FILE) as conn:  # as the previous version stored it
        conn.execute(
            "CREATE TABLE state (id INTEGER PRIMARY KEY CHECK (id = 1), schema INTEGER, body TEXT)"
        )
        conn.execute("INSERT INTO state VALUES (1, 1, ?)", (st.model_dump_json(),))
    s = scheduler(tmp_path)
    assert s.query([job])[job].state is JobState.PENDING
    with s.store.transaction() as now:
        assert s.store.launch_spec(now.jobs[job]) == (SCRIPT, {"A": "1"})


@pytest.mark.parametrize(
    "damage, said",
    [
        ("DELETE FROM launch", "its batch script is missing from"),
        ("UPDATE launch SET env = '{not json'", "its stored environment is damaged"),
        ("UPDATE launch SET script = 'echo no interpreter'", "its stored batch script is damaged"),
    ],
)
def test_a_missing_or_damaged_script_fails_its_job_with_one_line(tmp_path, damage, said):
    home, workdir = tmp_path / "mock", tmp_path / "work"
    workdir.mkdir()
    s = MockScheduler(home)
    job = s.submit(SCRIPT, JobOptions(hold=True, workdir=str(workdir)))
    with sqlite3.connect(home / DB_FILE) as conn:
        conn.execute(damage)
    with s.store.transaction() as st, pytest.raises(ConfigError, match=said) as err:
        s.store.launch_spec(st.jobs[job])
    assert "\n" not in str(err.value) and f"mock job {job}:" in str(err.value)
    try:
        s.release(job)  # it starts: its launch finds the damage
        info = wait_for(
            lambda: (i := s.query([job])[job]).state.is_terminal and i,
            timeout=30,
            what="the job's end",
        )
        assert (info.state, info.exit_code) == (JobState.FAILED, 1)
        lines = (workdir / f"slurm-{job}.out").read_text().splitlines()
        assert len(lines) == 1 and said in lines[0]
    finally:
        procs.reap(MockStore(home).job_dir(job))


# ------------------------------------------------------------------ change counting
_OPS = (
    "submit",
    "advance",
    "exit",
    "cancel",
    "requeue",
    "release",
    "start_now",
    "exclude",
    "fail_node",
    "revive_node",
    "drain_node",
    "preempt",
)
_INJECT = ("", "node_fail@20", "preempt@10", "crash@5", "timeout@30")


def _apply(st: MockState, op: str, k: int, now: float) -> list[model.Effect]:
    ids = sorted(st.jobs, key=int)
    job = ids[k % len(ids)] if ids else "1"
    node = f"n{k % 2 + 1}"
    match op:
        case "submit":
            inject = (_INJECT[k % len(_INJECT)],) if _INJECT[k % len(_INJECT)] else ()
            model.submit(
                st,
                "#!/bin/bash\n",
                JobOptions(
                    nodes=k % 2 + 1,
                    hold=k % 3 == 0,
                    time_limit="1" if k % 2 else None,
                    signal="USR1@30" if k % 4 == 1 else None,
                    inject=inject,
                ),
                now,
            )
            return []
        case "advance":
            return model.advance(st, now, {})
        case "exit":
            return model.advance(st, now, {job: (k % 3, None)})
        case "cancel":
            return model.cancel(st, job, now)
        case "requeue":
            return model.requeue(st, job, k % 2 == 0, now)
        case "release":
            model.release(st, job)
        case "start_now":
            model.start_now(st, job, now)
        case "exclude":
            model.update_excluded_nodes(st, job, [node])
        case "fail_node":
            return model.fail_node(st, node, now)
        case "revive_node":
            model.revive_node(st, node)
        case "drain_node":
            model.drain_node(st, node, "bad")
        case "preempt":
            return model.preempt(st, job, now)
    return []


@settings(max_examples=80, deadline=None)
@given(
    hs.lists(hs.tuples(hs.sampled_from(_OPS), hs.integers(0, 11), hs.integers(0, 200)), max_size=40)
)
def test_every_change_of_the_state_is_counted(steps):
    """The store writes the state back only when `model.changes()` moved, and the scheduler
    advances a second time only then: a change the count misses would be lost."""
    nodes = [MockNodeSpec(name="n1"), MockNodeSpec(name="n2")]
    st = MockState.create(
        MockConfig(
            nodes=nodes, requeue_delay_s=10, min_job_age_s=50, kill_wait_s=5, slurmd_timeout_s=20
        )
    )
    now = T0
    for op, k, dt in steps:
        now += dt
        before, counted = st.model_dump_json(), model.changes()
        try:
            effects = _apply(st, op, k, now)
        except FtslurmError:
            effects = []
        advancing = op in ("advance", "exit")
        if st.model_dump_json() != before or (advancing and effects):
            assert model.changes() != counted, (op, k)
        elif advancing:
            assert model.advance(st, now, {}) == [] and st.model_dump_json() == before


def test_job_info_is_the_same_as_constructed():
    """`model.job_info` fills a JobInfo's fields directly (a query of 10,000 jobs is mostly
    that): the result must be what JobInfo's own constructor makes, every field set."""
    st = MockState.create()
    running = model.submit(st, "#!/bin/bash\n", JobOptions(comment="r", time_limit="5"), T0)
    ended = model.submit(st, "#!/bin/bash\n", JobOptions(name="e"), T0)
    model.advance(st, T0, {})
    model.advance(st, T0 + 1, {ended: (3, None)})
    names = {f.name for f in dataclasses.fields(JobInfo)}
    for job, accounting in ((st.jobs[running], False), (st.jobs[ended], True)):
        info = model.job_info(job, T0 + 2, from_accounting=accounting)
        assert set(vars(info)) == names
        assert info == JobInfo(**{name: getattr(info, name) for name in names})


def test_a_tick_that_ends_a_job_at_its_limit_writes_it_for_the_other_processes(tmp_path):
    """The controller's tick that finds a job at its time limit signals it and writes the
    ending, so every other process (a CLI, the daemon) sees it ending."""
    now = [T0]
    controller = MockScheduler(tmp_path, clock=lambda: now[0])
    job = controller.submit(
        "#!/bin/bash\nsleep 60\n", JobOptions(time_limit="0:05", workdir=str(tmp_path))
    )
    try:
        assert controller.query([job])[job].state is JobState.RUNNING
        now[0] += 10  # past the limit
        controller.tick()
        other = MockScheduler(tmp_path, clock=lambda: now[0])
        assert other.query([job])[job].state is not JobState.RUNNING
    finally:
        procs.reap(controller.store.job_dir(job))
