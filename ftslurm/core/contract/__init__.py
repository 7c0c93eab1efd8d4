"""The contract between the compute side and the daemon, in one place (pure).

What the two sides share, and nothing else may spell out again (`tests/test_architecture.py`
checks it):
- `RunDir`: every path of a run's directory (on the shared file system) that one side
  writes and the other reads: progress, the FINISHED marker, the attempt reports of ranks
  and nodes, stop records, hang reports, the launchers' leases and peer-loss reports, the
  straggler files, logs, checkpoints;
  `HeartbeatDir`: the files between a node's launcher and its ranks;
- `ExitCode`: the exit codes with a meaning (the launcher's, the task wrapper's, the
  daemon's policy);
- `EnvName` and `JobEnv`: every `FTSLURM_*` environment variable. The daemon renders a
  `JobEnv` into the batch script (`JobEnv.render`); the launcher, the per-rank wrapper and
  the rank agent each parse it once (`JobEnv.from_environ(os.environ)`), with the defaults
  here; a bad value is a one-line `ConfigError`;
- `parse_signal`: the one parser of signal names ("USR2", "SIGUSR2", "12");
- `RunDir.rendezvous` and `published_rendezvous`: the endpoint the launcher of node rank 0
  bound and published for the others (`rendezvous_port`: the fallback without a run
  directory).

No I/O here: path arithmetic, parsing and rendering only.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ftslurm.errors import ConfigError


# ----------------------------------------------------------------------------- exit codes
class ExitCode(IntEnum):
    """Exit codes with a meaning between the compute side and the daemon."""

    FINISHED = 0  # done; also a submitit-style "checkpointed, continue me" (0 after the signal)
    FAILED = 1
    RESUME_ELSEWHERE = 16  # a rank asks to resume on other hardware
    FAILED_VALIDATION = 17
    RESTARTS_EXHAUSTED = 74  # the launcher used up its in-job restarts: the daemon may retry
    CONTINUE = 75  # every rank checkpointed after the signal: continue me
    REJOIN = 76  # a rank left a failed live round on purpose: restart it alone, no restart used
    DO_NOT_RETRY = 93
    CANNOT_EXECUTE = 126  # the task wrapper could not start the command
    NOT_FOUND = 127  # the command does not exist


# Exit codes a rank chooses to say something, with the outcome name reports use; in order of
# precedence when ranks of a node disagree.
NAMED_EXITS: dict[ExitCode, str] = {
    ExitCode.DO_NOT_RETRY: "do_not_retry",
    ExitCode.FAILED_VALIDATION: "failed_validation",
    ExitCode.RESUME_ELSEWHERE: "resume_elsewhere",
}
# Codes no user setting may claim (`user_error_exit_codes`).
RESERVED_EXITS = frozenset(
    {
        ExitCode.FINISHED,
        ExitCode.RESUME_ELSEWHERE,
        ExitCode.FAILED_VALIDATION,
        ExitCode.DO_NOT_RETRY,
        ExitCode.RESTARTS_EXHAUSTED,
        ExitCode.CONTINUE,
        ExitCode.REJOIN,
    }
)


# ----------------------------------------------------------------------------- signals
UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


def parse_signal(value: str | int) -> signal.Signals:
    """A signal a job can catch, from its name ("USR2", "sigusr2", "SIGUSR2") or number
    ("12"); KILL and STOP (which no process can catch) and unknown names are refused with a
    one-line `ConfigError`."""
    text = str(value).strip()
    name = text.upper().removeprefix("SIG")
    found: signal.Signals | None = None
    if name.isdigit():
        if int(name) in {s.value for s in signal.Signals}:
            found = signal.Signals(int(name))
    else:
        found = signal.Signals.__members__.get(f"SIG{name}")
    if found is None or found in UNCATCHABLE:
        raise ConfigError(f"not a signal a job can catch: {text!r}")
    return found


def signal_name(value: str | int) -> str:
    """The name without "SIG" ("USR2") of what `parse_signal` accepts."""
    return parse_signal(value).name.removeprefix("SIG")


def checked_signal_name(value: str | int) -> str:
    """`signal_name` for a pydantic validator: a refused signal is a ValueError."""
    try:
        return signal_name(value)
    except ConfigError as exc:
        raise ValueError(exc.message) from None


# The checkpoint signal held back from a rank because no process of it catches the signal
# (a plain script: the wall limit ends it instead, `ftslurm.agent.sigmask`): in a rank
# report (`ftslurm.agent.task`) the signal's name ("USR2"), in a node report
# (`ftslurm.agent.launch`) the global ranks of the node that withheld it.
WITHHELD_SIGNAL = "checkpoint_signal_withheld"
WITHHELD_RANKS = "checkpoint_signal_withheld_ranks"


# ----------------------------------------------------------------------------- ports
PORT_BASE, PORT_SPAN = 20000, 40000


def rendezvous_port(job_id: str | int | None, restart_count: int = 0) -> int:
    """A port (20000-59999) from the job id and Slurm's restart count alone: the fallback
    every node can compute where nothing was published (a launcher or a rank started
    without a run directory). Two jobs of one id (two mock clusters, two Slurm clusters) or
    any other process may hold it: with a run directory the rendezvous host binds a free
    port and publishes it instead (`RunDir.rendezvous`). Another one for each restart of
    the job (104729 is prime to 40000, so consecutive restarts never collide)."""
    job = int(re.sub(r"\D", "", str(job_id or "")) or 0)
    return PORT_BASE + (job * 7919 + restart_count * 104729) % PORT_SPAN


def rendezvous_record(
    *,
    host: str,
    port: int,
    rdzv_id: str,
    job_id: str,
    step_id: str,
    restart_count: int,
    pid: int,
    time: float,
) -> dict[str, Any]:
    """What the rendezvous host publishes in `RunDir.rendezvous` (the JSON of a
    `Rendezvous`): the address it bound, the rendezvous id (unique per run, attempt, restart
    and launch), and the job, step and restart it serves, so a reader never takes another
    launch's endpoint."""
    from ftslurm.core.contract.reports import Rendezvous  # (it imports this module)

    record = Rendezvous(
        host=host,
        port=int(port),
        id=rdzv_id,
        job_id=str(job_id),
        step_id=str(step_id),
        restart_count=int(restart_count),
        pid=pid,
        time=time,
    )
    return record.to_json()


