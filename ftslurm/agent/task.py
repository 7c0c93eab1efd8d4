"""The per-task wrapper: `srun python -m ftslurm.agent.task -- CMD [ARGS...]`.

For every task (rank) of an attempt it
- gives the command torch's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  NODE_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT: a free port for a rank alone; for
  several, one rank 0 found free and published in the run directory, the others waiting
  for it, or without a run directory `rendezvous_port` of the job) computed from Slurm's, and
  FTSLURM_ATTEMPT (FTSLURM_ATTEMPT_BASE + SLURM_RESTART_COUNT when the base is set);
- runs it in its own process group, copying its stderr through (and keeping the tail);
- forwards TERM, INT, HUP and CONT to that group (the handler only records and forwards),
  remembering when the checkpoint signal (FTSLURM_CHECKPOINT_SIGNAL, default USR2) or TERM
  first came; USR1, USR2 and the checkpoint signal, whose default action would end a script
  that does not expect them, go only to the processes of the group that catch them (their
  caught-signal mask, `ftslurm.agent.sigmask`), and are held while none does: delivered once
  one installs its handler (the rank agent's, say), never to a plain script, which the wall
  limit ends instead (the report then names the signal in `checkpoint_signal_withheld`);
- carries out the in-job fault injections of FTSLURM_INJECT (crash, hang, straggler): a
  crash or hang once per run (a spec already listed in an earlier attempt's report of this
  rank is skipped); a straggler slows the node it first hits and, like a bad node, that node
  stays slow for every rank that runs on it later in the run (recorded in
  `$FTSLURM_RUN_DIR/attempts/straggler-nodes.json`), while other nodes are spared; under
  the launcher it slows the training, not the start-up (from the rank agent's heartbeat
  record, at most STRAGGLER_START_WAIT_S after its time);
- when the command ends, writes `$FTSLURM_RUN_DIR/attempts/<attempt>/rank-<rank>.json`
  (atomic) for the daemon:
      {"rank", "node", "job_id", "restart_count", "attempt", "exit_code", "signal",
       "started_at", "ended_at", "checkpoint_signal_at", "injected", "outcome",
       "error_tail", "error_line", "saved_step", "disk_full_path",
       "checkpoint_signal_withheld"}
  where outcome is one of "finished", "checkpointed" (exit 0 after the checkpoint signal:
  continue me; a checkpoint signal held back from a script that never caught it does not
  count), "teardown_failed" (the rank recorded "saved step S, stopping" through the
  rank agent, `saved_step`, and then died while tearing down: the save stands),
  "resume_elsewhere" (16), "failed_validation" (17), "do_not_retry" (93), "disk_full" (it
  died of ENOSPC, "No space left on device", at `disk_full_path` when its stderr names
  it), "user_error", "killed" or "failed" (see `classify_exit`), or "stopped" (TERM or INT
  came before the command started: it never did, and the wrapper exits 128 + the signal);
  `error_line` says in one line what failed, for the daemon's reason (the last Python
  exception line of its stderr, "ModuleNotFoundError: No module named 'foo'", see
  `error_line`; null when it did not fail); a stop record left by an earlier process of
  this rank is removed before the command starts;
- exits with the command's code (128+N when signal N killed it; 127 when it cannot start).
"""

from __future__ import annotations

import os
import random
import re
import signal as signals
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

import hostlist

from ftslurm.agent.boot import STOPS  # one before the command starts: it never does
from ftslurm.agent.peers import PeerWatch, task_watch
from ftslurm.agent.rank import read_stop_record
from ftslurm.agent.sigmask import catchers, readable
from ftslurm.core.contract import (
    NAMED_EXITS,
    EnvName,
    ExitCode,
    HeartbeatDir,
    JobEnv,
    published_rendezvous,
    rendezvous_port,
    rendezvous_record,
)
from ftslurm.core.contract.reports import (
    CLEAN,
    Kind,
    NodeReport,
    Outcome,
    RankReport,
    StopRecord,
    TakeOver,
    parse,
)
from ftslurm.core.inject import Injection, InjectKind, parse_injection
from ftslurm.errors import ConfigError
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.runfiles import rank_reports, read_report, read_reports, write_report

