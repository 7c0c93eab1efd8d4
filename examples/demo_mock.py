"""Demo: rehearse a training run's recovery on a laptop, with `ftslurm submit --dry-run`.

`examples/recipe.py` (a real 2-rank PyTorch DDP job on the CPU) runs on the mock Slurm
cluster twice, through the same commands a user types:
  1. uninterrupted, for reference;
  2. with a node failure injected 5 s into the first attempt and a preemption 10 s into
     the second. ftslurm's daemon reads Slurm's verdict each time, keeps the failed node
     out, starts the requeued job at once (no 120 s requeue delay), and counts the
     preemption, where the recipe checkpointed on SIGTERM, as a continuation.
The faulty run must end COMPLETED with exactly the parameters of the reference run.

Nothing is faked: the jobs are real processes, the faults really kill them, and the
parameters are compared by digest. Run it with `make demo`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent
console = Console()


def ftslurm(*args: str, env: dict[str, str], check: bool = True) -> str:
    console.print(f"[bold]$ ftslurm {shlex.join(args)}[/]")
    proc = subprocess.run([sys.executable, "-m", "ftslurm", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.stderr.strip():
        console.print(proc.stderr.rstrip(), markup=False, highlight=False)
    if check and proc.returncode != 0:
        raise SystemExit(f"ftslurm {args[0]} exited {proc.returncode}:\n{proc.stdout}")
    return proc.stdout


def run(name: str, work: Path, env: dict[str, str], faults: list[str], step_time: str) -> dict:
    ckpt = work / name
    inject = [a for f in faults for a in ("--inject", f)]
    out = ftslurm("submit", "--dry-run", "--json", "-N", "2", "--retries", "2",
                  "--name", name, *inject, str(ROOT / "recipe.py"), "--", "--steps", "150",
                  "--ckpt-every", "10", "--step-time", step_time,
                  "--checkpoint-dir", str(ckpt), env=env)  # fmt: skip
    run_id = json.loads(out)["run_id"]
    started = time.monotonic()
    ftslurm("wait", run_id, "--timeout", "150", env=env, check=False)
    console.print(ftslurm("status", run_id, env=env), end="")
    final = ckpt / "final.json"
    result = json.loads(final.read_text()) if final.exists() else {}
    status = json.loads(ftslurm("status", run_id, "--json", env=env))
    return {**result, "status": status, "seconds": time.monotonic() - started}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ftslurm-demo-"))
    env = dict(os.environ, FTSLURM_HOME=str(work / "home"),
               FTSLURM_MOCK_HOME=str(work / "mock"), PYTHONWARNINGS="ignore",
               COLUMNS=os.environ.get("COLUMNS", "150"))  # fmt: skip
    console.rule("ftslurm demo: a PyTorch run survives a node failure and a preemption (mock)")
    try:
        # SlurmdTimeout 3 s instead of Slurm's 300 s so the rehearsal is quick.
        ftslurm("mock", "up", "--slurmd-timeout", "3", env=env)
        reference = run("reference", work, env, [], "0")
        faulty = run("with-faults", work, env, ["node_fail@5", "preempt@10"], "0.1")
        s = faulty["status"]
        causes = [a["cause"] for a in s["attempts"]]
        ok = (s["state"] == "COMPLETED" and "node_fail" in causes and "checkpointed" in causes
              and faulty.get("digest") == reference.get("digest")
              and faulty.get("step") == reference.get("step") == 150)  # fmt: skip
        console.print(f"reference: step {reference.get('step')}, digest "
                      f"{reference.get('digest')}")  # fmt: skip
        console.print(f"with faults: {s['state']} after {len(s['attempts'])} attempts "
                      f"({', '.join(c or '-' for c in causes)}), excluded "
                      f"{', '.join(s['excluded_nodes']) or 'none'}; step {faulty.get('step')}, "
                      f"digest {faulty.get('digest')} ({faulty['seconds']:.0f}s)",
                      soft_wrap=True)  # fmt: skip
        console.print(f"files in {work}")
        console.rule("[green]demo passed[/]" if ok else "[red]demo failed[/]")
        return 0 if ok else 1
    finally:
        ftslurm("daemon", "stop", env=env, check=False)
        ftslurm("mock", "down", env=env, check=False)


if __name__ == "__main__":
    sys.exit(main())
