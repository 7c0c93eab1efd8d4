"""Daemon scenarios shared by the mock and the real-cluster suites.

Each scenario submits through the real CLI (`python -m ftslurm submit ...`), so the daemon
is a separate process, as in production. The test reads `status --json`; while it waits
for a condition it reads the same summary in process from the store (a `status` process
per poll would take most of a core from the jobs under test on a small machine).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ftslurm.agent.task import free_port
from ftslurm.core.contract import LIVE_RECORDS, EnvName, RunDir
from ftslurm.core.contract.reports import Kind
from ftslurm.runfiles import read_reports

# A training stand-in: steps of `step_s` with an all-reduce across ranks, a checkpoint (and
# its report) every `every` steps and when the checkpoint signal or SIGTERM arrives, then
# exit 0 (the ranks stop at the step where they see the signal; a real script would agree
# on the step with ftslurm.agent.rank); FINISHED at `steps`.
TRAIN = r"""
import json, os, signal, sys, time
from ftslurm.agent import progress

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:  # ranks depend on each other, as in real training: a lost peer fails them
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")

steps, step_s, every = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
fail_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
rank = int(os.environ["RANK"])
ckpt = os.path.join(os.environ["FTSLURM_CHECKPOINT_DIR"], "step.json")
stop = []
for sig in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.append(1))
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
print(f"rank {rank} attempt {os.environ['FTSLURM_ATTEMPT']} starts at step {step}", flush=True)

def leave(code):
    if world > 1:  # as a real script should: exiting with gloo's threads up may abort
        dist.destroy_process_group()
    sys.exit(code)

def save(step):
    if rank == 0:
        tmp = ckpt + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
        os.replace(tmp, ckpt)
        progress.checkpoint_saved(step, 0.01)

while step < steps:
    if step == fail_at:
        sys.exit(3)
    time.sleep(step_s)
    if world > 1:
        dist.all_reduce(torch.ones(1))
    step += 1
    if step % every == 0:
        save(step)
    if stop:
        save(step)
        print(f"rank {rank} checkpointed at {step} on request", flush=True)
        leave(0)
if rank == 0:
    progress.finished(step)
