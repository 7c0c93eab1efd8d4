"""The per-node launcher: `srun --ntasks-per-node=1 ftslurm launch [options] -- CMD [ARGS]`.

Built on torch.distributed.elastic (c10d rendezvous, worker-group restart): it starts
`--nproc-per-node` ranks, each under the task wrapper (`ftslurm.agent.task`), and
- restarts every rank inside the same allocation, up to `--max-restarts` times, when a rank
  exits non-zero (torch elastic) or hangs (here: a section or heartbeat timeout read from
  the ranks' shared-memory records, `ftslurm.agent.heartbeat`);
- forwards the checkpoint signal (USR2 by default) and USR1 to the ranks without stopping
  anything (one that comes before the ranks exist reaches them once they start; each rank's
  wrapper passes it on only to processes that catch it, `ftslurm.agent.task`, and the node
  report lists the ranks that never caught it), and on SIGTERM gives them `--grace`
  seconds to checkpoint and exit before killing them (not a fixed 30 s). No signal is lost
  in any phase: a SIGTERM or SIGINT that comes before the ranks started (from the
  launcher's first line on, the rendezvous and torch's join included) means they never
  start: the launcher exits 128 + the signal with the outcome "stopped" in its node report;
- exits with a code the daemon understands (`ftslurm.core.contract.ExitCode`), and writes
  `$FTSLURM_RUN_DIR/attempts/<attempt>/node-<node_rank>.json` (in-job restarts, hangs,
  outcome, teardown failures). The outcome comes from what the ranks recorded as well as
  from their exit codes (`decide_outcome`): when every rank of the node recorded "saved
  step S, stopping" (`ftslurm.agent.rank`) and one then died while tearing down its
  process group, the node still exits 75 "checkpointed", with a warning; a rank that
  died before recording its save stays a failure;
- meets the other nodes' launchers at a rendezvous hosted by node rank 0's launcher on a
  free port it binds and publishes in the run directory (`RunDir.rendezvous`, with an id
  unique per run, attempt, restart and launch); the others wait for it. Without a run
  directory the port comes from the job (`rendezvous_port`), or `--rdzv-endpoint`;
- on a job of several nodes, watches the other nodes' launchers through a lease each in the
  run directory, from before the rendezvous, and reports a node silent for
  `--peer-timeout` seconds (`attempts/<attempt>/recovery/lost-<node_rank>.json`;
  `ftslurm.agent.peers`);
- when it fails before its ranks start (its setup or the rendezvous), writes its node
  report with the error's last line and `recovery/launcher-failed-<node_rank>.json`, so the
  daemon ends the attempt at once, and exits 1;
- with hot spares (`--spare-nodes`), keeps N nodes training and K waiting, swaps a spare in
  for a node lost, and steps out itself (`recovery/benched-<node_rank>.json`, exit 0) when
  its ranks hang or the straggler report names its node, while a spare can take its place
  (`ftslurm.agent.spares`).
Timeouts come from `--section-timeouts` (JSON, e.g. {"setup": 600, "step": 180,
"checkpointing": 600, "out_of_section": 300, "initial": 1800, "warmup_steps": 20}; null =
infinite; what is left out gets the defaults of `ftslurm.agent.heartbeat`, so hang detection
is on by default) and are tightened from what ranks observed in earlier attempts
(`--safety-factor` x the longest seen, saved next to the checkpoints by the rank agent) and,
within a round, after its warm-up steps, from the pace of the steps (`heartbeat.learned`).
A rank that never writes heartbeats (a script that does not use the rank agent) is watched
by its CPU time alone: idle for the running timeout counts as hung.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftslurm.agent import boot  # first: it records the signals that come meanwhile
from ftslurm.agent import spares as sp
from ftslurm.agent.boot import STOPS
from ftslurm.agent.heartbeat import (
    FLOOR_S,
    SAFETY_FACTOR,
    Beat,
    CpuWatch,
    Pace,
    Timeouts,
    hang_reason,
    idle_reason,
    learned,
    observe_pace,
    read_beat,
    silence,
    watch_cpu,
)
from ftslurm.agent.peers import PeerWatch, poll_interval
from ftslurm.agent.rank import read_stop_record
from ftslurm.agent.straggler import collect_report
from ftslurm.agent.task import STOPPED
from ftslurm.core.contract import (
    DEFAULT_CHECKPOINT_SIGNAL,
    NAMED_EXITS,
    RANK_REPORTS,
    WITHHELD_RANKS,
    WITHHELD_SIGNAL,
    EnvName,
    ExitCode,
    HeartbeatDir,
    JobEnv,
    RunDir,
    observed_record,
    parse_signal,
    published_rendezvous,
    rendezvous_port,
    rendezvous_record,
)
from ftslurm.core.settings import (
    DEFAULT_INITIAL_S,
    DEFAULT_RUNNING_S,
    DEFAULT_SECTION_S,
    DEFAULT_WARMUP_STEPS,
)
from ftslurm.errors import ConfigError
from ftslurm.fsutil import read_json, write_json_atomic

log = logging.getLogger("ftslurm.launch")


@dataclass(frozen=True)
class NodeOutcome:
    code: int
    outcome: str
    warnings: tuple[str, ...] = field(default=())


def decide_outcome(
    *,
    succeeded: bool,
    failures: dict[int, int],
    ranks: set[int],
    stopped: dict[int, str],
    signalled: bool,
    finished: bool,
    max_restarts: int,
    hung: bool = False,
) -> NodeOutcome:
    """The node's exit code and outcome (pure), from how its ranks ended and what they
    recorded. `failures`: rank -> exit code of the ranks that failed; `ranks`: every rank
    of this node; `stopped`: rank -> the outcome it recorded ("checkpointed"/"finished")
    before its teardown. Failures after every rank recorded its stop are teardown
    failures: the save stands (75, or 0 when finished), with a warning each. A named exit
    code (16, 17, 93) is never a teardown failure. `hung`: the last round ended because a
    rank hung (the launcher killed it): the outcome says "hung", so the daemon counts a hang,
    not a crash."""
    all_stopped = bool(ranks) and ranks <= set(stopped)
    stopped_finished = all_stopped and all(stopped[r] == "finished" for r in ranks)
    teardown = bool(failures) and all_stopped and not set(failures.values()) & set(NAMED_EXITS)
    if succeeded or teardown:
        done = finished or stopped_finished
        code = ExitCode.CONTINUE if (signalled or all_stopped) and not done else ExitCode.FINISHED
        warnings = (
            tuple(
                f"rank {r} died while tearing down (exit {c}) after it recorded its save: "
                "the checkpoint stands"
                for r, c in sorted(failures.items())
            )
            if teardown
            else ()
        )
        return NodeOutcome(
            code, "checkpointed" if code == ExitCode.CONTINUE else "finished", warnings
        )
    codes = sorted(set(failures.values()))
    named = [c for c in NAMED_EXITS if c in codes]
    if named:
        code = named[0]
    elif max_restarts > 0:
        code = ExitCode.RESTARTS_EXHAUSTED
    else:
        code = next((c for c in codes if c > 0), 1)
    outcome = {**NAMED_EXITS, ExitCode.RESTARTS_EXHAUSTED: "restarts_exhausted"}.get(code, "failed")
    if hung and not named:
        outcome = "hung"
    return NodeOutcome(code, outcome)


# "setup" is never tightened: the first attempt's setup usually loaded no checkpoint.
NOT_TIGHTENED = frozenset({"setup"})


def tightened(
    configured: Timeouts, observed: list[dict[str, float]], factor: float, floor_s: float = FLOOR_S
) -> Timeouts:
    """Timeouts tightened by what earlier attempts observed (pure): for every section (and
    the out-of-section gap) seen before, `factor` x the longest duration across ranks, at
    least `floor_s`, and never looser than what was configured."""
    longest: dict[str, float] = {}
    for ranks in observed:
        for key, value in ranks.items():
            longest[key] = max(longest.get(key, 0.0), float(value))

    def tighter(current: float | None, seen: float) -> float:
        calculated = max(floor_s, factor * seen)
        return calculated if current is None else min(current, calculated)

    sections = dict(configured.sections)
    for key, value in longest.items():
        if key != "out_of_section" and key not in NOT_TIGHTENED:
            sections[key] = tighter(sections.get(key), value)
    out = configured.out_of_section
    if "out_of_section" in longest:
        out = tighter(out, longest["out_of_section"])
    return replace(configured, sections=sections, out_of_section=out)


def parse_timeouts(text: str | dict[str, Any] | None) -> Timeouts:
    """The JSON of `--section-timeouts` (or it parsed); a key left out gets its default, null
    is off."""
    data: dict[str, Any] = dict(json.loads(text) if isinstance(text, str) else text or {})
    out = data.pop("out_of_section", DEFAULT_RUNNING_S)
    initial = data.pop("initial", DEFAULT_INITIAL_S)
    warmup = data.pop("warmup_steps", DEFAULT_WARMUP_STEPS)
    sections = {**DEFAULT_SECTION_S, **data}
    return Timeouts(
        sections={k: (None if v is None else float(v)) for k, v in sections.items()},
        out_of_section=None if out is None else float(out),
        initial=None if initial is None else float(initial),
        warmup_steps=None if warmup is None else int(warmup),
    )


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ftslurm launch", description=__doc__.splitlines()[0])
    try:
        env = JobEnv.from_environ(os.environ)
    except ConfigError as exc:
        p.error(exc.message)
    p.add_argument("--nproc-per-node", type=int, default=env.nproc_per_node)
    p.add_argument("--nnodes", type=int, default=_env_int("SLURM_NNODES", 1))
    p.add_argument("--node-rank", type=int, default=_env_int("SLURM_NODEID", 0))
    p.add_argument("--max-restarts", type=int, default=env.in_job_restarts)
    p.add_argument("--monitor-interval", type=float, default=0.5)
    p.add_argument("--grace", type=float, default=env.grace_s)
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT (default MASTER_ADDR and a port derived from the job)",
    )
    p.add_argument("--rdzv-timeout", type=int, default=300)
    p.add_argument("--section-timeouts", default=env.section_timeouts)
    p.add_argument("--safety-factor", type=float, default=SAFETY_FACTOR)
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=env.peer_timeout_s,
        help="seconds a node's launcher may be silent before it is reported lost",
    )
    p.add_argument(
        "--spare-nodes",
        type=int,
        default=env.spare_nodes,
        help="of the --nnodes nodes, how many wait idle to replace a lost one",
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    args.env = env
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given (put it after --)")
    if args.nproc_per_node < 1 or args.max_restarts < 0:
        p.error("--nproc-per-node must be >= 1 and --max-restarts >= 0")
    if not args.peer_timeout > 0:
        p.error("--peer-timeout must be > 0")
    if args.spare_nodes and env.run is None:
        p.error(f"--spare-nodes needs {EnvName.RUN_DIR.value}: the launchers meet in it")
    if not 0 <= args.spare_nodes < args.nnodes:
        p.error(
            f"--spare-nodes {args.spare_nodes}: must be >= 0 and leave at least one of "
            f"the {args.nnodes} node(s) to train"
        )
    return args


def _endpoint(args: argparse.Namespace) -> str:
    if args.rdzv_endpoint:
        return args.rdzv_endpoint
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    port = rendezvous_port(os.environ.get("SLURM_JOB_ID"), _env_int("SLURM_RESTART_COUNT", 0))
    return f"{host}:{port}"


class Abandoned(Exception):
    """The rendezvous given up for news of a peer (its launcher failed or its node was
    lost) or a stop: not this launcher's own failure."""


