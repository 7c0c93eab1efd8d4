"""Live recovery against today's path: what a crashed rank costs, and what the per-step
commit costs, on one node under ftslurm's launcher with the example recipe.

Four runs of `examples/recipe.py` under `python -m ftslurm.agent.launch` (one node,
`--nproc-per-node` ranks, gloo on CPU, the memory tier on), the same recipe and settings:

  today, clean   without --live
  today, fault   without --live, rank `--crash-rank` SIGKILLs itself once, right after step
                 `--crash-step` (the recipe's `--fail-at-step S --fail-rank R --fail-once
                 --fail-by-kill`): timed by the step, not the clock, so that a slow start
                 (imports under load) cannot move the crash before the training starts
                 (an earlier version used the injection `crash@6:1`, which on a loaded
                 machine fired during the ranks' imports and measured no recovery). The
                 launcher restarts every rank, which load the newest checkpoint (memory
                 tier, else disk) and redo the steps since it
  live, clean    --live
  live, fault    --live, the same fault: the launcher restarts that rank alone, the others
                 keep their processes and hand it the state; the interrupted step runs again

Reported: each run's wall time (launcher start to exit), the fault's cost on each path
(faulted run minus clean run, so it holds the restart, the recovery and the redone steps)
and their ratio. The commit's cost per step is measured apart, as its own wall-time
differences would drown it: `--nproc` ranks around a coordinator store time an all-reduce
of 4096 floats alone and inside `LiveGroup.commit`, `--commit-calls` times each, twice in
turn; the median difference, relative to `--step-time`. Every run must end with the
parameters of the clean run (digests compared). Targets: a crashed rank costs under 3 s on
the live path; the commit under 1% of a 100 ms step.

A node stepping out (`--stepout`, two more runs): three launchers on this machine as nodes
n0-n2, 2 training and 1 spare (`--spare-nodes 1`, one rank each, the recipe with 150 steps
of 0.05 s), node n1 made 4x slower from its first step (`straggler@0:n1*4`) and judged a
persistent straggler after two 1 s report windows (shortened from the defaults' 60 s and 3,
which only delay the verdict); its launcher steps out. Today's path: the survivor's ranks
restart with the spare from the newest checkpoint; live (`--live`, `live_recovery`): the
spare's warm rank takes rank 1 over. Timed from the bench record (`recovery/benched-1.json`)
to training again: the spare's round record's first step (today), the live recovery's first
committed step (live). Target: under 5 s.

A crashed rank's place taken by a warm standby (`--standby`, two more runs, both --live):
rank `--crash-rank` stops itself right after committing step `--crash-step` (the live
group's test hook, `FTSLURM_TEST_PAUSE_LIVE`) and this script SIGKILLs it there. Cold:
without the `live_recovery` setting, the launcher restarts the rank alone in a new process.
Warm: with it (`FTSLURM_LIVE_RECOVERY=1`), the launcher keeps a standby waiting, and the
kill comes once the standby waits (its `waiting-<slot>` mark), so the run measures the warm
path and not a standby still starting. Timed by the recovery's own record: from the moment
the survivors saw the step fail to the first step committed after it (`failed_at` to
`first_commit_at`). Target: under 3 s.

    python benchmarks/live_recovery.py [--steps 60] [--step-time 0.1] [--ckpt-every 20]
        [--crash-step 25] [--crash-rank 1] [--nproc 3] [--repeat 1] [--commit-calls 300]
        [--stepout] [--standby] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftslurm.core.contract import EnvName

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "recipe.py"


def one_node_env(work: Path, **extra: str) -> dict[str, str]:
    """A launcher's environment for a run of one node in `work` (its run, checkpoint and
    memory-tier folders there), without a job's variables."""
    for name in ("run", "ckpt"):
        (work / name).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
    env.update(
        FTSLURM_RUN_DIR=str(work / "run"),
        FTSLURM_CHECKPOINT_DIR=str(work / "ckpt"),
        FTSLURM_MEMORY_DIR=str(work / "memory"),
        MASTER_ADDR="127.0.0.1",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def run_once(args: argparse.Namespace, live: bool, fault: bool, work: Path) -> dict:
    """One launcher run; its wall time, final digest and how many ranks started."""
    env = one_node_env(work)
    recipe = [
        sys.executable,
        str(RECIPE),
        "--steps",
        str(args.steps),
        "--step-time",
        str(args.step_time),
        "--ckpt-every",
        str(args.ckpt_every),
        "--checkpoint-dir",
        str(work / "ckpt"),
        *(["--live"] if live else []),
    ]
    if fault:
        recipe += [
            "--fail-at-step",
            str(args.crash_step),
            "--fail-rank",
            str(args.crash_rank),
            "--fail-once",
            "--fail-by-kill",
        ]
    launcher = [
        sys.executable,
        "-m",
        "ftslurm.agent.launch",
        "--nproc-per-node",
        str(args.nproc),
        "--max-restarts",
        "2",
        "--",
    ]
    started = time.perf_counter()
    proc = subprocess.run(
        [*launcher, *recipe], env=env, capture_output=True, text=True, timeout=args.timeout
    )
    wall = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"the launcher exited {proc.returncode}:\n{out[-4000:]}")
    final = json.loads((work / "ckpt" / "final.json").read_text())
    return {
        "wall_s": wall,
        "digest": final["digest"],
        "world_restarts": out.count(f"rank 0 of {args.nproc} starts at step") - 1,
        "restarted_alone": out.count("restarted alone"),
    }