print(f"rank {rank} finished at {step}", flush=True)
leave(0)
"""


def write_train(folder: Path) -> Path:
    path = folder / "train.py"
    path.write_text(TRAIN)
    return path


class Cli:
    """Runs `ftslurm` as a user would, with its own state directory."""

    def __init__(self, home: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.home = home
        self.cwd = cwd or home.parent
        self.env = dict(os.environ, FTSLURM_HOME=str(home), **(env or {}))

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "ftslurm", *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ftslurm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def submit(self, *args: str) -> dict[str, Any]:
        return json.loads(self("submit", "--json", *args).stdout)

    def status(self, run_id: str) -> dict[str, Any]:
        return json.loads(self("status", run_id, "--json").stdout)

    def summary(self, run_id: str) -> dict[str, Any]:
        """What `status RUN_ID --json` prints, read in this process."""
        from ftslurm.cli.status import run_summary
        from ftslurm.daemon.store import Store

        store = Store(self.home)
        try:
            run = store.get_run(run_id)
            assert run is not None, f"no run {run_id}"
            return json.loads(json.dumps(run_summary(store, run)))
        finally:
            store.close()

    def wait_for(
        self, run_id: str, pred: Callable[[dict], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        s = self.status(run_id)  # once through the CLI, as a user would
        while not pred(s):
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for {what}; last "
                    f"status:\n{json.dumps(s, indent=1)}"
                )
            time.sleep(0.25)
            s = self.summary(run_id)
        return s

    def stop_daemon(self) -> None:
        self("daemon", "stop", check=False)


CANCEL_WAIT_S = 60.0  # how long a test's teardown waits for its daemon to end its runs


def daemon_cli(tmp_path: Path, **env: str) -> Iterator[Cli]:
    """A `Cli` with its own home for one test (a fixture's body: `yield from`); after it,
    its runs still active are cancelled and, once the daemon has ended them (or after
    CANCEL_WAIT_S), the daemon is stopped. In that order: `cancel` starts a daemon when
    none serves, so a cancel after the stop would leave one running."""
    from ftslurm.daemon.store import Store

    def active() -> list[str]:
        store = Store(c.home)
        try:
            return [run.run_id for run in store.list_runs(active_only=True)]
        finally:
            store.close()

    c = Cli(tmp_path / "home", cwd=tmp_path, env=env or None)
    yield c
    try:
        runs = active()
        for run_id in runs:
            c("cancel", run_id, check=False)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while runs and time.monotonic() < deadline:
            time.sleep(0.5)
            runs = active()
    finally:
        c.stop_daemon()
        end_jobs(c.home, tmp_path)


def daemon_cli_on_a_mock(tmp_path: Path, **env: str) -> Iterator[Cli]:
    """`daemon_cli` on a mock cluster of its own (a fixture's body: `yield from`): KillWait
    5 s, a failed node noticed in 2 s (SlurmdTimeout), ended jobs kept 60 s (MinJobAge);
    after the test the runs are cancelled, the daemon stopped and the mock destroyed."""
    gen = daemon_cli(tmp_path, FTSLURM_MOCK_HOME=str(tmp_path / "mock"), **env)
    c = next(gen)
    try:
        config = tmp_path / "mock.json"
        config.write_text('{"kill_wait_s": 5}')
        c("mock", "up", "--config", str(config), "--slurmd-timeout", "2", "--min-job-age", "60")
        yield c
    finally:
        try:
            next(gen, None)
        finally:
            c("mock", "destroy", check=False)


JOB_END_WAIT_S = 90.0  # KillWait (30 s on the local cluster) and a margin


def end_jobs(home: Path, tmp_path: Path) -> None:
    """Cancel the jobs of the test's runs that outlive them (a run ended while its job
    still waits on a dead node's task, as Slurm's --no-kill does) and wait until no
    process of the test's folder is left (`conftest.left_behind`)."""
    from ftslurm.backends import create_backend
    from ftslurm.daemon.store import Store
    from ftslurm.daemon.submission import backend_key
    from ftslurm.errors import FtslurmError

    from .conftest import left_behind

    if not (home / "state.db").exists():
        return
    store = Store(home)
    try:
        jobs = [
            (backend_key(run.spec), a.job_id)
            for run in store.list_runs()
            for a in store.attempts(run.run_id)
            if a.job_id
        ]
    finally:
        store.close()
    for key, job in jobs:
        kind, _, where = key.partition(":")
        try:
            create_backend(kind, where or None).cancel(job)
        except FtslurmError:
            pass  # ended and gone already

    def jobs_left() -> list[tuple[int, str, str]]:  # a mock controller is the test's to stop
        return [p for p in left_behind(tmp_path) if p[1] != "mock controller"]

    deadline = time.monotonic() + JOB_END_WAIT_S
    while jobs_left() and time.monotonic() < deadline:
        time.sleep(0.5)


def ended(s: dict[str, Any]) -> bool:
    return s["state"] in ("COMPLETED", "FAILED", "CANCELLED")


RECIPE = Path(__file__).resolve().parent.parent / "examples" / "recipe.py"


def recipe_file(tmp_path: Path, name: str, **settings: Any) -> Path:
    """A recipe of form (b): examples/recipe.py on 2 nodes x 2 ranks, with settings."""
    args = settings.pop("args")
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[sys.executable, {str(RECIPE)!r}, *{args!r}], "
        f"nodes=2, ntasks_per_node=2, "
        + ", ".join(f"{k}={v!r}" for k, v in settings.items())
        + ")\n"
    )
    return path