def published_rendezvous(
    record: Any, *, job_id: str, step_id: str, restart_count: int
) -> tuple[str, int, str] | None:
    """(host, port, rendezvous id) from a published record (a `Rendezvous`'s JSON) when it
    is one of this job's step and restart, else None (not written yet, torn, or left by
    another launch)."""
    from ftslurm.core.contract.reports import Rendezvous  # (it imports this module)

    try:  # strict: a port or a restart count spelled as a string is not this launch's
        found = Rendezvous.model_validate(record, strict=True)
    except ValidationError:
        return None
    if (
        found.job_id != str(job_id)
        or found.step_id != str(step_id)
        or found.restart_count != restart_count
        or not found.host
        or not found.id
        or found.port is None
        or not 0 < found.port < 65536
    ):
        return None
    return found.host, found.port, found.id


# ----------------------------------------------------------------------------- paths
DEFAULT_CHECKPOINT_DIR = "checkpoints"  # relative to the working directory, without a run
# Where a run's checkpoints go when neither the recipe nor --checkpoint-dir says: under the
# site's scratch space (FTSLURM_SCRATCH, else the common SCRATCH), never silently under the
# state directory, which is usually a quota'd home directory (`default_checkpoint_dir`).
SCRATCH_ENVS = ("FTSLURM_SCRATCH", "SCRATCH")
SCRATCH_SUBDIR = "ftslurm"  # <scratch>/ftslurm/<run id>/checkpoints
# What the files of a training's state may show to others: `private` (the default: model
# weights and optimizer state are the owner's alone) or `group` (readable by the group,
# for a folder a team shares); folder mode, file mode. The job's batch script creates the
# checkpoint folder with these modes too (`ftslurm.daemon.submission`).
SHARING_MODES = {"private": (0o700, 0o600), "group": (0o750, 0o640)}
RANK_REPORTS = "rank-*.json"  # in an attempt's folder (RunDir.attempt) or stragglers/
NODE_REPORTS = "node-*.json"
HUNG_NODE_REPORTS = "hung-node-*.json"
HANG_CLAIMS = "hang-claim-*.json"  # RunDir.hang_claim
# In an attempt's recovery folder (RunDir.recovery): what the daemon must see at once.
PEER_LOST_REPORTS = "lost-*.json"  # RunDir.peer_lost
ROUND_RECORDS = "round-*.json"  # RunDir.round_record
BENCHED_RECORDS = "benched-*.json"  # RunDir.benched
LAUNCHER_FAILED_REPORTS = "launcher-failed-*.json"  # RunDir.launcher_failed
UNHEALTHY_REPORTS = "unhealthy-*.json"  # RunDir.unhealthy
LIVE_RECORDS = "live-*.json"  # RunDir.live_record
VALIDATION_REPORTS = "validation-rank-*.json"  # in an attempt's folder: RunDir.validation
CHECKPOINT_MANIFEST = re.compile(r"step-(\d+)\.json")  # ftslurm.checkpoint's manifests


