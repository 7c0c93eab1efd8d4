"""Scheduler load of `query`: commands and wall time for N jobs versus 1, on a real cluster.

Submits N held jobs, then times `SlurmCliBackend.query` for 1 id and for all N ids in the
same run and prints the ratio (a per-job `scontrol show job` loop is timed as the baseline
that one batched query replaces). Needs a running cluster (`make slurm-up`); cancels its jobs.

    python benchmarks/query_scaling.py [--jobs 200] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from ftslurm.backends.slurm_cli import CommandRunner, SlurmCliBackend
from ftslurm.core.types import JobOptions
from ftslurm.localcluster import LocalCluster


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("SLURM_CONF", str(LocalCluster().layout.slurm_conf))
    backend = SlurmCliBackend(CommandRunner())
    ids = [
        backend.submit("#!/bin/bash\ntrue\n", JobOptions(hold=True, name=f"bench-{i}"))
        for i in range(args.jobs)
    ]
    try:
        before = backend.runner.commands
        one = timed(lambda: backend.query(ids[:1]), args.repeat)
        many = timed(lambda: backend.query(ids), args.repeat)
        commands_per_query = (backend.runner.commands - before) / (2 * args.repeat)
        per_job = timed(
            lambda: [
                subprocess.run(
                    ["scontrol", "show", "job", "-o", j], capture_output=True, check=True
                )
                for j in ids
            ],
            1,
        )
    finally:
        for job in ids:
            backend.cancel(job)
    result = {
        "jobs": args.jobs,
        "commands_per_query": commands_per_query,
        "query_1_job_s": one,
        "query_all_jobs_s": many,
        "ratio_all_to_1": many / one,
        "per_job_scontrol_loop_s": per_job,
        "speedup_vs_per_job_loop": per_job / many,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value:.4f}" if isinstance(value, float) else f"{key:>26}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
