"""The mock `srun`: starts a job step's tasks as local processes, one group per task.

Placed first on a mock job's PATH. It understands the options jobs commonly pass
(-N/--nodes, -n/--ntasks, --ntasks-per-node, --kill-on-bad-exit, -k/--no-kill, -W/--wait,
and ignores the output-shaping ones), gives each task the environment Slurm's srun would
(SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURMD_NODENAME, SLURM_STEP_ID, ...), records
the tasks in `steps/<id>.json` so the mock can signal or kill them by node, and exits like
srun: 0 when every task succeeded, else the first failing task's code (128+N for a signal).

`--wait=S` as Slurm's: S seconds after the first task ended (whatever its code), the tasks
still running are terminated (SIGTERM, then SIGKILL after the job's KillWait); 0, or no
--wait, waits for them all (Slurm's WaitTime default).

A node of a `--no-kill` job that the controller declared down (`procs.node_down`) is left out
of new steps; a step asking for more nodes than are left waits, as Slurm's does, until it is
cancelled. A running step that lost a node reports "Node failure on NODE" once the node is
declared down; its lost tasks do not count as failures (with `srun --no-kill` the others run
on and decide the exit code; without it the controller kills them: 137).
"""

from __future__ import annotations

import fcntl
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hostlist

from ftslurm.backends.mock import procs

_VALUE_OPTS = {
    "-N": "nodes",
    "--nodes": "nodes",
    "-n": "ntasks",
    "--ntasks": "ntasks",
    "--ntasks-per-node": "tpn",
    "-W": "wait",
    "--wait": "wait",
}
_IGNORED_WITH_VALUE = {
    "-J",
    "--job-name",
    "-o",
    "--output",
    "-e",
    "--error",
    "--export",
    "--mpi",
    "--cpu-bind",
    "--gpus-per-task",
    "-c",
    "--cpus-per-task",
    "--label-format",
    "--overlap-opts",
}
_IGNORED_FLAGS = {
    "-u",
    "--unbuffered",
    "-l",
    "--label",
    "--overlap",
    "--exact",
    "-Q",
    "--quiet",
    "-v",
    "--verbose",
}


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if not arg.startswith("--") and len(arg) > 2:  # -N2, -n4: a short option's value
            name, eq, value = arg[:2], "=", arg[2:]
        if name in _VALUE_OPTS or name in _IGNORED_WITH_VALUE:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if name in _VALUE_OPTS:
                opts[_VALUE_OPTS[name]] = value
        elif name == "--kill-on-bad-exit" or name == "-K":
            opts["kill_on_bad_exit"] = value if eq else "1"
        elif name == "--no-kill" or name == "-k":
            opts["no_kill"] = "0" if eq and value.lower() in ("off", "0", "no") else "1"
        elif name in _IGNORED_FLAGS:
            pass
        elif name == "--":
            i += 1
            break
        else:
            print(f"srun (ftslurm mock): unsupported option {arg}", file=sys.stderr)
            raise SystemExit(2)
        i += 1
    return opts, argv[i:]


