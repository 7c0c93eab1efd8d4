"""Why a user error ends a run, in the run's reason (issue 26 items 6 and 9): exit 126 and
127 say what they mean and name the file the rank could not start; a script deleted since
the submit is named as not found; never only "it would fail the same way again"."""

from __future__ import annotations

import pytest

from ftslurm.core.settings import Cause, FtSettings
from ftslurm.core.types import JobState
from ftslurm.daemon.policy import Budget, Ending, Verdict, decide


def reason(code: int, line: str) -> str:
    e = Ending(JobState.FAILED, code, rank_outcomes=("user_error",), error_line=line)
    d = decide(Cause.USER_ERROR, e, Budget(), FtSettings(), False)
    assert d.verdict is Verdict.FAIL
    return d.reason


@pytest.mark.parametrize(
    "code,line,said",
    [
        (
            126,
            "ftslurm: cannot start '/home/u/train.sh': Permission denied",
            "user error: /home/u/train.sh cannot be executed (exit 126: Permission denied: not "
            "executable, no permission, or not a script or program): it would fail the same way "
            "again",
        ),
        (
            126,
            "ftslurm: cannot start '/home/u/train': Exec format error",
            "/home/u/train cannot be executed (exit 126: Exec format error",
        ),
        (126, "", "the command cannot be executed (exit 126: not executable"),
        (
            127,
            "ftslurm: cannot start '/home/u/gone.sh': No such file or directory",
            "user error: /home/u/gone.sh not found (exit 127): it would fail the same way again",
        ),
        (127, "", "user error: the command was not found (exit 127)"),
        (
            2,
            "/usr/bin/python3: can't open file '/home/u/train.py': [Errno 2] No such file or "
            "directory",
            "user error: /home/u/train.py not found (deleted or moved since the submit?)",
        ),
        (
            1,
            "ModuleNotFoundError: No module named 'mymodel'",
            "user error: ModuleNotFoundError: No module named 'mymodel': it would fail the same",
        ),
        (1, "", "user error: it would fail the same way again"),
    ],
)
def test_a_user_errors_reason_says_what_failed(code, line, said):
    assert said in reason(code, line)
