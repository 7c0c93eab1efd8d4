"""Runs one mock job's batch script and records how it ended (`python -m ...jobwrap DIR`).

It starts `bash script.sh` in a process group of its own (signals for the batch shell go
to that group, never to jobwrap), waits for it, gives the job's steps KillWait seconds to
end and kills what is left, the steps' tasks and whatever the script left in its group (an
`srun` still waiting on a lost node's tasks, a background process), as Slurm kills every
process of a job when its batch script ends; then it writes exit.json atomically.
SIGKILLed, as on a dead host, it writes nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftslurm.backends.mock import procs


def main(argv: list[str] | None = None) -> int:
    job_dir = Path((argv or sys.argv[1:])[0])
    launch = procs.read_json(job_dir / "launch.json")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    mode = "a" if launch["open_mode"] == "append" else "w"
    stdout = open(launch["stdout"], mode)
    stderr = stdout if launch["stderr"] == launch["stdout"] else open(launch["stderr"], mode)
    try:
        shell = subprocess.Popen(
            ["/bin/bash", str(job_dir / "script.sh")],
            cwd=launch["cwd"],
            env=launch["env"],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            restore_signals=True,
            preexec_fn=_default_signals,
        )
    except OSError as exc:
        print(f"jobwrap: cannot start the batch script: {exc}", file=stderr, flush=True)
        procs.write_json_atomic(job_dir / "exit.json", {"exit_code": 1, "signal": None})
        return 1
    procs.write_json_atomic(job_dir / "shell.json", {"pid": shell.pid, "pgid": shell.pid})
    code = shell.wait()
    # As slurmstepd: steps get KillWait seconds to finish after the batch shell is gone.
    deadline = time.monotonic() + float(launch.get("kill_wait_s", 30))
    while procs.steps_alive(job_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    procs.signal_steps(job_dir, signal.SIGKILL)
    # The batch shell's group outlives it when, e.g., it died of a cancel's SIGTERM while
    # its srun (which forwards SIGTERM) still waits on a lost node; nothing ends it later.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(shell.pid, signal.SIGKILL)
    procs.write_json_atomic(
        job_dir / "exit.json",
        {
            "exit_code": code if code >= 0 else 0,
            "signal": -code if code < 0 else None,
        },
    )
    return 0


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
