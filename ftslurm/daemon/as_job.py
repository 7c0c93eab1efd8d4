"""The daemon as a Slurm job: no service on a login node required (`ftslurm daemon submit`).

A small job (one task, one CPU, `--requeue`) runs `ftslurm daemon run --job` for the state
directory. It is found like any daemon, through the state directory: the lease in the
database names its host, pid and job (`service.serving`), and `daemon-job.json` names the
job submitted last, so that commands do not start a second daemon on a login node while it
waits in the queue.

Its life:
- **Starting**: it takes the lease like any daemon (`service.LeaseKeeper`). A successor
  (`--successor`) is patient: it waits for its predecessor to release the lease.
- **Before its time limit** Slurm sends it `HANDOVER_SIGNAL` (`--signal=B:USR1@lead`): it
  submits its successor and serves on; once the successor runs (and waits for the lease) it
  releases the lease and exits, and the successor takes over at once. If the successor is
  still queued at the limit, the daemon stops at SIGTERM, releasing the lease, and the
  successor takes it when it starts.
- **Its node dies**: Slurm requeues the job (`--requeue`); the new incarnation finds the
  lease of the dead one silent and takes it after the lease timeout.

`scrontab` is an alternative where a site enables it (docs/daemon.md).
"""

from __future__ import annotations

import logging
import shlex
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.types import JobOptions, JobState
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.paths import HOME_ENV

log = logging.getLogger("ftslurm.daemon")

DAEMON_JOB_FILE = "daemon-job.json"  # in the state directory: the daemon job submitted last
DAEMON_JOB_NAME = "ftslurm-daemon"
HANDOVER_SIGNAL = signal.SIGUSR1
DEFAULT_TIME = "1-00:00:00"
DEFAULT_HANDOVER_S = 600  # the handover signal this long before the time limit
SUCCESSOR_POLL_S = 5.0  # how often a handing-over daemon asks whether its successor runs


@dataclass(frozen=True)
class DaemonJob:
    """How to submit a daemon job for a state directory."""

    home: Path
    python: str  # the interpreter that runs `-m ftslurm` on the compute nodes
    time: str = DEFAULT_TIME
    handover_s: int = DEFAULT_HANDOVER_S
    lease_timeout_s: float | None = None  # None: the daemon's default
    partition: str | None = None
    account: str | None = None
    extra: Mapping[str, str | None] = field(default_factory=dict)  # raw sbatch flags

    def script(self, successor: bool = False) -> str:
        """The batch script: every value that reaches it is quoted."""
        args = ["-m", "ftslurm", "daemon", "run", "--job"]
        if successor:
            args.append("--successor")
        if self.lease_timeout_s is not None:
            args += ["--lease-timeout", f"{self.lease_timeout_s:g}"]
        return (
            "#!/bin/bash\n"
            "# ftslurm's daemon as a Slurm job (`ftslurm daemon submit`)\n"
            f"export {HOME_ENV}={shlex.quote(str(self.home))}\n"
            f"exec {shlex.join([self.python, *args])}\n"
        )

    def options(self) -> JobOptions:
        return JobOptions(
            name=DAEMON_JOB_NAME,
            nodes=1,
            ntasks_per_node=1,
            cpus_per_task=1,
            time_limit=self.time,
            partition=self.partition,
            account=self.account,
            output=str(self.home / "daemon-job-%j.log"),
            requeue=True,
            signal=f"B:{HANDOVER_SIGNAL.name.removeprefix('SIG')}@{self.handover_s}",
            workdir=str(self.home),
            extra=dict(self.extra),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "home": str(self.home),
            "python": self.python,
            "time": self.time,
            "handover_s": self.handover_s,
            "lease_timeout_s": self.lease_timeout_s,
            "partition": self.partition,
            "account": self.account,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: Any) -> DaemonJob | None:
        try:
            return cls(
                Path(data["home"]),
                str(data["python"]),
                str(data["time"]),
                int(data["handover_s"]),
                data.get("lease_timeout_s"),
                data.get("partition"),
                data.get("account"),
                dict(data.get("extra") or {}),
            )
        except (TypeError, KeyError, ValueError):
            return None


def submit(backend: SchedulerBackend, job: DaemonJob, successor: bool = False) -> str:
    """Submit a daemon job and record it (`DAEMON_JOB_FILE`); its job id."""
    job_id = backend.submit(job.script(successor), job.options())
    write_json_atomic(
        Path(job.home) / DAEMON_JOB_FILE,
        {"job_id": job_id, "submitted_at": time.time(), "spec": job.to_json()},
        mode=0o600,
    )
    return job_id


def recorded(home: Path) -> tuple[str, DaemonJob | None] | None:
    """The daemon job submitted last for `home` and how, or None."""
    data = read_json(Path(home) / DAEMON_JOB_FILE)
    if not isinstance(data, dict) or not isinstance(data.get("job_id"), str):
        return None
    return data["job_id"], DaemonJob.from_json(data.get("spec"))


@dataclass
class Handover:
    """A daemon job's handover to its successor (module doc): `requested` is set by the
    handover signal; the serve loop calls `due()` after every cycle and stops when it says
    so."""

    home: Path
    backend: Callable[[], SchedulerBackend]
    requested: threading.Event = field(default_factory=threading.Event)
    successor: str | None = None
    _asked_at: float = 0.0

    def install(self) -> None:
        signal.signal(HANDOVER_SIGNAL, lambda *_: self.requested.set())

    def due(self) -> bool:
        """True when the successor runs: release the lease and exit."""
        if not self.requested.is_set():
            return False
        now = time.monotonic()
        if now - self._asked_at < SUCCESSOR_POLL_S:
            return False
        self._asked_at = now
        backend = self.backend()
        if self.successor is None:
            found = recorded(self.home)
            spec = found[1] if found else None
            if spec is None:
                log.error(
                    "handover asked, but %s has no daemon job spec: serving until the time limit",
                    self.home / DAEMON_JOB_FILE,
                )
                self.requested.clear()
                return False
            self.successor = submit(backend, replace(spec, home=self.home), successor=True)
            log.info("handover: submitted the successor daemon job %s", self.successor)
            return False
        info = backend.query([self.successor]).get(self.successor)
        if info is not None and info.state is JobState.RUNNING:
            log.info("handover: the successor job %s runs; releasing the lease", self.successor)
            return True
        if info is not None and info.state.is_terminal:
            log.warning(
                "handover: the successor job %s ended (%s); submitting another",
                self.successor,
                info.state.value,
            )
            self.successor = None
        return False