FORWARDED = (
    signals.SIGTERM,
    signals.SIGINT,
    signals.SIGHUP,
    signals.SIGUSR1,
    signals.SIGUSR2,
    signals.SIGCONT,
)
# The outcome of a rank (and of a launcher, `ftslurm.agent.launch`) told to stop before its
# command (its ranks) started.
STOPPED = Outcome.STOPPED.value
TAIL_BYTES = 16 * 1024
TAIL_LINES = 40
# A straggler's node runs for 1/FACTOR of each period and is stopped for the rest; each
# period is drawn from STRAGGLER_PERIOD_S x [0.5, 1.5): a fixed one kept in step with a rank
# whose step sleeps a multiple of it (0.1 s), which then always woke in its run slice and
# was not slowed at all.
STRAGGLER_PERIOD_S = 0.1
# A straggler slows the training, not the start-up: under the launcher its slicing waits
# for the rank agent's heartbeat record (the process group formed), at most this long
# after its TIME (a script without the rank agent has none). A start-up slowed FACTOR-fold
# (a minute of imports on a loaded machine at 10x) ran into the script's own process-group
# timeout before any straggler detection could see a step.
STRAGGLER_START_WAIT_S = 60.0
HOLD_SIGNALS_MAX_S = 120.0  # without a readable signal mask: how long USR1/USR2 wait for
# the rank agent to attach
HELD_LOOK_S = 0.5  # how often a held signal looks again for a process that catches it
# Ranks started without the launcher: how long the others wait for the port rank 0 bound
# and published (`Task.agree_port`), and how often they look
PORT_WAIT_S = 300.0
PORT_LOOK_S = 0.1
# Without the launcher, how long a node's first task waits for the node's other tasks' rank
# reports before it writes the node's report with those it has (they end together).
NODE_REPORT_WAIT_S = 5.0
NODE_REPORT_LOOK_S = 0.1  # how often it looks for them meanwhile
_USER_ERROR = re.compile(
    r"^(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|NameError)(:|$)"
    r"|can't open file"
)
# ENOSPC as Python and C libraries print it; the path when the message names one.
_DISK_FULL = re.compile(r"\[Errno 28\]|No space left on device|ENOSPC")
_DISK_FULL_PATH = re.compile(r"No space left on device: ('([^']*)'|\"([^\"]*)\")")
DISK_FULL_LINES = 5  # how far from the end of the tail the fatal error may be
# The line a Python traceback ends with: the exception's (dotted) type, then its message.
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|"
    r"KeyboardInterrupt|StopIteration)(:|$)"
)
ERROR_LINE_CHARS = 300  # the longest error line a report carries


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """`2(x3),1` -> the task count of node `node_id` (Slurm's compressed per-node counts)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id] if 0 <= node_id < len(counts) else None


def torch_env(environ: Mapping[str, str], job: JobEnv | None = None) -> dict[str, str]:
    """torch.distributed's variables (and FTSLURM_ATTEMPT) from Slurm's, for one task;
    `job`: `environ` parsed (`JobEnv.from_environ`)."""
    job = job if job is not None else JobEnv.from_environ(environ)
    node_id = _int(environ.get("SLURM_NODEID"))
    restarts = _int(environ.get("SLURM_RESTART_COUNT"))
    env = {
        "RANK": environ.get("SLURM_PROCID") or "0",
        "LOCAL_RANK": environ.get("SLURM_LOCALID") or "0",
        "WORLD_SIZE": environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1",
        "NODE_RANK": str(node_id),
        "GROUP_RANK": str(node_id),
    }
    local: int | None = None
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if local is None and environ.get(key):
            local = _tasks_on_node(environ[key], node_id)
    env["LOCAL_WORLD_SIZE"] = str(local or environ.get("SLURM_NTASKS_PER_NODE") or 1)
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    env["MASTER_ADDR"] = environ.get("MASTER_ADDR") or (
        hostlist.expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1"
    )
    # One rank alone needs no agreement: a port free now, not one derived from the job id,
    # which another job's (another mock cluster's) or any process may hold. Ranks of one
    # step started without the launcher agree on one through the run directory
    # (`Task.agree_port`); without a run directory the job's derived port is all they share.
    env["MASTER_PORT"] = environ.get("MASTER_PORT") or str(
        free_port()
        if env["WORLD_SIZE"] == "1"
        else rendezvous_port(environ.get("SLURM_JOB_ID"), restarts)
    )
    if environ.get("TORCHELASTIC_RUN_ID"):  # started by the launcher: its ranks stand
        for key in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            if environ.get(key):
                env[key] = environ[key]
        env["NODE_RANK"] = env["GROUP_RANK"]
    if job.attempt_base is not None or job.attempt is not None:
        env[EnvName.ATTEMPT.value] = str(job.current_attempt(restarts))
    return env


def free_port() -> int:
    """A TCP port free on this host now (the system's pick)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def disk_full(stderr_tail: str) -> tuple[bool, str | None]:
    """Whether the last lines of a rank's stderr say it died of ENOSPC, and the path
    named when there is one."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    for line in reversed(lines[-DISK_FULL_LINES:]):
        if _DISK_FULL.search(line):
            match = _DISK_FULL_PATH.search(line)
            return True, (match.group(2) or match.group(3)) if match else None
    return False, None


def error_line(stderr_tail: str, exit_code: int | None) -> str | None:
    """What failed, in one line of a failed rank's stderr: the last Python exception line
    (the end of a traceback: "ModuleNotFoundError: No module named 'foo'"), else, for a
    command that exited non-zero (not killed by a signal), its last line. None when there
    is neither. At most ERROR_LINE_CHARS characters."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), None)
    if found is None and exit_code not in (None, 0) and lines:
        found = lines[-1]
    if found is None:
        return None
    return found if len(found) <= ERROR_LINE_CHARS else found[: ERROR_LINE_CHARS - 3] + "..."


def classify_exit(
    exit_code: int | None,
    signal: int | None,
    checkpoint_signal_seen: bool,
    runtime_s: float,
    stderr_tail: str,
    user_error_window_s: float,
    stopped: str | None = None,
) -> str:
    """How a task ended, in the daemon's words (see the module docstring). `stopped`: what
    the rank recorded before it ended ("checkpointed": saved step S, stopping; "finished":
    the training is done), None when it recorded nothing."""
    if signal is None and exit_code == 0:
        done = Outcome.CHECKPOINTED if checkpoint_signal_seen else Outcome.FINISHED
        return stopped or done.value
    if signal is None and exit_code in NAMED_EXITS:
        return NAMED_EXITS[ExitCode(exit_code)]
    if stopped is not None:
        return Outcome.TEARDOWN_FAILED.value
    if disk_full(stderr_tail)[0]:
        return Outcome.DISK_FULL.value
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    if runtime_s <= user_error_window_s and lines and _USER_ERROR.search(lines[-1]):
        return Outcome.USER_ERROR.value
    return (Outcome.KILLED if signal is not None else Outcome.FAILED).value


def parse_inject_env(value: str | None) -> tuple[Injection, ...]:
    """FTSLURM_INJECT (what `inject.env_value` writes) back into injections; a malformed
    spec is reported on stderr and skipped rather than failing the task."""
    found = []
    for spec in (value or "").split(","):
        if spec.strip():
            try:
                found.append(parse_injection(spec))
            except ConfigError as exc:
                print(f"ftslurm: ignoring {EnvName.INJECT.value} entry: {exc}", file=sys.stderr)
    return tuple(found)


def _applies(inj: Injection, rank: int, node: str, node_id: int, nnodes: int) -> bool:
    if inj.kind in (InjectKind.CRASH, InjectKind.HANG):
        return rank == (inj.rank or 0)
    if inj.kind is InjectKind.STRAGGLER:
        if inj.node is not None:
            return node == inj.node
        return node_id == (inj.node_index if inj.node_index is not None else nnodes - 1)
    return False


class Task:
    """One wrapped task: see the module docstring."""

    def __init__(self, command: list[str], environ: Mapping[str, str]) -> None:
        self.started, self.started_wall = time.monotonic(), time.time()
        self.command = command
        self.environ = dict(environ)
        self.job = JobEnv.from_environ(self.environ)
        self.env = {**self.environ, **torch_env(self.environ, self.job)}
        self.env[EnvName.RANK_STARTED.value] = repr(self.started_wall)
        self.rank = _int(self.env["RANK"])
        # A warm spare's rank (live recovery) has no rank of its own until its launcher
        # hands it one (`HeartbeatDir.takeover`): no injection, no stop record, no report.
        self.warm = self.environ.get(EnvName.LIVE_SPARE.value) == "1"
        self.node_id = _int(self.environ.get("SLURM_NODEID"))
        self.node = self.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.attempt = self.job.current_attempt(_int(self.environ.get("SLURM_RESTART_COUNT")))
        self.rundir = self.job.run
        self.run_dir = self.rundir.root if self.rundir is not None else None
        self.checkpoint_signal = self.job.checkpoint_signal_number
        self.checkpoint_signal_at: float | None = None
        self.injected: list[str] = []
        self.tail = bytearray()
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.early: list[int] = []  # signals that came before the command started
        # Signals that would end a process without a handler: delivered only to those that
        # catch them, held (in `held`, each once) while none does.
        self.selective = {signals.SIGUSR1, signals.SIGUSR2, self.checkpoint_signal} - {
            signals.SIGTERM,
            signals.SIGINT,
            signals.SIGHUP,
            signals.SIGCONT,
        }
        self.held: list[int] = []
        self.told_to_stop = False  # TERM, or the checkpoint signal, reached the command
        self.hung = False
        self.stopped_ever = False

    # ------------------------------------------------------------------ signals
    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        if sig == signals.SIGSTOP:
            self.stopped_ever = True
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _forward(self, sig: int, _frame: object) -> None:
        if self.checkpoint_signal_at is None and sig in (self.checkpoint_signal, signals.SIGTERM):
            self.checkpoint_signal_at = time.time()
        if self.proc is None:  # not there yet: held until it starts
            self.early.append(sig)
            return
        if sig in self.selective:
            if not self._deliver_selective(sig) and sig not in self.held:
                self.held.append(sig)  # looked at again by `_deliver_held`
            return
        if sig == signals.SIGCONT:
            self.hung = False
        elif self.stopped_ever and not self.hung:
            self._signal_group(signals.SIGCONT)  # a straggler's pause must not hold it back
        if sig == signals.SIGTERM:
            self.told_to_stop = True
        self._signal_group(sig)

    def _deliver_selective(self, sig: int) -> bool:
        """Deliver a signal whose default action would end a process only to the processes
        of the command's group that catch it. False: none does (yet); it is held."""
        assert self.proc is not None
        targets = catchers(self.proc.pid, sig)
        if targets is None and not readable():  # no masks here: the rank agent's record tells
            if not self._rank_ready():
                return False
        elif not targets:  # none catches it, or the command is gone: it stays held
            return False
        if self.stopped_ever and not self.hung:
            self._signal_group(signals.SIGCONT)  # a straggler's pause must not hold it back
        if sig == self.checkpoint_signal:
            self.told_to_stop = True
        if targets is None:
            self._signal_group(sig)
        for pid in targets or ():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return True

    def _rank_ready(self) -> bool:
        """Where the signal mask cannot be read: under the launcher, the rank agent's
        heartbeat record shows the rank's signal handlers are in place; without the
        launcher there is nothing to wait for."""
        hb_dir = self.job.heartbeat_dir
        if not hb_dir or time.monotonic() - self.started > HOLD_SIGNALS_MAX_S:
            return True
        return HeartbeatDir(hb_dir).record(self.env.get("LOCAL_RANK", "0")).exists()

    def _deliver_held(self, done: threading.Event) -> None:
        """Looks again, every HELD_LOOK_S, for a process that catches a held signal (the
        handler only appends to `held`; only this thread removes from it)."""
        told: set[int] = set()
        while not done.wait(HELD_LOOK_S):
            for sig in list(self.held):
                if self._deliver_selective(sig):
                    self.held.remove(sig)
                elif sig not in told:
                    told.add(sig)
                    name = signals.Signals(sig).name
                    print(
                        f"ftslurm: {name} held: no process of rank {self.rank} catches it "
                        f"(delivered if one installs a handler; a script without one is "
                        f"left to run to its wall limit)",
                        file=sys.stderr,
                        flush=True,
                    )

    # ------------------------------------------------------------------ threads
    def _copy_stderr(self, pipe: IO[bytes]) -> None:
        out = sys.stderr.buffer
        while chunk := pipe.read1(65536):  # type: ignore[attr-defined]
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):
                pass
            with self.lock:
                self.tail += chunk
                del self.tail[:-TAIL_BYTES]

    def attempt_report_exists(self) -> bool:
        return self.rundir is not None and self.rundir.rank_report(self.attempt, self.rank).exists()

    def _record_fired(self, spec: str) -> None:
        """Noted before acting: a rank killed for hanging writes no report afterwards."""
        if self.rundir is None:
            return
        path = self.rundir.fired(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        fired = set(read_json(path) or [])
        write_json_atomic(path, sorted(fired | {spec}))

    def _results_spoiled(self) -> set[str]:
        """The nan and spike injections this rank's command carried out (its rank agent
        records them where this wrapper records its own: `RunDir.fired`)."""
        if self.rundir is None:
            return set()
        specs = {i.spec() for i in parse_inject_env(self.job.inject) if i.kind.on_result}
        return specs & set(read_json(self.rundir.fired(self.rank)) or [])

    def _straggler_nodes(self) -> dict[str, str]:
        """Straggler spec -> the node it slowed first in this run (it stays slow)."""
        if self.rundir is None:
            return {}
        return read_json(self.rundir.straggler_nodes) or {}

    def _record_straggler_node(self, spec: str) -> None:
        if self.rundir is None or spec in self._straggler_nodes():
            return
        write_json_atomic(self.rundir.straggler_nodes, {**self._straggler_nodes(), spec: self.node})

    def _fired_before(self) -> set[str]:
        """Specs this rank already carried out in an earlier attempt of the run, or earlier
        in this attempt before an in-job restart (its report is then already there)."""
        if self.rundir is None:
            return set()
        fired: set[str] = set(read_json(self.rundir.fired(self.rank)) or [])
        for report in rank_reports(self.rundir, self.rank):
            fired.update(report.injected)
        return fired

    def _trains(self, since: float) -> bool:
        """Whether a straggler fired at `since` (monotonic) slows the rank now: once its
        rank agent attached under the launcher (its heartbeat record), or without the
        launcher at once, or STRAGGLER_START_WAIT_S after it fired at the latest."""
        hb = self.job.heartbeat_dir
        return (
            not hb
            or HeartbeatDir(hb).record(self.env.get("LOCAL_RANK", "0")).exists()
            or time.monotonic() - since >= STRAGGLER_START_WAIT_S
        )

    def _inject(self, pending: list[Injection], done: threading.Event) -> None:
        slow: Injection | None = None
        slow_since = 0.0
        while not done.is_set() and (pending or slow):
            now = time.monotonic() - self.started
            while pending and pending[0].at_s <= now:
                inj = pending.pop(0)
                self.injected.append(inj.spec())
                self._record_fired(inj.spec())
                print(
                    f"ftslurm: injected {inj.spec()} on rank {self.rank} (node {self.node})",
                    file=sys.stderr,
                    flush=True,
                )
                if inj.kind is InjectKind.CRASH:
                    self._signal_group(signals.SIGKILL)
                elif inj.kind is InjectKind.HANG:
                    self.hung = True
                    self._signal_group(signals.SIGSTOP)
                else:
                    self._record_straggler_node(inj.spec())
                    slow, slow_since = inj, time.monotonic()
            if slow is not None and not self.hung and self._trains(slow_since):
                period = STRAGGLER_PERIOD_S * random.uniform(0.5, 1.5)
                run_s = period / (slow.factor or 2.0)
                self._signal_group(signals.SIGCONT)
                if done.wait(run_s):
                    break
                if not self.hung:
                    self._signal_group(signals.SIGSTOP)
                done.wait(period - run_s)
                if not self.hung:
                    self._signal_group(signals.SIGCONT)
            else:
                done.wait(min(0.05, max(0.0, pending[0].at_s - now)) if pending else 0.05)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        for sig in {*FORWARDED, self.checkpoint_signal}:
            signals.signal(sig, self._forward)
        if self.rundir is not None and not self.warm:  # only this process records its stop
            self.rundir.stop_record(self.attempt, self.rank).unlink(missing_ok=True)
        if self.job.heartbeat_dir:  # tell the launcher our handlers are in place
            HeartbeatDir(self.job.heartbeat_dir).ready(self.env.get("LOCAL_RANK", "0")).touch()
        failed = self.agree_port()
        if failed is not None:
            return failed
        stop = next((s for s in self.early if s in STOPS), None)
        if stop is not None:  # told to stop before the command started: it never does
            message = (
                f"ftslurm: rank {self.rank} was told to stop "
                f"({signals.Signals(stop).name}) before its command started: not "
                f"starting it"
            )
            print(message, file=sys.stderr, flush=True)
            self._report(None, stop, STOPPED, None)
            return 128 + stop
        failed = self._start()
        if failed is not None:
            return failed
        assert self.proc is not None and self.proc.stderr is not None
        copier = threading.Thread(target=self._copy_stderr, args=(self.proc.stderr,), daemon=True)
        copier.start()
        done = threading.Event()
        threading.Thread(target=self._deliver_held, args=(done,), daemon=True).start()
        pending = self._pending_injections()
        injector = threading.Thread(target=self._inject, args=(pending, done), daemon=True)
        if pending:
            injector.start()
        # Without the launcher, the node's lease (`peers.task_watch`): its loss is seen.
        watch = task_watch(self.job, self.environ, self.attempt, self.node)
        status = self.proc.wait()
        done.set()
        if pending:
            injector.join(timeout=1)
        if self.stopped_ever:
            self._signal_group(signals.SIGCONT)  # leave nothing of the group stopped
        copier.join(timeout=5)
        return self._ended(status, watch)

    def agree_port(self) -> int | None:
        """Ranks of a step started without the launcher (several, with a run directory and
        no MASTER_PORT of the user's): rank 0 takes a port free on its host now and
        publishes it (`RunDir.rendezvous`, the launcher's record: this job's step and
        restart), and the others take it from there, waiting up to PORT_WAIT_S (less when
        told to stop meanwhile). A port derived from the job id alone could be held by any
        process, or by another job of the same id (another mock cluster). The exit code
        when no port came in time (reported), else None."""
        if (
            self.rundir is None
            or self.warm
            or self.environ.get("TORCHELASTIC_RUN_ID")
            or self.environ.get("MASTER_PORT")
            or _int(self.env.get("WORLD_SIZE"), 1) <= 1
        ):
            return None
        restarts = _int(self.environ.get("SLURM_RESTART_COUNT"))
        job = self.environ.get("SLURM_JOB_ID", "local")
        step = self.environ.get("SLURM_STEP_ID", "")
        path = self.rundir.rendezvous(self.attempt, restarts)
        if self.rank == 0:
            port = free_port()
            record = rendezvous_record(
                host=self.env["MASTER_ADDR"],
                port=port,
                rdzv_id=f"ftslurm-{job}-{self.attempt}-{restarts}-task-{os.getpid()}",
                job_id=job,
                step_id=step,
                restart_count=restarts,
                pid=os.getpid(),
                time=time.time(),
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, record)
            self.env["MASTER_PORT"] = str(port)
            return None
        deadline = time.monotonic() + PORT_WAIT_S
        while not any(s in STOPS for s in self.early):
            found = published_rendezvous(
                read_json(path), job_id=job, step_id=step, restart_count=restarts
            )
            if found is not None:
                self.env["MASTER_PORT"] = str(found[1])
                return None
            if time.monotonic() > deadline:
                message = (
                    f"ftslurm: rank {self.rank}: rank 0 published no port within "
                    f"{PORT_WAIT_S:.0f}s ({path})"
                )
                print(message, file=sys.stderr, flush=True)
                code = int(ExitCode.FAILED)
                self._report(code, None, Outcome.FAILED.value, message, error=message)
                return code
            time.sleep(PORT_LOOK_S)
        return None  # told to stop: the command never starts (`run`)

    def _start(self) -> int | None:
        """Start the command in a session of its own and hand it the signals that came
        before; the exit code when it cannot start (reported), else None."""
        try:
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with(os.getpid()),
            )
        except OSError as exc:
            code = (
                ExitCode.NOT_FOUND
                if isinstance(exc, FileNotFoundError)
                else ExitCode.CANNOT_EXECUTE
            )
            message = f"ftslurm: cannot start {self.command[0]!r}: {exc.strerror or exc}"
            print(message, file=sys.stderr, flush=True)
            self._report(code, None, Outcome.USER_ERROR, message, error=message)
            return code
        held, self.early = self.early, []
        for sig in held:
            self._forward(sig, None)
        return None

    def _pending_injections(self) -> list[Injection]:
        """The in-job injections this rank carries out, by time: those that apply to it and
        did not fire before (a straggler's on the node it slowed first). None on a warm
        spare's rank (live recovery): the rank it may take over carried out its own."""
        if self.warm:
            return []
        nnodes = _int(
            self.environ.get("SLURM_NNODES") or self.environ.get("SLURM_JOB_NUM_NODES"), 1
        )
        fired = self._fired_before()
        if self.attempt_report_exists():  # an in-job restart: keep what already fired here
            self.injected = sorted(fired)
        slow_nodes = self._straggler_nodes()
        return sorted(
            (
                i
                for i in parse_inject_env(self.job.inject)
                if (
                    slow_nodes.get(i.spec()) == self.node
                    if i.spec() in slow_nodes
                    else i.spec() not in fired
                    and _applies(i, self.rank, self.node, self.node_id, nnodes)
                )
            ),
            key=lambda i: i.at_s,
        )

    def _adopted(self) -> bool:
        """A warm spare's rank: whether it took a rank over (and become that rank)."""
        hb = self.job.heartbeat_dir
        told = (
            read_report(HeartbeatDir(hb).takeover(self.env.get("LOCAL_RANK", "0")), TakeOver)
            if hb
            else None
        )
        if told is None or told.rank is None:
            return False
        self.rank, self.warm = told.rank, False
        if told.local_rank is not None:  # a node's standby, in a crashed rank's place
            self.env["LOCAL_RANK"] = str(told.local_rank)
        return True

    def _ended(self, status: int, watch: PeerWatch | None) -> int:
        """The command ended with `status` (Popen's): classified, reported; the exit code."""
        code, sig = (status, None) if status >= 0 else (None, -status)
        if self.warm and not self._adopted():  # never took a rank over: nothing to report
            return code if code is not None else 128 + (sig or 0)
        with self.lock:
            tail = self.tail.decode(errors="replace")
        window = self.job.user_error_window_s
        stop = parse(StopRecord, read_stop_record(self.run_dir, self.attempt, self.rank))
        withheld = self.checkpoint_signal in self.held  # no process of the rank caught it
        outcome = classify_exit(
            code,
            sig,
            self.told_to_stop,
            time.monotonic() - self.started,
            tail,
            window,
            (stop.outcome or Outcome.CHECKPOINTED.value) if stop else None,
        )
        if watch is not None:
            watch.stop(outcome)
        if outcome == Outcome.TEARDOWN_FAILED:
            print(
                f"ftslurm: rank {self.rank} died while tearing down ("
                f"{f'signal {sig}' if sig else f'exit {code}'}) after it saved step "
                f"{stop.step if stop else None}: the checkpoint stands",
                file=sys.stderr,
                flush=True,
            )
        self._report(
            code,
            sig,
            outcome,
            tail if status != 0 else None,
            saved_step=stop.step if stop else None,
            disk_full_path=disk_full(tail)[1] if outcome == Outcome.DISK_FULL else None,
            withheld=self.checkpoint_signal.name.removeprefix("SIG") if withheld else None,
            error=error_line(tail, code) if status != 0 else None,
        )
        return code if code is not None else 128 + (sig or 0)

    def _report(
        self,
        code: int | None,
        sig: int | None,
        outcome: str,
        tail: str | None,
        saved_step: int | None = None,
        disk_full_path: str | None = None,
        withheld: str | None = None,
        error: str | None = None,
    ) -> None:
        if self.rundir is None:
            return
        write_report(
            self.rundir.rank_report(self.attempt, self.rank),
            RankReport(
                rank=self.rank,
                node=self.node,
                job_id=self.environ.get("SLURM_JOB_ID"),
                restart_count=_int(self.environ.get("SLURM_RESTART_COUNT")),
                attempt=self.attempt,
                exit_code=code,
                signal=sig,
                started_at=self.started_wall,
                ended_at=time.time(),
                checkpoint_signal_at=self.checkpoint_signal_at,
                injected=sorted({*self.injected, *self._results_spoiled()}),
                outcome=outcome,
                error_tail="\n".join(tail.splitlines()[-TAIL_LINES:]) if tail else None,
                error_line=error,
                saved_step=saved_step,
                disk_full_path=disk_full_path,
                checkpoint_signal_withheld=withheld,
            ),
        )
        self._node_report()

    def _keeps_node(self) -> bool:
        """Without the launcher, the node's first task writes the node's report (as it
        keeps the node's lease, `peers.task_watch`)."""
        return (
            self.rundir is not None
            and not self.job.heartbeat_dir
            and not self.warm
            and (self.environ.get("SLURM_LOCALID") or "0") == "0"
        )

    def _node_report(self) -> None:
        """The node's report (`RunDir.node_report`, what a launcher writes) from its ranks'
        reports, once this task's own is written: the node's other tasks' are waited for
        up to NODE_REPORT_WAIT_S. Its outcome and exit code are the first failed rank's
        (by rank), else this rank's; so the daemon, `status` and `report` see every node of
        a job without the launcher as of one with it."""
        if not self._keeps_node():
            return
        assert self.rundir is not None
        job = self.environ.get("SLURM_JOB_ID")
        restarts = _int(self.environ.get("SLURM_RESTART_COUNT"))
        expected = max(1, _int(self.env.get("LOCAL_WORLD_SIZE"), 1))
        deadline = time.monotonic() + NODE_REPORT_WAIT_S
        while True:
            ours = sorted(
                (
                    r
                    for r in read_reports(self.rundir, Kind.RANK, self.attempt)
                    if r.node == self.node
                    and str(r.job_id) == str(job)
                    and r.restart_count in (None, restarts)
                ),
                key=lambda r: r.rank if r.rank is not None else -1,
            )
            if len(ours) >= expected or time.monotonic() > deadline:
                break
            time.sleep(NODE_REPORT_LOOK_S)
        own = next((r for r in ours if r.rank == self.rank), None)
        failed = [r for r in ours if r.outcome not in CLEAN]
        pick = failed[0] if failed else own or (ours[0] if ours else None)
        code = pick.exit_code if pick is not None else None
        if pick is not None and code is None and pick.signal:
            code = 128 + pick.signal
        stop = pick.signal if pick is not None and pick.outcome == STOPPED else None
        write_report(
            self.rundir.node_report(self.attempt, self.node_id),
            NodeReport(
                node_rank=self.node_id,
                node=self.node,
                job_id=job,
                attempt=self.attempt,
                outcome=pick.outcome if pick is not None else None,
                exit_code=code,
                signal=signals.Signals(stop).name if stop else None,
                started_at=self.started_wall,
                ended_at=time.time(),
                checkpoint_signal_withheld_ranks=[
                    r.rank for r in ours if r.checkpoint_signal_withheld and r.rank is not None
                ],
            ),
        )


def _die_with(parent: int) -> Callable[[], None]:
    """For the child: be killed when the wrapper dies (even by SIGKILL), so a rank never
    outlives its task where processes are tracked by process group only."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signals.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the wrapper died before prctl took effect
                os._exit(137)

    return preexec


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m ftslurm.agent.task [--] COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # Die with whoever started us (srun's task, or the launcher), so no rank outlives it
    # where processes are tracked by process group only.
    _die_with(os.getppid())()
    try:
        task = Task(args, os.environ)
    except ConfigError as exc:
        print(f"ftslurm: {exc.message}", file=sys.stderr)
        return 2
    return task.run()


if __name__ == "__main__":
    sys.exit(main())
