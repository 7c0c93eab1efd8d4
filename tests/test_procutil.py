"""Whether a process runs (`ftslurm.procutil`), with real processes: the one pid check the
mock scheduler and the local cluster share."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from ftslurm.procutil import pid_alive, stat_fields

from .conftest import wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_a_zombie_is_not_alive_and_neither_is_a_reaped_process():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert pid_alive(proc.pid)
        assert stat_fields(proc.pid)[2] == str(os.getpgrp())  # state, ppid, pgrp
        os.kill(proc.pid, signal.SIGKILL)
        # not reaped yet: it still answers kill(0), as a zombie
        wait_for(lambda: (stat_fields(proc.pid) or ["?"])[0] == "Z", what="a zombie")
        os.kill(proc.pid, 0)
        assert not pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not pid_alive(proc.pid) and stat_fields(proc.pid) is None


def test_no_pid_is_not_alive():
    """0 and None name no process (kill(0, 0) would ask this process group)."""
    assert not pid_alive(0) and not pid_alive(None)
    assert pid_alive(os.getpid())
