"""The daemon's state store (SQLite, WAL) and the one-daemon-per-directory lock."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import selectors
import sqlite3
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ftslurm import fsutil
from ftslurm.backends.mock.store import MockStore
from ftslurm.daemon.records import SUBMITTING, Attempt, Event, NodeFlag, Run, RunState
from ftslurm.daemon.store import (
    SCHEMA_VERSION,
    DaemonAlreadyRunning,
    DaemonLock,
    StaleRecord,
    StateError,
    Store,
    lock_name,
    schema,
    this_host,
)
from ftslurm.errors import ConfigError, FtslurmError
from ftslurm.fsutil import STATE_FS_ENV


def make_run(run_id: str = "r1", created_at: float = 100.0, **kw: object) -> Run:
    base = Run(
        run_id=run_id,
        name=f"name-{run_id}",
        state=RunState.RUNNING,
        created_at=created_at,
        spec={"script": "train.py", "nodes": 2, "env": {"A": "1"}, "args": ["--lr", 0.1]},
        settings={"max_job_retries": 3, "exclude_failed_nodes": True, "ratio": 0.5},
        job_retries_used=2,
        cause_counts={"node_failure": 1, "timeout": 1},
        continuations=4,
        stalled_continuations=1,
        last_checkpoint_step=1200,
        reason="node failure on n3",
        cancel_requested=True,
        ended_at=None,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def make_attempt(run_id: str = "r1", attempt: int = 0, **kw: object) -> Attempt:
    base = Attempt(
        run_id=run_id,
        attempt=attempt,
        state="FAILED",
        job_id=f"{1000 + attempt}",
        tag=f"ftslurm:{run_id}:{attempt}",
        restart_count=1,
        nodes=["n1", "n2"],
        submitted_at=10.5,
        start=11.25,
        end=99.75,
        exit_code=137,
        signal=9,
        reason="NodeFail",
        cause="node_failure",
        in_job_restarts=2,
        checkpoint_signal_at=90.0,
        failure_seen_at=100.5,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "home")
    yield s
    s.close()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------- round trips
def test_run_round_trip(store: Store) -> None:
    run = make_run(ended_at=123.5)
    store.add_run(run)
    got = store.get_run("r1")
    assert got == run
    assert isinstance(got.state, RunState)
    assert store.get_run("missing") is None
    minimal = Run("r2", "n", RunState.PENDING, 5.0, spec={}, settings={})
    store.add_run(minimal)
    assert store.get_run("r2") == minimal


def test_find_runs_by_unique_prefix_and_exact_id(store: Store) -> None:
    for run_id in ("ab12", "ab12cd", "ab9", "Ab1x", "a%1"):
        store.add_run(make_run(run_id))
    ids = lambda prefix: [r.run_id for r in store.find_runs(prefix)]  # noqa: E731
    assert ids("ab12") == ["ab12"]  # an exact id wins over longer ids it prefixes
    assert ids("ab1") == ["ab12", "ab12cd"]  # ambiguous: both, for the error message
    assert ids("ab9") == ["ab9"] and ids("ab12c") == ["ab12cd"]
    assert ids("A") == ["Ab1x"]  # case-sensitive
    assert ids("a%") == ["a%1"] and ids("%") == [] and ids("zz") == []  # no wildcards


def test_add_run_twice_raises(store: Store) -> None:
    store.add_run(make_run())
    with pytest.raises(StateError, match="already exists"):
        store.add_run(make_run(name="other"))
    assert store.get_run("r1") == make_run()


def test_columns_are_queryable(store: Store) -> None:
    store.add_run(make_run())
    with sqlite3.connect(store.path) as db:
        row = db.execute(
            "SELECT state, name, created_at, job_retries_used, reason, spec FROM runs"
        ).fetchone()
    assert row[:5] == ("RUNNING", "name-r1", 100.0, 2, "node failure on n3")
    assert '"script": "train.py"' in row[5]


def test_attempt_round_trip(store: Store) -> None:
    store.add_run(make_run())
    a = make_attempt()
    store.add_attempt(a)
    assert store.attempts("r1") == [a]
    bare = Attempt("r1", 1, SUBMITTING)
    store.add_attempt(bare)
    assert store.attempts("r1") == [a, bare]
    with pytest.raises(StateError, match="already exists"):
        store.add_attempt(bare)
    with pytest.raises(StateError, match="unknown run"):
        store.add_attempt(Attempt("nope", 0, SUBMITTING))


def test_update_replaces_whole_records(store: Store) -> None:
    run = make_run()
    store.add_run(run)
    store.add_attempt(make_attempt())
    done = replace(
        run,
        state=RunState.COMPLETED,
        reason=None,
        cause_counts={},
        last_checkpoint_step=None,
        cancel_requested=False,
        ended_at=200.0,
    )
    store.update_run(done)
    # all but the cancel request, which only `request_cancel` sets (a stale copy must not
    # undo it)
    assert store.get_run("r1") == replace(done, cancel_requested=True)
    a = replace(
        make_attempt(),
        state="COMPLETED",
        nodes=[],
        exit_code=0,
        signal=None,
        cause="completed",
        job_id="2000",
    )
    store.update_attempt(a)
    assert store.attempts("r1") == [a]
    with pytest.raises(StateError):
        store.update_run(make_run("ghost"))
    with pytest.raises(StateError):
        store.update_attempt(make_attempt(attempt=7))


def test_list_runs_order_and_active_filter(store: Store) -> None:
    states = [
        RunState.COMPLETED,
        RunState.RUNNING,
        RunState.FAILED,
        RunState.PENDING,
        RunState.CANCELLED,
    ]
    for i, state in enumerate(states):
        # inserted out of creation order: the listing sorts by created_at
        store.add_run(make_run(f"r{i}", created_at=100.0 - i, state=state))
    assert [r.run_id for r in store.list_runs()] == ["r4", "r3", "r2", "r1", "r0"]
    assert [r.run_id for r in store.list_runs(active_only=True)] == ["r3", "r1"]
    assert all(not r.state.is_terminal for r in store.list_runs(active_only=True))


def test_latest_attempt(store: Store) -> None:
    store.add_run(make_run("r1"))
    store.add_run(make_run("r2", created_at=200.0))
    assert store.latest_attempt("r1") is None
    store.add_attempt(make_attempt("r1", 0, job_id="10"))
    store.add_attempt(make_attempt("r1", 2, job_id="11"))
    store.add_attempt(make_attempt("r1", 1, job_id="10"))  # the same job id, requeued
    store.add_attempt(make_attempt("r2", 0, job_id="20"))
    assert store.latest_attempt("r1").attempt == 2
    assert [a.attempt for a in store.attempts("r1")] == [0, 1, 2]


def test_active_heads_give_the_versions_of_active_runs_and_their_latest_attempts(
    store: Store,
) -> None:
    store.add_run(make_run("r1", created_at=2.0))
    store.add_run(make_run("r0", created_at=1.0, cancel_requested=False))
    store.add_run(make_run("r2", created_at=3.0))  # no attempt yet
    store.add_run(make_run("done", created_at=0.5, state=RunState.COMPLETED))
    for a in (make_attempt("r1", 0), make_attempt("r1", 1), make_attempt("r0", 0)):
        store.add_attempt(a)
    a = store.latest_attempt("r1")
    store.update_attempt(a)
    store.request_cancel("r0", 5.0)  # moves the run's version on (it had no request yet)
    store.update_run(replace(store.get_run("r0"), reason="x"))
    assert store.active_heads() == [("r0", 2, 0, 0), ("r1", 0, 1, 1), ("r2", 0, None, None)]
    got = store.latest_attempts(["r0", "r1", "r2"])
    assert {k: (v.attempt, v.version) for k, v in got.items()} == {"r0": (0, 0), "r1": (1, 1)}


def test_runs_by_id_share_the_decoded_settings_of_the_same_text(store: Store) -> None:
    for i in range(3):
        store.add_run(make_run(f"r{i}", settings={"x": 1} if i < 2 else {"x": 2}))
    shared: dict = {}
    runs = store.runs_by_id(["r0", "r1", "r2", "missing"], shared)
    assert sorted(runs) == ["r0", "r1", "r2"]
    assert runs["r0"].settings is runs["r1"].settings and runs["r2"].settings == {"x": 2}
    assert runs["r0"] == store.get_run("r0")
    assert runs["r0"].spec is not runs["r1"].spec  # only the settings are shared


def test_the_stamp_moves_on_with_every_commit_of_any_connection(tmp_path: Path) -> None:
    with Store(tmp_path / "home") as daemon, Store(tmp_path / "home") as command:
        first = daemon.stamp()
        assert daemon.stamp() == first  # nothing written
        daemon.list_runs()
        assert daemon.stamp() == first  # reading writes nothing
        command.add_run(make_run("r1"))  # another connection (a command)
        second = daemon.stamp()
        assert second != first
        daemon.append_event("r1", "x", {}, 1.0)  # its own
        third = daemon.stamp()
        assert third != second
        command.request_cancel("r1", 2.0)
        assert daemon.stamp() != third


# ---------------------------------------------------------------------- events
def test_events_append_only_and_filters(store: Store) -> None:
    store.add_run(make_run("r1"))
    ids = [
        store.append_event("r1", "created", {"recipe": "a.yaml"}, 1.0),
        store.append_event(None, "daemon_started", {"pid": 42}, 2.0),
        store.append_event("r2", "submitted", {"job_id": "7", "exclude": ["n1"]}, 3.0),
        store.append_event("r1", "ended", {"nested": {"x": [1, 2.5, None]}}, 4.5),
    ]
    assert ids == sorted(ids) and len(set(ids)) == 4
    all_events = store.events()
    assert all_events[0] == Event(ids[0], 1.0, "r1", "created", {"recipe": "a.yaml"})
    assert all_events[3] == Event(ids[3], 4.5, "r1", "ended", {"nested": {"x": [1, 2.5, None]}})
    assert [e.event_id for e in all_events] == ids
    assert [e.kind for e in store.events("r1")] == ["created", "ended"]
    assert [e.event_id for e in store.events(since_id=ids[1])] == ids[2:]
    assert [e.event_id for e in store.events("r1", since_id=ids[0])] == [ids[3]]
    assert [e.event_id for e in store.events(limit=2)] == ids[:2]
    assert store.events(since_id=ids[3]) == []
    # ids keep growing, also after the highest row would be gone
    with sqlite3.connect(store.path) as db:
        db.execute("DELETE FROM events WHERE event_id = ?", (ids[3],))
    assert store.append_event("r1", "again", {}, 5.0) > ids[3]


# ---------------------------------------------------------------------- node flags
def test_node_flags(store: Store) -> None:
    flags = [
        NodeFlag("n1", "node_failure", 10.0, None, "r1"),
        NodeFlag("n2", "xid 79", 11.0, 50.0),
        NodeFlag("n3", "slow", 12.0, 100.0, "r2"),
    ]
    for f in flags:
        store.flag_node(f)
    assert store.node_flags() == flags
    assert store.node_flags(now=49.0) == flags
    assert store.node_flags(now=50.0) == [flags[0], flags[2]]
    assert store.node_flags(now=1000.0) == [flags[0]]
    newer = NodeFlag("n2", "again", 60.0, 200.0, "r3")
    store.flag_node(newer)  # replaces the old flag
    assert store.node_flags(now=150.0) == [flags[0], newer]
    assert store.unflag_node("n2") is True
    assert store.unflag_node("n2") is False
    assert [f.node for f in store.node_flags()] == ["n1", "n3"]


def test_a_flag_is_removed_by_its_reason_only_while_it_is_still_that_one(store: Store) -> None:
    """What exit 17 asks (issue 30): remove the run's result-validation flags, not a flag
    that replaced one since or another run's."""
    store.flag_node(NodeFlag("n1", "result validation (exit 16)", 10.0, 99.0, "r1"))
    store.flag_node(NodeFlag("n2", "node_fail under the run", 11.0, 99.0, "r1"))
    store.flag_node(NodeFlag("n3", "result validation (exit 16)", 12.0, 99.0, "r2"))
    reason = "result validation (exit 16)"
    assert store.unflag_node("n2", reason, "r1") is False
    assert store.unflag_node("n3", reason, "r1") is False
    assert store.unflag_node("n1", reason, "r1") is True
    assert [f.node for f in store.node_flags()] == ["n2", "n3"]


