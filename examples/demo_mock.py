"""Demo: rehearse a training run's recovery on a laptop, with `ftslurm submit --dry-run`.

`examples/recipe.py` (a real 2-rank PyTorch DDP job on the CPU) runs on the mock Slurm
cluster twice, through the same commands a user types:
  1. uninterrupted, for reference;
  2. with a node failure injected 5 s into the first attempt and a preemption 10 s into
     the second. ftslurm's daemon reads Slurm's verdict each time, keeps the failed node
     out, starts the requeued job at once (no 120 s requeue delay), and counts the
     preemption, where the recipe checkpointed on SIGTERM, as a continuation;
  3. with a hot spare (`--spare-nodes 1`: 3 nodes, training on 2) and an active node failed
     15 s in: the launchers restart the ranks on the survivor and the spare from the last
     checkpoint, inside the same job (no requeue), within seconds.
Both faulty runs must end COMPLETED with exactly the parameters of the reference run.

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
    proc = subprocess.run(
        [sys.executable, "-m", "ftslurm", *args], env=env, capture_output=True, text=True
    )
    if proc.stderr.strip():
        console.print(proc.stderr.rstrip(), markup=False, highlight=False)
    if check and proc.returncode != 0:
        raise SystemExit(f"ftslurm {args[0]} exited {proc.returncode}:\n{proc.stdout}")
    return proc.stdout


def run(
    name: str,
    work: Path,
    env: dict[str, str],
    faults: list[str],
    step_time: str,
    *options: str,
    recipe: Path = ROOT / "recipe.py",
) -> dict:
    ckpt = work / name
    inject = [a for f in faults for a in ("--inject", f)]
    out = ftslurm(
        "submit",
        "--dry-run",
        "--json",
        "-N",
        "2",
        "--retries",
        "2",
        *options,
        "--name",
        name,
        *inject,
        str(recipe),
        "--",
        "--steps",
        "150",
        "--ckpt-every",
        "10",
        "--step-time",
        step_time,
        "--checkpoint-dir",
        str(ckpt),
        env=env,
    )
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
    env = dict(
        os.environ,
        FTSLURM_HOME=str(work / "home"),
        FTSLURM_MOCK_HOME=str(work / "mock"),
        PYTHONWARNINGS="ignore",
        COLUMNS=os.environ.get("COLUMNS", "150"),
    )
    console.rule(
        "ftslurm demo: a PyTorch run survives a node failure, a preemption and a lost "
        "node replaced by a hot spare (mock)"
    )
    try:
        # SlurmdTimeout 3 s instead of Slurm's 300 s so the rehearsal is quick.
        ftslurm("mock", "up", "--slurmd-timeout", "3", env=env)
        reference = run("reference", work, env, [], "0")
        faulty = run("with-faults", work, env, ["node_fail@5", "preempt@10"], "0.1")
        s = faulty["status"]
        causes = [a["cause"] for a in s["attempts"]]
        # The same recipe with a short peer timeout (a setting of the recipe), so the
        # launchers tell a lost node in 3 s.
        spare_recipe = work / "spare_recipe.py"
        spare_recipe.write_text(
            "import sys\nimport ftslurm\nrecipe = ftslurm.Recipe(command=["
            f"sys.executable, {str(ROOT / 'recipe.py')!r}], "
            "peer_timeout_s=3.0)\n"
        )
        spared = run(
            "with-a-spare",
            work,
            env,
            ["node_fail@15:1"],
            "0.1",
            "--spare-nodes",
            "1",
            recipe=spare_recipe,
        )
        sp = spared["status"]
        rounds = sorted(Path(sp["run_dir"], "attempts", "0", "recovery").glob("round-*.json"))
        swap = json.loads(rounds[0].read_text()) if rounds else {}
        ok = (
            s["state"] == "COMPLETED"
            and "node_fail" in causes
            # The ranks save at the preemption's signal ("checkpointed"); on a loaded
            # machine the signal can come before they start, and the job goes on from the
            # checkpoint it had ("preempted", a retry). Either way it goes on.
            and bool({"checkpointed", "preempted"} & set(causes))
            and faulty.get("digest") == reference.get("digest")
            and faulty.get("step") == reference.get("step") == 150
            and sp["state"] == "COMPLETED"
            and len(sp["attempts"]) == 1
            and bool(swap)
            and spared.get("digest") == reference.get("digest")
        )
        console.print(f"reference: step {reference.get('step')}, digest {reference.get('digest')}")
        console.print(
            f"with faults: {s['state']} after {len(s['attempts'])} attempts "
            f"({', '.join(c or '-' for c in causes)}), excluded "
            f"{', '.join(s['excluded_nodes']) or 'none'}; step {faulty.get('step')}, "
            f"digest {faulty.get('digest')} ({faulty['seconds']:.0f}s)",
            soft_wrap=True,
        )
        lost = (
            json.loads(
                next(
                    Path(sp["run_dir"], "attempts", "0", "recovery").glob("lost-*.json")
                ).read_text()
            )
            if swap
            else {}
        )
        took = (swap.get("first_step_at") or 0) - (lost.get("last_heard") or 0)
        console.print(
            f"with a spare: {sp['state']} in {len(sp['attempts'])} attempt (job "
            f"{sp['attempts'][0]['job_id']}); {', '.join(swap.get('lost') or ['-'])} "
            f"replaced by a spare, training again {took:.0f}s after it fell silent; "
            f"step {spared.get('step')}, digest {spared.get('digest')} "
            f"({spared['seconds']:.0f}s)",
            soft_wrap=True,
        )
        console.print(f"files in {work}")
        console.rule("[green]demo passed[/]" if ok else "[red]demo failed[/]")
        return 0 if ok else 1
    finally:
        ftslurm("daemon", "stop", env=env, check=False)
        ftslurm("mock", "down", env=env, check=False)


if __name__ == "__main__":
    sys.exit(main())