@dataclass(frozen=True)
class RunDir:
    """A run's directory and every file the compute side and the daemon share in it."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def progress(self) -> Path:
        """progress.json: the training's step and checkpoints (`ftslurm.agent.progress`)."""
        return self.root / "progress.json"

    @property
    def cadence(self) -> Path:
        """The checkpoint interval the daemon tuned for the run (`ftslurm.core.cadence`,
        JSON of `Cadence`; rewritten when it changes), read by every rank agent."""
        return self.root / "checkpoint-cadence.json"

    @property
    def finished(self) -> Path:
        """The marker the training writes when it is done."""
        return self.root / "FINISHED"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def job_output(self) -> str:
        """sbatch's --output pattern (%j: the job id)."""
        return f"{self.logs}/job-%j.out"

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint directory of a run."""
        return self.root / DEFAULT_CHECKPOINT_DIR

    @property
    def attempts(self) -> Path:
        return self.root / "attempts"

    def attempt(self, attempt: str | int) -> Path:
        """The folder of attempt `attempt`'s reports."""
        return self.attempts / str(attempt)

    def rank_report(self, attempt: str | int, rank: int) -> Path:
        """What the task wrapper of `rank` reports when its command ends (JSON, keys in
        `ftslurm.agent.task`; `error_line`: what failed in one line of its stderr, the
        exception's type and message, which the daemon puts in the attempt's reason)."""
        return self.attempt(attempt) / f"rank-{rank}.json"

    def node_report(self, attempt: str | int, node_rank: int) -> Path:
        """What the launcher of node `node_rank` reports when its ranks end."""
        return self.attempt(attempt) / f"node-{node_rank}.json"

    def stop_record(self, attempt: str | int, rank: int) -> Path:
        """Where `rank` records "saved step S, stopping" before its teardown."""
        return self.attempt(attempt) / f"stopping-rank-{rank}.json"

    def hung_node(self, attempt: str | int, node_rank: int) -> Path:
        """The ranks a launcher found hung when it was told to stop."""
        return self.attempt(attempt) / f"hung-node-{node_rank}.json"

    def hang_claim(self, attempt: str | int, node_rank: int) -> Path:
        """A launcher with spares found a rank of its node hung: what it saw of the rank,
        for the other launchers that judged the same hang to compare before one steps out
        (`ftslurm.agent.spare_rules.hang_culprit`)."""
        return self.attempt(attempt) / f"hang-claim-{node_rank}.json"

    def peer_lease(self, attempt: str | int, node_rank: int) -> Path:
        """The lease of node `node_rank`'s launcher (`ftslurm.agent.peers`): rewritten every
        poll while it runs (JSON: node_rank, node, pid, seq, time, ended), so the other
        launchers can tell a lost node from a live one."""
        return self.attempt(attempt) / f"peer-lease-{node_rank}.json"

    def rendezvous(self, attempt: str | int, restart_count: int) -> Path:
        """Where the launcher of node rank 0 publishes the rendezvous endpoint it bound (a
        free port) for restart `restart_count` of the job (JSON: `rendezvous_record`); the
        other launchers wait for it (`published_rendezvous`). Without the launcher, rank
        0's task wrapper publishes its ranks' MASTER_PORT there the same way."""
        return self.attempt(attempt) / f"rendezvous-{restart_count}.json"

    def recovery(self, attempt: str | int) -> Path:
        """The folder of what a loss inside the attempt's allocation left: the peer-loss
        reports, the in-job rounds after the first, the nodes that stepped out. One folder,
        so the daemon looks at one directory's stat each poll to know whether any is new
        (the leases, rewritten every poll, live outside it)."""
        return self.attempt(attempt) / "recovery"

    def peer_lost(self, attempt: str | int, node_rank: int) -> Path:
        """A launcher's report that node `node_rank` fell silent for `peer_timeout_s`
        (JSON: lost_node_rank, lost_node, last_heard, lease_time, silent_s,
        peer_timeout_s, reported_by, reported_by_node_rank, time, job_id, attempt; the
        first launcher to see it writes it, see `ftslurm.agent.peers`)."""
        return self.recovery(attempt) / f"lost-{node_rank}.json"

    def round_record(self, attempt: str | int, round_: int) -> Path:
        """In-job round `round_` (1, 2, ...: the ranks restarted inside the allocation),
        written by the launcher of global rank 0 when the round's ranks start and again at
        their first step (JSON: round, started_at, first_step_at (null until a rank
        reports a step; stays null for a script without the rank agent), step, world_size,
        nnodes_active, spares_left, why (the launcher's words for the restart), lost
        (node names replaced by a spare in this round), job_id, attempt)."""
        return self.recovery(attempt) / f"round-{round_}.json"

    def live_record(self, attempt: str | int, group: str, round_: int) -> Path:
        """A live recovery (`ftslurm.agent.live`): round `round_` of live group `group`
        (the launchers' rendezvous round it belongs to: a name that sorts by the time the
        round formed; `FTSLURM_LIVE_GROUP`) formed after a fault, the running ranks kept;
        written by the rank that handed the state over (the lowest one when none was
        needed), and again at the first committed step after it (JSON: the
        `LiveRecovery` model)."""
        return self.recovery(attempt) / f"live-{group}-{round_}.json"

    def live_given_up(self, attempt: str | int, group: str, round_: int, rank: int) -> Path:
        """Rank `rank` gave live recovery up in round `round_` of live group `group`: why
        (`given_up`, the fallback; JSON: the `LiveRecovery` model). Today's path follows."""
        return self.recovery(attempt) / f"live-{group}-{round_}-given-up-{rank}.json"

    def live_fallback(self, attempt: str | int, node_rank: int) -> Path:
        """The launcher of node `node_rank` fell back from live recovery to today's path
        (the batch host lost, no spare left, a warm spare that could not take over): why
        (`given_up`, the fallback; `recovery`: "new_job" when the run goes on in a new job;
        JSON: the `LiveRecovery` model). One file per launcher: one writer each."""
        return self.recovery(attempt) / f"live-fallback-node-{node_rank}.json"

    def benched(self, attempt: str | int, node_rank: int) -> Path:
        """A node whose launcher took itself out of the training so that a spare replaces
        it (JSON: node_rank, node, why ("hang", "straggler"), reason (the launcher's words),
        time, job_id, attempt): the daemon flags it for later attempts like a lost node."""
        return self.recovery(attempt) / f"benched-{node_rank}.json"

    def launched(self, attempt: str | int) -> Path:
        """Touched by the batch script just before it starts the job's step (srun), after
        the recipe's setup lines (`launched_line`): from when the daemon first sees it,
        node rank 0's launcher (or task wrapper) has `launcher_start_timeout_s` to write
        its lease, or the attempt ends as one whose launcher never started."""
        return self.attempt(attempt) / "launched"

    def launcher_failed(self, attempt: str | int, node_rank: int) -> Path:
        """A launcher that failed before its ranks started (in its setup or the rendezvous:
        a port it could not bind, a host it could not reach, a rendezvous that timed out):
        JSON: node_rank, node, job_id, attempt, error (the error's last line), phase
        ("setup" or "rendezvous"), exit_code, time. The daemon ends the attempt at once with
        the error in its reason, rather than waiting for the other launchers' timeouts."""
        return self.recovery(attempt) / f"launcher-failed-{node_rank}.json"

    def unhealthy(self, attempt: str | int, node_rank: int) -> Path:
        """A node whose launcher failed its pre-flight health check before the rendezvous
        (`ftslurm.agent.health`; JSON: the `Unhealthy` model: node, node_rank, job_id,
        attempt, check, detail, value, floor, time, benched, injected). The daemon flags
        the node; the attempt goes on with a spare in its place (the node also wrote its
        `benched` record) or ends, and the run goes on in a job without it."""
        return self.recovery(attempt) / f"unhealthy-{node_rank}.json"

    def health_probe(self, attempt: str | int) -> Path:
        """The endpoint (JSON: host, port, job_id, time) where node rank 0's launcher
        answers the other nodes' timed transfers of the health check's network probe."""
        return self.attempt(attempt) / "health-probe.json"

    def health_figure(self, attempt: str | int, node_rank: int) -> Path:
        """The transfer rate node `node_rank` measured to node rank 0 in the health check
        (JSON: node, node_rank, job_id, mb_s, time), compared with the other nodes'."""
        return self.attempt(attempt) / f"health-net-{node_rank}.json"

    @property
    def fired_unhealthy(self) -> Path:
        """The `unhealthy` fault injections the launchers carried out in this run (a JSON
        list of specs): each fires once per run, a requeued job too."""
        return self.attempts / "fired-unhealthy.json"

    def fired(self, rank: int) -> Path:
        """The fault injections rank `rank` carried out in this run."""
        return self.attempts / f"fired-rank-{rank}.json"

    @property
    def result_fault_nodes(self) -> Path:
        """Injected persistent nan/spike spec -> the node whose results it spoiled first
        (every rank there computes wrong for the rest of the run)."""
        return self.attempts / "result-fault-nodes.json"

    def validation(self, attempt: str | int, rank: int) -> Path:
        """Rank `rank`'s result validation in attempt `attempt` (`ftslurm.agent.validation`):
        its counts (checks, re-runs, re-runs that differed) and the suspicious results with
        their verdicts (JSON: the `ValidationReport` model), rewritten at each event."""
        return self.attempt(attempt) / f"validation-rank-{rank}.json"

    @property
    def straggler_nodes(self) -> Path:
        """Injected straggler spec -> the node it slowed (it stays slow for the run)."""
        return self.attempts / "straggler-nodes.json"

    @property
    def stragglers(self) -> Path:
        return self.root / "stragglers"

    def straggler_rank(self, rank: int) -> Path:
        """The last window of step times rank `rank` published."""
        return self.stragglers / f"rank-{rank}.json"

    @property
    def straggler_state(self) -> Path:
        return self.stragglers / "state.json"

    @property
    def straggler_report(self) -> Path:
        """The scores of the latest window; the daemon reads it."""
        return self.stragglers / "report.json"

    @property
    def straggler_lock(self) -> Path:
        return self.stragglers / ".lock"


