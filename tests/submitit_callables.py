"""A submitit Checkpointable as a submitit user writes one, for the executor plugin's tests
(tests/test_submitit_plugin.py). The tests send this module by value (cloudpickle's
`register_pickle_by_value`): the jobs need not import the test package."""

from __future__ import annotations

import time
from typing import Any

import submitit

from ftslurm.agent import progress


def value(step: int) -> int:
    """What step `step` adds to the total: the result depends on every step, once."""
    return (step * 7919) % 1009


def expected(steps: int) -> dict[str, int]:
    """The result of an uninterrupted run of `steps` steps."""
    return {"steps": steps, "total": sum(value(s) for s in range(steps))}


class Counter(submitit.helpers.Checkpointable):
    """Counts steps; its state is the last complete step, kept in one attribute replaced
    whole, so `checkpoint()` (submitit's default: this object, pickled) stores a
    consistent state wherever the signal lands."""

    def __init__(self) -> None:
        self.done: tuple[int, int] | None = None  # (steps done, total) after a whole step

    def __call__(self, steps: int, step_s: float) -> dict[str, int]:
        env = submitit.JobEnvironment()
        step, total = self.done or (0, 0)
        print(
            f"job {env.job_id} rank {env.global_rank}/{env.num_tasks} starting at step {step}",
            flush=True,
        )
        while step < steps:
            time.sleep(step_s)
            total += value(step)
            step += 1
            self.done = (step, total)
            progress.report_step(step)
        print(f"finished at step {step}", flush=True)
        return {"steps": step, "total": total}


def describe(job: Any) -> str:
    """What a failed assertion shows of a job: its info and logs' tail."""
    info = job.get_info(mode="force")
    return f"{info}\n{(job.stdout() or '')[-3000:]}"
