"""Demo: a 2-node job survives a node failure on the real local Slurm cluster.

What happens, all of it real (no simulated output):
1. a 2-node job starts; its tasks count steps and rank 0 checkpoints the step to a file;
2. one of its nodes is killed hard (slurmd and every process on it);
3. Slurm marks the node DOWN and requeues the job (NODE_FAIL);
4. we recover it the way ftslurm's daemon does: exclude the failed node, drop Slurm's
   ~120 s requeue delay with StartTime=now;
5. the job resumes from its checkpoint on healthy nodes and completes; the node is revived.

Run it with `make demo` (it starts the cluster first), or after `make slurm-up`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from ftslurm.backends.slurm_cli import SlurmCliBackend
from ftslurm.cli.scheduler import jobs_table
from ftslurm.core.types import JobInfo, JobOptions, JobState
from ftslurm.localcluster import LocalCluster

STEPS = 30
SCRIPT = """#!/bin/bash
# Each task trains for {steps} steps, in lock-step with the other (as a collective would
# make it): a task only advances while its peer's heartbeat is fresh. Rank 0 checkpoints.
srun bash -c '
  ckpt={ckpt}; hb={work}/hb
  step=$(cat $ckpt 2>/dev/null || echo 0)
  echo "task $SLURM_PROCID on $SLURMD_NODENAME resumes at step $step (restart ${{SLURM_RESTART_COUNT:-0}})"
  peer=$((1 - SLURM_PROCID))
  while [ $step -lt {steps} ]; do
    date +%s.%N > $hb.$SLURM_PROCID; sleep 0.5
    seen=$(cut -d. -f1 $hb.$peer 2>/dev/null); now=$(date +%s)
    [ $((now - ${{seen:-0}})) -le 2 ] || continue  # peer gone: block, as a collective would
    step=$((step + 1))
    if [ $SLURM_PROCID -eq 0 ]; then echo $step > $ckpt.tmp && mv $ckpt.tmp $ckpt; fi
  done
  echo "task $SLURM_PROCID finished at step $step"'
"""

console = Console()


def wait(backend: SlurmCliBackend, job: str, cond, timeout: float, what: str) -> JobInfo:
    deadline = time.monotonic() + timeout
    with console.status(f"waiting for {what}"):
        while time.monotonic() < deadline:
            info = backend.query([job])[job]
            if cond(info):
                return info
            time.sleep(0.5)
    console.print(f"[red]gave up waiting for {what}[/red]")
    sys.exit(1)


def main() -> int:
    cluster = LocalCluster()
    os.environ["SLURM_CONF"] = str(cluster.layout.slurm_conf)
    backend = SlurmCliBackend()
    work = Path(tempfile.mkdtemp(prefix="ftslurm-demo-"))
    ckpt = work / "step.ckpt"

    console.rule("ftslurm demo: surviving a node failure on a real Slurm cluster")
    job = backend.submit(
        SCRIPT.format(steps=STEPS, ckpt=ckpt, work=work),
        JobOptions(
            name="demo-train",
            nodes=2,
            ntasks_per_node=1,
            workdir=str(work),
            output=str(work / "job.out"),
            comment="ftslurm-demo",
            extra={"open-mode": "append"},
        ),
    )
    try:
        return run_demo(cluster, backend, job, work, ckpt)
    finally:
        backend.cancel(job)  # a no-op once it completed


def run_demo(
    cluster: LocalCluster, backend: SlurmCliBackend, job: str, work: Path, ckpt: Path
) -> int:
    info = wait(backend, job, lambda i: i.state is JobState.RUNNING, 60, "the job to start")
    console.print(f"job {job} RUNNING on {', '.join(info.nodes)}")
    wait(
        backend,
        job,
        lambda i: ckpt.exists() and int(ckpt.read_text() or 0) >= 5,
        60,
        "5 training steps",
    )

    victim = info.nodes[1]
    failed_at = time.monotonic()
    killed = cluster.fail_node(victim)
    at_step = int(ckpt.read_text())
    console.print(f"[bold red]killed node {victim}[/] ({len(killed)} processes) at step {at_step}")
    info = wait(
        backend,
        job,
        lambda i: i.restart_count >= 1 or i.state is JobState.NODE_FAIL,
        120,
        "Slurm to notice the node failure",
    )
    detected = time.monotonic() - failed_at
    down = [n for n in backend.nodes() if n.name == victim][0]
    console.print(
        f"Slurm noticed after {detected:.0f}s: node {victim} is {down.state.value} "
        f"({down.reason}); job {job} is {info.state.value}, reason {info.reason}, "
        f"restarts {info.restart_count}"
    )
    console.print(jobs_table([info]))

    if info.state is not JobState.PENDING:  # NODE_FAIL seen before the automatic requeue
        info = wait(backend, job, lambda i: i.state is JobState.PENDING, 60, "the requeue")
    backend.update_excluded_nodes(job, [victim])
    backend.start_now(job)
    info = wait(backend, job, lambda i: i.state is JobState.RUNNING, 60, "the job to run again")
    console.print(
        f"job {job} RUNNING again on {', '.join(info.nodes)} "
        f"{time.monotonic() - failed_at:.0f}s after the failure "
        f"(without StartTime=now Slurm would hold it ~120 s more)"
    )
    assert victim not in info.nodes

    info = wait(backend, job, lambda i: i.state.is_terminal, 120, "the job to finish")
    console.print(jobs_table([info]))
    console.print((work / "job.out").read_text().strip())
    final = int(ckpt.read_text())
    console.print(f"final step {final} of {STEPS}; state {info.state.value}")

    with console.status(f"reviving node {victim}"):
        cluster.revive_node(victim)
    console.print(f"node {victim} is back")
    resumed = "resumes at step 0 (restart 1)" not in (work / "job.out").read_text()
    ok = info.state is JobState.COMPLETED and final == STEPS and resumed and at_step < STEPS
    console.rule("[green]demo passed[/]" if ok else "[red]demo failed[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
