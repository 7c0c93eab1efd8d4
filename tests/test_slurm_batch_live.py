"""The batch actions against the real local cluster: one scontrol command per list, the
ended job of the list refused with the error its single-job action raises, the others
acted on (the daemon's requeue sequence: requeue held, exclude, release, start now)."""

from __future__ import annotations

import time

from ftslurm.core.types import JobOptions, JobState
from ftslurm.errors import JobStateConflict

from .conftest import in_state, wait_job

SLEEP = "#!/bin/bash\nsleep 600\n"


def test_each_batch_action_acts_on_the_list_in_one_command_and_refuses_the_ended_job(backend, jobs):
    a, b = (backend.submit(SLEEP, JobOptions(name="batch", requeue=True)) for _ in range(2))
    ended = backend.submit("#!/bin/bash\ntrue\n", JobOptions(name="batch", requeue=False))
    jobs += [a, b, ended]
    for job in (a, b):
        wait_job(backend, job, in_state(JobState.RUNNING), 60, "RUNNING")
    wait_job(backend, ended, in_state(JobState.COMPLETED), 60, "COMPLETED")
    three = [a, b, ended]

    def one_command(act):  # type: ignore[no-untyped-def]
        before = backend.runner.commands
        refused = act()
        assert backend.runner.commands - before == 1
        assert list(refused) == [ended] and isinstance(refused[ended], JobStateConflict)
        assert f"job {ended}" in refused[ended].message
        return refused

    one_command(lambda: backend.requeue_many(three, hold=True))  # --no-requeue: refused
    for job in (a, b):
        info = wait_job(backend, job, in_state(JobState.PENDING), 60, "PENDING (held)")
        assert info.restart_count == 1

    one_command(lambda: backend.update_excluded_nodes_many(three, ["n3", "n4"]))
    assert [backend.describe(j)["ExcNodeList"] for j in (a, b)] == ["n[3-4]", "n[3-4]"]

    one_command(lambda: backend.release_many(three))  # ended: "Job has already finished"
    for job in (a, b):  # released (no longer priority 0), waiting out the requeue delay
        fields = backend.describe(job)
        assert fields["Priority"] != "0" and float(fields["EligibleTime"]) > time.time() + 30

    one_command(lambda: backend.start_now_many(three))
    for job in (a, b):
        info = wait_job(backend, job, in_state(JobState.RUNNING), 60, "RUNNING again")
        assert not set(info.nodes) & {"n3", "n4"}
