"""Demo: rehearse a training run's recovery on a laptop, against the mock scheduler.

`examples/recipe.py` (a real 2-rank PyTorch DDP job on the CPU) runs on a simulated
4-node Slurm cluster with two faults injected: a node dies 5 s into the first attempt, and
the job is preempted 10 s into the second. Each time, the recovery loop below does what
ftslurm's daemon will do (issue 3/5): read Slurm's verdict, keep the failed node out, and
start the requeued job at once instead of waiting Slurm's requeue delay. The run must end
COMPLETED with exactly the parameters of an uninterrupted run, which is computed first.

Nothing is faked: the jobs are real processes, the faults really kill them, and the
parameters are compared by digest. Run it with `make demo`.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ftslurm.backends.mock import MockConfig, MockScheduler, controller
from ftslurm.core.types import JobInfo, JobOptions, JobState

RECIPE = Path(__file__).resolve().parent / "recipe.py"
STEPS = 150
console = Console()


def script(ckpt: Path, step_time: float) -> str:
    cmd = [sys.executable, "-W", "ignore", str(RECIPE), "--steps", str(STEPS),
           "--ckpt-every", "10", "--step-time", str(step_time), "--checkpoint-dir", str(ckpt)]
    return f"#!/bin/bash\nsrun --kill-on-bad-exit=1 {shlex.join(cmd)}\n"


def run_job(mock: MockScheduler, text: str, options: JobOptions, deadline_s: float,
            recover: bool) -> tuple[JobInfo, list[str]]:  # fmt: skip
    """Submit, then watch; with `recover`, act on every ending as the daemon will."""
    job = mock.submit(text, options)
    log: list[str] = []
    seen = (None, -1)
    excluded: set[str] = set()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        info = mock.query([job])[job]
        if (info.state, info.restart_count) != seen:
            seen = (info.state, info.restart_count)
            where = f" on {','.join(info.nodes)}" if info.nodes else ""
            log.append(f"attempt {info.restart_count}: {info.state.value}{where}"
                       + (f" ({info.reason})" if info.reason else ""))  # fmt: skip
        if info.state is JobState.COMPLETED or (info.state.is_terminal and not recover):
            return info, log
        if recover and info.state is JobState.PENDING and info.reason == "BeginTime":
            down = {n.name for n in mock.nodes() if not n.state.usable}
            if down - excluded:
                excluded |= down
                mock.update_excluded_nodes(job, sorted(excluded))
                log.append(f"  recovery: exclude {', '.join(sorted(excluded))}")
            mock.start_now(job)
            log.append("  recovery: start now (skip the requeue delay)")
        time.sleep(0.2)
    raise SystemExit(f"job {job} did not finish in {deadline_s:.0f}s")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ftslurm-demo-"))
    home = work / "mockcluster"
    mock = MockScheduler(home, MockConfig(slurmd_timeout_s=3, kill_wait_s=15))
    stop = threading.Event()
    ctl = threading.Thread(target=controller.run, args=(home, 0.1, stop), daemon=True)
    ctl.start()
    console.rule("ftslurm demo: a PyTorch run survives a node failure and a preemption (mock)")
    try:
        started = time.monotonic()
        options = JobOptions(name="recipe", nodes=2, ntasks_per_node=1, workdir=str(work),
                             output=str(work / "reference.out"))  # fmt: skip
        ref, _ = run_job(mock, script(work / "ref", 0.0), options, 120, recover=False)
        reference = json.loads((work / "ref" / "final.json").read_text())
        console.print(f"uninterrupted run: {ref.state.value}, step {reference['step']}, "
                      f"digest {reference['digest']} ({time.monotonic() - started:.0f}s)")

        started = time.monotonic()
        faulty = JobOptions(name="recipe", nodes=2, ntasks_per_node=1, workdir=str(work),
                            output=str(work / "faulty.out"),
                            inject=("node_fail@5", "preempt@10"))  # fmt: skip
        console.print("faulty run: --inject node_fail@5 --inject preempt@10")
        info, log = run_job(mock, script(work / "faulty", 0.1), faulty, 170, recover=True)
        for line in log:
            console.print(f"  {line}")
        final = json.loads((work / "faulty" / "final.json").read_text())
        table = Table("run", "state", "attempts", "final step", "digest")
        table.add_row("uninterrupted", ref.state.value, "1", str(reference["step"]),
                      reference["digest"])  # fmt: skip
        table.add_row("with faults", info.state.value, str(info.restart_count + 1),
                      str(final["step"]), final["digest"])  # fmt: skip
        console.print(table)
        lines = (work / "faulty.out").read_text().splitlines()
        console.print("the job's own output (ranks' tracebacks left out, see faulty.out):")
        for line in lines:
            if not line.startswith("[rank"):
                console.print(f"  {line}", markup=False, highlight=False)
        ok = (info.state is JobState.COMPLETED and info.restart_count >= 2
              and final == reference)  # fmt: skip
        console.print(f"took {time.monotonic() - started:.0f}s; files in {work}")
        console.rule("[green]demo passed[/]" if ok else "[red]demo failed[/]")
        return 0 if ok else 1
    finally:
        stop.set()
        ctl.join()


if __name__ == "__main__":
    sys.exit(main())