# ---------------------------------------------------------------------- database file
def test_permissions_and_pragmas(tmp_path: Path) -> None:
    home = tmp_path / "deep" / "home"
    old = os.umask(0o022)
    try:
        s = Store(home)
    finally:
        os.umask(old)
    try:
        assert s.path == home / "state.db"
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE(s.path.stat().st_mode) == 0o600
        s.append_event(None, "x", {}, 1.0)
        wal = home / "state.db-wal"
        assert wal.exists()
        assert stat.S_IMODE(wal.stat().st_mode) == 0o600
        shm = home / "state.db-shm"
        if shm.exists():
            assert stat.S_IMODE(shm.stat().st_mode) == 0o600
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert s._db.execute("PRAGMA busy_timeout").fetchone()[0] == 10000
        assert s.schema_version() == SCHEMA_VERSION
    finally:
        s.close()


def test_reopen_keeps_data_and_skips_migrations(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    with Store(home) as s:
        s.add_run(make_run())
        s.append_event("r1", "created", {}, 1.0)
    # A next version adds a table; a re-run of it (or of an earlier one) would fail.
    migrations = [*schema.MIGRATIONS, (SCHEMA_VERSION + 1, ["CREATE TABLE extra (x)"])]
    monkeypatch.setattr(schema, "MIGRATIONS", migrations)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    for _ in range(2):
        with Store(home) as s:
            assert s.schema_version() == SCHEMA_VERSION + 1
            assert s.get_run("r1") == make_run()
            assert len(s.events()) == 1
    with sqlite3.connect(home / "state.db") as db:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "attempts", "events", "node_flags", "extra"} <= names