@dataclass(frozen=True)
class HeartbeatDir:
    """The node-local folder between a launcher and its ranks (`FTSLURM_HEARTBEAT_DIR`)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    PREFIX = "ftslurm-hb-"

    @staticmethod
    def for_launcher(tmp: str | Path, job: str, node_rank: int, pid: int) -> HeartbeatDir:
        return HeartbeatDir(Path(tmp) / f"{HeartbeatDir.PREFIX}{job}-{node_rank}-{pid}")

    @staticmethod
    def launcher_pid(name: str) -> int | None:
        """The pid of the launcher whose folder has this name (`for_launcher`'s, with the
        fresh suffix the launcher adds), or None for any other name."""
        if not name.startswith(HeartbeatDir.PREFIX):
            return None
        parts = name[len(HeartbeatDir.PREFIX) :].rsplit("-", 2)
        return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None

    RECORDS = "rank-*.hb"
    READY = "ready-*"

    def record(self, local_rank: int | str) -> Path:
        """The rank's shared-memory heartbeat record (`ftslurm.agent.heartbeat`)."""
        return self.root / f"rank-{local_rank}.hb"

    def ready(self, local_rank: int | str) -> Path:
        """Touched by the rank's wrapper once its signal handlers are in place."""
        return self.root / f"ready-{local_rank}"

    LIVE = "live-*"

    def live(self, local_rank: int | str) -> Path:
        """Touched by a rank whose process group recovers live (`ftslurm.agent.live`), once
        it is set up (it holds a training state, or received one): its launcher restarts it
        alone when it fails. A rank lost before that has nothing to rejoin."""
        return self.root / f"live-{local_rank}"

    def takeover(self, local_rank: int | str) -> Path:
        """Written by a warm spare's launcher (one writer): the rank local rank `local_rank`
        takes over (`TakeOver`); its rank process and wrapper read it. A warm standby's
        (`waiting`) is its own slot's: the launcher names there the local rank it becomes."""
        return self.root / f"takeover-{local_rank}.json"

    WAITING = "waiting-*"

    def waiting(self, local_rank: int | str) -> Path:
        """Touched by a warm rank (a spare's, or a node's standby: `FTSLURM_LIVE_SPARE`)
        once it waits in `live.init_process_group` for a rank to take over; removed when it
        has one. A standby's slot is a local rank past the node's ranks, never reused."""
        return self.root / f"waiting-{local_rank}"

    @property
    def sections(self) -> Path:
        """Names of the sections numbered from 16."""
        return self.root / "sections.json"

    @property
    def torch_logs(self) -> Path:
        """torch elastic's own logs of the ranks (the launcher's, node-local)."""
        return self.root / "logs"


