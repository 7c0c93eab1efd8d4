"""The launcher's first lines: the signals that come while it starts are recorded, never
lost and never fatal.

`python -m ftslurm.agent.launch` spends a while importing (its own modules, pydantic, then
torch) before `launch.main` runs; a signal there would take its default action (SIGUSR2,
the checkpoint signal, would end the launcher) or be forgotten. Imported first by the
launcher's module, this installs handlers that only record: `EARLY`, the signals the ranks
have not had yet; `STOP`, the first SIGTERM or SIGINT. `launch.main` goes on with both.
Imported elsewhere (a test, a tool), it installs nothing until `record` is called.
"""

from __future__ import annotations

import signal
import sys

STOPS = (signal.SIGTERM, signal.SIGINT)  # the signals that stop a launcher (or a wrapper)
EARLY: list[int] = []  # signals for ranks that do not exist yet, each once, in order
STOP: list[int] = []  # the first SIGTERM or SIGINT


def remember(sig: int, _frame: object = None) -> None:
    if sig in STOPS and not STOP:
        STOP.append(sig)
    if sig not in EARLY:
        EARLY.append(sig)


def record(*extra: int) -> None:
    """Record (only) TERM, INT, USR1, USR2 and `extra` from now on."""
    for sig in {*STOPS, signal.SIGUSR1, signal.SIGUSR2, *extra}:
        signal.signal(sig, remember)


_main = getattr(sys.modules.get("__main__"), "__spec__", None)
if getattr(_main, "name", None) == "ftslurm.agent.launch":  # run as the launcher
    record()
