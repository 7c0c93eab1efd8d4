"""sbatch's command line for a job's options (pure): the flags `sbatch` is given, and the
`#SBATCH` lines of a batch script (`ftslurm.templates`) carry the same."""

from __future__ import annotations

from ftslurm.core.timefmt import format_time_limit, parse_time_limit
from ftslurm.core.types import JobOptions


def sbatch_args(options: JobOptions) -> list[str]:
    """Command-line flags for `sbatch` from generic job options."""
    args: list[str] = []

    def add(flag: str, value: object) -> None:
        if value is not None:
            args.append(f"--{flag}={value}")

    add("job-name", options.name)
    add("nodes", options.nodes)
    add("ntasks-per-node", options.ntasks_per_node)
    add("cpus-per-task", options.cpus_per_task)
    add("gpus-per-node", options.gpus_per_node)
    if options.time_limit is not None:
        add("time", format_time_limit(parse_time_limit(options.time_limit)))
    add("partition", options.partition)
    add("account", options.account)
    if options.exclude:
        add("exclude", ",".join(options.exclude))
    add("comment", options.comment)
    add("output", options.output)
    add("error", options.error)
    add("chdir", options.workdir)
    add("signal", options.signal)
    if options.requeue is not None:
        args.append("--requeue" if options.requeue else "--no-requeue")
    if options.hold:
        args.append("--hold")
    if options.no_kill:
        args.append("--no-kill")
    for key, value in sorted(options.extra.items()):
        args.append(f"--{key}" if value is None else f"--{key}={value}")
    return args
