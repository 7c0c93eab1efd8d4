"""Recovery latency and checkpoint-signal precision: ftslurm versus Slurm's own, on a real cluster.

Two measurements, each taken for ftslurm and for plain Slurm side by side in the same run:

1. Recovery latency after a node failure. Each round starts a 2-node ftslurm run (a small
   recipe submitted with `ftslurm submit`, its own state directory and daemon) and, on the
   two other nodes, an equivalent `sbatch --requeue` job (`srun` of the same sleeping task).
   Both are killed at once: the slurmd of one node of each (with every job process on it,
   as `LocalCluster.fail_node` does). Timed from the kill, and from the moment the job was
   first seen out of RUNNING (Slurm marked it NODE_FAIL / requeued it), to the replacement
   RUNNING again: for ftslurm the run's next attempt (the daemon's own "recovered" event,
   failure observed -> replacement running, is reported too); for Slurm the same job id
   running again after its own requeue (which waits its requeue delay), with a deadline of
   240 s. Killed nodes are revived as soon as ftslurm's replacement runs, so that Slurm's
   restart waits only for Slurm. Rounds run one after another (`--repeat` of them).
2. Checkpoint-signal precision. `--repeat` ftslurm runs (1 node, `time="2"`,
   `preempt_time=60`, Slurm's `--signal` backstop off: the daemon sends the signal) and
   `--repeat` `sbatch -t 2 --signal=USR2@60` jobs (a step task) run concurrently; each rank
   writes the wall time at which SIGUSR2 reached it. The error is arrival - due, where
   due = StartTime + TimeLimit - 60 from `scontrol show job`.

3. Kill -> training progressing again (`--only progress`): the first step a rank records
   after the kill, not merely a job RUNNING. A plain DDP script (gloo, one all-reduce a
   step, rank 0 checkpointing every 10 steps and logging each step with its wall time and
   its process) trains on 2 nodes along four recovery paths, one after another, each at
   SlurmdTimeout 10 s and at Slurm's default 300 s (the cluster is reconfigured for the
   second pass and put back after), one round each:
   - slurm: `sbatch --requeue` + `srun` of the script, nothing else: Slurm notices after
     SlurmdTimeout, requeues (JobRequeue=1) and runs it again after its requeue delay;
   - today: ftslurm without peer-loss detection (`peer_timeout_s` out of reach): the
     daemon acts on Slurm's NODE_FAIL (requeue, start now);
   - peer: ftslurm as shipped: the launchers report the lost node after `peer_timeout_s`
     and the daemon moves the run to a new job without it;
   - spare: ftslurm with `spare_nodes=1` (3 nodes, 2 training): the survivors restart the
     ranks in the same job with the spare.
   The node killed is one that trains and is not the batch host. Rounds wait at most
   PROGRESS_DEADLINE_S for progress.

4. Kill -> training progressing again with every default (`--only defaults`): Slurm's
   default SlurmdTimeout (300 s), the default `peer_timeout_s` and the daemon's default
   back-off (the kill comes `--settle` seconds after the submission, 120 by default, when
   the daemon looks at most once a minute), one round per case:
   - batch-host: a 2-node run loses its batch host (node rank 0); no spare;
   - other-node: a 2-node run loses its other node; no spare;
   - spare: a 2-node run with `spare_nodes=1` (3 nodes) loses a node that trains, not the
     batch host;
   - spare-batch-host: as spare, but the node lost is the batch host (node rank 0): the
     spare cannot serve it inside the job, the run goes on in a new job;
   - spare-live: as spare, with `live_recovery` and the same training through
     `ftslurm.agent.live`: the spare's ranks wait warm and take the lost node's over, the
     batch host's rank keeps its process; timed to the first step committed after the
     recovery (its `LiveRecovery` record), with the steps redone;
   - one-node: a 1-node run loses its node.
   Targets: under 30 s without a spare or with the batch host lost, under 15 s with a
   spare, under 5 s live.

Detection time depends on the cluster's SlurmdTimeout (and the kill on KillWait): the
settings found are printed with the results. Needs a running cluster (`make slurm-up`) and
root (to kill a node's slurmd); every job is cancelled and every node revived, even on error.

    python benchmarks/slurm_recovery.py [--repeat 3]
        [--only recovery|preempt|progress|defaults] [--timeouts 10,300]
        [--paths slurm,today,peer,spare]
        [--cases batch-host,other-node,spare,spare-batch-host,spare-live,one-node]
        [--settle 120] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftslurm.daemon.store import Store
from ftslurm.localcluster import ClusterError, LocalCluster

PREEMPT_S = 60  # seconds before the wall limit the checkpoint signal is asked for
PREEMPT_LIMIT_MIN = 2  # wall limit (minutes) of the signal jobs
SLURM_DEADLINE_S = 240.0  # how long Slurm's own requeue gets to run the job again
FTSLURM_DEADLINE_S = 120.0
POLL_S = 0.25
CONFIG_KEYS = (
    "SLURM_VERSION",
    "SlurmdTimeout",
    "KillWait",
    "MessageTimeout",
    "JobRequeue",
    "MinJobAge",
    "SchedulerType",
    "SchedulerParameters",
    "SchedulerTimeSlice",
    "ReturnToService",
    "OverTimeLimit",
)

# The rank: records when SIGUSR2 reaches it (wall time, atomically), then sleeps on until
# it is cancelled; the file `<out>.ready` says when it was able to catch the signal.
RANK = r"""
import os, signal, sys, time
out = sys.argv[1]