def test_failed_migration_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    Store(home).close()
    migrations = [
        *schema.MIGRATIONS,
        (SCHEMA_VERSION + 1, ["CREATE TABLE extra (x)", "NOT SQL AT ALL"]),
    ]
    monkeypatch.setattr(schema, "MIGRATIONS", migrations)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(StateError, match="syntax error"):
        Store(home)
    with sqlite3.connect(home / "state.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert (
            db.execute("SELECT count(*) FROM sqlite_master WHERE name='extra'").fetchone()[0] == 0
        )


def test_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with Store(home) as s:
        s.add_run(make_run())
    db = sqlite3.connect(home / "state.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    db.close()
    before = file_digest(home / "state.db")
    with pytest.raises(StateError) as info:
        Store(home)
    err = info.value
    assert isinstance(err, FtslurmError)
    assert "\n" not in err.user_message()
    assert f"version {SCHEMA_VERSION + 5}" in err.message
    assert f"up to version {SCHEMA_VERSION}" in err.message
    assert file_digest(home / "state.db") == before


# ---------------------------------------------------------------------- transactions
def test_transaction_rolls_back_every_write(store: Store) -> None:
    store.add_run(make_run("keep"))
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.add_run(make_run("r1"))
            store.add_attempt(make_attempt("r1"))
            store.update_run(make_run("keep", state=RunState.FAILED))
            store.append_event("r1", "created", {}, 1.0)
            store.flag_node(NodeFlag("n1", "bad", 1.0, None))
            store.unflag_node("n1")
            raise RuntimeError("boom")
    assert [r.run_id for r in store.list_runs()] == ["keep"]
    assert store.get_run("keep").state is RunState.RUNNING
    assert store.attempts("r1") == []
    assert store.events() == []
    assert store.node_flags() == []
    # the store is usable afterwards
    store.append_event(None, "after", {}, 2.0)
    assert [e.kind for e in store.events()] == ["after"]


def test_transaction_nests_and_is_invisible_until_commit(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with Store(home) as s, Store(home) as other:
        with s.transaction():
            s.add_run(make_run("r1"))
            with s.transaction():
                s.add_attempt(make_attempt("r1"))
            with pytest.raises(ValueError):
                with s.transaction():  # an inner failure undoes only its own writes
                    s.append_event("r1", "lost", {}, 1.0)
                    raise ValueError("inner")
            s.append_event("r1", "kept", {}, 2.0)
            assert other.get_run("r1") is None  # not committed yet
        assert other.get_run("r1") == make_run("r1")
        assert len(other.attempts("r1")) == 1
        assert [e.kind for e in other.events()] == ["kept"]


# ---------------------------------------------------------------------- processes
def _append_events(home: str, worker: int, count: int, barrier) -> None:
    barrier.wait(timeout=60)
    with Store(home) as s:  # every worker opens (and may create) the database itself
        barrier.wait(timeout=60)  # all have opened it: now they write at once
        for i in range(count):
            s.append_event(f"w{worker}", "tick", {"worker": worker, "i": i}, float(i))
            # paced as writers are (a daemon's cycle writes a few records): SQLite queues no
            # one, so with a rollback journal a process that writes in a tight loop can keep
            # another out past the busy timeout on a loaded machine
            time.sleep(0.002)


@pytest.mark.parametrize("state_fs", ["local", "network"])
def test_concurrent_processes_append(tmp_path: Path, monkeypatch, state_fs) -> None:
    """Four processes append at once; with the state on a network filesystem (forced) the
    database keeps a rollback journal and the same holds."""
    monkeypatch.setenv(STATE_FS_ENV, state_fs)  # the spawned writers inherit it
    home = str(tmp_path / "home")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_append_events, args=(home, w, 200, barrier)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with Store(home) as s:
        assert s.journal == ("delete" if state_fs == "network" else "wal")
        assert not (Path(home) / "state.db-wal").exists() or state_fs == "local"
        events = s.events()
        assert len(events) == 800
        ids = [e.event_id for e in events]
        assert len(set(ids)) == 800 and ids == sorted(ids)
        for w in range(4):
            mine = s.events(f"w{w}")
            assert [e.data["i"] for e in mine] == list(range(200))  # each writer's order kept


def test_on_a_network_filesystem_the_database_keeps_a_rollback_journal(tmp_path, monkeypatch):
    """WAL's shared-memory index cannot be shared by two hosts: on NFS, Lustre, GPFS, ...
    (statfs, or FTSLURM_STATE_FS=network) the database uses a rollback journal, and a
    database made elsewhere in WAL is switched when nobody else has it open."""
    home = tmp_path / "home"
    with Store(home, network=False) as s:  # made on a local disk: WAL
        s.append_event(None, "x", {}, 1.0)
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    monkeypatch.setenv(STATE_FS_ENV, "network")
    with Store(home) as s:
        assert s.network and s._db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        s.append_event(None, "y", {}, 2.0)
        s.checkpoint()  # a no-op without WAL
        assert [e.kind for e in s.events()] == ["x", "y"]
        assert not (home / "state.db-wal").exists() and not (home / "state.db-shm").exists()
        assert s.backup().exists()
    # the filesystem is asked when nothing is forced
    monkeypatch.setenv(STATE_FS_ENV, "auto")
    monkeypatch.setattr(fsutil, "filesystem_type", lambda _p: 0x6969)  # NFS_SUPER_MAGIC
    assert fsutil.network_filesystem(home) == "NFS" and Store(home).journal == "delete"
    monkeypatch.setattr(fsutil, "filesystem_type", lambda _p: 0xEF53)  # ext4
    assert fsutil.network_filesystem(home) is None and Store(home).journal == "wal"
    monkeypatch.setenv(STATE_FS_ENV, "sometimes")
    with pytest.raises(ConfigError, match="FTSLURM_STATE_FS='sometimes'"):
        Store(home)


def test_the_filesystem_of_a_path_is_told_by_statfs(tmp_path):
    assert fsutil.filesystem_type(tmp_path) is not None
    assert fsutil.filesystem_type(tmp_path / "not" / "yet") == fsutil.filesystem_type(tmp_path)
    if Path("/dev/shm").is_dir():
        assert fsutil.filesystem_type("/dev/shm") == 0x01021994  # TMPFS_MAGIC: local
        assert fsutil.network_filesystem("/dev/shm") is None


def test_the_mock_schedulers_state_follows_the_same_rule(tmp_path, monkeypatch):
    monkeypatch.setenv(STATE_FS_ENV, "network")
    mock = MockStore(tmp_path / "mock")
    with mock._connect() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


# ---------------------------------------------------------------------- daemon lock
CHILD = (
    "import sys\n"
    "from ftslurm.daemon.store import DaemonLock\n"
    "lock = DaemonLock(sys.argv[1])\n"
    "lock.acquire()\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


def _wait_for_line(proc: subprocess.Popen, expected: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(left):
                line = proc.stdout.readline()
                if line.strip() == expected:
                    return
                if not line:
                    raise AssertionError(f"child exited ({proc.wait()}) before {expected!r}")
        raise AssertionError(f"child did not print {expected!r} within {timeout}s")
    finally:
        sel.close()


def test_daemon_lock_across_processes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert DaemonLock.holder_pid(home) is None
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(home)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        _wait_for_line(proc, "locked", timeout=60)
        assert stat.S_IMODE((home / lock_name(this_host())).stat().st_mode) == 0o600
        assert DaemonLock.holder_pid(home) == proc.pid
        lock = DaemonLock(home)
        with pytest.raises(DaemonAlreadyRunning) as info:
            lock.acquire()
        assert info.value.message == f"a daemon is already running for {home} (pid {proc.pid})"
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == 0
    assert DaemonLock.holder_pid(home) is None  # the lock ended with its process
    lock.acquire()
    try:
        assert DaemonLock.holder_pid(home) == os.getpid()
        lock.acquire()  # already held by this object: nothing to do
        with pytest.raises(DaemonAlreadyRunning, match=f"pid {os.getpid()}"):
            DaemonLock(home).acquire()  # another holder, even in the same process
    finally:
        lock.release()
    assert DaemonLock.holder_pid(home) is None
    with DaemonLock(home):
        assert DaemonLock.holder_pid(home) == os.getpid()
    assert DaemonLock.holder_pid(home) is None


# ---------------------------------------------------------------------- one writer
def test_updates_are_compare_and_set_on_the_version(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with Store(home) as daemon, Store(home) as other:  # two connections, as two processes
        run = make_run()
        daemon.add_run(run)
        daemon.add_attempt(make_attempt())
        assert run.version == 0 and daemon.get_run("r1").version == 0
        mine, theirs = daemon.get_run("r1"), other.get_run("r1")
        daemon.update_run(replace(mine, reason="first"))
        assert daemon.get_run("r1").version == 1
        with pytest.raises(StaleRecord) as info:  # theirs was read at version 0
            other.update_run(replace(theirs, reason="overwritten"))
        assert isinstance(info.value, StateError) and "\n" not in info.value.user_message()
        assert "version 0, now 1" in info.value.message
        assert daemon.get_run("r1").reason == "first"  # nothing written over
        again = replace(other.get_run("r1"), reason="second")
        other.update_run(again)
        again.reason = "third"
        other.update_run(again)  # a copy that was written carries its new version
        assert again.version == 3 and daemon.get_run("r1").version == 3
        assert daemon.get_run("r1").reason == "third"

        a, b = daemon.attempts("r1")[0], other.attempts("r1")[0]
        daemon.update_attempt(replace(a, state="COMPLETED"))
        with pytest.raises(StaleRecord):
            other.update_attempt(replace(b, state="FAILED"))
        stored = daemon.attempts("r1")[0]
        assert (stored.state, stored.version) == ("COMPLETED", 1)
        with pytest.raises(StateError, match="no attempt 7") as missing:
            daemon.update_attempt(make_attempt(attempt=7))
        assert not isinstance(missing.value, StaleRecord)


def test_a_write_in_a_rolled_back_transaction_leaves_the_copy_stale(store: Store) -> None:
    store.add_run(make_run())
    copy = store.get_run("r1")
    with pytest.raises(RuntimeError), store.transaction():
        store.update_run(replace(copy, reason="undone"))
        raise RuntimeError("boom")
    stale = replace(copy, version=1)  # what the rolled-back write left in its copy
    with pytest.raises(StaleRecord):
        store.update_run(stale)  # a false conflict: read again, never a lost update
    assert store.get_run("r1") == make_run() and store.get_run("r1").version == 0


def test_upgrade_from_a_version_1_database_keeps_the_data(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    with monkeypatch.context() as m:  # a database written by the ftslurm of schema 1
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
        m.setattr(schema, "SCHEMA_VERSION", 1)
        with Store(home) as old:
            old._db.execute(
                "INSERT INTO runs VALUES ('r1', 'name-r1', 'RUNNING', 100.0, NULL,"
                " '{}', '{}', 2, '{}', 0, 0, NULL, 'why', 1)"
            )
            old._db.execute(
                "INSERT INTO attempts VALUES ('r1', 0, 'RUNNING', '1000', "
                "'ftslurm:r1:0', 0, '[\"n1\"]', 10.0, 11.0, NULL, NULL, NULL, "
                "NULL, NULL, 0, NULL, NULL)"
            )
            old.append_event("r1", "created", {}, 1.0)
            old.flag_node(NodeFlag("n2", "node_fail", 5.0, None, "r1"))
            assert old.schema_version() == 1
    with Store(home) as s:
        assert s.schema_version() == SCHEMA_VERSION == 5
        run = s.get_run("r1")
        assert (run.name, run.job_retries_used, run.reason, run.cancel_requested) == (
            "name-r1",
            2,
            "why",
            True,
        )
        assert run.injected == []
        assert run.version == 0
        (a,) = s.attempts("r1")
        assert (a.job_id, a.nodes, a.version, a.lost_nodes) == ("1000", ["n1"], 0, [])
        assert [e.kind for e in s.events()] == ["created"]
        assert [f.node for f in s.node_flags()] == ["n2"]
        s.update_run(replace(run, reason="upgraded"))  # compare-and-set works on old rows
        s.update_attempt(replace(a, state="COMPLETED"))
        assert (s.get_run("r1").version, s.attempts("r1")[0].version) == (1, 1)
        assert s.pending_requests() == []


def test_the_lost_nodes_an_attempt_acted_on_are_stored(store: Store) -> None:
    """Which lost nodes an attempt acted on survives a daemon restart (schema 3)."""
    store.add_run(Run("r1", "r1", RunState.RUNNING, 1.0, {}, {}))
    store.add_attempt(Attempt("r1", 0, "RUNNING", job_id="5"))
    a = store.latest_attempt("r1")
    store.update_attempt(replace(a, lost_nodes=["n2", "n4"]))
    assert store.latest_attempt("r1").lost_nodes == ["n2", "n4"]
    assert store.attempts("r1")[0].lost_nodes == ["n2", "n4"]


def test_the_injections_that_fired_in_a_run_are_stored(store: Store) -> None:
    """Which fault injections fired survives a daemon restart (schema 5): each fires once
    per run."""
    store.add_run(Run("r1", "r1", RunState.RUNNING, 1.0, {}, {}))
    assert store.get_run("r1").injected == []
    store.update_run(replace(store.get_run("r1"), injected=["node_fail@10"]))
    assert store.get_run("r1").injected == ["node_fail@10"]
    assert store.list_runs()[0].injected == ["node_fail@10"]


def test_requests_are_recorded_and_applied_once(store: Store) -> None:
    first = store.add_request("nodes_add", {"nodes": ["n1"]}, 10.0)
    second = store.add_request("nodes_remove", {"nodes": ["n2"]}, 11.0)
    assert second > first
    assert [(r.request_id, r.kind, r.data) for r in store.pending_requests()] == [
        (first, "nodes_add", {"nodes": ["n1"]}),
        (second, "nodes_remove", {"nodes": ["n2"]}),
    ]
    assert store.finish_request(first, {"applied": ["n1"]}, 12.0) is True
    assert store.finish_request(first, {"applied": []}, 13.0) is False  # once
    done = store.get_request(first)
    assert (done.applied_at, done.result) == (12.0, {"applied": ["n1"]})
    assert [r.request_id for r in store.pending_requests()] == [second]
    assert store.get_request(999) is None


def test_a_request_that_cannot_be_applied_on_a_full_disk_does_not_stop_the_polling(tmp_path):
    """A pending `nodes add` on a full disk: the daemon still looks at its runs (a job's
    ending is seen), reports the full disk, and applies the request once there is room."""
    from ftslurm.core.settings import FtSettings
    from ftslurm.daemon import user_requests
    from ftslurm.daemon.reconcile import Reconciler
    from ftslurm.daemon.records import new_run_record
    from ftslurm.daemon.store import DiskFull
    from ftslurm.daemon.submission import make_spec
    from ftslurm.recipe import Recipe

    from .test_reconcile_property import ModelBackend

    backend = ModelBackend()
    store = Store(tmp_path / "home")
    spec = make_spec(
        Recipe(command=["true"], nodes=1, time="10:00"),
        run_dir=tmp_path / "run",
        backend="mock",
        workdir=str(tmp_path),
        mock_home=tmp_path / "mock",
    )
    run, first = new_run_record("r0", "r0", spec, FtSettings(), backend.now)
    store.add_run(run)
    store.add_attempt(first)
    rec = Reconciler(store, lambda _kind: backend, clock=lambda: backend.now)
    rec.cycle()
    assert store.latest_attempt("r0").job_id
    request_id = store.add_request(*user_requests.nodes_add(["n9"], "bad", None), backend.now)
    real_flag = store.flag_node

    def no_room(_flag):  # type: ignore[no-untyped-def]
        raise DiskFull("database or disk is full")

    store.flag_node = no_room  # type: ignore[method-assign]
    before = len(backend.log)
    with pytest.raises(DiskFull):
        rec.cycle()
    assert "query" in [m for _, m, _ in backend.log[before:]]  # the runs were looked at
    assert store.get_request(request_id).applied_at is None
    store.flag_node = real_flag  # type: ignore[method-assign]
    rec.cycle()
    assert [f.node for f in store.node_flags()] == ["n9"]