class Stopped(Exception):
    """Told to stop (SIGTERM, SIGINT) before the ranks started: they never do. Raised at
    the phase boundaries before a round of ranks starts, and by the signal handler itself
    out of torch's rendezvous join, so a stop does not wait for the other nodes."""

    def __init__(self, sig: int) -> None:
        super().__init__(f"told to stop ({signal.Signals(sig).name}) before the ranks started")
        self.sig = sig


# Test hook: the launcher stops itself (SIGSTOP) at each phase named here (comma-separated:
# "start", "rendezvous", "ranks", "spawn"; see `main`), so a test can send a signal at
# exactly that point and then continue it.
PAUSE_ENV = "FTSLURM_TEST_PAUSE_LAUNCH"


def _pause_for_tests(phase: str) -> None:
    if phase in os.environ.get(PAUSE_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGSTOP)


def _checkpoint_signal() -> int | None:
    """The job's checkpoint signal, read before anything else (None when it is not valid:
    the job's settings are checked, in one line, with the arguments)."""
    try:
        return parse_signal(
            os.environ.get(EnvName.CHECKPOINT_SIGNAL.value) or DEFAULT_CHECKPOINT_SIGNAL
        )
    except ConfigError:
        return None


PUBLISHED_POLL_S = 0.1  # how often a launcher looks for the published rendezvous endpoint
ERROR_CHARS = 400  # an error's line in the reports, at most