def write(path, value):
    with open(path + ".tmp", "w") as f:
        f.write(repr(value))
    os.replace(path + ".tmp", path)

def caught(signum, frame):
    if not os.path.exists(out):
        write(out, time.time())

signal.signal(signal.SIGUSR2, caught)
write(out + ".ready", time.time())
while True:
    time.sleep(1)
"""


# The training of the progress rounds: plain DDP, as a user writes it. Under srun alone it
# takes its rank from Slurm; under ftslurm's launcher torch elastic sets RANK and the rest.
# Rank 0 appends "step wall-time pid" to <out>/steps.log every step; every rank writes the
# node it runs on to <out>/rank-<r>.node when it starts.
DDP = r"""
import datetime, os, sys, time
import torch
import torch.distributed as dist
out, steps = sys.argv[1], int(sys.argv[2])
env = os.environ
if "RANK" not in env:
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(30000 + (int(env["SLURM_JOB_ID"]) * 7
                                      + int(env.get("SLURM_RESTART_COUNT") or 0) * 131) % 20000)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
with open(os.path.join(out, f"rank-{rank}.node"), "w") as f:
    f.write(env.get("SLURMD_NODENAME", ""))
ckpt = os.path.join(out, "ckpt.pt")
w, start = torch.zeros(4), 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    w, start = state["w"], state["step"]
for step in range(start, steps):
    g = torch.ones(4) * (rank + 1)
    dist.all_reduce(g)
    w -= 0.01 * g
    if rank == 0:
        with open(os.path.join(out, "steps.log"), "a") as f:
            f.write(f"{step} {time.time()} {os.getpid()}\n")
        if step % 10 == 9:
            torch.save({"w": w, "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    time.sleep(0.2)
dist.destroy_process_group()
"""
# The same training with live recovery (`ftslurm.agent.live`): the step's all-reduce inside
# the commit, the state handed over to a rank that lacks it.
DDP_LIVE = r"""
import os, sys, time
import torch
import torch.distributed as dist
from ftslurm.agent import live
out, steps = sys.argv[1], int(sys.argv[2])
group = live.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(out, f"rank-{rank}.node"), "w") as f:
    f.write(os.environ.get("SLURMD_NODENAME", ""))
ckpt = os.path.join(out, "ckpt.pt")
s = {"w": torch.zeros(4), "step": 0}
if os.path.exists(ckpt) and not group.rejoining:
    s.update(torch.load(ckpt))
group.attach(state=lambda: dict(s), load=s.update, step=lambda: s["step"])
while s["step"] < steps:
    g = torch.ones(4) * (rank + 1)
    if not group.commit(lambda: dist.all_reduce(g)):
        continue
    s["w"] = s["w"] - 0.01 * g
    s["step"] += 1
    if rank == 0:
        with open(os.path.join(out, "steps.log"), "a") as f:
            f.write(f"{s['step'] - 1} {time.time()} {os.getpid()}\n")
        if s["step"] % 10 == 0:
            torch.save(dict(s), ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    time.sleep(0.2)
dist.destroy_process_group()
"""
PROGRESS_PATHS = ("slurm", "today", "peer", "spare")
DEFAULT_CASES = ("batch-host", "other-node", "spare", "spare-batch-host", "spare-live", "one-node")
DEFAULT_SLURMD_TIMEOUT_S = 300  # Slurm's default
PROGRESS_DEADLINE_S = 900.0  # at SlurmdTimeout 300 s Slurm's own path needs ~7 min
UNREACHABLE_PEER_TIMEOUT_S = 10**6  # "today": the launchers never report a lost node


def step_lines(out: Path) -> list[tuple[int, float, str]]:
    """(step, wall time, pid) of each step rank 0 logged so far."""
    path = out / "steps.log"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 3:
            rows.append((int(parts[0]), float(parts[1]), parts[2]))
    return rows


# ------------------------------------------------------------------------ helpers
def first_step_after(
    out: Path, kill: float, before: list[tuple[int, float, str]], what: str
) -> tuple[int, float, str] | None:
    """The first step logged after `kill` by another process than the last one `before`
    (the training going again), or None when none came within the deadline."""

    def progressed() -> Any:
        rows = [r for r in step_lines(out) if r[1] > kill and r[2] != before[-1][2]]
        return rows[0] if rows else None

    try:
        return wait(progressed, PROGRESS_DEADLINE_S, f"{what}: a step after the kill")
    except RuntimeError:
        return None


def first_live_step_after(
    cli: Any, run_id: str, out: Path, kill: float, what: str
) -> tuple[tuple[int, float, str] | None, int | None]:
    """With live recovery: the first step committed after the recovery the kill caused, as
    its record says (`LiveRecovery.first_commit_at`), and the steps redone (the step that
    ran again, and the steps rank 0 had logged beyond it)."""
    from ftslurm.core.contract import RunDir
    from ftslurm.core.contract.reports import Kind
    from ftslurm.runfiles import read_reports

    run = cli.store.get_run(run_id)
    run_dir = RunDir(run.spec["run_dir"])

    def committed() -> Any:
        latest = cli.store.latest_attempt(run_id)
        found = [
            r
            for a in range(latest.attempt + 1 if latest else 1)
            for r in read_reports(run_dir, Kind.LIVE, a)
            if r.first_commit_at and r.first_commit_at > kill
        ]
        return found[0] if found else None

    try:
        record = wait(committed, PROGRESS_DEADLINE_S, f"{what}: a step committed after the kill")
    except RuntimeError:
        return None, None
    logged = [row[0] for row in step_lines(out) if row[1] <= kill]
    redone = (max(logged) + 1 - record.step) if logged else None
    return (record.step, record.first_commit_at, "live"), redone


def sh(*argv: str, check: bool = True, timeout: float = 30) -> str:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


def slurm_config() -> dict[str, str]:
    found = {}
    for line in sh("scontrol", "show", "config").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in CONFIG_KEYS:
            found[key.strip()] = value.strip()
    return found


def show_job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict ({} once the job is gone)."""
    out = sh("scontrol", "show", "job", "-o", job_id, check=False)
    fields = {}
    for token in out.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def states(job_ids: list[str]) -> dict[str, str]:
    """{job id: state} for these jobs, in one squeue call (finished ones included)."""
    ids = [j for j in job_ids if j]
    if not ids:
        return {}
    out = sh("squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%i|%T", check=False)
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def epoch(slurm_time: str) -> float | None:
    try:
        return time.mktime(time.strptime(slurm_time, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def limit_s(text: str) -> float:
    """Slurm's TimeLimit ([D-]HH:MM:SS or MM:SS) in seconds."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days) if days else 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def sbatch(*args: str) -> str:
    return sh("sbatch", "--parsable", *args).strip().split(";")[0]


def summary(values: list[float | None], absolute: bool = False) -> dict[str, Any]:
    got = [abs(v) if absolute else v for v in values if v is not None]
    if not got:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {
        "n": len(got),
        "median": round(statistics.median(got), 3),
        "min": round(min(got), 3),
        "max": round(max(got), 3),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class Ftslurm:
    """`ftslurm` as a user runs it, with its own state directory (and so its own daemon)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = dict(os.environ, FTSLURM_HOME=str(home))
        self.runs: list[str] = []
        self._store: Store | None = None

    def __call__(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "ftslurm", *args],
            env=self.env,
            cwd=self.home.parent,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"ftslurm {' '.join(args)} exited {proc.returncode}: "
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc.stdout

    def submit(self, recipe: Path) -> str:
        run_id = json.loads(self("submit", "--json", str(recipe)))["run_id"]
        self.runs.append(run_id)
        return run_id

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self.home)
        return self._store

    def cancel(self, run_id: str) -> None:
        self("cancel", run_id, check=False)

    def close(self) -> None:
        for run_id in self.runs:
            self.cancel(run_id)
        self("daemon", "stop", check=False)
        if self._store is not None:
            self._store.close()


def write_recipe(folder: Path, name: str, rank: Path, out: Path, **settings: Any) -> Path:
    path = folder / f"{name}.py"
    fields = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    path.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(rank)!r}, "
        f"{str(out)!r}], {fields})\n"
    )
    return path


def wait(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


class Bench:
    def __init__(self, cluster: LocalCluster, tmp: Path) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.rank = tmp / "rank.py"
        self.rank.write_text(RANK)
        self.ddp = tmp / "ddp.py"
        self.ddp.write_text(DDP)
        self.ddp_live = tmp / "ddp_live.py"
        self.ddp_live.write_text(DDP_LIVE)
        self.jobs: list[str] = []  # plain sbatch jobs to cancel
        self.clis: list[Ftslurm] = []
        self.killed: set[str] = set()
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ cleanup
    def revive(self, nodes: list[str]) -> None:
        for node in nodes:
            with self.lock:
                if node not in self.killed:
                    continue
            self.cluster.revive_node(node, timeout=90)
            with self.lock:
                self.killed.discard(node)

    def cleanup(self) -> None:
        for job in self.jobs:
            sh("scancel", job, check=False)
        for cli in self.clis:
            with contextlib.suppress(Exception):
                cli.close()
        for node in sorted(self.killed):
            with contextlib.suppress(Exception):
                self.cluster.revive_node(node, timeout=90)
        self.killed.clear()

    def slurm_job(self, *args: str, out: Path) -> str:
        job = sbatch(
            f"--output={self.tmp / 'slurm-%j.out'}",
            f"--chdir={self.tmp}",
            *args,
            f"--wrap=srun {sys.executable} {self.rank} {out}",
        )
        self.jobs.append(job)
        return job

    # ---------------------------------------------------------------- recovery
    def recovery_round(self, i: int, log: Callable[[str], None]) -> dict[str, Any]:
        self.cluster.wait_nodes_idle(timeout=120)
        folder = self.tmp / f"recovery-{i}"
        folder.mkdir()
        cli = Ftslurm(folder / "home")
        self.clis.append(cli)
        recipe = write_recipe(
            folder,
            "sleeper",
            self.rank,
            folder / "ft.signal",
            nodes=2,
            ntasks_per_node=1,
            time="10",
            num_job_retries_on_failure=3,
        )
        run_id = cli.submit(recipe)

        def ft_running() -> Any:
            a = cli.store.latest_attempt(run_id)
            return a if a and a.state == "RUNNING" and len(a.nodes) == 2 else None

        first = wait(ft_running, 90, "the ftslurm run to be RUNNING")
        ft_job = first.job_id or ""
        others = [n for n in self.cluster.layout.node_names if n not in first.nodes][:2]
        sl_job = self.slurm_job(
            "--requeue",
            "-N",
            "2",
            "--ntasks-per-node=1",
            "-t",
            "10",
            f"--nodelist={','.join(others)}",
            out=folder / "sl.signal",
        )
        wait(lambda: states([sl_job]).get(sl_job) == "RUNNING", 60, "the sbatch job to be RUNNING")
        sl_nodes = sh("squeue", "-h", "-j", sl_job, "-o", "%N").strip()
        time.sleep(2.0)  # both tasks started
        ft_victim, sl_victim = first.nodes[1], others[1]
        with self.lock:
            self.killed.update({ft_victim, sl_victim})
        self.cluster.fail_node(ft_victim)
        ft_kill = time.time()
        self.cluster.fail_node(sl_victim)
        sl_kill = time.time()
        log(
            f"recovery {i + 1}: killed {ft_victim} (ftslurm job {ft_job} on "
            f"{','.join(first.nodes)}) and {sl_victim} (sbatch job {sl_job} on {sl_nodes})"
        )
        ft_marked = ft_running_at = sl_marked = sl_running_at = None
        after: threading.Thread | None = None
        replacement = None

        def release() -> None:  # ftslurm measured: its run goes, the nodes come back
            cli.cancel(run_id)
            self.revive([ft_victim, sl_victim])

        while True:
            now = time.time()
            seen = states([ft_job, sl_job])
            latest = cli.store.latest_attempt(run_id)
            if ft_marked is None and (seen.get(ft_job) != "RUNNING" or latest.attempt > 0):
                ft_marked = now
            if ft_running_at is None and after is None:
                if latest.attempt > 0 and latest.state == "RUNNING":
                    ft_running_at, replacement = now, latest
                if ft_running_at is not None or now - ft_kill > FTSLURM_DEADLINE_S:
                    after = threading.Thread(target=release, daemon=True)
                    after.start()
            if sl_marked is None and seen.get(sl_job) != "RUNNING":
                sl_marked = now
            elif sl_marked is not None and seen.get(sl_job) == "RUNNING":
                sl_running_at = now
            if sl_running_at is not None or now - sl_kill > SLURM_DEADLINE_S:
                if after is not None:
                    break
            time.sleep(POLL_S)
        sl_info = show_job(sl_job)
        sh("scancel", sl_job, check=False)
        after.join(timeout=150)
        recovered = [e for e in cli.store.events(run_id) if e.kind == "recovered"]
        sl_start = epoch(sl_info.get("StartTime", "")) if sl_running_at else None
        result = {
            "ftslurm": {
                "run_id": run_id,
                "job_id": ft_job,
                "nodes": first.nodes,
                "killed": ft_victim,
                "replacement_nodes": replacement.nodes if replacement else None,
                "replacement_job_id": replacement.job_id if replacement else None,
                "kill_to_marked_s": rounded(ft_marked - ft_kill if ft_marked else None),
                "kill_to_running_s": rounded(ft_running_at - ft_kill if ft_running_at else None),
                "marked_to_running_s": rounded(
                    ft_running_at - ft_marked if ft_running_at and ft_marked else None
                ),
                "daemon_recovered_latency_s": recovered[0].data["latency_s"] if recovered else None,
            },
            "slurm": {
                "job_id": sl_job,
                "nodes": sl_nodes,
                "killed": sl_victim,
                "restarted": sl_running_at is not None,
                "restarts": sl_info.get("Restarts"),
                "kill_to_marked_s": rounded(sl_marked - sl_kill if sl_marked else None),
                "kill_to_running_s": rounded(sl_running_at - sl_kill if sl_running_at else None),
                "marked_to_running_s": rounded(
                    sl_running_at - sl_marked if sl_running_at and sl_marked else None
                ),
                "start_time_minus_kill_s": rounded(sl_start - sl_kill if sl_start else None, 1),
            },
        }
        log(
            f"recovery {i + 1}: ftslurm {result['ftslurm']['kill_to_running_s']} s, "
            f"slurm {result['slurm']['kill_to_running_s']} s"
        )
        cli.close()
        return result

    def recovery(self, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
        rounds = [self.recovery_round(i, log) for i in range(repeat)]
        out: dict[str, Any] = {"rounds": rounds}
        for side in ("ftslurm", "slurm"):
            out[side] = {
                key: summary([r[side][key] for r in rounds])
                for key in ("kill_to_running_s", "marked_to_running_s", "kill_to_marked_s")
            }
        out["ftslurm"]["daemon_recovered_latency_s"] = summary(
            [r["ftslurm"]["daemon_recovered_latency_s"] for r in rounds]
        )
        out["slurm"]["restarted"] = sum(r["slurm"]["restarted"] for r in rounds)
        out["slurm"]["deadline_s"] = SLURM_DEADLINE_S
        out["ratio_slurm_to_ftslurm"] = ratio(
            out["slurm"]["kill_to_running_s"]["median"],
            out["ftslurm"]["kill_to_running_s"]["median"],
        )
        return out

    # ---------------------------------------------------------------- progress
    def progress_round(
        self, path: str, slurmd_timeout: int, log: Callable[[str], None]
    ) -> dict[str, Any]:
        """One recovery path: train, kill a node that trains (not the batch host), time the
        first new step."""
        self.cluster.wait_nodes_idle(timeout=120)
        folder = self.tmp / f"progress-{path}-{slurmd_timeout}"
        out = folder / "train"
        out.mkdir(parents=True)
        command = [sys.executable, str(self.ddp), str(out), "1000000"]
        cli: Ftslurm | None = None
        run_id = job = ""
        if path == "slurm":
            job = sbatch(
                f"--output={folder / 'slurm-%j.out'}",
                f"--chdir={folder}",
                "--requeue",
                "-N",
                "2",
                "--ntasks-per-node=1",
                "-t",
                "20",
                f"--wrap=srun {' '.join(command)}",
            )
            self.jobs.append(job)
        else:
            cli = Ftslurm(folder / "home")
            self.clis.append(cli)
            settings: dict[str, Any] = {
                "nodes": 2,
                "ntasks_per_node": 1,
                "time": "20",
                "num_job_retries_on_failure": 3,
            }
            if path == "today":
                settings["peer_timeout_s"] = UNREACHABLE_PEER_TIMEOUT_S
            elif path == "spare":
                settings["spare_nodes"] = 1
            recipe = folder / "ddp_recipe.py"
            recipe.write_text(
                "import ftslurm\n"
                f"recipe = ftslurm.Recipe(command={command!r}, "
                + ", ".join(f"{k}={v!r}" for k, v in settings.items())
                + ")\n"
            )
            run_id = cli.submit(recipe)

        def job_now() -> str:
            if cli is None:
                return job
            a = cli.store.latest_attempt(run_id)
            return (a.job_id if a else None) or ""

        wait(lambda: len(step_lines(out)) >= 15, 180, f"{path}: 15 training steps")
        first_job = job_now()
        host = show_job(first_job).get("BatchHost", "")
        trained = sorted({p.read_text().strip() for p in out.glob("rank-*.node")})
        victim = next(n for n in trained if n and n != host)  # a node that trains, not it
        before = step_lines(out)
        with self.lock:
            self.killed.add(victim)
        self.cluster.fail_node(victim)
        kill = time.time()
        log(
            f"progress {path} @ SlurmdTimeout {slurmd_timeout}: killed {victim} "
            f"at step {before[-1][0]}, job {first_job}"
        )

        first = first_step_after(out, kill, before, path)
        after_job = job_now()
        events = cli.store.events(run_id) if cli is not None else []
        lost = [e.data for e in events if e.kind == "node_lost"]
        ended = [e.data.get("cause") for e in events if e.kind == "ended"]
        if cli is not None:
            cli.cancel(run_id)
        else:
            sh("scancel", job, check=False)
        self.revive([victim])
        result = {
            "path": path,
            "slurmd_timeout_s": slurmd_timeout,
            "killed": victim,
            "job_id": first_job,
            "job_id_after": after_job,
            "same_job": after_job == first_job,
            "last_step_before_kill": before[-1][0],
            "resumed_at_step": first[0] if first else None,
            "kill_to_progress_s": rounded(first[1] - kill if first else None),
            "detected_by": lost[0].get("source") if lost else None,
            "ended_as": ended,
        }
        log(
            f"progress {path} @ {slurmd_timeout}: {result['kill_to_progress_s']} s "
            f"({'same job' if result['same_job'] else 'job ' + after_job}; "
            f"detected by {result['detected_by']}, ended as {', '.join(ended) or 'nothing'})"
        )
        if cli is not None:
            cli.close()
        return result

    def progress(
        self, timeouts: list[int], paths: list[str], log: Callable[[str], None]
    ) -> dict[str, Any]:
        rounds = []
        for timeout in timeouts:
            with self.cluster.slurmd_timeout(timeout):
                rounds += [self.progress_round(path, timeout, log) for path in paths]
        return {"rounds": rounds, "deadline_s": PROGRESS_DEADLINE_S}

    # ---------------------------------------------------------------- defaults
    def defaults_round(
        self, case: str, settle: float, log: Callable[[str], None]
    ) -> dict[str, Any]:
        """One case of `--only defaults`: a run with every default setting trains, the
        daemon backs off for `settle` seconds, a node is killed, the first new step is
        timed."""
        self.cluster.wait_nodes_idle(timeout=120)
        folder = self.tmp / f"defaults-{case}"
        out = folder / "train"
        out.mkdir(parents=True)
        script = self.ddp_live if case == "spare-live" else self.ddp
        command = [sys.executable, str(script), str(out), "1000000"]
        cli = Ftslurm(folder / "home")
        self.clis.append(cli)
        settings: dict[str, Any] = {
            "nodes": 1 if case == "one-node" else 2,
            "ntasks_per_node": 1,
            "time": "20",
            "num_job_retries_on_failure": 3,
        }
        if case in ("spare", "spare-batch-host", "spare-live"):
            settings["spare_nodes"] = 1
        if case == "spare-live":
            settings["live_recovery"] = True
        recipe = folder / "ddp_recipe.py"
        recipe.write_text(
            "import ftslurm\n"
            f"recipe = ftslurm.Recipe(command={command!r}, "
            + ", ".join(f"{k}={v!r}" for k, v in settings.items())
            + ")\n"
        )
        submitted = time.monotonic()
        run_id = cli.submit(recipe)

        def job_now() -> str:
            a = cli.store.latest_attempt(run_id)
            return (a.job_id if a else None) or ""

        wait(lambda: len(step_lines(out)) >= 15, 180, f"{case}: 15 training steps")
        wait(lambda: time.monotonic() - submitted >= settle, settle + 1, "the daemon to back off")
        first_job = job_now()
        host = show_job(first_job).get("BatchHost", "")
        trained = sorted({p.read_text().strip() for p in out.glob("rank-*.node")})
        victim = (
            host
            if case in ("batch-host", "spare-batch-host", "one-node")
            else next(n for n in trained if n and n != host)
        )
        before = step_lines(out)
        with self.lock:
            self.killed.add(victim)
        self.cluster.fail_node(victim)
        kill = time.time()
        log(f"defaults {case}: killed {victim} at step {before[-1][0]}, job {first_job}")

        if case == "spare-live":  # rank 0 keeps its process: the recovery's own record
            first, redone = first_live_step_after(cli, run_id, out, kill, case)
        else:
            first, redone = first_step_after(out, kill, before, case), None
        after_job = job_now()
        events = cli.store.events(run_id)
        lost = [e.data for e in events if e.kind == "node_lost"]
        cli.cancel(run_id)
        self.revive([victim])
        result = {
            "case": case,
            "killed": victim,
            "job_id": first_job,
            "job_id_after": after_job,
            "same_job": after_job == first_job,
            "kill_to_progress_s": rounded(first[1] - kill if first else None),
            "detected_by": lost[0].get("source") if lost else None,
            "detection_s": lost[0].get("detection_s") if lost else None,
            "target_s": {"spare": 15, "spare-live": 5}.get(case, 30),
            "steps_redone": redone,
        }
        log(
            f"defaults {case}: {result['kill_to_progress_s']} s "
            f"({'same job' if result['same_job'] else 'job ' + after_job}; "
            f"detected by {result['detected_by']})"
        )
        cli.close()
        return result

    def defaults(
        self, cases: list[str], repeat: int, settle: float, log: Callable[[str], None]
    ) -> dict[str, Any]:
        with self.cluster.slurmd_timeout(DEFAULT_SLURMD_TIMEOUT_S):
            rounds = [
                self.defaults_round(case, settle, log) for _ in range(repeat) for case in cases
            ]
        summary_ = {
            case: summary([r["kill_to_progress_s"] for r in rounds if r["case"] == case])
            for case in cases
        }
        return {
            "rounds": rounds,
            "summary": summary_,
            "settle_s": settle,
            "slurmd_timeout_s": DEFAULT_SLURMD_TIMEOUT_S,
        }

    # ----------------------------------------------------------------- preempt
    def preempt(self, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
        self.cluster.wait_nodes_idle(timeout=120)
        folder = self.tmp / "preempt"
        folder.mkdir()
        cli = Ftslurm(folder / "home")
        self.clis.append(cli)
        items: list[dict[str, Any]] = []
        for i in range(repeat):
            out = folder / f"ftslurm-{i}.signal"
            recipe = write_recipe(
                folder,
                f"signal{i}",
                self.rank,
                out,
                nodes=1,
                ntasks_per_node=1,
                time=str(PREEMPT_LIMIT_MIN),
                preempt_time=PREEMPT_S,
                signal_backstop=False,
                num_job_retries_on_failure=0,
            )
            items.append({"source": "ftslurm", "run_id": cli.submit(recipe), "out": out})
        for i in range(repeat):
            out = folder / f"slurm-{i}.signal"
            job = self.slurm_job(
                "-N",
                "1",
                "-n",
                "1",
                "-t",
                str(PREEMPT_LIMIT_MIN),
                f"--signal=USR2@{PREEMPT_S}",
                out=out,
            )
            items.append({"source": "slurm", "job_id": job, "out": out})
        log(f"preempt: {repeat} ftslurm runs and {repeat} sbatch --signal jobs submitted")
        deadline = time.time() + 90 + PREEMPT_LIMIT_MIN * 60 + 15
        while time.time() < deadline:
            pending = False
            for item in items:
                if "run_id" in item and not item.get("job_id"):
                    a = cli.store.latest_attempt(item["run_id"])
                    item["job_id"] = a.job_id if a else None
                if "done" in item:
                    continue
                pending = True
                if item.get("job_id") and "start" not in item:
                    info = show_job(item["job_id"])
                    if info.get("JobState") == "RUNNING":
                        item["start"] = epoch(info["StartTime"])
                        item["limit_s"] = limit_s(info["TimeLimit"])
                        item["due"] = item["start"] + item["limit_s"] - PREEMPT_S
                out: Path = item["out"]
                if out.exists():
                    item["arrival"] = float(out.read_text())
                    item["done"] = True
                elif "start" in item and time.time() > item["start"] + item["limit_s"] + 10:
                    item["done"] = True  # the limit passed without a signal
            if not pending:
                break
            time.sleep(POLL_S)
        for item in items:
            if "run_id" in item:
                cli.cancel(item["run_id"])
            elif item.get("job_id"):
                sh("scancel", item["job_id"], check=False)
        repeats = []
        for item in items:
            ready = item["out"].with_name(item["out"].name + ".ready")
            arrival, due, start = item.get("arrival"), item.get("due"), item.get("start")
            row = {
                "source": item["source"],
                "job_id": item.get("job_id"),
                "start": start,
                "due": due,
                "arrival": rounded(arrival),
                "received": arrival is not None,
                "error_s": rounded(arrival - due if arrival is not None and due else None),
                "rank_ready_after_start_s": rounded(
                    float(ready.read_text()) - start if ready.exists() and start else None
                ),
            }
            if "run_id" in item:
                row["run_id"] = item["run_id"]
                sent = [
                    e for e in cli.store.events(item["run_id"]) if e.kind == "checkpoint_signal"
                ]
                row["daemon_sent_minus_due_s"] = rounded(
                    sent[0].time - sent[0].data["due"] if sent else None
                )
            repeats.append(row)
        cli.close()
        out: dict[str, Any] = {
            "preempt_time_s": PREEMPT_S,
            "time_limit_s": PREEMPT_LIMIT_MIN * 60,
            "repeats": repeats,
        }
        for side in ("ftslurm", "slurm"):
            errors = [r["error_s"] for r in repeats if r["source"] == side]
            out[side] = {
                "received": sum(r["received"] for r in repeats if r["source"] == side),
                "error_s": summary(errors),
                "abs_error_s": summary(errors, True),
            }
        out["ratio_median_abs_error_slurm_to_ftslurm"] = ratio(
            out["slurm"]["abs_error_s"]["median"], out["ftslurm"]["abs_error_s"]["median"]
        )
        out["ratio_max_abs_error_slurm_to_ftslurm"] = ratio(
            out["slurm"]["abs_error_s"]["max"], out["ftslurm"]["abs_error_s"]["max"]
        )
        return out


# -------------------------------------------------------------------------- output
def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = result["cluster"]
    console.print("cluster: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    rec = result.get("recovery")
    if rec:
        table = Table(title="Recovery after a node failure (s): kill -> replacement RUNNING")
        for col in (
            "round",
            "ftslurm kill->run",
            "ftslurm marked->run",
            "daemon latency",
            "slurm kill->marked",
            "slurm kill->run",
            "slurm marked->run",
        ):
            table.add_column(col, justify="right")
        for i, r in enumerate(rec["rounds"]):
            f, s = r["ftslurm"], r["slurm"]
            table.add_row(
                str(i + 1),
                fmt(f["kill_to_running_s"]),
                fmt(f["marked_to_running_s"]),
                fmt(f["daemon_recovered_latency_s"]),
                fmt(s["kill_to_marked_s"]),
                fmt(s["kill_to_running_s"]) if s["restarted"] else "never",
                fmt(s["marked_to_running_s"]),
            )
        console.print(table)
        table = Table(title="Recovery summary (s)")
        for col in ("source", "measure", "n", "median", "min", "max"):
            table.add_column(col, justify="right")
        for side, key in (
            ("ftslurm", "kill_to_running_s"),
            ("ftslurm", "marked_to_running_s"),
            ("ftslurm", "daemon_recovered_latency_s"),
            ("slurm", "kill_to_running_s"),
            ("slurm", "marked_to_running_s"),
        ):
            s = rec[side][key]
            table.add_row(side, key, str(s["n"]), fmt(s["median"]), fmt(s["min"]), fmt(s["max"]))
        console.print(table)
        console.print(
            f"Slurm restarted {rec['slurm']['restarted']}/{len(rec['rounds'])} "
            f"within {SLURM_DEADLINE_S:.0f}s; median kill->running ratio "
            f"Slurm / ftslurm = {fmt(rec['ratio_slurm_to_ftslurm'])}"
        )
    pre = result.get("preempt")
    if pre:
        table = Table(
            title=f"Checkpoint signal arrival - due (s), due = start + limit - "
            f"{pre['preempt_time_s']}s, limit {pre['time_limit_s']}s"
        )
        for col in ("source", "job", "received", "error", "rank ready after start"):
            table.add_column(col, justify="right")
        for r in pre["repeats"]:
            table.add_row(
                r["source"],
                str(r["job_id"]),
                "yes" if r["received"] else "no",
                fmt(r["error_s"]),
                fmt(r["rank_ready_after_start_s"]),
            )
        console.print(table)
        table = Table(title="Checkpoint signal error summary (s)")
        for col in ("source", "received", "median error", "median |error|", "max |error|"):
            table.add_column(col, justify="right")
        for side in ("ftslurm", "slurm"):
            s = pre[side]
            table.add_row(
                side,
                str(s["received"]),
                fmt(s["error_s"]["median"]),
                fmt(s["abs_error_s"]["median"]),
                fmt(s["abs_error_s"]["max"]),
            )
        console.print(table)
        console.print(
            "ratio Slurm / ftslurm: median |error| "
            f"{fmt(pre['ratio_median_abs_error_slurm_to_ftslurm'])}, max |error| "
            f"{fmt(pre['ratio_max_abs_error_slurm_to_ftslurm'])}"
        )
    prog = result.get("progress")
    if prog:
        table = Table(title="Kill -> training progressing again (first new step), s")
        for col in (
            "path",
            "SlurmdTimeout",
            "kill->step",
            "same job",
            "detected by",
            "steps redone",
        ):
            table.add_column(col, justify="right")
        for r in prog["rounds"]:
            redone = (
                None
                if r["resumed_at_step"] is None
                else r["last_step_before_kill"] + 1 - r["resumed_at_step"]
            )
            table.add_row(
                r["path"],
                f"{r['slurmd_timeout_s']} s",
                fmt(r["kill_to_progress_s"])
                if r["kill_to_progress_s"] is not None
                else f"> {prog['deadline_s']:.0f}",
                "yes" if r["same_job"] else "no",
                r["detected_by"] or "-",
                fmt(redone),
            )
        console.print(table)
    dflt = result.get("defaults")
    if dflt:
        table = Table(
            title=f"Every default (SlurmdTimeout {dflt['slurmd_timeout_s']} s, "
            f"kill {dflt['settle_s']:.0f} s after the submission): "
            "kill -> first new step, s"
        )
        for col in ("case", "kill->step", "target", "same job", "detected by", "detection"):
            table.add_column(col, justify="right")
        for r in dflt["rounds"]:
            table.add_row(
                r["case"],
                fmt(r["kill_to_progress_s"])
                if r["kill_to_progress_s"] is not None
                else f"> {PROGRESS_DEADLINE_S:.0f}",
                f"< {r['target_s']}",
                "yes" if r["same_job"] else "no",
                r["detected_by"] or "-",
                fmt(r["detection_s"]),
            )
        console.print(table)
    console.print(f"wall time {result['wall_s']:.0f}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=("recovery", "preempt", "progress", "defaults"))
    parser.add_argument(
        "--timeouts", default="10,300", help="SlurmdTimeout values (s) for the progress rounds"
    )
    parser.add_argument(
        "--paths", default=",".join(PROGRESS_PATHS), help="recovery paths of the progress rounds"
    )
    parser.add_argument(
        "--cases", default=",".join(DEFAULT_CASES), help="cases of the defaults rounds"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=120.0,
        help="seconds from a defaults round's submission to the kill",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - set(DEFAULT_CASES) or args.settle < 0:
        parser.error(f"--cases: some of {','.join(DEFAULT_CASES)}; --settle: seconds >= 0")
    try:
        timeouts = [int(t) for t in args.timeouts.split(",") if t.strip()]
    except ValueError:
        parser.error("--timeouts takes comma-separated seconds")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not timeouts or min(timeouts) < 1 or not paths or set(paths) - set(PROGRESS_PATHS):
        parser.error(f"--timeouts: seconds >= 1; --paths: some of {','.join(PROGRESS_PATHS)}")
    started = time.time()
    # SIGTERM (a `timeout`, a CI limit) unwinds like Ctrl-C: the cleanup below cancels the
    # jobs, revives the killed nodes and puts SlurmdTimeout back.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cluster = LocalCluster()
    os.environ.setdefault("SLURM_CONF", str(cluster.layout.slurm_conf))
    try:
        sh("scontrol", "ping", timeout=15)
        config = slurm_config()
        cluster.wait_nodes_idle(timeout=120)
    except (OSError, RuntimeError, ClusterError, subprocess.TimeoutExpired) as exc:
        if isinstance(exc, subprocess.TimeoutExpired):
            why = f"{' '.join(exc.cmd)} did not answer within {exc.timeout:.0f}s"
        else:
            why = (str(exc).strip().splitlines() or [repr(exc)])[-1]
        print(f"slurm_recovery: no usable Slurm cluster: {why}", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="ftslurm-recovery-bench-"))
    bench = Bench(cluster, tmp)
    result: dict[str, Any] = {"cluster": config, "repeat": args.repeat}
    try:
        if args.only in (None, "preempt"):
            result["preempt"] = bench.preempt(args.repeat, log)
        if args.only in (None, "recovery"):
            result["recovery"] = bench.recovery(args.repeat, log)
        if args.only in (None, "progress"):
            result["progress"] = bench.progress(timeouts, paths, log)
        if args.only in (None, "defaults"):
            result["defaults"] = bench.defaults(cases, args.repeat, args.settle, log)
    finally:
        bench.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    result["wall_s"] = round(time.time() - started, 1)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