def run_standby(args: argparse.Namespace, warm: bool, work: Path) -> dict:
    """One --live launcher run whose rank `--crash-rank` stops after committing step
    `--crash-step` and is killed there (`warm`: once the node's standby waits): seconds
    from the failed step to the first committed step after it, from the recovery's record."""
    from ftslurm.agent.live import PAUSE_ENV
    from ftslurm.core.contract import RunDir
    from ftslurm.core.contract.reports import Kind
    from ftslurm.runfiles import read_reports

    (work / "tmp").mkdir(parents=True)
    env = one_node_env(
        work,
        TMPDIR=str(work / "tmp"),
        **{PAUSE_ENV: f"committed:{args.crash_rank}:{args.crash_step}"},
        **({EnvName.LIVE_RECOVERY.value: "1"} if warm else {}),
    )
    cmd = [
        *(sys.executable, "-m", "ftslurm.agent.launch", "--nproc-per-node", str(args.nproc)),
        *("--max-restarts", "2", "--", sys.executable, str(RECIPE), "--live"),
        *("--steps", str(args.steps), "--step-time", str(args.step_time)),
        *("--ckpt-every", str(args.ckpt_every), "--checkpoint-dir", str(work / "ckpt")),
    ]
    log = work / "launcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    killed, deadline = None, time.monotonic() + args.timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            ready = not warm or any((work / "tmp").glob(f"ftslurm-hb-*/waiting-{args.nproc}"))
            if killed is None and ready:
                killed = _kill_stopped_rank(work / "tmp", args.crash_rank)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = log.read_text()
    if proc.returncode != 0 or killed is None:
        raise SystemExit(f"the launcher exited {proc.returncode}:\n{text[-4000:]}")
    (record,) = read_reports(RunDir(work / "run"), Kind.LIVE, 0)
    final = json.loads((work / "ckpt" / "final.json").read_text())
    return {
        "crash_to_training_s": record.first_commit_at - record.failed_at,
        "standby_took_place": record.standby is not None,
        "digest": final["digest"],
    }


