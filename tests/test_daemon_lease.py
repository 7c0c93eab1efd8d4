"""One daemon per state directory across hosts: the lease in the state database.

Two hosts sharing a home directory are played on this one: the second "host" is a daemon
run in this process with another host name (its lock file is then another, as it would be
on another machine, where the first host's flock may not reach). The worst moment is forced
with SIGSTOP: the serving daemon is paused past the lease timeout, the other takes over,
and the paused one, resumed, finds its lease taken and stops before it acts again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftslurm.core.leases import DaemonLease, Seen, daemon_lease_verdict, observe
from ftslurm.daemon import service
from ftslurm.daemon import store as store_mod
from ftslurm.daemon.store import DaemonAlreadyRunning, Store
from ftslurm.fsutil import STATE_FS_ENV

from .conftest import wait_for

HERE = "login1"


def lease(host: str = "login2", seq: int = 0, ended: str | None = None) -> DaemonLease:
    return DaemonLease(f"{host}:7:ab", host, 7, seq, 1000.0 + seq, ended)


# ------------------------------------------------------------------------- the rule
def test_a_free_released_or_own_hosts_lease_is_taken_at_once():
    seen = Seen(0, changed_at=0.0)
    assert daemon_lease_verdict(None, seen, host=HERE, now=0.0) == "take"
    assert daemon_lease_verdict(lease(ended="stopped"), seen, host=HERE, now=0.0) == "take"
    # this host's lock is the caller's: the daemon that wrote it here is gone
    assert daemon_lease_verdict(lease(host=HERE), seen, host=HERE, now=0.0) == "take"


def test_another_hosts_lease_is_held_once_it_moves_and_taken_once_silent():
    seen = observe(Seen(0, changed_at=0.0), lease(seq=3), 0.0, 0.0)
    assert daemon_lease_verdict(lease(seq=3), seen, host=HERE, now=5.0, timeout=60) == "wait"
    moved = observe(seen, lease(seq=4), 5.0, 5.0)
    assert daemon_lease_verdict(lease(seq=4), moved, host=HERE, now=5.0, timeout=60) == "held"
    # silent from the first read on, on the reader's own clock (the writer's is never read)
    assert daemon_lease_verdict(lease(seq=3), seen, host=HERE, now=60.0, timeout=60) == "wait"
    assert daemon_lease_verdict(lease(seq=3), seen, host=HERE, now=60.1, timeout=60) == "take"


def test_two_daemons_that_read_the_same_lease_cannot_both_take_it(tmp_path):
    with Store(tmp_path) as a, Store(tmp_path) as b:
        assert a.daemon_lease() is None
        assert a.swap_daemon_lease(lease("hostA"), None)
        assert not b.swap_daemon_lease(lease("hostB"), None)  # it read "free": too late
        seen = b.daemon_lease()
        assert seen == lease("hostA")
        assert a.swap_daemon_lease(lease("hostA", seq=1), lease("hostA"))  # a renewal
        assert not b.swap_daemon_lease(lease("hostB"), seen)  # it moved since b read it
        assert b.daemon_lease() == lease("hostA", seq=1)


# ------------------------------------------------------------------ two hosts, one home
def start_daemon(home: Path, timeout_s: float) -> subprocess.Popen[str]:
    env = dict(os.environ, FTSLURM_HOME=str(home))
    return subprocess.Popen(
        [sys.executable, "-m", "ftslurm", "daemon", "run", "--lease-timeout", str(timeout_s)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def serve_elsewhere(
    home: Path, timeout_s: float, stop: threading.Event, errors: list[BaseException]
) -> threading.Thread:
    def run() -> None:
        try:
            service.serve(home, stop=stop, lease_timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def owner_host(home: Path) -> str | None:
    with Store(home) as s:
        held = s.daemon_lease()
    return held.host if held is not None and held.ended is None else None


@pytest.mark.slow
def test_a_second_hosts_daemon_refuses_a_live_one_and_replaces_a_silent_one(tmp_path, monkeypatch):
    home, timeout = tmp_path / "home", 3.0
    # a home shared by two hosts is on a network filesystem: a rollback journal, no WAL
    monkeypatch.setenv(STATE_FS_ENV, "network")
    first = start_daemon(home, timeout)
    try:
        wait_for(lambda: owner_host(home) == service.this_host(), 30, "the first daemon's lease")
        monkeypatch.setattr(service, "this_host", lambda: "login2")
        # 1. the first daemon lives: the second one sees its lease renewed and refuses
        stop, errors = threading.Event(), []
        began = time.monotonic()
        serve_elsewhere(home, timeout, stop, errors).join(timeout=30)
        assert len(errors) == 1 and isinstance(errors[0], DaemonAlreadyRunning), errors
        assert f"on host {store_mod.this_host()}" in errors[0].message
        assert time.monotonic() - began < timeout  # told by a renewal, not by the timeout
        assert service.serving(home) == service.Serving(store_mod.this_host(), first.pid, False)
        # 2. the first daemon is paused past the timeout (its host gone, as far as anyone
        # can tell): the second takes the lease over and serves
        os.kill(first.pid, signal.SIGSTOP)
        stop, errors = threading.Event(), []
        second = serve_elsewhere(home, timeout, stop, errors)
        wait_for(lambda: owner_host(home) == "login2" or errors, 30, "the takeover")
        assert not errors and owner_host(home) == "login2"
        # 3. the first one wakes up: it finds its lease taken and stops by itself
        os.kill(first.pid, signal.SIGCONT)
        out, _ = first.communicate(timeout=30)
        assert first.returncode == 0, out
        assert "was taken over" in out and "stopping" in out, out
        assert owner_host(home) == "login2"  # it did not take it back
        stop.set()
        second.join(timeout=30)
        assert not second.is_alive() and not errors
        with Store(home) as s:
            released = s.daemon_lease()
        assert released is not None and (released.host, released.ended) == ("login2", "stopped")
        assert not (home / "state.db-wal").exists()
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
            first.wait()


def test_stop_and_status_name_the_host_of_a_daemon_serving_from_elsewhere(tmp_path, monkeypatch):
    home = tmp_path / "home"
    with Store(home) as s:
        s.swap_daemon_lease(DaemonLease("far:42:ab", "far", 42, 0, time.time()), None)
    found = service.serving(home)
    assert found == service.Serving("far", 42, False) and found.describe() == "pid 42 on host far"
    with pytest.raises(service.FtslurmError, match="runs on host far"):
        service.stop(home)
    assert service.start(home) == found  # no second daemon is started here
    # a lease silent (by this host's clock) for longer than the timeout is not served
    with Store(home) as s:
        s.swap_daemon_lease(
            DaemonLease("far:42:ab", "far", 42, 1, time.time() - 3600), s.daemon_lease()
        )
    assert service.serving(home) is None
