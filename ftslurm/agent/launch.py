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
import contextlib
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
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from ftslurm.agent import (
    boot,  # first: it records the signals that come meanwhile
    health_rules,
)
from ftslurm.agent import health as hc
from ftslurm.agent import launch_core as core
from ftslurm.agent import spares as sp
from ftslurm.agent.boot import STOPS
from ftslurm.agent.heartbeat import FLOOR_S, SAFETY_FACTOR, Timeouts
from ftslurm.agent.launch_core import NodeOutcome, decide_outcome  # noqa: F401 (re-exported)
from ftslurm.agent.launch_io import (  # noqa: F401 (PAUSE_ENV re-exported)
    PAUSE_ENV,
    Abandoned,
    FailedHealthCheck,
    Stopped,
    pause_for_tests,
    rendezvous_closed,
    sweep_heartbeat_dirs,
)
from ftslurm.agent.peers import PeerWatch
from ftslurm.agent.rank import read_stop_record
from ftslurm.agent.straggler import collect_report
from ftslurm.agent.task import STOPPED, parse_inject_env
from ftslurm.core.contract import (
    DEFAULT_CHECKPOINT_SIGNAL,
    EnvName,
    ExitCode,
    HeartbeatDir,
    JobEnv,
    RunDir,
    parse_signal,
    published_rendezvous,
    rendezvous_port,
    rendezvous_record,
)
from ftslurm.core.contract.reports import (
    LiveRecovery,
    NodeReport,
    Outcome,
    RankReport,
    Report,
    StopRecord,
    StragglerReport,
    Unhealthy,
    parse,
)
from ftslurm.core.settings import (
    DEFAULT_INITIAL_S,
    DEFAULT_RUNNING_S,
    DEFAULT_SECTION_S,
    DEFAULT_WARMUP_STEPS,
    RECOVERY_SECTION,
)
from ftslurm.errors import ConfigError
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.runfiles import read_observed, read_report, write_report

log = logging.getLogger("ftslurm.launch")


# "setup" is never tightened: the first attempt's setup usually loaded no checkpoint.
NOT_TIGHTENED = frozenset({"setup", RECOVERY_SECTION})  # not a pace: what it met


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


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


class UsageError(SystemExit):
    """A bad argument or FTSLURM_* setting of the launcher: argparse's usage and error line
    are printed (`parse_args` exits 2, as any command's); `main` reports it as the
    launcher's failure in its setup and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        try:
            super().error(message)
        except SystemExit:
            raise UsageError(message) from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="ftslurm launch", description=__doc__.splitlines()[0])
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
        _coordinate_live(host, store.port)
        return handler
    assert run is not None
    host, port, rdzv_id = wait_published(
        run, attempt, restarts, job=job, step_id=step_id, timeout=args.rdzv_timeout, abandon=abandon
    )
    params = RendezvousParameters(
        endpoint=f"{host}:{port}", run_id=rdzv_id, is_host=False, **common
    )
    _coordinate_live(host, port)
    return rdzv_registry.get_rendezvous_handler(params)


def own_rendezvous(args: argparse.Namespace) -> Any:
    """A rendezvous of this node alone, on a port the system picks: a warm spare's ranks
    start on it (torch's environment of a group of one node) and wait."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params = RendezvousParameters(
        backend="c10d",
        endpoint="127.0.0.1:0",
        run_id=f"ftslurm-warm-{secrets.token_hex(6)}",
        min_nodes=1,
        max_nodes=1,
        is_host=True,
        join_timeout=args.rdzv_timeout,
    )
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def _coordinate_live(host: str, port: int) -> None:
    """The ranks' coordinator for live recovery (`ftslurm.agent.live`): the rendezvous
    store node rank 0's launcher hosts, which outlives every rank (torch's per-round store,
    hosted by rank 0, dies with it)."""
    os.environ[EnvName.LIVE_STORE.value] = f"{host}:{port}"