OBSERVED_DIR = ".ftslurm-observed"  # inside the checkpoint directory


def observed_record(checkpoint_dir: str | Path, rank: int) -> Path:
    """The longest section durations rank `rank` observed, kept next to the checkpoints for
    the next attempt's launcher."""
    return Path(checkpoint_dir) / OBSERVED_DIR / f"rank-{rank}.json"


def node_memory_area(base: Path, run: str, node: str) -> Path:
    """The memory tier's area of `run` on `node`: what a lost node takes with it."""
    return base / run / node


# ----------------------------------------------------------------------------- environment
class EnvName(str, Enum):
    """Every FTSLURM_* environment variable: the job's (`JobEnv`) and the login node's."""

    RUN_ID = "FTSLURM_RUN_ID"
    RUN_DIR = "FTSLURM_RUN_DIR"
    CHECKPOINT_DIR = "FTSLURM_CHECKPOINT_DIR"
    ATTEMPT_BASE = "FTSLURM_ATTEMPT_BASE"  # the attempt the job was submitted as
    ATTEMPT = "FTSLURM_ATTEMPT"  # ATTEMPT_BASE + SLURM_RESTART_COUNT
    CHECKPOINT_SIGNAL = "FTSLURM_CHECKPOINT_SIGNAL"
    STRAGGLER_INTERVAL_S = "FTSLURM_STRAGGLER_INTERVAL_S"
    STRAGGLER_THRESHOLD = "FTSLURM_STRAGGLER_THRESHOLD"
    STRAGGLER_WINDOWS = "FTSLURM_STRAGGLER_WINDOWS"
    STRAGGLER_REFERENCE = "FTSLURM_STRAGGLER_REFERENCE"
    INJECT = "FTSLURM_INJECT"  # in-job fault injections (`ftslurm.core.inject.env_value`)
    IN_JOB_RESTARTS = "FTSLURM_IN_JOB_RESTARTS"
    SECTION_TIMEOUTS = "FTSLURM_SECTION_TIMEOUTS"  # JSON; see ftslurm.agent.launch
    GRACE_S = "FTSLURM_GRACE_S"
    NPROC_PER_NODE = "FTSLURM_NPROC_PER_NODE"
    HEARTBEAT_DIR = "FTSLURM_HEARTBEAT_DIR"  # set by the launcher for its ranks
    # the wall-clock time (seconds since the epoch) the rank's wrapper started, set by it
    # for its command: the rank agent's injected result faults count from it, as the
    # wrapper's own injections (crash, hang) do
    RANK_STARTED = "FTSLURM_RANK_STARTED"
    USER_ERROR_WINDOW_S = "FTSLURM_USER_ERROR_WINDOW_S"
    PEER_TIMEOUT_S = "FTSLURM_PEER_TIMEOUT_S"  # a node silent this long is reported lost
    SPARE_NODES = "FTSLURM_SPARE_NODES"  # nodes of the job kept idle to replace a lost one
    MEMORY_DIR = "FTSLURM_MEMORY_DIR"  # where the memory checkpoint tier keeps node areas
    CHECKPOINT_SHARING = "FTSLURM_CHECKPOINT_SHARING"  # private (0700/0600) or group
    # live recovery (`ftslurm.agent.live`): "1" on a rank its launcher restarted alone, to
    # rejoin the ranks that kept running; and the coordinator store (host:port) where no
    # launcher hosts one (torch's agent store otherwise)
    LIVE_REJOIN = "FTSLURM_LIVE_REJOIN"
    LIVE_STORE = "FTSLURM_LIVE_STORE"
    # the live group of a rendezvous round (its keys' prefix in the coordinator store), set
    # by the launcher for the round's ranks: the same on every node, where torch's restart
    # count is not (a node restarting for a changed membership does not count it)
    LIVE_GROUP = "FTSLURM_LIVE_GROUP"
    # "1": the run recovers live (the `live_recovery` setting): a spare node's launcher keeps
    # its ranks warm, started up to the process group, and a lost or stepped-out node's ranks
    # are taken over by them without stopping the others
    LIVE_RECOVERY = "FTSLURM_LIVE_RECOVERY"
    # "1" on a warm spare's rank (set by its launcher): it waits in `live.init_process_group`
    # until its launcher hands it the ranks of a node to take over (`HeartbeatDir.takeover`)
    LIVE_SPARE = "FTSLURM_LIVE_SPARE"
    # JSON of a `Disambiguation`, set by the daemon on the job it submits after a rank exited
    # 16 (resume elsewhere): this attempt re-runs on other nodes to tell whether the
    # suspicious result was the machine's or the model's (docs/policy.md)
    DISAMBIGUATE = "FTSLURM_DISAMBIGUATE"
    # JSON of a `HealthConfig`: the pre-flight health check each launcher runs before the
    # rendezvous (`ftslurm.agent.health`); absent: the defaults (on)
    HEALTH = "FTSLURM_HEALTH"
    # the node's name, in the environment of the site's health command (`HealthConfig.command`)
    HEALTH_NODE = "FTSLURM_HEALTH_NODE"


