"""Running Slurm commands: a timeout on every call, typed errors, bounded retries.

`classify` (pure) reads a failed command's exit status and stderr and says what kind of
failure it was; `CommandRunner` runs the command, retries transient failures with tenacity
(exponential backoff with jitter, bounded in time) and raises typed errors otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential,
    wait_random,
)

from ftslurm.errors import (
    ConfigError,
    FtslurmError,
    InvalidJobId,
    InvalidPartition,
    JobStateConflict,
    OperatorNeeded,
    SchedulerRejected,
    SchedulerUnavailable,
)

log = logging.getLogger(__name__)

# stderr fragments (lower case) that mean "the controller or database could not be reached".
_TRANSIENT = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "connect failure",
    "zero bytes were transmitted",
    "communication connection failure",
    "transport endpoint is not connected",
    "resource temporarily unavailable",
    "rpc rate limit",
    "rate limit exceeded",
    "temporarily unable to accept job",
    "slurmctld not responding",
    "slurm backup controller in standby mode",
    "problem talking to the database",
    "slurmdbd: getting response",
    "failed to open persistent connection",
    "unable to establish",
    "network is unreachable",
)
# Failures that happen before the request reached the controller: safe to repeat even for
# requests that are not idempotent (sbatch).
_NOT_DELIVERED = ("connection refused", "connect failure", "unable to contact slurm controller")

_PERMANENT: tuple[tuple[re.Pattern[str], type[FtslurmError]], ...] = (
    (re.compile(r"invalid job id|job id .* not found|unknown job"), InvalidJobId),
    (re.compile(r"invalid partition|partition .* (does not exist|not found)"), InvalidPartition),
    (re.compile(r"invalid --time|invalid time limit|time limit specification"), ConfigError),
    (
        re.compile(
            r"job is (no longer )?pending|pending execution|job is not pending|"
            r"presently disabled|already completing or completed|job is pending|"
            r"job has already finished"
        ),
        JobStateConflict,
    ),
)


# Refusals only Slurm's operator can lift, with what to ask for (seen as an ordinary user on
# Slurm 22.05: another user's job, a node update, a munge socket the user cannot reach).
_OPERATOR: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"munge.*permission denied|protocol authentication error"),
        "Slurm's authentication (munge) refused this user; an operator must let users reach "
        "the munge socket",
    ),
    (
        re.compile(
            r"invalid account|account/partition combination|user.*not.*association|"
            r"invalid qos"
        ),
        "this user has no association for that account, partition or QOS; an operator adds "
        "one with sacctmgr add user NAME account=ACCOUNT",
    ),
    (
        re.compile(r"access/permission denied|invalid user id|not authorized"),
        "allowed to the job's owner and Slurm's operator only",
    ),
)

_NOISE = re.compile(r"^(\w+: )?(error: )?(batch job submission failed: )?", re.IGNORECASE)


def _last_line(text: str) -> str:
    """The last non-empty line, without the "sbatch: error: ..." prefixes Slurm repeats."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return _NOISE.sub("", lines[-1]) if lines else ""


def classify(argv: Sequence[str], returncode: int, stderr: str) -> FtslurmError:
    """The typed error for a failed Slurm command (pure)."""
    low = stderr.lower()
    line = _last_line(stderr) or f"exit status {returncode}"
    prog = os.path.basename(argv[0]) if argv else "slurm"
    if any(fragment in low for fragment in _TRANSIENT):
        return SchedulerUnavailable(f"{prog}: {line}")
    for pattern, hint in _OPERATOR:
        if pattern.search(low):
            return OperatorNeeded(f"{prog}: {line}", hint=hint)
    for pattern, kind in _PERMANENT:
        if pattern.search(low):
            return kind(f"{prog}: {line}")
    return SchedulerRejected(f"{prog}: {line}")


def _may_repeat(exc: BaseException, idempotent: bool) -> bool:
    if not isinstance(exc, SchedulerUnavailable):
        return False
    return idempotent or any(f in exc.message.lower() for f in _NOT_DELIVERED)