def _kill_stopped_rank(tmp: Path, rank: int) -> int | None:
    """SIGKILL the rank's process once it stopped at its pause (its heartbeat record names
    it); its pid, or None while it has not stopped."""
    from ftslurm.agent.heartbeat import read_beat

    for folder in tmp.glob("ftslurm-hb-*"):
        beat = read_beat(folder, rank)  # one node: local rank = rank
        if beat is None:
            continue
        try:
            stat = Path(f"/proc/{beat.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] == "T":
            os.kill(beat.pid, signal.SIGKILL)
            return beat.pid
    return None


def measure_standby(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="ftslurm-standby-bench-") as tmp:
        for i in range(args.repeat):
            for name in runs:
                runs[name].append(run_standby(args, name == "warm", Path(tmp) / f"{i}-{name}"))
    took = {n: statistics.median(r["crash_to_training_s"] for r in rs) for n, rs in runs.items()}
    return {
        "crash_to_training_s": took,
        "warm_over_cold": took["warm"] / took["cold"] if took["cold"] > 0 else None,
        "standby_took_place": {
            n: all(r["standby_took_place"] for r in rs) for n, rs in runs.items()
        },
        "digests": sorted({r["digest"] for rs in runs.values() for r in rs}),
    }


STEPOUT_STEPS, STEPOUT_STEP_S = 150, 0.05


def run_stepout(args: argparse.Namespace, live: bool, work: Path) -> dict:
    """Three launchers (2 training, 1 spare) on this machine, node n1 a persistent
    straggler: seconds from its bench record to training again, and the final digest."""
    from ftslurm.core.contract import RunDir
    from ftslurm.core.contract.reports import Benched, Kind, RoundRecord
    from ftslurm.runfiles import read_report, read_reports

    run = RunDir(work / "run")
    for name in ("run", "ckpt"):
        (work / name).mkdir(parents=True)
    job = str(90000 + os.getpid() % 9000 + (1 if live else 0))
    procs = []
    for node_rank in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
        env.update(
            FTSLURM_RUN_DIR=str(run.root),
            FTSLURM_CHECKPOINT_DIR=str(work / "ckpt"),
            FTSLURM_MEMORY_DIR=str(work / "memory"),
            FTSLURM_INJECT="straggler@0:n1*4",
            FTSLURM_STRAGGLER_INTERVAL_S="1",
            FTSLURM_STRAGGLER_WINDOWS="2",
            MASTER_ADDR="127.0.0.1",
            SLURM_JOB_ID=job,
            SLURMD_NODENAME=f"n{node_rank}",
            PYTHONUNBUFFERED="1",
        )
        if live:
            env[EnvName.LIVE_RECOVERY.value] = "1"
        command = [
            *(sys.executable, "-m", "ftslurm.agent.launch", "--nproc-per-node=1"),
            *("--nnodes=3", f"--node-rank={node_rank}", "--spare-nodes=1", "--"),
            *(sys.executable, str(RECIPE), "--steps", str(STEPOUT_STEPS)),
            *("--step-time", str(STEPOUT_STEP_S), "--ckpt-every", "10"),
            *("--checkpoint-dir", str(work / "ckpt"), *(["--live"] if live else [])),
        ]
        log = open(work / f"n{node_rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if codes != [0, 0, 0]:
        logs = "\n".join((work / f"n{r}.log").read_text()[-2000:] for r in range(3))
        raise SystemExit(f"the launchers exited {codes}:\n{logs}")
    benched = read_report(run.benched(0, 1), Benched)
    if benched is None or benched.time is None:
        raise SystemExit("node n1 never stepped out")
    if live:
        (record,) = read_reports(run, Kind.LIVE, 0)
        again = record.first_commit_at
    else:
        again = read_report(run.round_record(0, 1), RoundRecord).first_step_at  # type: ignore[union-attr]
    final = json.loads((work / "ckpt" / "final.json").read_text())
    return {"stepout_to_training_s": (again or 0.0) - benched.time, "digest": final["digest"]}


def measure_stepout(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ftslurm-stepout-bench-") as tmp:
        runs = {
            path: run_stepout(args, path == "live", Path(tmp) / path) for path in ("today", "live")
        }
    return {
        "stepout_to_training_s": {p: r["stepout_to_training_s"] for p, r in runs.items()},
        "identical": len({r["digest"] for r in runs.values()}) == 1,
        "settings": {"steps": STEPOUT_STEPS, "step_time": STEPOUT_STEP_S, "nodes": "2 + 1 spare"},
    }


def commit_worker(calls: int) -> None:
    """One rank of the commit measurement: `calls` all-reduces of a gradient-sized tensor
    alone, then each inside `LiveGroup.commit`, twice in turn; rank 0 prints the medians."""
    import torch
    import torch.distributed as dist

    from ftslurm.agent import live

    group = live.init_process_group("gloo")
    group.attach(state=lambda: {}, load=lambda _state: None, step=lambda: 0)
    grad = torch.ones(COMMIT_TENSOR)

    def reduce() -> None:
        dist.all_reduce(grad)

    times: dict[str, list[float]] = {"plain": [], "commit": []}
    for _ in range(2):
        for name in times:
            dist.barrier()
            for _ in range(calls):
                t = time.perf_counter()
                reduce() if name == "plain" else group.commit(reduce)
                times[name].append(time.perf_counter() - t)
    if group.rank == 0:
        print(json.dumps({n: statistics.median(v) for n, v in times.items()}), flush=True)
    os._exit(0)  # as the rank agent's exit: no teardown of gloo's threads


COMMIT_TENSOR = 4096  # floats reduced per step in the commit measurement


def measure_commit(args: argparse.Namespace) -> dict:
    """The commit's cost per step, `args.nproc` ranks on loopback, around a coordinator store
    this process hosts (`FTSLURM_LIVE_STORE`)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTSLURM_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--commit-worker", str(args.commit_calls)],
            env=dict(
                env,
                RANK=str(r),
                WORLD_SIZE=str(args.nproc),
                FTSLURM_LIVE_STORE=f"127.0.0.1:{store.port}",
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(args.nproc)
    ]
    out = [p.communicate(timeout=args.timeout)[0] for p in procs]
    medians = json.loads(out[0].strip().splitlines()[-1])
    return {
        "plain_s": medians["plain"],
        "commit_s": medians["commit"],
        "cost_s": medians["commit"] - medians["plain"],
    }


def measure(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="ftslurm-live-bench-") as tmp:
        for i in range(args.repeat):
            for path in ("today", "live"):
                for fault in (False, True):
                    name = f"{path}, {'fault' if fault else 'clean'}"
                    work = Path(tmp) / f"{i}-{path}-{int(fault)}"
                    runs.setdefault(name, []).append(run_once(args, path == "live", fault, work))
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    digests = {r["digest"] for rs in runs.values() for r in rs}
    today = wall["today, fault"] - wall["today, clean"]
    live = wall["live, fault"] - wall["live, clean"]
    commit = measure_commit(args)
    return {
        "settings": {
            k: getattr(args, k)
            for k in ("steps", "step_time", "ckpt_every", "crash_step", "crash_rank", "nproc")
        },
        "wall_s": wall,
        "digests": sorted(digests),
        "identical": len(digests) == 1,
        "fault_cost_s": {"today": today, "live": live},
        "live_over_today": live / today if today > 0 else None,
        "commit": commit,
        "commit_share_of_step": commit["cost_s"] / args.step_time if args.step_time else None,
        "world_restarts": {n: rs[0]["world_restarts"] for n, rs in runs.items()},
        "restarted_alone": {n: rs[0]["restarted_alone"] for n, rs in runs.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument(
        "--crash-step", type=int, default=25, help="the step after which the rank is killed"
    )
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--commit-calls", type=int, default=300)
    parser.add_argument("--commit-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--stepout", action="store_true", help="also a straggler stepping out to a spare"
    )
    parser.add_argument(
        "--standby", action="store_true", help="also a crashed rank's place taken by a standby"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.commit_worker is not None:
        commit_worker(args.commit_worker)
    result = measure(args)
    if args.stepout:
        result["stepout"] = measure_stepout(args)
        result["identical"] = result["identical"] and result["stepout"]["identical"]
    if args.standby:
        result["standby"] = measure_standby(args)
        digests = {*result["standby"]["digests"], *result["digests"]}
        result["identical"] = result["identical"] and len(digests) == 1
    if args.json:
        print(json.dumps(result, indent=1))
        return 0 if result["identical"] else 1
    s = result["settings"]
    print(
        f"{s['nproc']} ranks, {s['steps']} steps of {s['step_time']} s, checkpoint every "
        f"{s['ckpt_every']}, rank {s['crash_rank']} killed after step {s['crash_step']}"
    )
    for name, wall in result["wall_s"].items():
        print(f"  {name:13s} {wall:7.2f} s")
    cost = result["fault_cost_s"]
    print(
        f"the fault costs: today {cost['today']:.2f} s (every rank restarted, the steps "
        f"since the last checkpoint redone), live {cost['live']:.2f} s "
        f"(one rank restarted alone, at most 1 step redone); ratio "
        f"{result['live_over_today'] or float('nan'):.2f}"
    )
    share = result["commit_share_of_step"]
    print(
        f"the commit costs {result['commit']['cost_s'] * 1e3:.2f} ms per step (an "
        f"all-reduce of {COMMIT_TENSOR} floats: {result['commit']['plain_s'] * 1e3:.2f} ms "
        f"alone, {result['commit']['commit_s'] * 1e3:.2f} ms in a commit)"
        + (f" ({share:.1%} of the step)" if share is not None else "")
    )
    if "stepout" in result:
        took = result["stepout"]["stepout_to_training_s"]
        print(
            f"a straggler steps out to the spare (2 nodes + 1 spare, one rank each): training "
            f"again {took['today']:.2f} s after its bench record today (every rank restarted "
            f"from the checkpoint), {took['live']:.2f} s live (the spare's warm rank takes "
            f"its rank over)"
        )
    if "standby" in result:
        sb = result["standby"]
        took = sb["crash_to_training_s"]
        print(
            f"a crashed rank (killed after step {s['crash_step']}), from the failed step to "
            f"training again: {took['cold']:.2f} s restarted cold, {took['warm']:.2f} s with "
            f"the warm standby in its place (standby used: {sb['standby_took_place']['warm']})"
        )
    print(f"final parameters identical in every run: {result['identical']}")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