class Disambiguation(BaseModel):
    """The context of a disambiguation run (`EnvName.DISAMBIGUATE`): attempt `attempt` of
    the run ended with exit 16 (a rank found a result it could not trust and asked to
    resume on other hardware) on `nodes`, which the daemon flagged; this attempt runs
    elsewhere from the checkpoint at `step` (None: the run reported none). The rank agent
    re-runs the suspicious step and exits 17 when the result reproduces (the model's
    fault, not the machine's), or goes on when it does not."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    attempt: int = Field(ge=0)
    nodes: tuple[str, ...] = ()
    step: int | None = None


# The pre-flight health check's defaults (`FtSettings` and `HealthConfig` take them from
# here). Floors a healthy laptop or CI machine clears with room: they catch a node that is
# broken (a full disk, memory exhausted, a hung or read-only mount, a GPU gone), not a slow one.
DEFAULT_HEALTH_TIMEOUT_S = 5.0  # every check of a node together, at most
DEFAULT_HEALTH_WRITE_MB_S = 1.0  # write + fsync of a small file in the checkpoint directory
DEFAULT_HEALTH_FREE_MEMORY_MB = 256.0
DEFAULT_HEALTH_FREE_DISK_MB = 256.0  # of the checkpoint directory's file system
DEFAULT_HEALTH_GPU_FREE_MB = 256.0  # on each GPU the job asked for
DEFAULT_HEALTH_BANDWIDTH_RATIO = 0.1  # of the median node's transfer rate to node rank 0


class HealthConfig(BaseModel):
    """The pre-flight health check's settings as the job receives them
    (`EnvName.HEALTH`, from the run's `FtSettings`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    enabled: bool = True
    timeout_s: float = Field(DEFAULT_HEALTH_TIMEOUT_S, gt=0)
    min_write_mb_s: float = Field(DEFAULT_HEALTH_WRITE_MB_S, ge=0)
    min_free_memory_mb: float = Field(DEFAULT_HEALTH_FREE_MEMORY_MB, ge=0)
    min_free_disk_mb: float = Field(DEFAULT_HEALTH_FREE_DISK_MB, ge=0)
    min_gpu_free_mb: float = Field(DEFAULT_HEALTH_GPU_FREE_MB, ge=0)
    min_bandwidth_ratio: float = Field(DEFAULT_HEALTH_BANDWIDTH_RATIO, ge=0, le=1)
    # more folders that must be writable, `{node}` replaced by the node's name (node-local
    # scratch or staging)
    dirs: tuple[str, ...] = ()
    command: str | None = None  # the site's own check (a shell command): non-zero fails


def _alias(name: EnvName) -> Any:
    return {"alias": name.value}


# The defaults of the settings that travel to the compute side: `FtSettings` (the run's)
# and `JobEnv` (what the job parses) both take them from here.
DEFAULT_CHECKPOINT_SIGNAL = "USR2"
DEFAULT_GRACE_S = 120.0  # seconds ranks get to checkpoint after SIGTERM
DEFAULT_STRAGGLER_INTERVAL_S = 60.0  # straggler report window
DEFAULT_STRAGGLER_THRESHOLD = 0.75  # a score below it is a straggler
DEFAULT_STRAGGLER_WINDOWS = 3  # windows below the threshold that make a node persistent
DEFAULT_STRAGGLER_REFERENCE: Literal["best", "median"] = "best"
DEFAULT_PEER_TIMEOUT_S = 20.0  # a node's launcher silent this long: the node is lost


class JobEnv(BaseModel):
    """The FTSLURM_* environment of a job, with its defaults. An empty variable counts as
    unset. `render()` gives what the daemon writes into the batch script; `from_environ`
    parses it back (a bad value: one-line ConfigError)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    run_id: str | None = Field(None, **_alias(EnvName.RUN_ID))
    run_dir: str | None = Field(None, **_alias(EnvName.RUN_DIR))
    checkpoint_dir: str | None = Field(None, **_alias(EnvName.CHECKPOINT_DIR))
    attempt_base: int | None = Field(None, ge=0, **_alias(EnvName.ATTEMPT_BASE))
    attempt: int | None = Field(None, ge=0, **_alias(EnvName.ATTEMPT))
    checkpoint_signal: str = Field(DEFAULT_CHECKPOINT_SIGNAL, **_alias(EnvName.CHECKPOINT_SIGNAL))
    straggler_interval_s: float = Field(
        DEFAULT_STRAGGLER_INTERVAL_S, gt=0, **_alias(EnvName.STRAGGLER_INTERVAL_S)
    )
    straggler_threshold: float = Field(
        DEFAULT_STRAGGLER_THRESHOLD, gt=0, le=1, **_alias(EnvName.STRAGGLER_THRESHOLD)
    )
    straggler_windows: int = Field(
        DEFAULT_STRAGGLER_WINDOWS, ge=1, **_alias(EnvName.STRAGGLER_WINDOWS)
    )
    straggler_reference: Literal["best", "median"] = Field(
        DEFAULT_STRAGGLER_REFERENCE, **_alias(EnvName.STRAGGLER_REFERENCE)
    )
    inject: str | None = Field(None, **_alias(EnvName.INJECT))
    in_job_restarts: int = Field(0, ge=0, **_alias(EnvName.IN_JOB_RESTARTS))
    section_timeouts: dict[str, Any] | None = Field(None, **_alias(EnvName.SECTION_TIMEOUTS))
    grace_s: float = Field(DEFAULT_GRACE_S, gt=0, **_alias(EnvName.GRACE_S))
    nproc_per_node: int = Field(1, ge=1, **_alias(EnvName.NPROC_PER_NODE))
    heartbeat_dir: str | None = Field(None, **_alias(EnvName.HEARTBEAT_DIR))
    user_error_window_s: float = Field(60.0, ge=0, **_alias(EnvName.USER_ERROR_WINDOW_S))
    peer_timeout_s: float = Field(DEFAULT_PEER_TIMEOUT_S, gt=0, **_alias(EnvName.PEER_TIMEOUT_S))
    spare_nodes: int = Field(0, ge=0, **_alias(EnvName.SPARE_NODES))
    live_recovery: bool = Field(False, **_alias(EnvName.LIVE_RECOVERY))
    memory_dir: str | None = Field(None, **_alias(EnvName.MEMORY_DIR))
    checkpoint_sharing: Literal["private", "group"] = Field(
        "private", **_alias(EnvName.CHECKPOINT_SHARING)
    )
    disambiguate: Disambiguation | None = Field(None, **_alias(EnvName.DISAMBIGUATE))
    health: HealthConfig = Field(default_factory=HealthConfig, **_alias(EnvName.HEALTH))

    @field_validator("checkpoint_signal")
    @classmethod
    def _signal(cls, value: str) -> str:
        return checked_signal_name(value)

    @field_validator("section_timeouts", "disambiguate", "health", mode="before")
    @classmethod
    def _timeouts(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("not JSON") from None
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        return value

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobEnv:
        """Parse the FTSLURM_* variables of `environ` (others are ignored)."""
        names = {n.value for n in EnvName}
        present = {k: v for k, v in environ.items() if k in names and v != ""}
        try:
            return cls.model_validate(present)
        except ValidationError as exc:
            error = exc.errors()[0]
            key = str(error["loc"][0]) if error.get("loc") else "?"
            raise ConfigError(
                f"{key}={present.get(key, '')!r}: {error['msg'].removeprefix('Value error, ')}"
            ) from None

    def render(self) -> dict[str, str]:
        """The variables as the job's environment has them: the fields given (defaults of
        fields left out are not rendered, they apply where the job parses them)."""
        out = {}
        for name, value in self.model_dump(by_alias=True, exclude_unset=True).items():
            if value is None:
                continue
            if isinstance(value, dict):
                out[name] = json.dumps(value, sort_keys=True)
            else:
                out[name] = str(value)
        return out

    def current_attempt(self, restart_count: int) -> int:
        """The attempt this process belongs to: the base plus Slurm's restart count when the
        daemon gave a base (a requeued job runs the same script again), else FTSLURM_ATTEMPT."""
        if self.attempt_base is not None:
            return self.attempt_base + restart_count
        return self.attempt or 0

    @property
    def checkpoint_signal_number(self) -> signal.Signals:
        return parse_signal(self.checkpoint_signal)

    @property
    def checkpoint_folder(self) -> str:
        """Where checkpoints go: FTSLURM_CHECKPOINT_DIR, else ./checkpoints."""
        return self.checkpoint_dir or DEFAULT_CHECKPOINT_DIR

    @property
    def run(self) -> RunDir | None:
        return RunDir(self.run_dir) if self.run_dir else None


def attempt_setup_line() -> str:
    """The batch script's shell line that sets FTSLURM_ATTEMPT (see `current_attempt`)."""
    return (
        f"export {EnvName.ATTEMPT.value}="
        f"$(({EnvName.ATTEMPT_BASE.value} + ${{SLURM_RESTART_COUNT:-0}}))"
    )


def launched_line() -> str:
    """The batch script's line, after the setup lines and just before the step, that marks
    the step's start for the daemon (`RunDir.launched`); never fatal."""
    rd, attempt = RunDir(f"${EnvName.RUN_DIR.value}"), f"${EnvName.ATTEMPT.value}"
    folder, mark = rd.attempt(attempt), rd.launched(attempt)
    return f'{{ mkdir -p "{folder}" && : > "{mark}"; }} 2>/dev/null || true'


def default_checkpoint_dir(run_dir: Path, environ: Mapping[str, str]) -> tuple[Path, str]:
    """Where a run's checkpoints go by default, and why: `<scratch>/ftslurm/<run id>/
    checkpoints` when the site names a scratch space (`SCRATCH_ENVS`, the first set), else
    the run directory's `checkpoints` (the state directory's filesystem)."""
    for name in SCRATCH_ENVS:
        base = environ.get(name, "").strip()
        if base:
            return Path(base) / SCRATCH_SUBDIR / run_dir.name / DEFAULT_CHECKPOINT_DIR, f"${name}"
    return RunDir(run_dir).checkpoints, "the state directory"