def _next_step(job_dir: Path) -> int:
    with open(job_dir / "next_step", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read().strip()
        step = int(text) if text else 0
        f.seek(0)
        f.truncate()
        f.write(str(step + 1))
    return step


def main(argv: list[str] | None = None) -> int:
    opts, command = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not command:
        print("srun (ftslurm mock): no command given", file=sys.stderr)
        return 2
    job_dir = Path(os.environ["FTSLURM_MOCK_JOB_DIR"])
    nodelist = [
        n
        for n in hostlist.expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
        if not procs.node_declared_down(job_dir, n)
    ]
    nnodes = int(opts.get("nodes") or os.environ.get("SLURM_NNODES") or len(nodelist))
    nodes = nodelist[:nnodes]
    if "ntasks" in opts:
        ntasks = int(opts["ntasks"])
        tpn = int(opts.get("tpn") or math.ceil(ntasks / nnodes))
    else:
        tpn = int(opts.get("tpn") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
        ntasks = tpn * nnodes
    step = _next_step(job_dir)
    # Like Slurm's srun: INT/TERM/CONT go to the tasks; USR1/USR2 are not srun's to act on.
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if nnodes > len(nodelist):
        while True:  # never placed: the job's lost nodes do not come back to it
            signal.pause()
    tasks: list[tuple[subprocess.Popen, str]] = []

    def forward(sig: int, _frame) -> None:
        for proc, _ in tasks:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCONT):
        signal.signal(sig, forward)
    base = _step_env(step, ntasks, nodes, tpn)
    record = job_dir / "steps" / f"{step}.json"
    no_kill = opts.get("no_kill") == "1"
    _start_tasks(command, base, tasks, ntasks, tpn, nodes, record, no_kill)
    try:
        wait_s = float(opts.get("wait") or 0)
    except ValueError:
        print(f"srun (ftslurm mock): invalid --wait {opts.get('wait')!r}", file=sys.stderr)
        return 2
    return _wait(
        tasks,
        job_dir,
        kill_on_bad_exit=opts.get("kill_on_bad_exit", "0") not in ("0", ""),
        wait_s=wait_s,
    )


def _step_env(step: int, ntasks: int, nodes: list[str], tpn: int) -> dict[str, str]:
    """The environment every task of the step gets (Slurm's step variables)."""
    return {
        **os.environ,
        "SLURM_STEP_ID": str(step),
        "SLURM_STEPID": str(step),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NODELIST": hostlist.collect_hostlist(nodes),
        "SLURM_TASKS_PER_NODE": f"{tpn}(x{len(nodes)})",
    }


def _start_tasks(
    command: list[str],
    base: dict[str, str],
    tasks: list[tuple[subprocess.Popen, str]],
    ntasks: int,
    tpn: int,
    nodes: list[str],
    record: Path,
    no_kill: bool,
) -> None:
    """Start the step's tasks (appended to `tasks` as they start, for the signal handler)
    and keep the step's record of them up to date."""
    for rank in range(ntasks):
        node_index = min(rank // tpn, len(nodes) - 1)
        env = {
            **base,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % tpn),
            "SLURM_NODEID": str(node_index),
            "SLURMD_NODENAME": nodes[node_index],
        }
        proc = subprocess.Popen(
            command, env=env, start_new_session=True, preexec_fn=_default_signals
        )
        tasks.append((proc, nodes[node_index]))
        procs.write_json_atomic(
            record,
            {
                "no_kill": no_kill,
                "tasks": [
                    {"pid": p.pid, "pgid": p.pid, "node": n, "rank": r}
                    for r, (p, n) in enumerate(tasks)
                ],
            },
        )


def _kill_wait_s(job_dir: Path) -> float:
    """The job's KillWait (how long SIGKILL follows SIGTERM)."""
    return float((procs.read_json(job_dir / "launch.json") or {}).get("kill_wait_s", 30))


def _wait(
    tasks: list[tuple[subprocess.Popen, str]],
    job_dir: Path,
    kill_on_bad_exit: bool,
    wait_s: float = 0.0,
) -> int:
    first_bad: int | None = None
    terminate_at: float | None = None  # --wait: when the tasks left are terminated
    kill_at: float | None = None
    running = {p.pid: (p, node) for p, node in tasks}
    lost: set[str] = set()  # nodes that died under the step, not yet declared down
    while running or lost:
        for node in sorted(lost):
            if procs.node_declared_down(job_dir, node):  # a --no-kill job lives on
                print(f"srun: error: Node failure on {node}", file=sys.stderr, flush=True)
                lost.discard(node)
        for pid, (proc, node) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[pid]
            if terminate_at is None and wait_s > 0 and not procs.node_lost(job_dir, node):
                terminate_at = time.monotonic() + wait_s  # the first task ended
            if procs.node_lost(job_dir, node):
                # A dead host sends no exit status: like Slurm's srun, wait for the
                # controller's verdict (NODE_FAIL ends the job; a --no-kill job lives on and
                # the node is declared down) rather than report a task failure.
                lost.add(node)
                continue
            if code != 0 and first_bad is None:
                first_bad = code if code > 0 else 128 - code
                if kill_on_bad_exit:
                    for other, _ in running.values():
                        try:
                            os.killpg(other.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        now = time.monotonic()
        if terminate_at is not None and now >= terminate_at and running:
            print(
                f"srun: error: first task exited {wait_s:g}s ago: terminating the "
                f"{len(running)} task(s) left",
                file=sys.stderr,
                flush=True,
            )
            for other, _ in running.values():
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        os.killpg(other.pid, sig)
                    except ProcessLookupError:
                        pass
            terminate_at, kill_at = None, now + _kill_wait_s(job_dir)
        if kill_at is not None and now >= kill_at:
            for other, _ in running.values():
                try:
                    os.killpg(other.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kill_at = None
        time.sleep(0.05)
    return first_bad or 0


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
