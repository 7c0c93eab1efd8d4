"""The error family of ftslurm.

Every error carries a one-line, user-facing message. The subclass says what happens
next: a `TransientError` is worth retrying, a `PermanentError` is not. The CLI catches
`FtslurmError` in one place and prints `Error: <message>` with a non-zero exit code.
"""

from __future__ import annotations


class FtslurmError(Exception):
    """Root of every error ftslurm raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        # Keep the message to one line: it is what a user reads.
        self.message = " ".join(str(message).split())
        self.hint = hint
        super().__init__(self.message)

    def user_message(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class TransientError(FtslurmError):
    """Retrying later may succeed (controller down, socket timeout, RPC rate limit)."""


class PermanentError(FtslurmError):
    """Retrying will not help; stop and report."""


class ConfigError(PermanentError):
    """Bad user input: options, recipe, time limit, paths."""


# --- scheduler errors -------------------------------------------------------
class SchedulerError(FtslurmError):
    """Base for errors reported by a scheduler backend."""


class SchedulerUnavailable(SchedulerError, TransientError):
    """The scheduler could not be reached or did not answer in time."""


class SchedulerRejected(SchedulerError, PermanentError):
    """The scheduler refused the request (bad partition, bad option, ...)."""


class OperatorNeeded(SchedulerRejected):
    """Slurm refused a user what only its operator can grant or do (a registration in
    accounting, access to the munge socket, a request on another user's job or a node)."""


class InvalidJobId(SchedulerRejected):
    """The scheduler does not know the job (or the id is malformed)."""


class InvalidPartition(SchedulerRejected):
    """The partition does not exist."""


class JobStateConflict(SchedulerRejected):
    """The job is in a state that does not allow the operation (e.g. update a running job)."""


class BackendUnavailable(PermanentError):
    """A scheduler backend cannot be used here (missing library, version mismatch)."""