def _heartbeat_dir(job: str, node_rank: int) -> HeartbeatDir:
    """A folder of this launcher's own (0700, a fresh name): one left by a launcher that was
    killed (a lost node) may carry the same job id, node rank and pid, and another user's.
    The folders of this user's launchers that were killed are removed first."""
    named = HeartbeatDir.for_launcher(
        os.environ.get("TMPDIR", "/tmp"), job, node_rank, os.getpid()
    ).root
    named.parent.mkdir(parents=True, exist_ok=True)
    sweep_heartbeat_dirs(named.parent)
    return HeartbeatDir(tempfile.mkdtemp(prefix=f"{named.name}-", dir=named.parent))


def _timeouts(args: argparse.Namespace, ckpt_dir: Path | None) -> Timeouts:
    """`--section-timeouts`, tightened by what the ranks of earlier attempts observed."""
    observed = read_observed(ckpt_dir) if ckpt_dir else []
    timeouts = tightened(parse_timeouts(args.section_timeouts), observed, args.safety_factor)
    if observed:
        log.info("timeouts from earlier attempts: %s", timeouts)
    return timeouts


def _write(path: Path, record: Report) -> None:
    write_report(path, record)


class Node:
    """The launcher's shell around its decisions (`ftslurm.agent.launch_core`) and its
    elastic agent (`ftslurm.agent.elastic`): the job's facts and folders, the signal state
    (`signals`, written by the signal handler alone), the peer watch, and the writers of
    the node report and the recovery records."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # first: a bad --section-timeouts fails the setup before any folder is made
        self.timeouts = _timeouts(args, args.env.checkpoint_dir)
        self.job = os.environ.get("SLURM_JOB_ID", "local")
        self.restarts = _env_int("SLURM_RESTART_COUNT", 0)
        env: JobEnv = args.env
        self.attempt = env.current_attempt(self.restarts)
        os.environ[EnvName.ATTEMPT.value] = str(self.attempt)
        self.run = env.run
        self.run_dir = self.run.root if self.run is not None else None
        self.node_name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.hb = _heartbeat_dir(self.job, args.node_rank)
        os.environ[EnvName.HEARTBEAT_DIR.value] = str(self.hb.root)
        # Every round of ranks gets a fresh store (hosted by rank 0 on a new port): with the
        # agents' shared store, ranks of a restarted round can read the addresses published by
        # the killed round under the same keys and fail to connect.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        # Our own handlers for TERM, INT and the checkpoint signals stay in place.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
        collect = args.node_rank == 0 and self.run_dir is not None
        self.cfg = core.Config(
            node_rank=args.node_rank,
            nnodes=args.nnodes,
            spares=args.spare_nodes,
            max_restarts=args.max_restarts,
            grace=args.grace,
            has_run=self.run is not None,
            checkpoint_sig=env.checkpoint_signal_number,
            collect_every=env.straggler_interval_s / 2 if collect else None,
            live=env.live_recovery,
        )
        self.collector = straggler_collector(self.run_dir, env) if collect else None  # type: ignore[arg-type]
        self.signals = core.Signals()
        self.early = boot.EARLY  # signals for ranks that do not exist (yet): theirs once they start
        spare = args.spare_nodes and sp.starts_as_spare(
            args.node_rank, args.nnodes, args.spare_nodes
        )
        self.role = sp.SPARE if spare else None
        self.watch: PeerWatch | None = None
        self.agent: Any = None
        self.main_handler: Any = None  # a warm spare's: the training's rendezvous
        self._store: Any = None
        self.started = time.time()

    # ------------------------------------------------------------------------ signals
    def take_signals(self) -> None:
        """This launcher's handlers from now on. The signals recorded before them are
        noted first (while only recorded), and those that came meanwhile after."""
        noted = 0
        for installed in (False, True):
            if installed:
                for sig in {*STOPS, signal.SIGUSR1, signal.SIGUSR2, self.cfg.checkpoint_sig}:
                    signal.signal(sig, self.forward)
            for sig in list(self.early[noted:]):
                self.signals = core.note(self.signals, sig, self.cfg, time.monotonic())
            noted = len(self.early)

    def forward(self, sig: int, _frame: Any) -> None:
        agent = self.agent
        live = agent is not None and bool(agent.live_pids())
        joining = agent is not None and agent.state.joining
        self.signals, route = core.on_signal(
            self.signals, sig, self.cfg, time.monotonic(), live=live, joining=joining
        )
        if route.leaving and self.watch is not None:
            self.watch.leaving()  # the job is being ended: its close is no death
        if route.deliver:
            agent.deliver(sig)
            return
        if sig not in self.early:
            self.early.append(sig)  # no ranks (yet, or between rounds): theirs once they start
        if route.abort_join:
            raise Stopped(sig)  # out of torch's join: no waiting for the other nodes

    # ----------------------------------------------------------------- the rendezvous
    def start_watch(self) -> None:
        """The other nodes' launchers watch this one's lease and it theirs
        (ftslurm.agent.peers), from before the rendezvous: a node lost while the others
        wait for it is reported too (a job of one node: its lease, for the daemon)."""
        if self.run is not None:
            args = self.args
            self.watch = PeerWatch(
                self.run,
                attempt=self.attempt,
                node_rank=args.node_rank,
                nnodes=args.nnodes,
                node=self.node_name,
                job_id=self.job,
                timeout=args.peer_timeout,
                start_timeout=args.rdzv_timeout,
                role=self.role,
            ).start()
        self.started = time.time()

    def rendezvous(self) -> Any:
        """The rendezvous handler. With spares the rendezvous takes exactly the N nodes that
        train; the others wait on its redundancy list, and a dead participant is dropped in
        seconds, not torch's 15 s."""
        args, spares = self.args, self.cfg.spares
        nactive = sp.active_nodes(args.nnodes, spares)
        keep_alive = (
            {"keep_alive_interval": sp.KEEP_ALIVE_S, "keep_alive_max_attempt": sp.KEEP_ALIVE_MISSES}
            if spares
            else {}
        )
        params = {
            "backend": "c10d",
            "min_nodes": nactive,
            "max_nodes": nactive,
            "join_timeout": args.rdzv_timeout,
            "last_call_timeout": 5,
            **keep_alive,
        }
        return rendezvous_handler(
            args,
            params,
            run=self.run,
            attempt=self.attempt,
            job=self.job,
            restarts=self.restarts,
            abandon=self.abandon,
        )

    def abandon(self) -> str | None:
        """Why to stop waiting for the rendezvous host: told to stop, or its launcher failed,
        was told to stop or was reported lost (None: wait on)."""
        run, attempt = self.run, self.attempt
        if run is None:
            return "told to stop" if self.signals.stop is not None else None
        host_unhealthy = parse(Unhealthy, read_json(run.unhealthy(attempt, 0)))
        host_failed = read_json(run.launcher_failed(attempt, 0))
        if host_failed is None and host_unhealthy is not None:
            host_failed = {"job_id": host_unhealthy.job_id, "error": host_unhealthy.words}
        return core.abandon_reason(
            stop=self.signals.stop,
            job=self.job,
            host_failed=host_failed,
            host_lease=sp.read_lease(run, attempt, 0),
            host_lost=read_json(run.peer_lost(attempt, 0)),
            stopped=STOPPED,
        )

    def wait_to_join(self) -> bool:
        """A spare holds back from the first rendezvous until the nodes that train first
        started their ranks (or one was lost). False: the job ended meanwhile."""
        assert self.run is not None
        args, spares, run, attempt = self.args, self.cfg.spares, self.run, self.attempt
        deadline = time.monotonic() + args.rdzv_timeout
        while time.monotonic() < deadline and not self.signals.signalled:
            firsts = range(sp.active_nodes(args.nnodes, spares))
            leases = {r: sp.read_lease(run, attempt, r) for r in firsts}
            join = core.spare_join(self.cfg, leases, sp.gone_reports(run, attempt))
            if join is not None:  # False: the training is over
                return join
            time.sleep(0.25)
        return not self.signals.signalled

    # ------------------------------------------------------------------ live recovery
    def main_run_id(self) -> str:
        """The training's rendezvous id (its live group's keys start with it)."""
        handler = self.main_handler or self.agent._rdzv_handler
        return str(handler.get_run_id())

    def live_store(self) -> Any:
        """A client of the coordinator store (node rank 0's rendezvous store)."""
        if self._store is None:
            import datetime

            import torch.distributed as dist

            host, _, port = os.environ[EnvName.LIVE_STORE.value].rpartition(":")
            self._store = dist.TCPStore(
                host,
                int(port),
                is_master=False,
                timeout=datetime.timedelta(seconds=10),
                wait_for_workers=False,
            )
        return self._store

    def warm_spare(self) -> bool:
        """Whether this launcher keeps its ranks warm as a spare (live recovery)."""
        return self.cfg.live and self.role == sp.SPARE and self.run is not None

    def run_warm(self, handler: Any) -> tuple[Any, Any, bool]:
        """A warm spare: its ranks start now on a rendezvous of this node alone and wait in
        `live.init_process_group` until they take a node over (`TakeOver`). The agent, its
        last round's result, and whether to fall back to a spare without live recovery
        (its warm ranks failed while the training may still need a spare)."""
        from ftslurm.agent.elastic import make_agent, round_ending

        self.main_handler = handler
        private = own_rendezvous(self.args)
        agent = self.agent = make_agent(self, private, warm=True)
        os.environ[EnvName.LIVE_SPARE.value] = "1"
        if self.watch is not None:  # a loss report then says "warm spare"
            self.watch.set_warm(True)
        log.info("spare: its ranks start now and wait warm to take a node over (live recovery)")
        result, failed = None, False
        try:
            result = agent.run()
        except Stopped:
            pass  # told to stop before its warm ranks started: a spare never needed
        except Exception as exc:  # noqa: BLE001 - the warm ranks' own failure
            log.warning("warm spare: %s", error_line(exc))
            failed = True
        finally:
            os.environ.pop(EnvName.LIVE_SPARE.value, None)
            with contextlib.suppress(Exception):
                private.shutdown()
        succeeded, _ = round_ending(result)
        if agent.state.trained:  # it took a node over: the others end the rendezvous
            if not succeeded:
                with contextlib.suppress(Exception):
                    handler.shutdown()  # its ranks failed: the others stop too
            return agent, result, False
        over = (
            self.signals.stop is not None
            or agent.state.new_job
            or self.run.finished.exists()
            or rendezvous_closed(handler)
        )
        if over or not (failed or not succeeded):
            return agent, result, False
        log.warning("the warm ranks failed: waiting as a spare without live recovery")
        if self.watch is not None:
            self.watch.set_warm(False)
        return agent, result, True

    def run_agent(self, agent: Any, handler: Any) -> tuple[int | None, Any]:
        """Run the ranks (a spare: once it may join): the exit code of a launcher that
        failed or was stopped before its ranks started, and the last round's result."""
        ran, result, failed = False, None, None
        try:
            if self.role == sp.SPARE and not self.wait_to_join():
                ran = True  # the training ended before this spare was needed
            else:
                result = agent.run()
                ran = True
        except FailedHealthCheck as exc:  # between rounds: reported, it leaves
            ran, failed = True, exc.code
            agent.state = core.on_failed_health(agent.state, exc.benched)
        except Stopped:  # before a round of ranks started: the first, or an in-job restart
            ran = True
            if agent.state.ranks_started:  # the last round's ending stands
                result = agent.last_result
                agent.carry_out(core.on_stopped(agent.state), {})
            elif self.role != sp.SPARE:  # (a spare leaves as a spare never needed)
                failed = self.stopped_before_ranks()
        except Exception as exc:
            after = core.after_error(agent.state)
            if after is core.AfterError.RAISE:
                raise
            if after is core.AfterError.FAILED:
                # Failed in the rendezvous: reported at once, before the rendezvous is closed
                # (one that ended under a stop: the launcher was stopped, `launcher_failed`).
                failed, ran = self.launcher_failed(exc, "rendezvous"), True
            # A spare that never trained leaves when the rendezvous closes or its host is gone.
            log.info("spare leaves: %s", exc)
            ran = True
        finally:
            self.leave(agent, handler, ran)
        return failed, result

    def leave(self, agent: Any, handler: Any, ran: bool) -> None:
        try:
            how = core.how_to_leave(agent.state)
            if how is core.Leave.QUIETLY:  # the others go on with a spare: close nothing
                sp.leave_rendezvous(handler)
            elif how is core.Leave.CLOSE:  # (a spare never needed closes nothing)
                handler.shutdown()  # closes the rendezvous: the others stop too
        finally:  # (it may fail when the host of the rendezvous is gone)
            if self.watch is not None and not ran:
                self.watch.wait_settled()
                self.watch.stop("error")

    # ---------------------------------------------------------------------- reading
    def stopped_ranks(self, ranks: Collection[int]) -> dict[int, str]:
        """The ranks that recorded their stop: rank -> the outcome they recorded."""
        records = {
            r: parse(StopRecord, read_stop_record(self.run_dir, self.attempt, r)) for r in ranks
        }
        return {
            r: str(rec.outcome or Outcome.CHECKPOINTED.value)
            for r, rec in records.items()
            if rec is not None
        }

    def write_bench(self, why: str, reason: str) -> None:
        """This node steps out: its bench record, for the other launchers and the daemon."""
        assert self.run is not None
        record = sp.benched_record(
            node_rank=self.args.node_rank,
            node=self.node_name,
            why=why,
            reason=reason,
            time=time.time(),
            job_id=self.job,
            attempt=self.attempt,
        )
        _write(self.run.benched(self.attempt, self.args.node_rank), record)

    def write_live_fallback(self, fell_back: core.RecordFallback) -> None:
        """Live recovery cannot serve what happened: why, for `status` and `report`."""
        if self.run is None:
            return
        record = LiveRecovery(
            given_up=fell_back.why.value,
            why=fell_back.detail,
            node_rank=self.args.node_rank,
            recovery=fell_back.recovery,
            failed_at=time.time(),
            job_id=self.job,
            attempt=self.attempt,
        )
        try:
            _write(self.run.live_fallback(self.attempt, self.args.node_rank), record)
        except OSError as exc:
            log.warning("could not record the live recovery's fallback: %s", exc)

    # ------------------------------------------------------------------ health check
    def health_check(self, between_rounds: bool = False) -> int | None:
        """The pre-flight health check (`ftslurm.agent.health`), before the rendezvous (the
        job's first, or `between_rounds`: an in-job restart's, without the network probe):
        None when the node passed (or the checks are off); else the launcher's exit code,
        the node's failure reported (`unhealthy_node`)."""
        env: JobEnv = self.args.env
        started = _env_float("SLURM_JOB_START_TIME", self.started)
        health = hc.run_checks(
            env.health,
            checkpoint_dir=env.checkpoint_dir,
            node=self.node_name,
            node_rank=self.args.node_rank,
            nnodes=self.args.nnodes,
            job=self.job,
            attempt=self.attempt,
            run=self.run,
            injections=parse_inject_env(env.inject),
            elapsed_s=max(0.0, time.time() - started),
            host=os.environ.get("MASTER_ADDR") or socket.gethostname(),
            probe_network=not between_rounds,
        )
        if health.failure is None:
            if health.results:
                log.info("%s", hc.said(health))
            return None
        log.error("%s", hc.said(health))
        return self.unhealthy_node(health)

    def unhealthy_node(self, health: hc.Health) -> int:
        """The node failed its health check: it leaves before the rendezvous. With a spare
        that can take its place (`may_step_out`: never the batch host) it steps out as a
        bad node does (`recovery/benched-<n>.json`, exit 0); otherwise it exits 1 and the
        daemon ends the attempt. Either way its report (`recovery/unhealthy-<n>.json`) names
        the check, for the daemon's flag and `status`."""
        failure = health.failure
        assert failure is not None
        args, run = self.args, self.run
        gone = set(sp.gone_reports(run, self.attempt)) if run is not None else set()
        benched = bool(run is not None and self.cfg.spares) and sp.may_step_out(
            args.node_rank, gone, self.cfg.spares
        )
        spec = health.injected.spec() if health.injected is not None else None
        record = health_rules.report(
            failure,
            node=self.node_name,
            node_rank=args.node_rank,
            job_id=self.job,
            attempt=self.attempt,
            benched=benched,
            spec=spec,
            time=time.time(),
        )
        outcome = sp.BENCHED if benched else Outcome.UNHEALTHY.value
        if run is not None:
            try:
                _write(run.unhealthy(self.attempt, args.node_rank), record)
                if benched:
                    self.write_bench(sp.UNHEALTHY, record.words)
            except OSError as exc:
                log.error("could not report the failed health check in %s: %s", run.root, exc)
        if self.watch is not None:
            self.watch.stop(outcome)
        end = core.FailedHealth(record.words, benched, time.time())
        if run is not None:
            with contextlib.suppress(OSError):
                _write(run.node_report(self.attempt, args.node_rank), self.report(end))
        shutil.rmtree(self.hb.root, ignore_errors=True)
        code = core.health_exit(benched)
        said = "a spare takes its place" if benched else "the attempt ends without this node"
        log.info("%s: %s; exit %d", record.words, said, code)
        return code

    # ------------------------------------------------------------------------ endings
    def who(self) -> core.NodeId:
        return core.NodeId(
            node_rank=self.args.node_rank,
            node=self.node_name,
            job_id=self.job,
            attempt=self.attempt,
            max_restarts=self.args.max_restarts,
            started_at=self.started,
        )

    def report(self, end: core.Ending) -> NodeReport:
        """This node's report (`launch_core.node_report`), ended now."""
        peers_lost = list(self.watch.lost) if self.watch is not None else []
        return core.node_report(end, self.who(), ended_at=time.time(), peers_lost=peers_lost)

    def launcher_failed(self, exc: BaseException, phase: str) -> int:
        """The launcher failed before its ranks started: its node report says why (the
        error's last line) and, when the failure is its own (not news of a peer), the
        recovery folder too, where the daemon sees it at its next look and ends the attempt
        at once. Told to stop meanwhile, it was stopped, not failed (`stopped_before_ranks`)."""
        if self.signals.stop is not None:
            log.info("%s", error_line(exc) if not isinstance(exc, Stopped) else exc)
            return self.stopped_before_ranks()
        if self.watch is not None:
            self.watch.stop(Outcome.LAUNCHER_FAILED.value)
        shutil.rmtree(self.hb.root, ignore_errors=True)
        own = not isinstance(exc, Abandoned)
        end = core.LauncherFailed(error_line(exc) if own else str(exc), phase, time.time())
        peers_lost = list(self.watch.lost) if self.watch is not None else []
        return report_failed(self.run, self.who(), end, own=own, peers_lost=peers_lost)

    def stopped_before_ranks(self) -> int:
        """Told to stop (TERM, INT) before the ranks started: they never do. The node
        report says so (outcome "stopped", the signal) and the launcher exits 128 + the
        signal, as a process that signal ended."""
        sig = self.signals.stop
        assert sig is not None
        code = 128 + sig
        if self.watch is not None:
            self.watch.stop(STOPPED)
        shutil.rmtree(self.hb.root, ignore_errors=True)
        if self.run is not None:
            end = core.StoppedBeforeRanks(signal.Signals(sig).name, code, STOPPED)
            try:
                _write(self.run.node_report(self.attempt, self.args.node_rank), self.report(end))
            except OSError as io:
                log.error("could not write the node report in %s: %s", self.run.root, io)
        log.info(
            "told to stop (%s) before the ranks started: they never will; exit %d",
            signal.Signals(sig).name,
            code,
        )
        return code

    def out_of_training(self, end: core.Ending, outcome: str, said: str) -> int:
        """A spare never needed or a node that stepped out: its outcome and exit 0 (srun's
        exit status is the highest of its tasks': a 0 leaves the job's verdict to the nodes
        that train on). The daemon flags a node that stepped out from its bench record."""
        if self.watch is not None:
            self.watch.stop(outcome)
        if self.run is not None:
            _write(self.run.node_report(self.attempt, self.args.node_rank), self.report(end))
        shutil.rmtree(self.hb.root, ignore_errors=True)
        log.info("%s: exit 0", said)
        return ExitCode.FINISHED

    def finish(self, agent: Any, succeeded: bool, failures: dict[int, int]) -> int:
        """The launcher's ending once its ranks ran (or, a spare, never had to)."""
        state = agent.state
        left = core.out_of_training(state, agent.heartbeats, agent.restarts_used())
        if isinstance(left, core.SpareNeverNeeded):
            return self.out_of_training(left, sp.SPARE, "spare never needed")
        if left is not None:
            return self.out_of_training(left, sp.BENCHED, f"stepped out ({state.benched})")
        used = agent.restarts_used()
        decided = core.ranks_outcome(
            state,
            succeeded=succeeded,
            failures=failures,
            stopped=self.stopped_ranks(state.ranks),
            signalled=self.signals.signalled,
            finished=self.run is not None and self.run.finished.exists(),
        )
        for warning in decided.warnings:
            log.warning("%s", warning)
        if self.watch is not None:
            if decided.code not in (ExitCode.FINISHED, ExitCode.CONTINUE):
                self.watch.wait_settled()  # was a node lost under the failure? Report it first.
            self.watch.stop(decided.outcome)
        if self.run is not None:
            end = core.RanksEnded(
                state, decided, used, self.timeouts_said(), agent.heartbeats, self.withheld(state)
            )
            _write(self.run.node_report(self.attempt, self.args.node_rank), self.report(end))
        shutil.rmtree(self.hb.root, ignore_errors=True)
        log.info(
            "ranks ended: %s after %d in-job restart(s); exit %d",
            decided.outcome,
            used + state.swaps,
            decided.code,
        )
        return decided.code

    def timeouts_said(self) -> dict[str, Any]:
        t = self.timeouts
        return {
            "sections": t.sections,
            "out_of_section": t.out_of_section,
            "initial": t.initial,
            "warmup_steps": t.warmup_steps,
        }

    def withheld(self, state: core.LauncherState) -> list[int]:
        """The ranks whose processes never caught the checkpoint signal (ftslurm.agent.task)."""
        assert self.run is not None
        reports = {
            r: read_report(self.run.rank_report(self.attempt, r), RankReport) for r in state.ranks
        }
        return sorted(
            r for r, rep in reports.items() if rep is not None and rep.checkpoint_signal_withheld
        )