@dataclass
class CommandRunner:
    """Runs Slurm client commands; counts them (`commands`) for load measurements."""

    timeout_s: float = 30.0
    env: Mapping[str, str] | None = None
    max_wait_s: float = 5.0  # the longest pause between two tries
    commands: int = 0  # number of processes started, retries included
    abort: threading.Event | None = None  # once set, no more tries and no more waiting
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def run(
        self,
        argv: Sequence[str],
        *,
        budget_s: float,
        idempotent: bool = True,
        stdin: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """Run `argv`, return its stdout; retry transient failures for up to `budget_s`.

        A non-idempotent request (sbatch) is only repeated when it surely never reached the
        controller (connection refused), never after a timeout: a duplicate job is worse
        than an error the caller can reconcile.
        """
        for attempt in self._retrying(argv, budget_s, idempotent):
            with attempt:
                return self._once(
                    argv, stdin=stdin, extra_env=extra_env, timeout_s=timeout_s or self.timeout_s
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def run_refusals(self, argv: Sequence[str], *, budget_s: float) -> str:
        """Run an (idempotent) command that acts on a list of jobs: "" when it succeeded,
        otherwise the text in which it names the jobs it refused (stderr), for the caller
        to attribute. A failure that is not a refusal (`SchedulerUnavailable`: the
        controller cannot be reached) is retried for up to `budget_s`, then raised."""
        for attempt in self._retrying(argv, budget_s, idempotent=True):
            with attempt:
                proc = self._spawn(argv, stdin=None, extra_env=None, timeout_s=self.timeout_s)
                if proc.returncode == 0:
                    return ""
                text = proc.stderr or proc.stdout
                err = classify(argv, proc.returncode, text)
                if isinstance(err, SchedulerUnavailable):
                    raise err
                return text.strip() or f"exit status {proc.returncode}"
        raise AssertionError("unreachable")  # pragma: no cover

    def _retrying(self, argv: Sequence[str], budget_s: float, idempotent: bool) -> Retrying:
        return Retrying(
            retry=retry_if_exception(lambda e: _may_repeat(e, idempotent)),
            stop=stop_after_delay(budget_s) | stop_when_event_set(self.abort)
            if self.abort is not None
            else stop_after_delay(budget_s),
            wait=wait_exponential(multiplier=0.5, max=self.max_wait_s) + wait_random(0, 0.5),
            sleep=self.abort.wait if self.abort is not None else time.sleep,
            reraise=True,
            before_sleep=lambda rs: log.warning(
                "%s failed (%s); retrying", argv[0], rs.outcome.exception() if rs.outcome else ""
            ),
        )

    def _once(
        self,
        argv: Sequence[str],
        *,
        stdin: str | None,
        extra_env: Mapping[str, str] | None,
        timeout_s: float,
    ) -> str:
        proc = self._spawn(argv, stdin=stdin, extra_env=extra_env, timeout_s=timeout_s)
        if proc.returncode != 0:
            raise classify(argv, proc.returncode, proc.stderr or proc.stdout)
        return proc.stdout

    def _spawn(
        self,
        argv: Sequence[str],
        *,
        stdin: str | None,
        extra_env: Mapping[str, str] | None,
        timeout_s: float,
    ) -> subprocess.CompletedProcess[str]:
        env = dict(self.env if self.env is not None else os.environ)
        env["SLURM_TIME_FORMAT"] = "%s"
        if extra_env:
            env.update(extra_env)
        with self._lock:
            self.commands += 1
        try:
            proc = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout_s,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SchedulerUnavailable(
                f"{argv[0]} did not answer within {timeout_s:.0f}s"
            ) from None
        except FileNotFoundError:
            raise SchedulerRejected(
                f"{argv[0]} not found on PATH", hint="is the Slurm client installed?"
            ) from None
        return proc
