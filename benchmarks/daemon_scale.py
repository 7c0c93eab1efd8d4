"""Daemon scale: scheduler commands, CPU time and memory of one reconcile cycle over N runs.

Target: with 10,000 tracked runs, a constant number of scheduler commands per cycle (at most
2: the batched `query`, plus one `nodes` listing in a cycle where an attempt ended), and a
cycle cost that grows no faster than the number of runs.

For each size N (`--runs`, default 100,1000,10000) and each backend (`--backends`), a fresh
child process builds a state directory (FTSLURM_HOME in a temporary folder) holding N runs whose
first attempt is already submitted, then drives `Reconciler.cycle()` as the daemon does. Every
call of a scheduler-protocol method counts as one scheduler command (a wrapper counts them by
method and times them). Two backends:

  mock    the real mock scheduler (`MockScheduler`), in the daemon's process as in production.
          It runs jobs as real local processes, so its N jobs are submitted held (PENDING,
          JobHeldUser): they never start. They are written into the mock's state in one
          transaction with the mock's own state machine (`model.submit`), the state N sbatch
          calls would leave; every job carries a rendered batch script of realistic size.
  memory  an in-memory backend that follows the protocol (`query(ids)` answers all ids in one
          call), so that half of the runs can be RUNNING: a running attempt takes the
          daemon's longer path (settings, progress file, checkpoint-signal deadline). Each
          running run has a progress.json in its run directory, as a training run would.

Per size and backend it reports the commands of the first cycle (which also asks the cluster
facts once) and of the steady cycles (by method), the median CPU time (`time.process_time`)
and wall time of a steady cycle, the part of that CPU spent inside the backend's calls (for
the mock, its own state handling), the tracemalloc peak of one cycle and the child's peak RSS.
On the memory backend it then fails the nodes of 1% of the running jobs (NODE_FAIL) and counts
the commands of the cycle that sees the endings and of the next one, which brings the requeued
jobs back (`*_per_ended_run`: divided by the ended runs). The daemon carries out a cycle's
requeues, exclusions, releases and start-nows at its end, each kind as one batch action for
all its jobs (`scontrol requeue 1,2,3` on Slurm), so both cycles cost a constant number of
commands. With 50 of 10,000 runs ending:

  cycle that sees the endings  before: 1 nodes + 1 query + 50 requeue
                               after:  1 nodes + 1 query + 1 requeue_many
  next cycle                   before: 1 nodes + 1 query + 50 update_excluded_nodes
                                       + 50 release + 50 start_now
                               after:  1 nodes + 1 query + 1 update_excluded_nodes_many
                                       + 1 release_many + 1 start_now_many
Ratios compare the cost per run at the largest size with the smallest, measured in the same
invocation, so they carry across machines.

    python benchmarks/daemon_scale.py [--runs 100,1000,10000] [--backends mock,memory]
                                      [--cycles 5] [--json]

Targets at 10,000 runs on the memory backend: a steady cycle <= 100 ms of CPU, also with
100 flagged nodes, and a peak RSS <= 150 MB. Figures (`--runs 1000,10000 --backends memory`
on a 2-core machine shared with other work; "before" at a load average under 1, "after"
at 1.1 and, in brackets, the range of two more invocations at a load of 3.6-4.4):

    10,000 runs, 5,000 running     before        after
    steady cycle, CPU              1,211 ms      85 ms (96-119) median of 5
      of it in the backend            38 ms      31 ms (33-40)
      of it in the daemon          1,173 ms      53 ms (61-68): 5.3 µs per run
    a minute later (look wakes)        -         83 ms (109-120)
    first cycle (decodes all)          -         0.97 s (1.1-1.6)
    with 100 flagged nodes         2,519 ms      91 ms (98-141) steady; 263 ms the cycle
                                                 that sees the new flags (steps all again)
    tracemalloc peak of a cycle     77 MiB       2.3 MiB
    peak RSS                        223 MiB      129 MiB
    1,000 runs: steady cycle        112 ms       7.9 ms

    mock backend, 10,000 runs      1,272 ms      608 ms steady cycle: 588 ms of it in the
    (`--backends mock`)            (580 in the   mock itself, 20 ms in the daemon;
                                   mock); 446 MiB peak RSS 318 MiB (the mock's own cost)

What is left of the daemon's part: two `stat`s of each running attempt's files (about
26 ms for 5,000 running attempts here) and the comparison of each observation with the
last (about 2-3 µs per run); the backend's own `query` (building 10,000 `JobInfo`s) is the
rest. Under load the steady cycle can pass 100 ms (the brackets above).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftslurm.backends import batch
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import Progress
from ftslurm.core.types import (
    ClusterFacts,
    JobInfo,
    JobOptions,
    JobState,
    NodeInfo,
    NodeState,
    SignalTarget,
)
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import Attempt, NodeFlag, new_run_record
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import backend_key, build_attempt, make_spec, tag
from ftslurm.errors import InvalidJobId
from ftslurm.recipe import Recipe
from ftslurm.runfiles import write_report

BACKENDS = ("mock", "memory")
PROTOCOL_METHODS = tuple(
    name
    for name, value in vars(SchedulerBackend).items()
    if callable(value) and not name.startswith("_")
)
TIME_LIMIT = "1-00:00:00"  # long enough that no checkpoint signal falls due while measuring
MEMORY_NODES = 64


# ---------------------------------------------------------------------------- counting
class CountingBackend:
    """Wraps a backend: every protocol call is one scheduler command, counted and timed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.commands: Counter[str] = Counter()
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in PROTOCOL_METHODS:
            raise AttributeError(method)
        target = getattr(self.inner, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.commands[method] += 1
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                self.cpu_s += time.process_time() - cpu
                self.wall_s += time.perf_counter() - wall

        return call

    def take(self) -> tuple[dict[str, int], float, float]:
        """Commands by method, CPU and wall seconds inside the backend since the last take."""
        taken = (dict(sorted(self.commands.items())), self.cpu_s, self.wall_s)
        self.commands.clear()
        self.cpu_s = self.wall_s = 0.0
        return taken


# ---------------------------------------------------------------------------- memory backend
@dataclass
class _Job:
    job_id: str
    comment: str | None
    state: JobState = JobState.PENDING
    nodes: tuple[str, ...] = ()
    submit_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    time_limit_s: int | None = 86400
    restart_count: int = 0
    exit_code: int | None = None
    held: bool = False
    exclude: tuple[str, ...] = field(default_factory=tuple)


class MemoryScheduler:
    """A scheduler held in a dict: every protocol method is one call, `query` answers any
    number of ids at once. Enough of Slurm's behaviour for the daemon's steady state and for
    the requeue of a failed job (held, then excluded nodes, release, start now)."""

    name = "memory"

    def __init__(self, nodes: int = MEMORY_NODES) -> None:
        self.node_names = [f"m{i}" for i in range(nodes)]
        self.jobs: dict[str, _Job] = {}
        self.down: set[str] = set()
        self._next = 1

    def add(self, comment: str, state: JobState, nodes: tuple[str, ...], now: float) -> str:
        job_id = str(self._next)
        self._next += 1
        self.jobs[job_id] = _Job(
            job_id,
            comment,
            state,
            nodes,
            submit_time=now - 200,
            start_time=now - 100 if state is JobState.RUNNING else None,
        )
        return job_id

    def _job(self, job_id: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise InvalidJobId(f"Invalid job id specified: {job_id}")
        return job

    def _info(self, job: _Job, now: float) -> JobInfo:
        return JobInfo(
            job_id=job.job_id,
            state=job.state,
            observed_at=now,
            raw_state=job.state.value,
            exit_code=job.exit_code,
            nodes=job.nodes,
            submit_time=job.submit_time,
            start_time=job.start_time,
            end_time=job.end_time,
            time_limit_s=job.time_limit_s,
            restart_count=job.restart_count,
            comment=job.comment,
            reason="JobHeldUser" if job.held else None,
        )

    def submit(self, script: str, options: JobOptions) -> str:
        job_id = self.add(options.comment or "", JobState.PENDING, (), time.time())
        self.jobs[job_id].held = options.hold
        return job_id

    def query(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        now = time.time()
        return {
            j: self._info(self.jobs[j], now)
            if j in self.jobs
            else JobInfo.unknown(j, now, "not known")
            for j in job_ids
        }

    def find_jobs(self, comment: str, since: float | None = None) -> list[JobInfo]:
        now = time.time()
        return [self._info(j, now) for j in self.jobs.values() if j.comment == comment]

    def cancel(self, job_id: str) -> None:
        job = self._job(job_id)
        if not job.state.is_terminal:
            job.state, job.end_time = JobState.CANCELLED, time.time()

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        job = self._job(job_id)
        job.state, job.held, job.nodes = JobState.PENDING, hold, ()
        job.start_time = job.end_time = job.exit_code = None
        job.restart_count += 1

    def release(self, job_id: str) -> None:
        self._job(job_id).held = False

    def update_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._job(job_id).exclude = tuple(nodes)

    def start_now(self, job_id: str) -> None:
        self._job(job_id)

    # one call (one command, as `scontrol ... 1,2,3`) for a list of jobs
    def requeue_many(self, job_ids: Sequence[str], *, hold: bool = False) -> dict[str, Any]:
        return batch.requeue_each(self, job_ids, hold=hold)

    def release_many(self, job_ids: Sequence[str]) -> dict[str, Any]:
        return batch.release_each(self, job_ids)

    def start_now_many(self, job_ids: Sequence[str]) -> dict[str, Any]:
        return batch.start_now_each(self, job_ids)

    def update_excluded_nodes_many(
        self, job_ids: Sequence[str], nodes: Sequence[str]
    ) -> dict[str, Any]:
        return batch.update_excluded_nodes_each(self, job_ids, nodes)

    def signal(self, job_id: str, sig: str, target: SignalTarget = SignalTarget.STEPS) -> None:
        self._job(job_id)

    def nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(
                n,
                NodeState.DOWN if n in self.down else NodeState.ALLOCATED,
                "down" if n in self.down else "alloc",
            )
            for n in self.node_names
        ]

    def cluster_facts(self) -> ClusterFacts:
        return ClusterFacts(min_job_age_s=300, accounting=True, version="memory")

    def fail_node_of(self, job_id: str, now: float) -> None:
        """The job's node dies: the job ends NODE_FAIL, the node is DOWN."""
        job = self.jobs[job_id]
        self.down.update(job.nodes)
        job.state, job.end_time, job.exit_code = JobState.NODE_FAIL, now, 0


# ---------------------------------------------------------------------------- building state
def build(root: Path, n: int, kind: str) -> tuple[Store, CountingBackend, Any, list[str]]:
    """A state directory with `n` runs whose first attempt is submitted; the backend holding
    their jobs; the ids of the running jobs (memory backend only)."""
    home = root / "home"
    store = Store(home)
    recipe = Recipe(command=["python", "train.py"], name="bench", nodes=1, time=TIME_LIMIT)
    settings = recipe.settings()
    now = time.time()
    mock_home = root / "mock"
    specs = []
    for i in range(n):
        run_dir = home / "runs" / f"r{i:05d}"
        specs.append(
            make_spec(
                recipe,
                run_dir=run_dir,
                backend=kind,
                workdir=str(root),
                mock_home=mock_home if kind == "mock" else None,
            )
        )
    running: list[str] = []
    job_ids: list[str] = []
    if kind == "mock":
        from ftslurm.backends.mock import MockScheduler, model

        inner: Any = MockScheduler(mock_home)
        run0 = new_run_record("r00000", "bench", specs[0], settings, now)[0]
        script, options = build_attempt("r00000", specs[0], run0.settings, 0, ())
        with inner.store.transaction() as st:  # one transaction: the state N sbatch leave
            for i in range(n):
                opts = replace(options, comment=tag(f"r{i:05d}", 0), hold=True, env={})
                job_ids.append(model.submit(st, script.replace("r00000", f"r{i:05d}"), opts, now))
        states = [JobState.PENDING] * n
        nodes: list[tuple[str, ...]] = [()] * n
    else:
        inner = MemoryScheduler()
        states = [JobState.RUNNING if i % 2 else JobState.PENDING for i in range(n)]
        nodes = [
            (inner.node_names[i % MEMORY_NODES],) if s is JobState.RUNNING else ()
            for i, s in enumerate(states)
        ]
        for i in range(n):
            job_ids.append(inner.add(tag(f"r{i:05d}", 0), states[i], nodes[i], now))
        running = [j for j, s in zip(job_ids, states, strict=True) if s is JobState.RUNNING]
    with store.transaction():
        for i in range(n):
            run, attempt = new_run_record(f"r{i:05d}", "bench", specs[i], settings, now)
            store.add_run(run)
            started = now - 100 if states[i] is JobState.RUNNING else None
            store.add_attempt(
                Attempt(
                    run.run_id,
                    0,
                    states[i].value,
                    job_id=job_ids[i],
                    tag=attempt.tag,
                    nodes=list(nodes[i]),
                    submitted_at=now - 200,
                    start=started,
                )
            )
    if kind == "memory":  # what a training run leaves in its run directory
        for i, state in enumerate(states):
            if state is JobState.RUNNING:
                run_dir = Path(specs[i]["run_dir"])
                run_dir.mkdir(parents=True)
                saved = Progress(step=100, checkpoint_step=100, max_checkpoint_save_s=5.0)
                write_report(RunDir(run_dir).progress, saved)
    return store, CountingBackend(inner), inner, running


# ---------------------------------------------------------------------------- one child
Cycles = tuple[list[dict[str, int]], list[float], list[float], list[float]]


def _timed_cycles(reconciler: Reconciler, backend: CountingBackend, cycles: int) -> Cycles:
    """Commands, CPU seconds, wall seconds and CPU seconds inside the backend, per cycle."""
    commands, cpu, wall, inside = [], [], [], []
    for _ in range(cycles):
        c0, w0 = time.process_time(), time.perf_counter()
        reconciler.cycle()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        taken, b_cpu, _ = backend.take()
        commands.append(taken)
        inside.append(b_cpu)
    return commands, cpu, wall, inside


def _churn(
    reconciler: Reconciler, backend: CountingBackend, inner: MemoryScheduler, running: list[str]
) -> dict[str, Any]:
    """Fail the nodes of 1% of the running jobs; commands of the cycle that sees the endings
    and of the next one (the jobs brought back), in total and per ended run (the query aside)."""
    ending = running[: max(1, len(running) // 100)]
    now = time.time()
    for job_id in ending:
        inner.fail_node_of(job_id, now)
    out: dict[str, Any] = {"ended_runs": len(ending)}
    for name in ("ending_cycle", "requeue_cycle"):
        reconciler.cycle()
        taken, _, _ = backend.take()
        out[name] = taken
        out[f"{name}_per_ended_run"] = {
            m: c / len(ending) for m, c in taken.items() if m != "query"
        }
    return out


def measure(n: int, kind: str, cycles: int, flags: int) -> dict[str, Any]:
    """Everything for one size and backend, in this (fresh) process."""
    with tempfile.TemporaryDirectory(prefix="ftslurm-scale-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        store, backend, inner, running = build(root, n, kind)
        setup_s = time.perf_counter() - t0
        # the run files were written more than a second ago, as a training run's are between
        # two checkpoints (the daemon reads a file changed within the last second again)
        time.sleep(max(0.0, 1.1 - (time.perf_counter() - t0)))
        key = backend_key(store.list_runs()[0].spec)

        def backends(k: str) -> SchedulerBackend:
            if k != key:
                raise KeyError(k)
            return backend  # type: ignore[return-value]

        offset = [0.0]  # the daemon's clock runs ahead by this much (the later look below)
        reconciler = Reconciler(store, backends, clock=lambda: time.time() + offset[0])
        gc.collect()
        c0 = time.process_time()
        reconciler.cycle()
        first_cpu = time.process_time() - c0
        first, _, _ = backend.take()
        steady, cpu, wall, inside = _timed_cycles(reconciler, backend, cycles)
        # a minute later every look wake (the straggler report's interval) has come: the
        # daemon, polling at that interval, looks at every watched attempt's files again
        offset[0] = 61.0
        _, look_cpu, _, _ = _timed_cycles(reconciler, backend, min(cycles, 3))
        offset[0] = 0.0
        tracemalloc.start()
        reconciler.cycle()
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        gc.collect()
        rss_now = _rss_now_mib()  # the daemon as it runs on (the set-up's peak is behind it)
        backend.take()
        flagged: dict[str, Any] | None = None
        if flags:  # nodes kept out of later attempts, as after failures or stragglers
            now = time.time()
            with store.transaction():
                for i in range(flags):
                    store.flag_node(NodeFlag(f"flagged{i}", "bench", now, now + 86400))
            # the cycle that sees the new flags steps every attempt again; then steady ones
            f_commands, f_cpu, _, _ = _timed_cycles(reconciler, backend, 1 + min(cycles, 3))
            with store.transaction():
                for i in range(flags):
                    store.unflag_node(f"flagged{i}")
            flagged = {
                "node_flags": flags,
                "change_cycle_cpu_s": f_cpu[0],
                "cycle_cpu_s": statistics.median(f_cpu[1:]),
                "commands_per_cycle": max(sum(c.values()) for c in f_commands),
            }
        churn = _churn(reconciler, backend, inner, running) if running else None
        store.close()
    totals = [sum(c.values()) for c in steady]
    return {
        "backend": kind,
        "runs": n,
        "running": len(running),
        "setup_s": setup_s,
        "first_cycle_commands": first,
        "steady_cycle_commands": steady[-1],
        "steady_cycle_totals": totals,
        "commands_per_cycle": max(totals),
        "first_cycle_cpu_s": first_cpu,
        "cycle_cpu_s": statistics.median(cpu),
        "look_cycle_cpu_s": statistics.median(look_cpu),
        "cycle_wall_s": statistics.median(wall),
        "backend_cpu_s": statistics.median(inside),
        "daemon_cpu_s": statistics.median(c - b for c, b in zip(cpu, inside, strict=True)),
        "cycle_tracemalloc_peak_mib": traced_peak / 2**20,
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_steady_mib": rss_now,
        "flagged": flagged,
        "churn": churn,
    }


def _rss_now_mib() -> float:
    """This process's resident memory now (Linux: /proc/self/statm), else its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return pages * resource.getpagesize() / 2**20


# ---------------------------------------------------------------------------- driver
def run_child(n: int, kind: str, cycles: int, flags: int) -> dict[str, Any]:
    """`measure` in a fresh interpreter, so that peak RSS belongs to this size alone."""
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            f"{n}:{kind}",
            "--cycles",
            str(cycles),
            "--flags",
            str(flags),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"measuring {n} runs on {kind} failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per backend: whether the commands per cycle are the same at every size, and the
    cost per run at the largest size relative to the smallest."""
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(r["backend"] for r in rows):
        mine = sorted((r for r in rows if r["backend"] == kind), key=lambda r: r["runs"])
        small, large = mine[0], mine[-1]

        def growth(
            k: str, small: dict[str, Any] = small, large: dict[str, Any] = large
        ) -> float | None:
            if small[k] <= 0:
                return None
            return (large[k] / large["runs"]) / (small[k] / small["runs"])

        out[kind] = {
            "sizes": [r["runs"] for r in mine],
            "commands_per_cycle": [r["commands_per_cycle"] for r in mine],
            "constant_commands": len({json.dumps(r["steady_cycle_commands"]) for r in mine}) == 1,
            "cpu_per_run_ratio": growth("cycle_cpu_s"),
            "daemon_cpu_per_run_ratio": growth("daemon_cpu_s"),
        }
    return out


def _commands(c: dict[str, int]) -> str:
    return " + ".join(f"{v} {k}" for k, v in c.items()) or "0"


def print_tables(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    t = Table(title="One reconcile cycle over N tracked runs (median of the steady cycles)")
    for col in (
        "backend",
        "runs",
        "running",
        "commands, 1st cycle",
        "commands per cycle",
        "1st cycle CPU ms",
        "CPU ms",
        "a minute on, CPU ms",
        "wall ms",
        "in backend ms",
        "daemon CPU µs/run",
        "tracemalloc MiB",
        "RSS MiB after the cycles",
        "peak RSS MiB (set-up included)",
    ):
        t.add_column(col, justify="left" if "commands" in col or col == "backend" else "right")
    for r in rows:
        t.add_row(
            r["backend"],
            f"{r['runs']:,}",
            f"{r['running']:,}",
            _commands(r["first_cycle_commands"]),
            _commands(r["steady_cycle_commands"]),
            f"{r['first_cycle_cpu_s'] * 1e3:.0f}",
            f"{r['cycle_cpu_s'] * 1e3:.1f}",
            f"{r['look_cycle_cpu_s'] * 1e3:.1f}",
            f"{r['cycle_wall_s'] * 1e3:.1f}",
            f"{r['backend_cpu_s'] * 1e3:.1f}",
            f"{r['daemon_cpu_s'] / r['runs'] * 1e6:.1f}",
            f"{r['cycle_tracemalloc_peak_mib']:.1f}",
            f"{r['rss_steady_mib']:.0f}",
            f"{r['rss_peak_mib']:.0f}",
        )
    console.print(t)
    flagged = [r for r in rows if r["flagged"]]
    if flagged:
        t = Table(title="The same cycle while nodes are flagged (kept out of later attempts)")
        for col in (
            "backend",
            "runs",
            "running",
            "flagged nodes",
            "commands per cycle",
            "cycle that sees them, CPU ms",
            "CPU ms",
            "× without flags",
        ):
            t.add_column(col, justify="left" if col == "backend" else "right")
        for r in flagged:
            f = r["flagged"]
            t.add_row(
                r["backend"],
                f"{r['runs']:,}",
                f"{r['running']:,}",
                str(f["node_flags"]),
                str(f["commands_per_cycle"]),
                f"{f['change_cycle_cpu_s'] * 1e3:.0f}",
                f"{f['cycle_cpu_s'] * 1e3:.1f}",
                f"{f['cycle_cpu_s'] / r['cycle_cpu_s']:.2f}",
            )
        console.print(t)
    churn = [r for r in rows if r["churn"]]
    if churn:
        t = Table(
            title="After 1% of the running jobs lost their node: the cycle that sees the "
            "endings (requeues), and the next one (exclusions, release, start now)"
        )
        for col in (
            "backend",
            "runs",
            "ended",
            "cycle that sees the endings",
            "next cycle",
            "per ended run (next cycle)",
        ):
            t.add_column(col, justify="right" if col in ("runs", "ended") else "left")
        for r in churn:
            c = r["churn"]
            per = ", ".join(f"{v:g} {k}" for k, v in c["requeue_cycle_per_ended_run"].items())
            t.add_row(
                r["backend"],
                f"{r['runs']:,}",
                str(c["ended_runs"]),
                _commands(c["ending_cycle"]),
                _commands(c["requeue_cycle"]),
                per,
            )
        console.print(t)
    t = Table(title="Growth: cost per run at the largest size / at the smallest (same invocation)")
    for col in (
        "backend",
        "sizes",
        "commands per cycle",
        "constant",
        "CPU per run ×",
        "daemon CPU per run ×",
    ):
        t.add_column(col)
    for kind, v in summary.items():
        t.add_row(
            kind,
            " → ".join(f"{n:,}" for n in v["sizes"]),
            ", ".join(map(str, v["commands_per_cycle"])),
            "yes" if v["constant_commands"] else "NO",
            *(
                f"{x:.2f}" if x is not None else "-"
                for x in (v["cpu_per_run_ratio"], v["daemon_cpu_per_run_ratio"])
            ),
        )
    console.print(t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="100,1000,10000", help="sizes, comma-separated")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--cycles", type=int, default=5, help="steady cycles timed per size")
    parser.add_argument(
        "--flags",
        type=int,
        default=100,
        help="flagged nodes for the flagged-cycle measurement (0: skip it)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "N:backend", internal
    args = parser.parse_args()
    cycles, flags = max(1, args.cycles), max(0, args.flags)
    if args.child:
        n, kind = args.child.split(":")
        print(json.dumps(measure(int(n), kind, cycles, flags)))
        return 0
    try:
        sizes = sorted({int(s) for s in args.runs.split(",")})
    except ValueError:
        parser.error("--runs takes comma-separated integers")
    kinds = list(dict.fromkeys(k for k in args.backends.split(",") if k))
    if not kinds or set(kinds) - set(BACKENDS) or not sizes or min(sizes) < 1:
        parser.error(f"backends are {', '.join(BACKENDS)}; sizes must be positive")
    rows = [run_child(n, kind, cycles, flags) for kind in kinds for n in sizes]
    summary = summarise(rows)
    if args.json:
        print(
            json.dumps(
                {
                    "sizes": sizes,
                    "backends": kinds,
                    "cycles": cycles,
                    "rows": rows,
                    "summary": summary,
                }
            )
        )
    else:
        print_tables(rows, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