def straggler_is_moved_off(cli: Cli, tmp_path: Path, *submit_args: str) -> dict[str, Any]:
    """Scenario: the second node of a 2 x 2 run is slowed 10-fold; its ranks score ~0.5 for
    two 3 s windows, the daemon flags that node (and no other) and moves the running job off
    it (requeue held, exclude, release), which then finishes elsewhere. Returns the status.
    (Windows of 3 s hold several steps even when a loaded machine makes a slowed step take
    a second; a window in which a rank finished no step is not scored.)"""
    recipe = recipe_file(
        tmp_path,
        "straggler",
        args=[
            "--steps",
            "300",
            "--step-time",
            "0.05",
            "--ckpt-every",
            "50",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        straggler_report_interval_s=3.0,
        straggler_windows=2,
        stop_if_straggler=True,
    )
    out = cli.submit(*submit_args, "--inject", "straggler@2:1*10", str(recipe))
    s = cli.wait_for(out["run_id"], ended, 240, "the run to end")  # under pytest-timeout
    assert s["state"] == "COMPLETED", s
    first, second = s["attempts"][0], s["attempts"][1]
    victim = first["nodes"][1]
    assert first["cause"] == "straggler" and "moved off straggler" in first["reason"]
    assert victim not in second["nodes"] and victim in s["excluded_nodes"]
    assert s["job_retries_used"] == 0  # a move is not a failure
    assert first["job_id"] == second["job_id"]  # requeued, not resubmitted
    from ftslurm.daemon.store import Store

    flagged = [e.data for e in Store(cli.home).events(out["run_id"]) if e.kind == "straggler"]
    assert [f["nodes"] for f in flagged] == [[victim]], flagged  # that node, no other
    assert flagged[0]["reasons"][victim].startswith("straggler:")
    return s


def rank_node(run_dir: str | Path, attempt: int, rank: int) -> str:
    """The node rank `rank` ran on in attempt `attempt` (its rank report): torch's
    rendezvous numbers the nodes by (host name, launcher pid), not the allocation's order."""
    nodes = [r.node for r in read_reports(RunDir(run_dir), Kind.RANK, attempt) if r.rank == rank]
    assert len(nodes) == 1 and nodes[0], nodes
    return str(nodes[0])


_REFERENCE_DIGESTS: dict[tuple[str, int, int], str] = {}


def reference_digest(tmp_path: Path, steps: int, world: int = 2) -> str:
    """The parameter digest of examples/recipe.py run uninterrupted by `world` local ranks
    (no ftslurm around it), for comparing with a run that was interrupted and resumed.
    Deterministic (bit-identical runs are the point): run once per recipe text, `steps` and
    `world` in a pytest process, then remembered."""
    key = (RECIPE.read_text(), steps, world)
    if key not in _REFERENCE_DIGESTS:
        _REFERENCE_DIGESTS[key] = _run_reference(tmp_path, steps, world)
    return _REFERENCE_DIGESTS[key]


def _run_reference(tmp_path: Path, steps: int, world: int) -> str:
    folder = tmp_path / "reference"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTSLURM_", "SLURM_"))}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(RECIPE), "--steps", str(steps), "--checkpoint-dir", str(folder)],
            env={
                **env,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    final = json.loads((folder / "final.json").read_text())
    assert final["step"] == steps
    return final["digest"]


def job_log(run: RunDir) -> str:
    """What the run's jobs wrote to their output so far (the launchers' lines, the ranks')."""
    return "".join(p.read_text(errors="replace") for p in sorted(run.logs.glob("job-*.out")))


def lease_of(run: RunDir, attempt: int, node_rank: int) -> dict[str, Any]:
    """Node rank `node_rank`'s launcher's lease (its node, its pid)."""
    from .conftest import wait_for

    path = run.peer_lease(attempt, node_rank)
    return wait_for(lambda: path.exists() and json.loads(path.read_text()), 60, path.name)


def trained_step(run: RunDir) -> int:
    return int(json.loads(run.progress.read_text()).get("step") or 0)


def saved_step(run: RunDir) -> int:
    """The step of the run's newest checkpoint its progress tells of (0 before one)."""
    told = json.loads(run.progress.read_text()) if run.progress.exists() else {}
    return int(told.get("checkpoint_step") or 0)


def wait_trained(run: RunDir, step: int, timeout: float = 120) -> None:
    """Until the run's progress says its training passed `step` (a fault forced there lands
    mid-training however slow the start was)."""
    from .conftest import wait_for

    wait_for(lambda: run.progress.exists() and trained_step(run) >= step, timeout, f"step {step}")


def training_process(launcher_pid: int, rank: int | None = None) -> int:
    """The pid of examples/recipe.py (or the run's copy of it) below a launcher (its rank's
    training script; `rank`: that global rank's, never a warm process's)."""
    todo, seen = [launcher_pid], set()
    while todo:
        pid = todo.pop()
        seen.add(pid)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(cmd) > 1 and Path(cmd[1].decode()).name == RECIPE.name:  # not a wrapper
            if rank is None:
                return pid
            spare = f"{EnvName.LIVE_SPARE.value}=1".encode() in env
            if f"RANK={rank}".encode() in env and not spare:
                return pid
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [
                    int(k) for k in (task / "children").read_text().split() if int(k) not in seen
                ]
            except OSError:
                pass
    raise AssertionError(f"no training process below {launcher_pid}")


def rank_process(run: RunDir, rank: int, *, nodes: int) -> int:
    """The pid of global rank `rank`'s training script in the run's first attempt, below
    whichever node's launcher runs it (the rendezvous orders the nodes)."""
    for node_rank in range(nodes):
        try:
            return training_process(lease_of(run, 0, node_rank)["pid"], rank=rank)
        except AssertionError:
            continue
    raise AssertionError(f"no training process of rank {rank}")


def spare_takes_over_on_the_mock(
    tmp_path: Path, live: bool = False, hang: bool = False, settings: str = ""
) -> tuple[Any, dict[str, Any]]:
    """`--dry-run -N 2 --spare-nodes 1` of examples/recipe.py (200 steps of 0.1 s) on a
    fresh mock with its default SlurmdTimeout (300 s); `settings`: more Recipe arguments.
    Forced timing: node rank 1's node fails (`mock fail-node`) once training passed step 20 (and,
    live, once the spare's ranks wait warm); a failure timed from the job's start
    (`--inject node_fail@T`) lands before the ranks are up on a loaded machine. `hang`:
    its rank is stopped (SIGSTOP) instead (the hang injection aims at a rank, which torch's
    rendezvous may put on the batch host, which never steps out). Waits for
    the end of training and checks that it stayed in one job and ended bit-identical to an
    uninterrupted run, with round 1 (the spare's) in that job in a world of 2. Returns the
    run directory (`RunDir`) and round 1's record. `live`: with live recovery
    (`--live-recovery`, the recipe's `--live`): no round 1 (no rank restarts), the live
    recovery's record instead (`recovery/live-*.json`), which a warm spare's rank joined."""
    from .conftest import wait_for

    steps = 200
    expected = reference_digest(tmp_path, steps)
    with on_a_fresh_mock(tmp_path) as cli:
        recipe = example_recipe(tmp_path, "spare", f", peer_timeout_s=3.0{settings}")
        out = cli.submit(
            "--dry-run",
            "-N",
            "2",
            "--spare-nodes",
            "1",
            *(["--live-recovery"] if live else []),
            str(recipe),
            "--",
            *(["--live"] if live else []),
            "--steps",
            str(steps),
            "--step-time",
            "0.1",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        )
        run = RunDir(cli.status(out["run_id"])["run_dir"])
        if live:
            wait_for(lambda: "wait warm" in job_log(run), 120, "the spare's ranks to start")
        wait_trained(run, 20)
        lease = lease_of(run, 0, 1)
        if hang:
            os.kill(training_process(lease["pid"]), signal.SIGSTOP)
        else:
            cli("mock", "fail-node", lease["node"])
        final = tmp_path / "ckpt" / "final.json"
        wait_for(final.exists, 240, "the end of training")
        s = cli.summary(out["run_id"])
        assert [a["job_id"] for a in s["attempts"]] == [out["job_id"]], s
        assert json.loads(final.read_text())["digest"] == expected
        if live:
            (path,) = run.recovery(0).glob(LIVE_RECORDS)
            return run, json.loads(path.read_text())
        record = json.loads(run.round_record(0, 1).read_text())
        assert record["job_id"] == out["job_id"] and record["world_size"] == 2, record
        return run, record


def live_falls_back_to_a_new_job_on_the_mock(
    tmp_path: Path,
    *injects: str,
    nodes: int | None = None,
    first_job: Callable[[Cli, str, RunDir], None] | None = None,
) -> tuple[dict[str, Any], str, str]:
    """`--dry-run -N 2 --spare-nodes 1 --live-recovery --retries 1` of examples/recipe.py
    with --live (500 steps of 0.1 s, a checkpoint every 20) and the injections `injects`,
    which leave live recovery nothing to serve: the run must go on in a new job, from the
    last checkpoint, and end bit-identical to an uninterrupted run. Returns the run's
    summary (`status --json`), what `status` said while the new job ran and what `report`
    says at the end (`plain`). The injections must come after every launcher
    started (a node lost before its first lease is judged lost only after the rendezvous
    timeout). `nodes`: the mock's (its default, 4, leaves a new job of 3 one lost node);
    `first_job(cli, run_id, run_dir)`: what happens to the first job once submitted (faults
    forced at chosen moments, `fail_node`), before the test waits for a new job."""
    steps = 500
    expected = reference_digest(tmp_path, steps)
    with on_a_fresh_mock(tmp_path, nodes=nodes) as cli:
        recipe = example_recipe(tmp_path, "fallback", ", peer_timeout_s=3.0")
        inject = [arg for spec in injects for arg in ("--inject", spec)]
        out = cli.submit(
            "--dry-run", "-N", "2", "--spare-nodes", "1", "--live-recovery", "--retries", "1",
            *inject, str(recipe), "--", "--live", "--steps", str(steps), "--step-time", "0.1",
            "--checkpoint-dir", str(tmp_path / "ckpt"),
        )  # fmt: skip
        run_id = out["run_id"]
        if first_job is not None:
            first_job(cli, run_id, RunDir(cli.status(run_id)["run_dir"]))
        cli.wait_for(run_id, lambda s: len(s["attempts"]) > 1 or ended(s), 240, "a new job")
        said = plain(cli("status").stdout)
        s = cli.wait_for(run_id, ended, 360, "the run to end")
        assert s["state"] == "COMPLETED", s
        final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
        assert final == {"step": steps, "digest": expected}, s  # bit for bit
        return s, said, plain(cli("report", run_id).stdout)


def plain(text: str) -> str:
    """A command's output as one line of words: a table's rules and borders left out, so
    that a cell's text wrapped over several rows reads as it was written (the table's other
    cells are empty on those rows)."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", text).split())


@contextmanager
def on_a_fresh_mock(tmp_path: Path, nodes: int | None = None) -> Iterator[Cli]:
    """A `Cli` on a fresh mock of its own (with the mock's default SlurmdTimeout, 300 s;
    `nodes`: its node count, default the mock's, 4); afterwards its daemon is stopped and
    the mock destroyed."""
    cli = Cli(tmp_path / "home", env={"FTSLURM_MOCK_HOME": str(tmp_path / "mock")}, cwd=tmp_path)
    cli("mock", "up", *(("--nodes", str(nodes)) if nodes is not None else ()))
    try:
        yield cli
    finally:
        cli.stop_daemon()
        cli("mock", "destroy", check=False)


def example_recipe(tmp_path: Path, name: str, settings: str = "") -> Path:
    """A recipe running examples/recipe.py; `settings`: more Recipe arguments (", k=v")."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import sys\nimport ftslurm\nrecipe = ftslurm.Recipe(command=["
        f"sys.executable, {str(RECIPE)!r}]{settings})\n"
    )
    return path


def spare_recipe(tmp_path: Path, steps: int, more: str = "", step_time: float = 0.05) -> Path:
    """A recipe of examples/recipe.py (`steps` steps of `step_time` s, a checkpoint every 10)
    on 2 nodes and 1 hot spare, peer timeout 5 s, no in-job restart or retry of its own;
    `more`: further Recipe arguments."""
    path = tmp_path / "spares.py"
    args = [
        "--steps",
        str(steps),
        "--step-time",
        str(step_time),
        "--ckpt-every",
        "10",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    path.write_text(
        "import sys\nimport ftslurm\n"
        f"recipe = ftslurm.Recipe(command=[{sys.executable!r}, {str(RECIPE)!r}, *{args!r}], "
        "nodes=2, spare_nodes=1, ntasks_per_node=1, peer_timeout_s=5.0, "
        f"num_in_job_restarts=0, num_job_retries_on_failure=0{more})\n"
    )
    return path


def kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process's group (one "node" of launchers on this machine) and reap it."""
    import signal

    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def node_hangs(run_dir: Path, attempt: int = 0) -> list[dict[str, Any]]:
    """The hangs the launchers of an attempt detected (their node reports)."""
    return [
        h
        for p in sorted((run_dir / "attempts" / str(attempt)).glob("node-*.json"))
        for h in json.loads(p.read_text())["hangs"]
    ]


def hang_is_caught_in_the_first_attempt(cli: Cli, tmp_path: Path, *submit_args: str) -> None:
    """Scenario (issue: the first attempt lost its whole wall limit to a hang): rank 1 is
    stopped (SIGSTOP) past step 100 of the first attempt of a run that configures no
    timeout. The launchers' defaults, learned from the pace after the warm-up steps, catch
    it within the learned timeout (30 s: 3 x 0.05 s steps, raised to the floor) plus 5 s,
    restart the ranks in-job from the last checkpoint, and the run ends with the parameters
    of an uninterrupted one. (The stop comes by the step, past the warm-up however slow
    the start-up: a clock from the ranks' start once stopped a rank in its set-up.)"""
    steps, ckpt = 400, tmp_path / "ckpt"
    expected = reference_digest(tmp_path, steps)
    out = cli.submit(
        *submit_args,
        "--retries",
        "0",
        "--in-job-restarts",
        "2",
        "-N",
        "2",
        "-t",
        "5",
        str(RECIPE),
        "--",
        "--steps",
        str(steps),
        "--step-time",
        "0.05",
        "--checkpoint-dir",
        str(ckpt),
    )
    run = RunDir(cli.status(out["run_id"])["run_dir"])
    wait_trained(run, 100, timeout=240)
    os.kill(rank_process(run, 1, nodes=2), signal.SIGSTOP)
    s = cli.wait_for(out["run_id"], ended, 200, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert len(s["attempts"]) == 1 and s["in_job_restarts_total"] >= 1, s
    hangs = node_hangs(Path(s["run_dir"]))
    assert hangs, s
    reason = hangs[0]["reason"]
    assert "(timeout 30s)" in reason, reason  # learned from the pace, not the 300 s default
    silent = float(reason.split("no sign of life for ")[1].split("s ")[0])
    assert silent < 30 + 5, reason  # detected within the learned timeout + 5 s
    final = json.loads((ckpt / "final.json").read_text())
    assert final == {"step": steps, "digest": expected}


def straggler_is_not_taken_for_hung(cli: Cli, tmp_path: Path, *submit_args: str) -> None:
    """Scenario: the second node runs three times slower from 5 s on, with the default (and
    learned) hang timeouts: it keeps making progress, so nothing is restarted."""
    ckpt = tmp_path / "ckpt"
    out = cli.submit(
        *submit_args,
        "--retries",
        "0",
        "--in-job-restarts",
        "1",
        "-N",
        "2",
        "--inject",
        "straggler@5:1*3",
        str(RECIPE),
        "--",
        "--steps",
        "150",
        "--step-time",
        "0.05",
        "--checkpoint-dir",
        str(ckpt),
    )
    s = cli.wait_for(out["run_id"], ended, 200, "the run to end")
    assert s["state"] == "COMPLETED", s
    assert len(s["attempts"]) == 1 and s["in_job_restarts_total"] == 0, s
    assert node_hangs(Path(s["run_dir"])) == []
    assert json.loads((ckpt / "final.json").read_text())["step"] == 150


def started_once(log: str) -> bool:
    """The world started once, from nothing; every later start is a rank that received the
    state live. (Which node holds rank 0 is torch's rendezvous's choice: a stepped-out or
    killed node may hold it, and the rank that takes it over prints its start too.)"""
    # Two ranks' lines may interleave (a print is two writes): the source is one of the
    # recipe's words, not the rest of the line.
    sources = re.findall(
        r"rank \d+ of \d+ starts at step \d+ \(.*?\) from (a live peer|nothing|\w+)", log
    )
    return sources[:1] == ["nothing"] and set(sources[1:]) <= {"a live peer"}


def rank_crash_restarted_alone(
    cli: Cli,
    recipe: Path,
    ckpt: Path,
    args: list[str],
    *,
    dry_run: bool,
    live_recovery: bool = False,
) -> dict:
    """2 nodes x 2 ranks of the recipe with --live; rank 3 (on the second node) crashes in
    its set-up (`crash@0:3`): nothing to hand over yet, both nodes restart their ranks (one
    for a failed rank, the other for the changed membership: their in-job restart counts
    differ, their live group must not). Then, past step 40 of the training, rank 3's process
    is killed: its launcher restarts it alone (with `live_recovery`, the setting, its node's
    warm standby takes its place when it waits by then), the others keep their processes,
    and the run ends in its first job. The scenario's final parameters (final.json), for the
    caller to compare with an uninterrupted run's. The same on the mock and Slurm."""
    out = cli.submit(
        *(("--dry-run",) if dry_run else ()),
        *(("--live-recovery",) if live_recovery else ()),
        *("-N", "2", "--ntasks-per-node", "2", "--in-job-restarts", "2"),
        *("--inject", "crash@0:3"),
        str(recipe),
        "--",
        *args,
        *("--checkpoint-dir", str(ckpt)),
    )
    run = RunDir(cli.status(out["run_id"])["run_dir"])
    wait_trained(run, 40, timeout=240)  # the world restarted once, and trains
    os.kill(rank_process(run, 3, nodes=2), signal.SIGKILL)
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    log = cli("logs", out["run_id"], "--attempt", "0").stdout
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 1, (s, log[-4000:])
    assert "injected crash@0:3 on rank 3" in log, log[-4000:]
    warm = "its place taken by the warm standby" in log
    assert warm or "restarted alone" in log, log[-4000:]
    assert warm <= live_recovery, log[-4000:]  # a standby only with the setting
    assert started_once(log), log[-4000:]  # in training, never every rank
    (record,) = read_reports(run, Kind.LIVE, 0)
    assert 3 in record.receivers and record.state_from is not None, record
    assert record.standby == (3 if warm else None), record
    return json.loads((ckpt / "final.json").read_text())


def straggler_steps_out_live(
    cli: Cli, tmp: Path, args: list[str], *, interval_s: float, dry_run: bool, **settings: Any
) -> dict:
    """2 nodes x 2 ranks of the recipe with --live and a warm spare: the second node is
    slowed 4-fold from 2 s in and judged a persistent straggler after two `interval_s`
    windows; its launcher steps out, the spare's waiting ranks take that node's ranks over
    live, and the run ends in its first job. The scenario's final parameters (final.json).
    The same on the mock and Slurm. (Whether the daemon flags the node is not asserted: a
    short run can end before the daemon reads the straggler report.)"""
    ckpt = tmp / "ckpt"
    recipe = recipe_file(
        tmp,
        "straggler-live",
        args=[*args, "--checkpoint-dir", str(ckpt)],
        spare_nodes=1,
        live_recovery=True,
        straggler_report_interval_s=interval_s,
        straggler_windows=2,
        **settings,
    )
    out = cli.submit(
        *(("--dry-run",) if dry_run else ()), "--inject", "straggler@2:1*4", str(recipe)
    )
    s = cli.wait_for(out["run_id"], ended, 300, "the run to end")
    log = cli("logs", out["run_id"], "--attempt", "0").stdout
    assert s["state"] == "COMPLETED" and len(s["attempts"]) == 1, (s, log[-4000:])
    assert started_once(log), log[-4000:]  # never every rank
    run_dir = RunDir(s["run_dir"])
    (benched,) = read_reports(run_dir, Kind.BENCHED, 0)
    assert benched.why == "straggler" and benched.node_rank == 1, benched
    (record,) = read_reports(run_dir, Kind.LIVE, 0)
    assert record.took_over == 1 and sorted(record.receivers) == taken_over(log, 1), record
    print(f"stepped out -> first committed step: {record.first_commit_at - benched.time:.2f}s")
    return json.loads((ckpt / "final.json").read_text())


def taken_over(log: str, node_rank: int) -> list[int]:
    """The ranks a warm spare's ranks took over from `node_rank` (which ranks a node holds
    is torch's rendezvous's choice), from their lines in the job's log."""
    found = re.findall(rf"rank (\d+) of \d+: took over from node rank {node_rank}\b", log)
    return sorted(int(r) for r in found)