def report_failed(
    run: RunDir | None,
    who: core.NodeId,
    end: core.LauncherFailed,
    *,
    own: bool = True,
    peers_lost: list[int] | None = None,
) -> int:
    """A launcher failed before its ranks started: its node report says why (the error's
    last line) and, when the failure is its own (not news of a peer), the recovery folder
    too (`recovery/launcher-failed-<n>.json`), where the daemon sees it at its next look
    (within a second or two) and ends the attempt at once. Exit 1."""
    if run is not None:
        try:
            if own:
                record = core.launcher_failed_record(who, end)
                _write(run.launcher_failed(who.attempt, who.node_rank), record)
            report = core.node_report(end, who, ended_at=time.time(), peers_lost=peers_lost or [])
            _write(run.node_report(who.attempt, who.node_rank), report)
        except OSError as io:
            log.error("could not report the failure in %s: %s", run.root, io)
    log.error("Error: the launcher failed before its ranks started (%s): %s", end.phase, end.error)
    return int(ExitCode.FAILED)


def _early_identity(argv: list[str]) -> tuple[RunDir | None, core.NodeId]:
    """Who this launcher is, read leniently when its setup failed before it knew (a bad
    argument or setting, torch's import): the run directory and attempt from the job's
    environment as the batch script sets them (FTSLURM_RUN_DIR, FTSLURM_ATTEMPT, else
    FTSLURM_ATTEMPT_BASE + SLURM_RESTART_COUNT), the node rank from `--node-rank` or
    SLURM_NODEID. No run directory or no readable attempt: nothing can be reported there."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--max-restarts", type=int, default=0)
    own = argv[: argv.index("--")] if "--" in argv else argv
    try:
        known, _ = p.parse_known_args(own)
    except (SystemExit, argparse.ArgumentError):
        known = argparse.Namespace(node_rank=None, max_restarts=0)
    node_rank = known.node_rank if known.node_rank is not None else _env_int("SLURM_NODEID", 0)

    def number(name: str) -> int | None:
        try:
            value = int(os.environ.get(name, ""))
        except ValueError:
            return None
        return value if value >= 0 else None

    # as `JobEnv.current_attempt`: the base plus the restart count, else FTSLURM_ATTEMPT
    base, said = (os.environ.get(n.value, "") for n in (EnvName.ATTEMPT_BASE, EnvName.ATTEMPT))
    if base:
        b = number(EnvName.ATTEMPT_BASE.value)
        attempt = None if b is None else b + _env_int("SLURM_RESTART_COUNT", 0)
    else:
        attempt = number(EnvName.ATTEMPT.value) if said else 0
    run_dir = os.environ.get(EnvName.RUN_DIR.value, "")
    who = core.NodeId(
        node_rank=node_rank,
        node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        job_id=os.environ.get("SLURM_JOB_ID", "local"),
        attempt=attempt or 0,
        max_restarts=known.max_restarts,
        started_at=time.time(),
    )
    return (RunDir(run_dir) if run_dir and attempt is not None else None), who


def setup(argv: list[str]) -> tuple[Node | None, BaseException | None, Any]:
    """The launcher's setup up to the rendezvous: its arguments and settings, torch's
    import, its `Node`, its signal handlers and the peer watch. Returns the node (None if
    the failure came before it), the error that ended the setup (None: none) and
    `ftslurm.agent.elastic` (None on a failure)."""
    node = None
    try:
        args = parse_args(argv)
        # Imported here: the rest of ftslurm does not need torch.
        from ftslurm.agent import elastic

        node = Node(args)
        node.take_signals()
        node.start_watch()
        return node, None, elastic
    except (UsageError, Exception) as exc:
        return node, exc, None


def main(argv: list[str] | None = None) -> int:
    # One signal state from the launcher's first lines on (`ftslurm.agent.boot`), so
    # that no signal is lost in any phase: `boot.EARLY`, the signals for ranks that do not
    # exist (yet): theirs once they start; the first TERM or INT: the ranks never start
    # after it (checked before every phase that leads to them). Until the handlers that
    # forward are in place (torch is imported first), signals are only recorded.
    boot.record(*[s for s in [_checkpoint_signal()] if s is not None])
    pause_for_tests("start")
    logging.basicConfig(level=logging.INFO, format="ftslurm launch: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    # A failure anywhere before the ranks start (here the setup, below the rendezvous) is
    # reported where the daemon sees it, so that the attempt ends at once (`report_failed`).
    node, failed, elastic = setup(argv)
    if failed is not None:
        if node is not None:
            return node.launcher_failed(failed, "setup")
        run, who = _early_identity(argv)
        end = core.LauncherFailed(error_line(failed), "setup", time.time())
        return report_failed(run, who, end)
    assert node is not None and elastic is not None
    make_agent, round_ending = elastic.make_agent, elastic.round_ending
    if node.signals.stop is None:  # the pre-flight health check, before the rendezvous
        unhealthy = node.health_check()
        if unhealthy is not None:
            return unhealthy
    pause_for_tests("rendezvous")
    if node.signals.stop is not None and node.role != sp.SPARE:
        return node.stopped_before_ranks()  # told to stop already: no rendezvous, no ranks
    try:
        handler = node.rendezvous()
    except Exception as exc:
        return node.launcher_failed(exc, "rendezvous")
    node.agent = agent = make_agent(node, handler)
    if node.warm_spare():
        warm, result, fall_back = node.run_warm(handler)
        if not fall_back:
            return node.finish(warm, *round_ending(result))
        node.agent = agent  # its warm ranks failed: a spare as without live recovery
    failed, result = node.run_agent(agent, handler)
    if failed is not None:
        return failed
    return node.finish(agent, *round_ending(result))


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
        said = parse(StragglerReport, report)
        if said is not None and said.stragglers:
            stragglers = [s.to_json() for s in said.stragglers]
            log.info("stragglers in window %s: %s", said.window_index, stragglers)

    return collect


if __name__ == "__main__":
    exit_code = main()
    # The node report is written: leave without the interpreter's teardown, where torch's
    # native threads (the rendezvous store's) could still abort and change the exit code.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
