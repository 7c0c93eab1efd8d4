"""Submit a submitit Checkpointable through ftslurm, as submitit code does it, and wait for
its result (run it on the login node, or anywhere with `--dry-run`).

    python examples/submitit_executor.py --dry-run --steps 500 --step-time 0.1 \\
        --timeout-min 5 --preempt-time 10 --inject timeout@30 --inject node_fail@28

The task is `Trainer` of examples/submitit_recipe.py, unchanged: a deterministic linear
regression whose `checkpoint()` returns the trainer itself. The only ftslurm line is the
cluster's name: `submitit.AutoExecutor(folder, cluster="ftslurm")`. Each submit records an
ftslurm run that the daemon owns: the checkpoint signal `--preempt-time` seconds before the
wall limit calls `checkpoint()`, the daemon submits the continuation, retries after a lost
node within `--retries` (the node excluded), and `job.result()` returns the value of the
attempt that finished: the parameters' digest, the same as an uninterrupted run's. With
`--dry-run` it all happens on the mock scheduler, where `--inject` rehearses faults
(docs/fault-injection.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cloudpickle
import submitit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import submitit_recipe  # noqa: E402  (examples/ is not a package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="submitit-jobs/%j", help="submitit's job folder")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--step-time", type=float, default=0.1, help="extra seconds per step")
    parser.add_argument("--timeout-min", type=int, default=5)
    parser.add_argument("--preempt-time", type=int, default=60, help="seconds before the limit")
    parser.add_argument("--retries", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="on the mock scheduler")
    parser.add_argument("--inject", action="append", default=[], help="KIND@TIME[:TARGET]")
    args = parser.parse_args()

    # The trainer travels in the job's pickle: the job need not import this folder.
    cloudpickle.register_pickle_by_value(submitit_recipe)
    executor = submitit.AutoExecutor(args.folder, cluster="ftslurm")
    executor.update_parameters(
        timeout_min=args.timeout_min,
        ftslurm_retries=args.retries,
        ftslurm_preempt_time=args.preempt_time,
        ftslurm_dry_run=args.dry_run,
        ftslurm_inject=args.inject,
    )
    job = executor.submit(submitit_recipe.Trainer(), args.steps, step_time=args.step_time)
    print(f"submitted run {job.job_id}", flush=True)
    print(f"result {job.result()}", flush=True)  # waits; raises if the run FAILED


if __name__ == "__main__":
    main()
