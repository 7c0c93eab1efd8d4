"""Reading which processes catch a signal (`ftslurm.agent.sigmask`), with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftslurm.agent.sigmask import catchers, caught_signals, group_processes, mask_signals

from .conftest import wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")

# Installs a USR2 handler when its first argument says so, starts a child of its own (in
# its process group) that installs one when its second says so, then says it is ready.
PARENT = r'''
import os, signal, subprocess, sys, time
if sys.argv[1] == "1":
    signal.signal(signal.SIGUSR2, lambda *_: None)
child = subprocess.Popen([sys.executable, "-c", """
import signal, sys, time
if sys.argv[1] == "1":
    signal.signal(signal.SIGUSR2, lambda *_: None)
print("child ready", flush=True)
time.sleep(60)
""", sys.argv[2]], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
'''


def start(parent: bool, child: bool) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(int(parent)), str(int(child))],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def stop(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_mask_bits_are_signal_numbers() -> None:
    assert mask_signals(0) == frozenset()
    assert mask_signals(1 << (signal.SIGUSR2 - 1) | 1 << (signal.SIGTERM - 1)) == {
        signal.SIGUSR2,
        signal.SIGTERM,
    }


@pytest.mark.parametrize(
    ("parent", "child"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_the_processes_of_a_group_that_catch_a_signal(parent: bool, child: bool) -> None:
    proc, kid = start(parent, child)
    try:
        assert (signal.SIGUSR2 in (caught_signals(proc.pid) or ())) is parent
        assert (signal.SIGUSR2 in (caught_signals(kid) or ())) is child
        assert signal.SIGINT in (caught_signals(proc.pid) or ())  # Python's own handler
        assert wait_for(lambda: group_processes(proc.pid), what="the group") == [proc.pid, kid]
        assert catchers(proc.pid, signal.SIGUSR2) == [
            p for p, caught in ((proc.pid, parent), (kid, child)) if caught
        ]
        assert catchers(proc.pid, signal.SIGUSR1) == []
    finally:
        stop(proc)


def test_a_gone_process_is_unknown() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert caught_signals(proc.pid) is None
    assert group_processes(proc.pid) is None and catchers(proc.pid, signal.SIGUSR2) is None
