"""The one rule of where a lost node's job recovers (ftslurm.core.recovery)."""

import pytest

from ftslurm.core.recovery import Recovery, recovery


@pytest.mark.parametrize(
    ("lost", "spares", "expected"),
    [
        ({1}, 0, Recovery.NEW_JOB),  # no spare: a new job
        ({1}, 1, Recovery.SPARE),
        ({1, 2}, 1, Recovery.NEW_JOB),  # two lost, one spare
        ({1, 2}, 2, Recovery.SPARE),
        ({0}, 3, Recovery.NEW_JOB),  # the batch host: the job cannot survive it
        ({2, 0}, 3, Recovery.NEW_JOB),
        ((), 0, Recovery.SPARE),  # nothing lost: nothing to recover from
    ],
)
def test_where_a_lost_node_s_job_recovers(lost, spares, expected):
    assert recovery(lost, spares) is expected