def error_line(exc: BaseException) -> str:
    """An error as a traceback's last line says it (`Type: message`, on one line), with
    the innermost cause's when it is another (torch wraps a bind failure in a connection
    error that only says "see inner exception")."""

    def line(e: BaseException) -> str:
        text = " ".join(str(e).split())
        return f"{type(e).__name__}: {text}" if text else type(e).__name__

    root, seen = exc, {id(exc)}
    while (inner := root.__cause__ or root.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        root = inner
    said = line(exc) if root is exc else f"{line(exc)} ({line(root)})"
    return said if len(said) <= ERROR_CHARS else said[: ERROR_CHARS - 3] + "..."


def wait_published(
    run: RunDir,
    attempt: int,
    restarts: int,
    *,
    job: str,
    step_id: str,
    timeout: float,
    abandon: Callable[[], str | None],
) -> tuple[str, int, str]:
    """The endpoint node rank 0's launcher published for this job's step and restart
    (host, port, rendezvous id); `Abandoned` when `abandon` gives a reason first, and
    `TimeoutError` after `timeout` seconds."""
    path = run.rendezvous(attempt, restarts)
    deadline = time.monotonic() + timeout
    while True:
        found = published_rendezvous(
            read_json(path), job_id=job, step_id=step_id, restart_count=restarts
        )
        if found is not None:
            return found
        why = abandon()
        if why:
            raise Abandoned(why)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"node rank 0's launcher published no rendezvous endpoint "
                f"within {timeout:.0f}s ({path})"
            )
        time.sleep(PUBLISHED_POLL_S)


