"""Checks on every value that reaches a batch script (pure).

A value on an `#SBATCH` line must stay on its line: a newline in a run name would end the
header and run the rest of the name as shell commands. Values that become shell words (the
command, environment values) are quoted where the script is rendered; here they only must
be representable at all (no NUL byte, valid UTF-8). Environment keys must be shell names.
The recipe, the job options and the command line all call these, so the daemon, `submit`
and `--print-script` refuse the same things with the same one-line message.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping

from ftslurm.errors import ConfigError

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FLAG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]*\Z")
# Unicode categories that break a line or cannot be written: control characters (newline,
# NUL, ESC, ...), line and paragraph separators, lone surrogates (bytes not valid UTF-8).
_BAD_CATEGORIES = {
    "Cc": "a control character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
    "Cs": "bytes that are not UTF-8",
}

_LOG_REASON = (
    "ftslurm writes each attempt's output to <run dir>/logs/job-%j.out, where the "
    "daemon and `ftslurm logs` read it"
)
_REQUEUE_REASON = "ftslurm requeues the job itself and needs it requeueable"
# sbatch flags (long names) that ftslurm sets for every attempt, with the reason.
OWNED_SBATCH_FLAGS: Mapping[str, str] = {
    "output": _LOG_REASON,
    "error": _LOG_REASON,
    "open-mode": "ftslurm appends every attempt to the same log",
    "array": "each array task would be a separate run, and ftslurm owns one job per attempt "
    "of one run; submit one run per task instead",
    "signal": "ftslurm sets it from preempt_time and checkpoint_signal (use --preempt-time)",
    "requeue": _REQUEUE_REASON,
    "no-requeue": _REQUEUE_REASON,
    "comment": "ftslurm tags each job with its run and attempt there to find it again",
    "chdir": "ftslurm runs the job in the directory you submit from",
    "wrap": "ftslurm writes the batch script itself",
    "test-only": "ftslurm needs the job id of a real submission",
}

# sbatch's one-letter options and their long names (`man sbatch`).
SBATCH_SHORT: Mapping[str, str] = {
    "-A": "account",
    "-a": "array",
    "-B": "extra-node-info",
    "-b": "begin",
    "-C": "constraint",
    "-c": "cpus-per-task",
    "-D": "chdir",
    "-d": "dependency",
    "-e": "error",
    "-F": "nodefile",
    "-G": "gpus",
    "-H": "hold",
    "-I": "immediate",
    "-i": "input",
    "-J": "job-name",
    "-k": "no-kill",
    "-L": "licenses",
    "-M": "clusters",
    "-m": "distribution",
    "-N": "nodes",
    "-n": "ntasks",
    "-O": "overcommit",
    "-o": "output",
    "-p": "partition",
    "-Q": "quiet",
    "-q": "qos",
    "-S": "core-spec",
    "-s": "oversubscribe",
    "-t": "time",
    "-v": "verbose",
    "-W": "wait",
    "-w": "nodelist",
    "-x": "exclude",
}
# Short options that take no value, or only one written right after the letter (`-k`, `-I`).
SBATCH_SHORT_NO_VALUE = frozenset({"-H", "-I", "-k", "-O", "-Q", "-s", "-v", "-W"})


def bad_char(text: str) -> str | None:
    """What is wrong with the first character of `text` that cannot stay on one line."""
    for ch in text:
        what = _BAD_CATEGORIES.get(unicodedata.category(ch))
        if what:
            return f"{what} ({ch!r})" if what != _BAD_CATEGORIES["Cs"] else what
    return None


def check_line(what: str, value: object) -> None:
    """A value for an `#SBATCH` line or a path: one line of printable text."""
    if value is None:
        return
    problem = bad_char(str(value))
    if problem:
        raise ConfigError(
            f"{what} {str(value)!r} contains {problem}",
            hint="values of flags must be one line of printable text",
        )


def check_word(what: str, value: str) -> None:
    """A value that becomes one quoted shell word: anything a process can be given."""
    if "\0" in value:
        raise ConfigError(f"{what} {value!r} contains a NUL byte")
    if any(unicodedata.category(ch) == "Cs" for ch in value):
        raise ConfigError(f"{what} {value!r} contains bytes that are not UTF-8")


def check_env(env: Mapping[str, str]) -> None:
    for key, value in env.items():
        if not _ENV_KEY.match(key):
            raise ConfigError(
                f"environment variable name {key!r} is not a shell name",
                hint="letters, digits and _, not starting with a digit",
            )
        check_word(f"environment variable {key}", value)


def check_command(command: Iterable[str]) -> None:
    for word in command:
        check_word("command argument", word)


def check_sbatch_flag(name: str, value: str | None, *, owned_ok: bool = False) -> None:
    """An sbatch flag by its long name (without `--`) and its value, or None for none."""
    if not _FLAG_NAME.match(name):
        raise ConfigError(
            f"sbatch flag {name!r} is not a flag name",
            hint="letters, digits and -, e.g. --sbatch-arg=--qos=high",
        )
    if not owned_ok and name in OWNED_SBATCH_FLAGS:
        raise ConfigError(f"--{name} is set by ftslurm itself: {OWNED_SBATCH_FLAGS[name]}")
    check_line(f"--{name}", value)