def rendezvous_handler(
    args: argparse.Namespace,
    common: dict[str, Any],
    *,
    run: RunDir | None,
    attempt: int,
    job: str,
    restarts: int,
    abandon: Callable[[], str | None],
) -> Any:
    """The c10d rendezvous handler of this launcher. Node rank 0 hosts the store on a
    port it binds (port 0: the system picks a free one) and publishes it in the run
    directory; the others wait for that record and join it. With `--rdzv-endpoint`, or
    several nodes and no run directory to publish in, every node uses the endpoint given or
    derived from the job (`_endpoint`), as torchrun does."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    if args.rdzv_endpoint or (run is None and args.nnodes > 1):
        params = RendezvousParameters(
            endpoint=_endpoint(args),
            run_id=f"ftslurm-{job}-{restarts}",
            is_host=args.node_rank == 0,
            **common,
        )
        return rdzv_registry.get_rendezvous_handler(params)
    step_id = os.environ.get("SLURM_STEP_ID", "")
    if args.node_rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        rdzv_id = f"ftslurm-{args.env.run_id or job}-{attempt}-{restarts}-{secrets.token_hex(4)}"
        params = RendezvousParameters(endpoint=f"{host}:0", run_id=rdzv_id, is_host=True, **common)
        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        if run is not None:
            path = run.rendezvous(attempt, restarts)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                path,
                rendezvous_record(
                    host=host,
                    port=store.port,
                    rdzv_id=rdzv_id,
                    job_id=job,
                    step_id=step_id,
                    restart_count=restarts,
                    pid=os.getpid(),
                    time=time.time(),
                ),
            )
        log.info("rendezvous %s hosted at %s:%d", rdzv_id, host, store.port)
        return handler
    assert run is not None
    host, port, rdzv_id = wait_published(
        run, attempt, restarts, job=job, step_id=step_id, timeout=args.rdzv_timeout, abandon=abandon
    )
    params = RendezvousParameters(
        endpoint=f"{host}:{port}", run_id=rdzv_id, is_host=False, **common
    )
    return rdzv_registry.get_rendezvous_handler(params)


def main(argv: list[str] | None = None) -> int:
    # One signal state from the launcher's first lines on (`ftslurm.agent.boot`), so
    # that no signal is lost in any phase: `early`, the signals for ranks that do not exist
    # (yet): theirs once they start; `stop`, the first TERM or INT: the ranks never start
    # after it (checked before every phase that leads to them). Until the handlers that
    # forward are in place (torch is imported first), signals are only recorded.
    early, stop = boot.EARLY, boot.STOP
    boot.record(*[s for s in [_checkpoint_signal()] if s is not None])
    _pause_for_tests("start")
    logging.basicConfig(level=logging.INFO, format="ftslurm launch: %(message)s")
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # Imported here: the rest of ftslurm does not need torch.
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    job = os.environ.get("SLURM_JOB_ID", "local")
    restarts = _env_int("SLURM_RESTART_COUNT", 0)
    env: JobEnv = args.env
    attempt = env.current_attempt(restarts)
    os.environ[EnvName.ATTEMPT.value] = str(attempt)
    run = env.run
    run_dir = run.root if run is not None else None
    node_name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    # A folder of this launcher's own (0700, a fresh name): one left by a launcher that was
    # killed (a lost node) may carry the same job id, node rank and pid, and another user's.
    named = HeartbeatDir.for_launcher(
        os.environ.get("TMPDIR", "/tmp"), job, args.node_rank, os.getpid()
    ).root
    named.parent.mkdir(parents=True, exist_ok=True)
    hb = HeartbeatDir(tempfile.mkdtemp(prefix=f"{named.name}-", dir=named.parent))
    hb_dir = hb.root
    os.environ[EnvName.HEARTBEAT_DIR.value] = str(hb_dir)
    # Every round of ranks gets a fresh store (hosted by rank 0 on a new port): with the
    # agents' shared store, ranks of a restarted round can read the addresses published by
    # the killed round under the same keys and fail to connect.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Our own handlers for TERM, INT and the checkpoint signals stay in place.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
    ckpt_dir = env.checkpoint_dir
    observed = (
        [read_json(p) or {} for p in sorted(observed_record(ckpt_dir, 0).parent.glob(RANK_REPORTS))]
        if ckpt_dir
        else []
    )
    timeouts = tightened(parse_timeouts(args.section_timeouts), observed, args.safety_factor)
    if observed:
        log.info("timeouts from earlier attempts: %s", timeouts)
    state: dict[str, Any] = {
        "stop_at": None,
        "signalled": False,
        "hangs": [],
        "next_peer_check": 0.0,
        "next_collect": 0.0,
        "pace": {},
        "cpu": {},
        "heartbeats": False,
        "look_at_stop": False,
        "teardown": {},
        "ranks": set(),
        "ranks_started": False,
        # a round of ranks is running (signals go to them, not `early`)
        "live": False,
        # in torch's rendezvous join: a stop raises `Stopped` out of it
        "joining": False,
        # the checkpoint signal came: every round that starts later
        # gets it too (one that died under it did not save)
        "checkpoint_asked": False,
        "last_result": None,
    }  # the last round's ending (not HEALTHY)

    spares = args.spare_nodes
    # Hot spares (ftslurm.agent.spares): what this launcher knows of the nodes lost so far.
    spare_state: dict[str, Any] = {
        "lost": set(),
        "swaps": 0,
        "trained": False,
        "why": None,
        "next_check": 0.0,
        "new_job": False,
        "round": None,
        "benched": None,
        "benched_used": 0,
    }

    def stopped_ranks(ranks: set[int]) -> dict[int, str]:
        records = {r: read_stop_record(run_dir, attempt, r) for r in ranks}
        return {
            r: str(rec.get("outcome") or "checkpointed")
            for r, rec in records.items()
            if rec is not None
        }

    collector_interval = env.straggler_interval_s / 2
    collector = straggler_collector(run_dir, env) if args.node_rank == 0 and run_dir else None

    class Agent(LocalElasticAgent):
        def _start_workers(self, worker_group):  # type: ignore[no-untyped-def]
            _pause_for_tests("ranks")
            if stop:  # told to stop before this round's ranks exist: they never start
                raise Stopped(stop[0])
            state["ranks_started"] = True
            for old in [*hb_dir.glob(hb.RECORDS), *hb_dir.glob(hb.READY)]:
                old.unlink(missing_ok=True)
            state["pace"], state["cpu"] = {}, {}  # a new round learns its pace again
            state["hung_round"] = False
            if spares and run is not None:
                spare_state["trained"] = True
                # Nodes reported lost before this round formed are not in it: the round's
                # ranks restart for news of a loss after it only.
                spare_state["lost"] |= set(sp.gone_reports(run, attempt))
                if watch is not None:
                    watch.set_role(sp.ACTIVE)
            _pause_for_tests("spawn")
            started = super()._start_workers(worker_group)
            state["live"] = True
            came, early[:] = list(early), []  # what came before the ranks existed
            if state["checkpoint_asked"] and checkpoint_sig not in came:
                came.append(checkpoint_sig)
            for sig in came:  # reaches them when ready (a stop that came while they
                deliver(sig)  # were being started too: they get it)
            if run is not None and worker_group.group_rank == 0:
                record_round(worker_group)
            return started

        def _stop_workers(self, worker_group, *args, **kwargs):  # type: ignore[no-untyped-def]
            state["live"] = False  # from now on signals wait for the next round
            return super()._stop_workers(worker_group, *args, **kwargs)

        def _rendezvous(self, worker_group):  # type: ignore[no-untyped-def]
            while True:
                state["joining"] = True  # first: a stop from now on raises `Stopped`
                try:
                    if stop:
                        raise Stopped(stop[0])
                    return super()._rendezvous(worker_group)
                except RendezvousTimeoutError:
                    # A spare left waiting on the wait list times out with torch's join
                    # timeout: it joins again while a spare can still be needed.
                    if not (
                        spares
                        and not spare_state["new_job"]
                        and not (run is not None and run.finished.exists())
                    ):
                        raise
                    log.info("waiting on as a spare")
                finally:
                    state["joining"] = False

        def _monitor_workers(self, worker_group):  # type: ignore[no-untyped-def]
            result = self._judge_workers(worker_group)
            if result.state is not WorkerState.HEALTHY:
                state["last_result"] = result
            return result

        def _judge_workers(self, worker_group):  # type: ignore[no-untyped-def]
            result = super()._monitor_workers(worker_group)
            ranks = {w.global_rank for w in worker_group.workers}
            state["ranks"] = ranks
            if result.state is WorkerState.FAILED and result.failures:
                # All ranks are gone by now (torch elastic stops the rest on a failure):
                # were these failures only teardown after every rank recorded its save?
                failures = {r: f.exitcode for r, f in result.failures.items()}
                d = decide_outcome(
                    succeeded=False,
                    failures=failures,
                    ranks=ranks,
                    stopped=stopped_ranks(ranks),
                    signalled=state["signalled"],
                    finished=False,
                    max_restarts=0,
                )
                if d.warnings:  # no in-job restart: the ranks are done, the save stands
                    state["teardown"] = failures
                    return RunResult(
                        state=WorkerState.SUCCEEDED, return_values={r: None for r in ranks}
                    )
            if spares and result.state is WorkerState.FAILED and not state["signalled"]:
                # Did the ranks fail because an active node was lost under them?
                if failure_verdict() is sp.Action.SWAP:
                    self._remaining_restarts += 1  # a swap uses no in-job restart
                elif spare_state["new_job"]:
                    self._remaining_restarts = 0
            if result.state is not WorkerState.HEALTHY:
                return result
            now = time.monotonic()
            pids = self._pcontext.pids() if self._pcontext else {}
            deliver_held(pids)
            note_first_step()
            if spares and now >= spare_state["next_check"]:
                spare_state["next_check"] = now + 1.0
                action = check_losses()
                if action is sp.Action.NONE and run is not None:
                    reason = sp.straggler_reason(
                        read_json(run.straggler_report), attempt, node_name
                    )
                    if reason and step_out(self, sp.STRAGGLER, reason):
                        _kill(pids.values())
                        return RunResult(state=WorkerState.FAILED)
                if action is not sp.Action.NONE:
                    _kill(pids.values())
                    if action is sp.Action.SWAP:
                        self._remaining_restarts += 1  # undone by torch's count: no restart used
                    else:
                        self._remaining_restarts = 0
                    return RunResult(state=WorkerState.FAILED)
            if collector is not None and now >= state["next_collect"]:
                state["next_collect"] = now + collector_interval
                collector()
            if now >= state["next_peer_check"]:  # did another node's launcher give up?
                state["next_peer_check"] = now + 2.0
                try:
                    closed = worker_group.spec.rdzv_handler.is_closed()
                except Exception:  # the store is gone with node 0's launcher
                    closed = True
                if closed:
                    log.warning("another node's launcher ended the run: stopping the ranks")
                    self._remaining_restarts = 0
                    _kill(pids.values())
                    return RunResult(state=WorkerState.FAILED)
            if state["stop_at"] is not None and now > state["stop_at"]:
                log.warning(
                    "ranks did not exit within the %.0fs grace period: killing them", args.grace
                )
                _kill(pids.values())
                return RunResult(state=WorkerState.FAILED)
            if state["look_at_stop"]:  # told to stop: leave word of ranks that look hung
                state["look_at_stop"] = False
                hung_at_stop(worker_group, pids, now)
            for local_rank in range(args.nproc_per_node):
                why, beat = judge(local_rank, pids.get(local_rank), now)
                if why:
                    hang = {
                        "local_rank": local_rank,
                        "reason": why,
                        "step": beat.step if beat else None,
                        "time": time.time(),
                    }
                    if spares and run is not None:
                        action = hang_action(self, local_rank, why)
                        if action is not None:  # stepped out, or a peer did
                            if action is not sp.Action.SWAP:
                                state["hangs"].append(hang)
                            _kill(pids.values())
                            return RunResult(state=WorkerState.FAILED)
                    log.warning("local rank %d hung: %s; restarting the ranks", local_rank, why)
                    state["hangs"].append(hang)
                    state["hung_round"] = True
                    _kill(pids.values())
                    return RunResult(state=WorkerState.FAILED)
            return result

    def judge(
        local_rank: int, pid: int | None, now: float, limits: Timeouts | None = None
    ) -> tuple[str | None, Beat | None]:
        """Whether a rank is hung: by its heartbeat record (with the running timeout learned
        from its pace), or by its CPU time when it has none."""
        limits = limits or timeouts
        beat = read_beat(hb_dir, local_rank)
        if beat is not None and beat.beats:
            state["heartbeats"] = True
            pace = observe_pace(state["pace"].get(local_rank, Pace()), beat, limits)
            state["pace"][local_rank] = pace
            return hang_reason(beat, learned(limits, pace, args.safety_factor), now), beat
        if pid is None:
            return None, None
        cpu = _cpu_seconds(pid)
        if cpu is None:
            return None, None
        running = limits.out_of_section
        window = min(5.0, running / 3) if running else 5.0
        watch: CpuWatch = watch_cpu(state["cpu"].get(local_rank), cpu, now, window)
        state["cpu"][local_rank] = watch
        return idle_reason(watch, running, now), None

    def hung_at_stop(worker_group: Any, pids: dict[int, int], now: float) -> None:
        """Judged when the checkpoint signal or SIGTERM comes: ranks that look hung, with
        the default running timeout where it was turned off, so the daemon can tell an
        attempt that sat hung until its wall limit from one that was merely stopped."""
        if run_dir is None:
            return
        limits = (
            timeouts
            if timeouts.out_of_section is not None
            else replace(timeouts, out_of_section=DEFAULT_RUNNING_S)
        )
        hung = []
        for local_rank in range(args.nproc_per_node):
            why, beat = judge(local_rank, pids.get(local_rank), now, limits)
            if why:
                workers = getattr(worker_group, "workers", None) or []
                rank = next((w.global_rank for w in workers if w.local_rank == local_rank), None)
                hung.append(
                    {
                        "local_rank": local_rank,
                        "rank": rank,
                        "reason": why,
                        "section": beat.section if beat else None,
                        "silent_s": silence(beat, limits, now) if beat else None,
                    }
                )
        path = RunDir(run_dir).hung_node(attempt, args.node_rank)
        if hung:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                path,
                {"node_rank": args.node_rank, "node": node_name, "time": time.time(), "hung": hung},
            )
        else:
            path.unlink(missing_ok=True)

    def step_out(agent: Any, why: str, reason: str) -> bool:
        """Take this node out of the training so a spare replaces it, when the one rule
        allows (`spares.may_step_out`): write the bench record; the caller kills the ranks.
        False: it may not (the batch host, no spare left)."""
        assert run is not None
        if not sp.may_step_out(args.node_rank, sp.gone_reports(run, attempt), spares):
            return False
        log.warning("%s: stepping out so that a spare takes this node's place", reason)
        path = run.benched(attempt, args.node_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            path,
            sp.benched_record(
                node_rank=args.node_rank,
                node=node_name,
                why=why,
                reason=reason,
                time=time.time(),
                job_id=job,
                attempt=attempt,
            ),
        )
        spare_state["benched"] = why
        spare_state["benched_used"] = args.max_restarts - agent._remaining_restarts
        agent._remaining_restarts = 0  # leave for good: no rejoining the rendezvous
        return True

    def hang_action(agent: Any, local_rank: int, why: str) -> sp.Action | None:
        """A rank of this node hung, with spares: a peer that stepped out already explains
        it (SWAP, or NEW_JOB when no spare is left); else this node steps out when it may
        (NEW_JOB: it leaves); else it waits `BENCH_WAIT_S` for a peer to step out. None:
        restart the ranks in place, as without spares."""
        deadline = time.monotonic() + sp.BENCH_WAIT_S
        reason = f"local rank {local_rank} hung: {why}"
        while True:
            action = check_losses()
            if action is sp.Action.NONE and step_out(agent, sp.HANG, reason):
                return sp.Action.NEW_JOB
            if action is sp.Action.SWAP:
                agent._remaining_restarts += 1  # a swap uses no in-job restart
                return action
            if action is sp.Action.NEW_JOB:
                agent._remaining_restarts = 0
                return action
            if time.monotonic() > deadline:
                return None
            time.sleep(0.25)

    def check_losses() -> sp.Action:
        """Read the attempt's peer-loss reports and bench records: on news of an active
        node lost or stepped out, SWAP (a spare takes its place) or NEW_JOB (no spare can)."""
        assert run is not None
        reports = sp.gone_reports(run, attempt)
        new = set(reports) - spare_state["lost"]
        if not new:
            return sp.Action.NONE
        spare_state["lost"] |= new
        roles = {}
        for r in new:
            lease = sp.read_lease(run, attempt, r)
            roles[r] = lease.role if lease is not None else None
        action = sp.loss_action(spare_state["lost"], roles, spares)
        names = ", ".join(sp.gone_name(r, reports[r]) for r in sorted(new))
        if action is sp.Action.SWAP:
            spare_state["swaps"] += 1
            spare_state["why"] = sp.swap_why({r: reports[r] for r in new})
            log.warning(
                "node %s lost or stepped out: restarting the ranks with a spare (%d left)",
                names,
                sp.spares_left(spare_state["lost"], spares),
            )
        elif action is sp.Action.NEW_JOB:
            spare_state["new_job"] = True
            log.warning(
                "node %s lost and no spare can take its place: stopping (the run "
                "goes on in a new job)",
                names,
            )
        return action

    def failure_verdict() -> sp.Action:
        """After the ranks failed: wait (at most the peer timeout and three polls) until
        every other active node is heard from twice, or a loss of one is reported."""
        assert run is not None
        deadline = time.monotonic() + args.peer_timeout + 3 * poll_interval(args.peer_timeout)
        first: dict[int, int] = {}
        while True:
            action = check_losses()
            if action is not sp.Action.NONE:
                return action
            leases = {
                r: sp.read_lease(run, attempt, r)
                for r in range(args.nnodes)
                if r != args.node_rank and r not in spare_state["lost"]
            }
            for r, lease in leases.items():
                if lease is not None and lease.role == sp.ACTIVE and lease.ended is None:
                    first.setdefault(r, lease.seq)
            if sp.alive_since(first, leases) or time.monotonic() > deadline:
                return sp.Action.NONE
            time.sleep(0.25)

    def record_round(worker_group: Any) -> None:
        """The launcher of global rank 0 records every in-job round after the first."""
        assert run is not None
        round_ = sp.rendezvous_round(worker_group.spec.rdzv_handler)
        spare_state["round"] = None
        if not round_:
            return
        named = sp.named_in_rounds(run, attempt)
        reports = sp.gone_reports(run, attempt)
        fresh = {r: rep for r, rep in reports.items() if sp.gone_name(r, rep) not in named}
        lost = sorted(sp.gone_name(r, rep) for r, rep in fresh.items())
        why = spare_state["why"] or (sp.swap_why(fresh) if fresh else "in-job restart")
        spare_state["why"] = None
        workers = worker_group.workers or []
        record = sp.round_record(
            round_=round_,
            started_at=time.time(),
            world_size=workers[0].world_size if workers else 0,
            nnodes_active=worker_group.group_world_size,
            spares_left=sp.spares_left(reports, spares),
            why=why,
            lost=lost,
            job_id=job,
            attempt=attempt,
        )
        path = run.round_record(attempt, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, record)
        spare_state["round"] = (path, record)

    def note_first_step() -> None:
        """The round record gets the time of the first step a rank of this node reports."""
        pending = spare_state["round"]
        if pending is None:
            return
        steps = [
            b.step
            for b in (read_beat(hb_dir, lr) for lr in range(args.nproc_per_node))
            if b is not None and b.step is not None
        ]
        if steps:
            path, record = pending
            write_json_atomic(path, {**record, "first_step_at": time.time(), "step": max(steps)})
            spare_state["round"] = None

    def wait_to_join() -> bool:
        """A spare holds back from the first rendezvous until the nodes that train first
        started their ranks (or one was lost). False: the job ended meanwhile."""
        assert run is not None
        deadline = time.monotonic() + args.rdzv_timeout
        while time.monotonic() < deadline and not state["signalled"]:
            leases = {
                r: sp.read_lease(run, attempt, r)
                for r in range(sp.active_nodes(args.nnodes, spares))
            }
            if any(
                lease is not None
                and lease.ended not in (None, sp.BENCHED)
                and lease.role == sp.ACTIVE
                for lease in leases.values()
            ):
                return False  # the training is over (a node that stepped out needs a spare)
            if sp.may_join(leases, args.nnodes, spares, sp.gone_reports(run, attempt)):
                return True
            time.sleep(0.25)
        return not state["signalled"]

    agent_box: dict[str, Any] = {}

    held: dict[int, list[int]] = {}  # local rank -> signals waiting for its wrapper

    def send(local_rank: int, pid: int, sig: int) -> None:
        # A rank's wrapper that has not installed its handlers yet would die of USR1/2:
        # hold the signal until it says it is ready.
        if not hb.ready(local_rank).exists():
            held.setdefault(local_rank, []).append(sig)
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def deliver_held(pids: dict[int, int]) -> None:
        for local_rank in list(held):
            if local_rank in pids and hb.ready(local_rank).exists():
                for sig in held.pop(local_rank):
                    send(local_rank, pids[local_rank], sig)

    def live_pids() -> dict[int, int]:
        """The ranks of the round running now (none between rounds and before the first)."""
        agent = agent_box.get("agent")
        pcontext = getattr(agent, "_pcontext", None) if agent else None
        return pcontext.pids() if pcontext and state["live"] else {}

    def deliver(sig: int) -> None:
        for local_rank, pid in live_pids().items():
            send(local_rank, pid, sig)

    def note(sig: int) -> None:
        """What a signal changes in the launcher's state, whenever it came."""
        if sig in STOPS and not stop:
            stop.append(sig)
        if sig != signal.SIGUSR1:
            state["signalled"] = True
            state["look_at_stop"] = True
        if sig == checkpoint_sig:
            state["checkpoint_asked"] = True
        if sig == signal.SIGTERM and state["stop_at"] is None:
            state["stop_at"] = time.monotonic() + args.grace
        if sig in STOPS and agent_box.get("watch") is not None:
            agent_box["watch"].leaving()  # the job is being ended: its close is no death

    def forward(sig: int, _frame: Any) -> None:
        note(sig)
        if live_pids():
            deliver(sig)
            return
        if sig not in early:
            early.append(sig)  # no ranks (yet, or between rounds): theirs once they start
        if sig in STOPS and state["joining"]:
            raise Stopped(sig)  # out of torch's join: no waiting for the other nodes

    checkpoint_sig = env.checkpoint_signal_number
    for sig in {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, checkpoint_sig}:
        signal.signal(sig, forward)
    for sig in list(early):  # what came before these handlers: noted now, delivered later
        note(sig)

    # The other nodes' launchers watch this one's lease and it theirs (ftslurm.agent.peers),
    # from before the rendezvous: a node lost while the others wait for it is reported too.
    role = (
        (sp.SPARE if sp.starts_as_spare(args.node_rank, args.nnodes, spares) else None)
        if spares
        else None
    )
    watch = (
        PeerWatch(
            run,
            attempt=attempt,
            node_rank=args.node_rank,
            nnodes=args.nnodes,
            node=node_name,
            job_id=job,
            timeout=args.peer_timeout,
            start_timeout=args.rdzv_timeout,
            role=role,
        ).start()
        if run is not None
        else None
    )
    agent_box["watch"] = watch  # (a job of one node: its lease, for the daemon to watch)
    started = time.time()

    def launcher_failed(exc: BaseException, phase: str) -> int:
        """The launcher failed before its ranks started: its node report says why (the
        error's last line) and, when the failure is its own (not news of a peer), the
        recovery folder too, where the daemon sees it at its next look and ends the attempt
        at once. Told to stop meanwhile, it was stopped, not failed (`stopped_before_ranks`)."""
        if stop:
            log.info("%s", error_line(exc) if not isinstance(exc, Stopped) else exc)
            return stopped_before_ranks()
        if watch is not None:
            watch.stop("launcher_failed")
        shutil.rmtree(hb_dir, ignore_errors=True)
        own = not isinstance(exc, Abandoned)
        error = error_line(exc) if own else str(exc)
        code = int(ExitCode.FAILED)
        record = {
            "node_rank": args.node_rank,
            "node": node_name,
            "job_id": job,
            "attempt": attempt,
            "error": error,
            "phase": phase,
            "exit_code": code,
            "time": time.time(),
        }
        if run is not None:
            try:
                if own:
                    path = run.launcher_failed(attempt, args.node_rank)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_json_atomic(path, record)
                path = run.node_report(attempt, args.node_rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(
                    path,
                    {
                        **record,
                        "outcome": "launcher_failed",
                        "in_job_restarts": 0,
                        "max_restarts": args.max_restarts,
                        "started_at": started,
                        "ended_at": time.time(),
                        "peers_lost": list(watch.lost) if watch is not None else [],
                    },
                )
            except OSError as io:
                log.error("could not report the failure in %s: %s", run.root, io)
        log.error("Error: the launcher failed before its ranks started (%s): %s", phase, error)
        return code

    def stopped_before_ranks() -> int:
        """Told to stop (TERM, INT) before the ranks started: they never do. The node
        report says so (outcome "stopped", the signal) and the launcher exits 128 + the
        signal, as a process that signal ended."""
        sig = stop[0]
        code = 128 + sig
        if watch is not None:
            watch.stop(STOPPED)
        shutil.rmtree(hb_dir, ignore_errors=True)
        if run is not None:
            try:
                path = run.node_report(attempt, args.node_rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(
                    path,
                    {
                        "node_rank": args.node_rank,
                        "node": node_name,
                        "job_id": job,
                        "attempt": attempt,
                        "outcome": STOPPED,
                        "signal": signal.Signals(sig).name,
                        "exit_code": code,
                        "in_job_restarts": 0,
                        "max_restarts": args.max_restarts,
                        "started_at": started,
                        "ended_at": time.time(),
                        "peers_lost": list(watch.lost) if watch is not None else [],
                    },
                )
            except OSError as io:
                log.error("could not write the node report in %s: %s", run.root, io)
        log.info(
            "told to stop (%s) before the ranks started: they never will; exit %d",
            signal.Signals(sig).name,
            code,
        )
        return code

    def abandon() -> str | None:
        """Why to stop waiting for the rendezvous host: told to stop, or its launcher failed,
        was told to stop or was reported lost (None: wait on)."""
        if stop:
            return "told to stop"
        if run is None:
            return None
        failed = read_json(run.launcher_failed(attempt, 0))
        if isinstance(failed, dict) and failed.get("job_id") == job:
            return f"the rendezvous host's launcher (node rank 0) failed: {failed.get('error')}"
        host = sp.read_lease(run, attempt, 0)
        if host is not None and host.ended == STOPPED:
            return "the rendezvous host's launcher (node rank 0) was told to stop"
        lost = read_json(run.peer_lost(attempt, 0))
        if isinstance(lost, dict) and lost.get("job_id") == job:
            return "the rendezvous host (node rank 0) was reported lost"
        return None

    # With spares the rendezvous takes exactly the N nodes that train; the others wait on
    # its redundancy list, and a dead participant is dropped in seconds, not torch's 15 s.
    nactive = sp.active_nodes(args.nnodes, spares)
    keep_alive = (
        {"keep_alive_interval": sp.KEEP_ALIVE_S, "keep_alive_max_attempt": sp.KEEP_ALIVE_MISSES}
        if spares
        else {}
    )
    _pause_for_tests("rendezvous")
    if stop and role != sp.SPARE:  # told to stop already: no rendezvous, no ranks
        return stopped_before_ranks()
    try:
        handler = rendezvous_handler(
            args,
            {
                "backend": "c10d",
                "min_nodes": nactive,
                "max_nodes": nactive,
                "join_timeout": args.rdzv_timeout,
                "last_call_timeout": 5,
                **keep_alive,
            },
            run=run,
            attempt=attempt,
            job=job,
            restarts=restarts,
            abandon=abandon,
        )
    except Exception as exc:
        return launcher_failed(exc, "rendezvous")
    if spares:
        # A spare left on the wait list after a swap is no new member to make room for:
        # torch would restart the healthy ranks for it, over and over.
        handler.num_nodes_waiting = lambda: 0  # type: ignore[method-assign]
    spec = WorkerSpec(
        role="trainer",
        local_world_size=args.nproc_per_node,
        entrypoint=sys.executable,
        args=("-m", "ftslurm.agent.task", "--", *args.command),
        rdzv_handler=handler,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
    )
    agent = Agent(
        spec=spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(hb.torch_logs)),
        start_method="spawn",
        shutdown_timeout=int(max(1, args.grace)),
        exit_barrier_timeout=60,
    )
    agent_box["agent"] = agent
    ran = False
    result = None
    failed: int | None = None  # the exit code of a launcher that failed at the rendezvous
    try:
        if role == sp.SPARE and not wait_to_join():
            ran = True  # the training ended before this spare was needed
        else:
            result = agent.run()
            ran = True
    except Stopped:  # before a round of ranks started: the first, or an in-job restart
        ran = True
        if state["ranks_started"]:  # the last round's ending stands; no restart was made
            result = state["last_result"]
            agent._remaining_restarts = min(args.max_restarts, agent._remaining_restarts + 1)
        elif role != sp.SPARE:  # (a spare leaves as a spare never needed)
            failed = stopped_before_ranks()
    except Exception as exc:
        if not (spares and not spare_state["trained"]):
            if state["ranks_started"]:
                raise
            # Failed in the rendezvous: reported at once, before the rendezvous is closed
            # (one that ended under a stop: the launcher was stopped, `launcher_failed`).
            failed, ran = launcher_failed(exc, "rendezvous"), True
        # A spare that never trained leaves when the rendezvous closes or its host is gone.
        log.info("spare leaves: %s", exc)
        ran = True
    finally:
        try:
            if spare_state["benched"]:  # the others go on with a spare: leave, close nothing
                sp.leave_rendezvous(spec.rdzv_handler)
            elif not (spares and not spare_state["trained"]):  # a spare closes nothing
                spec.rdzv_handler.shutdown()  # closes the rendezvous: the others stop too
        finally:  # (it may fail when the host of the rendezvous is gone)
            if watch is not None and not ran:
                watch.wait_settled()
                watch.stop("error")
    if failed is not None:
        return failed

    def out_of_training(role: str, outcome: str, said: str, **fields: Any) -> int:
        """A spare never needed or a node that stepped out: its outcome and exit 0 (srun's
        exit status is the highest of its tasks': a 0 leaves the job's verdict to the nodes
        that train on). The daemon flags a node that stepped out from its bench record."""
        if watch is not None:
            watch.stop(outcome)
        if run is not None:
            write_json_atomic(
                run.node_report(attempt, args.node_rank),
                {
                    "node_rank": args.node_rank,
                    "node": node_name,
                    "job_id": job,
                    "attempt": attempt,
                    "role": role,
                    "outcome": outcome,
                    "exit_code": int(ExitCode.FINISHED),
                    **fields,
                    "started_at": started,
                    "ended_at": time.time(),
                    "peers_lost": list(watch.lost) if watch is not None else [],
                },
            )
        shutil.rmtree(hb_dir, ignore_errors=True)
        log.info("%s: exit 0", said)
        return ExitCode.FINISHED

    if spares and not spare_state["trained"]:
        return out_of_training(
            sp.SPARE, sp.SPARE, "spare never needed", in_job_restarts=0, spare_swaps=0
        )
    if spare_state["benched"]:
        return out_of_training(
            sp.ACTIVE,
            sp.BENCHED,
            f"stepped out ({spare_state['benched']})",
            benched=spare_state["benched"],
            in_job_restarts=spare_state["benched_used"] + spare_state["swaps"],
            max_restarts=args.max_restarts,
            spare_swaps=spare_state["swaps"],
            hangs=state["hangs"],
            heartbeats=state["heartbeats"],
        )
    if result is None:  # the rendezvous ended under a node that trained before
        result = RunResult(state=WorkerState.FAILED)
    used = args.max_restarts - agent._remaining_restarts
    finished = run is not None and run.finished.exists()
    failures = state["teardown"] or {r: f.exitcode for r, f in result.failures.items()}
    decided = decide_outcome(
        succeeded=result.state is WorkerState.SUCCEEDED and not state["teardown"],
        failures=failures,
        ranks=state["ranks"],
        stopped=stopped_ranks(state["ranks"]),
        signalled=state["signalled"],
        finished=finished,
        max_restarts=args.max_restarts,
        hung=bool(state.get("hung_round")),
    )
    code, outcome = decided.code, decided.outcome
    for warning in decided.warnings:
        log.warning("%s", warning)
    if watch is not None:
        if code not in (ExitCode.FINISHED, ExitCode.CONTINUE):
            watch.wait_settled()  # was a node lost under the failure? Report it first.
        watch.stop(outcome)
    if run is not None:
        path = run.node_report(attempt, args.node_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            path,
            {
                "node_rank": args.node_rank,
                "node": node_name,
                "job_id": job,
                "attempt": attempt,
                "in_job_restarts": used + spare_state["swaps"],
                "max_restarts": args.max_restarts,
                "spare_swaps": spare_state["swaps"],
                "role": sp.ACTIVE if spares else None,
                "recovery": sp.Action.NEW_JOB.value if spare_state["new_job"] else None,
                "hangs": state["hangs"],
                "outcome": outcome,
                "exit_code": code,
                "teardown_failures": list(decided.warnings),
                "started_at": started,
                "ended_at": time.time(),
                "timeouts": {
                    "sections": timeouts.sections,
                    "out_of_section": timeouts.out_of_section,
                    "initial": timeouts.initial,
                    "warmup_steps": timeouts.warmup_steps,
                },
                "heartbeats": state["heartbeats"],  # False: hangs were judged by CPU use alone
                "peers_lost": list(watch.lost) if watch is not None else [],  # node ranks
                # ranks whose processes never caught the checkpoint signal (ftslurm.agent.task)
                WITHHELD_RANKS: sorted(
                    r
                    for r in state["ranks"]
                    if (read_json(run.rank_report(attempt, r)) or {}).get(WITHHELD_SIGNAL)
                ),
            },
        )
    shutil.rmtree(hb_dir, ignore_errors=True)
    log.info(
        "ranks ended: %s after %d in-job restart(s); exit %d",
        outcome,
        used + spare_state["swaps"],
        code,
    )
    return code


def straggler_collector(run_dir: Path, env: JobEnv) -> Callable[[], None]:
    """Scores the ranks' published step times into the run's straggler report (the launcher
    on node 0 calls it twice per report interval); the daemon reads the report."""
    options = {
        "threshold": env.straggler_threshold,
        "persistent_windows": env.straggler_windows,
        "reference": env.straggler_reference,
    }

    def collect() -> None:
        try:
            report = collect_report(run_dir, **options)
        except (OSError, ValueError) as exc:  # never let scoring stop the training
            log.warning("straggler report failed: %s", exc)
            return
        if report.get("stragglers"):
            log.info(
                "stragglers in window %s: %s", report.get("window_index"), report["stragglers"]
            )

    return collect


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds used by the processes below a rank's wrapper (the training script and
    its children; the wrapper itself polls and is left out), or None when it is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    total, seen, todo = 0.0, {pid}, [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            if parent == pid:
                return None
            continue
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            for kid in kids:
                if kid in seen:
                    continue
                seen.add(kid)
                todo.append(kid)
                try:
                    with open(f"/proc/{kid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[-1].split()
                    total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                except (OSError, IndexError, ValueError):
                    pass
    return total


def _kill(pids: Any, wait_s: float = 10.0) -> None:
    """SIGKILL the ranks (their own children die with them) and wait until they are gone,
    so the next round never meets a straggling process of the last one."""
    pids = list(pids)
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] in ("Z", "X"):
                        break
            except OSError:
                break
            time.sleep(0.02)


if __name__ == "__main__":
    exit_code = main()
    # The node report is written: leave without the interpreter's teardown, where torch's
    # native threads (the rendezvous store's) could still abort and change the exit code.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
