"""Live recovery on the rank side: the ranks that are still healthy keep their processes.

    from ftslurm.agent import live
    group = live.init_process_group("gloo")          # in place of dist.init_process_group
    ... build the model and optimizer, load a checkpoint ...
    group.attach(state=lambda: training_state(model, optim, step), load=load, step=lambda: step)
    while step < steps:
        if not group.commit(forward_backward_and_all_reduce):
            continue                                 # a fault: the step runs again
        optim.step(); step += 1

How it works (the decisions are `ftslurm.agent.live_rules`, pure):

- A coordinator store outlives the ranks: torch's agent store, which the launcher of node
  rank 0 hosts (`TORCHELASTIC_USE_AGENT_STORE`), or `FTSLURM_LIVE_STORE=host:port`. Without
  one, live recovery is off and everything is plain torch.distributed: a fault ends the
  process as before.
- The process group of round r is formed over the store prefix of round r: every rank
  publishes the step it holds and waits for the whole world.
- `commit(fn)` runs the forward, backward and gradient reduction, then votes: one `add` on
  the store. The rank that brings the count to the world size writes "commit"; a rank whose
  collective raised writes "abort" and declares the round failed. The first writer wins
  (compare-and-set) and every rank follows what was written, so no rank applies a step
  another rank did not.
- After an abort the survivors abort their process group (gloo: its sockets; a peer that
  died closed them, so the error came at once), form round r+1, run the `on_regroup` hooks
  (a memory tier re-creates its group), and the member holding the newest step broadcasts
  its state to those holding an older one or none. The failed step runs again.
- A crashed rank is restarted alone by its launcher with `FTSLURM_LIVE_REJOIN=1`: it finds
  its former process's record in the current round, declares that round failed (which ends
  a survivor's wait for its vote at once), joins the next one and receives the state.
- Given up (`LiveRecoveryFailed`, the reason in `reason`) when a rank does not join in time,
  faults keep coming during the recovery, or the replica handing the state over does not
  answer within `handover_timeout_s` (`HANDOVER_TIMEOUT_S`): the process then ends non-zero
  and the launcher takes today's path (an in-job restart of every rank from the memory
  tier or disk).

Random number generators: a rank that receives the state gets the sender's RNG state; the
survivors keep their own.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftslurm.agent import live_rules as rules
from ftslurm.agent import rank as rank_agent
from ftslurm.core.contract import EnvName, ExitCode, HeartbeatDir, JobEnv
from ftslurm.core.contract.reports import LiveRecovery, TakeOver
from ftslurm.core.settings import RECOVERY_SECTION
from ftslurm.runfiles import read_report, write_report

COLLECTIVE_TIMEOUT_S = 60.0  # a live group's collectives (gloo waits this long on a silent peer)
JOIN_TIMEOUT_S = 120.0  # how long a new round waits for every rank (a restarted one imports torch)
MAX_ROUNDS = 3  # rounds failed one after the other before live recovery is given up
DECISION_POLL_S = 0.05  # how often a rank waiting for the votes looks for a failed round
TAKEOVER_POLL_S = 0.02  # how often a warm spare's rank looks whether it takes a node over
WATCH_POLL_S = 0.2  # how often a rank inside a step looks whether its round failed
STUCK_S = 2.0  # inside a step this long after a running rank declared the round failed
# How long each piece of a handover (the state's size, then each chunk of it) may wait for
# the replica at its other end; the first piece also waits for the sender to serialize its
# state. A replica that does not answer in time makes every member give live recovery up
# (`Fallback.NO_ANSWER`): today's path, rather than gloo's whole collective timeout.
HANDOVER_TIMEOUT_S = 20.0
HANDOVER_CHUNK_BYTES = 64 << 20  # the state is sent in chunks of this many bytes
log = logging.getLogger("ftslurm.live")
# Test hook: a rank stops itself (SIGSTOP) at one point of one step, "<point>:<rank>:<step>"
# (points: "reduced", after the step's work and before its vote; "committed", after the
# decision to commit and before the optimizer step; "sending", the rank that hands its state
# over, before it sends; "transfer", that rank after the state's size went out and before
# its bytes; "forming", every rank in a round before it connects to the others),
# so a test can kill it at that moment.
PAUSE_ENV = "FTSLURM_TEST_PAUSE_LIVE"


class LiveRecoveryFailed(RuntimeError):
    def __init__(self, reason: rules.Fallback, detail: str = "") -> None:
        super().__init__(
            f"live recovery given up: {reason.value}{f' ({detail})' if detail else ''}"
        )
        self.reason = reason


def is_fault(exc: BaseException) -> bool:
    """A collective that failed because a peer did (not a bug of the training code)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("gloo" in text or "nccl" in text)


def coordinator(environ: Mapping[str, str], timeout_s: float) -> Any | None:
    """A client of the coordinator store, or None where there is none."""
    spec = environ.get(EnvName.LIVE_STORE.value)
    if spec:
        host, _, port = spec.rpartition(":")
    elif environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and environ.get("MASTER_PORT"):
        host, port = environ.get("MASTER_ADDR", "127.0.0.1"), environ["MASTER_PORT"]
    else:
        return None
    return dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class RoundStore(dist.Store):
    """The store a round's process group forms over: its keys, whose waits end as soon as
    the round is declared failed. A rank lost while the others connect (a second fault
    during a recovery) then costs the time until its restarted process or a peer declares
    the round failed, not the backend's whole timeout: gloo waits for each peer's address
    in the store, a wait that nothing else can interrupt."""

    def __init__(
        self, keys: Any, coordinator: Any, failed_key: str, timeout: datetime.timedelta
    ) -> None:
        super().__init__()
        self.keys, self.coordinator, self.failed_key = keys, coordinator, failed_key
        self.set_timeout(timeout)

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        started = time.monotonic()
        while not self.keys.check(keys):
            if self.coordinator.check([self.failed_key]):
                raise dist.DistStoreError("the round failed while forming")
            if time.monotonic() - started > limit:
                raise dist.DistStoreError(f"waited {limit:.0f}s for {keys} while forming")
            time.sleep(DECISION_POLL_S / 5)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self.keys.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def set(self, key: str, value: Any) -> None:
        self.keys.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self.keys.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.keys.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.keys.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.keys.delete_key(key)

    def num_keys(self) -> int:
        return self.keys.num_keys()


class LiveGroup:
    def __init__(
        self,
        backend: str = "gloo",
        *,
        environ: Mapping[str, str] | None = None,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        max_rounds: int = MAX_ROUNDS,
        handover_timeout_s: float = HANDOVER_TIMEOUT_S,
        init_method: str | None = None,
        live: bool = True,
    ) -> None:
        env = dict(os.environ if environ is None else environ)
        self.environ = env
        self.backend = backend
        self.init_method = init_method  # a plain group's (without a coordinator store)
        self.rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
        self.world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
        self.timeout = datetime.timedelta(seconds=collective_timeout_s)
        self.join_timeout_s = join_timeout_s
        self.max_rounds = max_rounds
        self.handover_timeout_s = handover_timeout_s
        self.store = coordinator(env, collective_timeout_s) if live else None
        run = env.get("TORCHELASTIC_RUN_ID", "ftslurm")
        group = env.get(EnvName.LIVE_GROUP.value) or rules.group_prefix(
            run, env.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        self.keys = rules.Keys(group)
        self.rejoining = live and env.get(EnvName.LIVE_REJOIN.value) == "1"
        self.spare = live and env.get(EnvName.LIVE_SPARE.value) == "1"  # a warm spare's rank
        self.took_over: int | None = None  # the node rank whose rank this warm one took
        self.standby = False  # this warm one is its node's standby: it took a crashed rank
        self.round = 0
        self.seq = 0  # commits of this round
        self.failed_in_a_row = 0
        self._state: Callable[[], Any] | None = None
        self._load: Callable[[Any], None] | None = None
        self._step: Callable[[], int] = lambda: -1
        self._hooks: list[Callable[[], None]] = []
        self._parts = 1  # the state's parts (`attach`): 1, every rank holds it whole
        self._senders: list[int] = []  # of the last handover, one per part sent
        self._busy: tuple[int, float] | None = None  # (round, since): inside a step
        self._pending_record: tuple[Path, LiveRecovery] | None = None
        self._marker: Path | None = None  # HeartbeatDir.live: the launcher's sign
        self._setup = False  # between `start` and the end of `attach`
        self._holds = True  # a training state to hand over (a rejoining rank: once received)
        self.recoveries: list[dict[str, Any]] = []  # what each live recovery took
        self._store_of_round: RoundStore | None = None
        self._round_listeners: tuple[int, set[int]] = (-1, set())  # (round, local ports)
        self._voting: tuple[int, int] = (0, 0)  # (round, seq) of the step begun last

    @property
    def enabled(self) -> bool:
        return self.store is not None

    # ------------------------------------------------------------------ forming
    def start(self) -> None:
        if not self.enabled:
            dist.init_process_group(
                self.backend,
                init_method=self.init_method,
                rank=self.rank,
                world_size=self.world,
                timeout=self.timeout,
            )
            return
        hb = self.environ.get(EnvName.HEARTBEAT_DIR.value)
        if self.spare:  # warm: started up to here, waiting for a rank to take over
            self._take_over(HeartbeatDir(hb) if hb else None)
        local_rank = self.environ.get("LOCAL_RANK", "0")  # a standby's: the one it took
        if hb:  # tells the launcher, once set up: restart this rank alone when it fails
            self._marker = HeartbeatDir(hb).live(local_rank)
        r = int(self.store.add(self.keys.round(), 0))
        if self.rejoining:
            was = self.store.check([self.keys.member(r, self.rank)])
            failed = self.store.check([self.keys.failed(r)])
            r, declare = rules.rejoin_round(r, was_member=was, failed=failed)
            if declare:
                self._declare_failed(r - 1, f"{rules.BY_RESTART}rank {self.rank} restarted")
        if self.took_over is not None:  # for the recovery's record
            self.store.set(self.keys.took_over(r), str(self.took_over))
        if self.standby:
            self.store.set(self.keys.standby(r), str(self.rank))
        self._form(r, None)
        # Setting up (until `attach`): a fault now is not recovered live (the ranks hold no
        # training state yet, and their setup's collectives are not steps).
        self._setup = True
        self._busy = (self.round, time.monotonic())
        threading.Thread(target=self._watch, name="ftslurm-live-watch", daemon=True).start()

    def _take_over(self, hb: HeartbeatDir | None) -> None:
        """Wait until this warm process's launcher hands it a rank (`TakeOver`), then become
        that rank: a rejoining one, which receives the state from the running ranks. A
        spare node's rank takes over a lost node's rank; a node's standby takes a crashed
        rank's place on its own node, its local rank too (its heartbeat record, its live
        mark, its device: whatever the script reads from `LOCAL_RANK` after this)."""
        if hb is None:
            raise self._give_up(rules.Fallback.NO_STATE, "a warm spare without its launcher")
        slot = self.environ.get("LOCAL_RANK", "0")
        self._pause_at(f"standby:{slot}")  # tests: a warm process still starting
        waiting = hb.waiting(slot)
        waiting.touch()  # the launcher may hand it a rank now
        log.info("rank process %d waits warm to take a rank over", os.getpid())
        while (told := read_report(hb.takeover(slot), TakeOver)) is None or told.rank is None:
            time.sleep(TAKEOVER_POLL_S)
        waiting.unlink(missing_ok=True)
        assert told.world_size is not None and told.group is not None
        self.rank, self.world = told.rank, told.world_size
        self.keys = rules.Keys(told.group)
        self.rejoining = True
        became = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world)}
        if told.local_rank is not None:  # this node's standby, in a crashed rank's place
            self.standby = True
            became["LOCAL_RANK"] = str(told.local_rank)
        else:
            self.took_over = told.node_rank
        # What the rest of the process reads (the rank agent, the memory tier, ...).
        os.environ.update(became)
        self.environ.update(became)
        if self.standby:
            log.warning(
                "rank %d of %d: a warm standby, in local rank %s's place",
                self.rank,
                self.world,
                told.local_rank,
            )
        else:
            log.warning(
                "rank %d of %d: took over from node rank %s", self.rank, self.world, told.node_rank
            )

    def _form(self, r: int, step: int | None) -> None:
        """Form round `r` (or a later one when `r` fails while forming)."""
        while True:
            if r:
                self.store.compare_set(self.keys.round(), str(r - 1), str(r))
            self.store.set(self.keys.member(r, self.rank), "" if step is None else str(step))
            self.store.add(self.keys.joined(r), 1)
            started = time.monotonic()
            while True:
                state = rules.join_state(
                    int(self.store.add(self.keys.joined(r), 0)),
                    self.world,
                    failed=self.store.check([self.keys.failed(r)]),
                    waited_s=time.monotonic() - started,
                    timeout_s=self.join_timeout_s,
                )
                if state is not rules.Join.WAIT:
                    break
                time.sleep(DECISION_POLL_S / 5)
            if state is rules.Join.TIMED_OUT:
                raise self._give_up(rules.Fallback.JOIN_TIMEOUT, f"round {r}")
            if state is rules.Join.READY:
                self._pause("forming")
                before = _socket_fds()
                try:
                    dist.init_process_group(
                        self.backend,
                        store=self._round_store(r),
                        rank=self.rank,
                        world_size=self.world,
                        timeout=self.timeout,
                    )
                    self.round, self.seq = r, 0
                    # Where this round's group accepts connections: how a rank stuck in
                    # one of its collectives finds the group's connections (`_watch`).
                    own = _listeners(_socket_fds() - before)
                    self._round_listeners = (r, {port for _, port in own})
                    self.store.set(self.keys.listener(r, self.rank), _addresses(own))
                    return
                except Exception as exc:  # a fault while forming: the next round
                    if not is_fault(exc):
                        raise
                    self._declare_failed(r, f"forming: {exc}")
                    _drop_group()
            r = self._next_round(r)

    def _round_store(self, r: int) -> RoundStore:
        """Round r's store, kept while its group lives: the group calls the Python object
        behind it, which must outlive the call that created it."""
        self._store_of_round = RoundStore(
            dist.PrefixStore(self.keys.group(r), self.store),
            self.store,
            self.keys.failed(r),
            self.timeout,
        )
        return self._store_of_round

    def _pause(self, point: str) -> None:
        self._pause_at(f"{point}:{self.rank}:{self._step()}")

    def _pause_at(self, key: str) -> None:
        """Tests: stop here when `PAUSE_ENV` (a comma-separated list) names `key`."""
        if key in self.environ.get(PAUSE_ENV, "").split(","):
            os.kill(os.getpid(), signal.SIGSTOP)

    def _next_round(self, r: int) -> int:
        self.failed_in_a_row += 1
        why = rules.fallback(self.failed_in_a_row, self.max_rounds)
        if why is not None:
            raise self._give_up(why, f"{self.failed_in_a_row} rounds up to round {r}")
        return r + 1

    def _give_up(self, why: rules.Fallback, detail: str) -> LiveRecoveryFailed:
        """Live recovery ends here: without its mark the launcher no longer restarts this
        rank alone, and takes today's path when it exits."""
        if self._marker is not None:
            self._marker.unlink(missing_ok=True)
        job, group = self._job()
        if job.run is not None:  # why, for `status` (one file per rank: one writer each)
            path = job.run.live_given_up(job.attempt or 0, group, self.round, self.rank)
            record = LiveRecovery(
                round=self.round,
                why=detail or None,
                given_up=why.value,
                rank=self.rank,
                failed_at=time.time(),
                world_size=self.world,
                job_id=self.environ.get("SLURM_JOB_ID"),
                attempt=job.attempt,
            )
            try:
                write_report(path, record)
            except OSError as exc:
                log.warning("could not record the fallback in %s: %s", path, exc)
        return LiveRecoveryFailed(why, detail)

    def _job(self) -> tuple[JobEnv, str]:
        """The job's environment, and the name of this live group in the run directory's
        records (the in-job restart its keys belong to; a warm spare's, the group it took
        a rank in)."""
        return JobEnv.from_environ(self.environ), self.keys.prefix.rsplit("/", 1)[-1]

    def _declare_failed(self, r: int, why: str) -> None:
        self.store.compare_set(self.keys.failed(r), "", why)

    # ------------------------------------------------------------------ state
    def attach(
        self,
        *,
        state: Callable[[], Any],
        load: Callable[[Any], None],
        step: Callable[[], int],
        on_regroup: Iterable[Callable[[], None]] = (),
        replicated: bool = True,
        shards: int | None = None,
    ) -> None:
        """What a recovery hands over (`state()`, applied with `load(state)` on a rank that
        lacks it) and the step it holds. A collective: every rank calls it once, after
        building its model (a restarted rank receives the state here). `replicated=False`
        for a state each rank holds a different part of (FSDP, ZeRO) without a replica: a
        rank that lost its part cannot receive it from a peer, so that recovery is given
        up (`SHARDED`) and the launcher restores every rank from the memory tier's peer
        replica or the disk. `shards=S` for a state sharded over each S consecutive ranks
        and replicated across the world / S groups (HSDP: rank r holds part r % S): a rank
        that lost its part receives it from the rank of another replica holding the same
        part (`state()` there is its part)."""
        parts = shards if shards is not None else (1 if replicated else self.world)
        if parts < 1 or self.world % parts:
            raise ValueError(f"shards={shards}: must divide the world size {self.world}")
        self._state, self._load, self._step = state, load, step
        self._parts = parts
        self._hooks = list(on_regroup)
        has_replica = parts == 1 or parts < self.world
        if self.enabled and has_replica and self.rank == 0:
            # The daemon spaces disk checkpoints for the failures live recovery cannot
            # serve. A sharded state it cannot serve at all (every fault restores every
            # rank): the cadence stays today's.
            from ftslurm.agent import progress

            progress.live_recovery(self.environ)
        if self.enabled:
            # Set up: a fault from now on is recovered live (a sender lost mid-transfer too).
            self._setup, self._busy = False, None
            self._holds = not self.rejoining  # a state of its own (until one is received)
            try:
                plan = self._handover()
            except Exception as exc:  # the sender lost mid-transfer: the next round
                if not is_fault(exc):
                    raise
                plan = self._recover(f"handing the state over: {_first_line(exc)}")
            if self.rejoining and plan is None:  # nobody running holds a state to hand over
                raise self._give_up(rules.Fallback.NO_STATE, f"round {self.round}")
            self._setup, self._busy = False, None
            # Only now (it holds a state, or received one) may the launcher restart this
            # rank alone: a rank lost in its set-up has nothing to rejoin, and restarting it
            # alone made the others give up one round after another (NO_STATE).
            if self._marker is not None:
                self._marker.touch()

    def _watch(self) -> None:
        """Stuck in a step of a round that was declared failed (`rules.stuck`): end the
        round's connections, so that the step's collective raises and this rank recovers
        with its state; where they are unknown and a running rank declared the round failed,
        exit REJOIN, and the launcher restarts this rank alone."""
        client = coordinator(self.environ, self.timeout.total_seconds())
        seen: dict[int, float] = {}  # round -> when its failure was first seen here
        interrupted: set[int] = set()
        while client is not None:
            time.sleep(WATCH_POLL_S)
            busy = self._busy
            if busy is None:
                continue
            r, _ = busy
            try:
                key = self.keys.failed(r)
                declared = client.get(key).decode() if client.check([key]) else None
            except Exception:  # noqa: BLE001 - the coordinator is gone: nothing to decide
                return
            if declared is None:
                continue
            if self._setup:  # a fault while setting up: today's path, every rank again
                log.warning(
                    "rank %d: round %d failed while setting up (%s): live recovery given up",
                    self.rank,
                    r,
                    declared,
                )
                self._give_up(rules.Fallback.IN_SETUP, declared)
                os._exit(ExitCode.FAILED)
            first = seen.setdefault(r, time.monotonic())
            listening_round, own = self._round_listeners
            can_interrupt = listening_round == r and bool(own) and r not in interrupted
            what = rules.stuck(declared, time.monotonic() - first, STUCK_S, can_interrupt)
            if self._busy != busy or what is rules.Stuck.WAIT:
                continue
            if what is rules.Stuck.INTERRUPT:
                interrupted.add(r)
                log.warning(
                    "rank %d: stuck in a step of round %d, which failed (%s): ending the "
                    "round's %d connections",
                    self.rank,
                    r,
                    declared,
                    _shut_down(self._round_sockets(client, r, own)),
                )
            else:
                log.warning(
                    "rank %d: stuck in a step of round %d, which failed (%s): leaving to be "
                    "restarted alone",
                    self.rank,
                    r,
                    declared,
                )
                os._exit(ExitCode.REJOIN)

    def _round_sockets(self, client: Any, r: int, own: set[int]) -> set[int]:
        """This process's connections of round r's group (not its listener: gloo cannot
        survive a listener shut down; not the coordinator's, nor the user's own)."""
        try:
            published = client.multi_get([self.keys.listener(r, q) for q in range(self.world)])
        except Exception:  # noqa: BLE001 - a rank that never formed the round: its own alone
            published = []
        listeners = [a for v in published for a in _parse_addresses(v)]
        found = set()
        for fd, local, peer in _connections():
            if rules.round_connection(local, peer, listeners, own):
                found.add(fd)
        return found

    def _handover(self) -> rules.Handover | None:
        members = {
            r: rules.member_step(v)
            for r, v in enumerate(
                self.store.multi_get([self.keys.member(self.round, r) for r in range(self.world)])
            )
        }
        plans, stranded = rules.shard_handovers(members, self._parts)
        why = rules.handover_fallback(stranded)
        if why is not None:
            raise self._give_up(why, f"ranks {sorted(stranded)} in round {self.round}")
        if not plans:
            return None
        for plan in plans:  # one per part some rank lacks; every rank takes part in each
            state = self._state() if self.rank == plan.sender else None
            if self.rank == plan.sender:
                self._pause("sending")
            received = self._transfer(state, plan.sender)
            if self.rank in plan.receivers:
                self._load(received)
                self._holds = True
            log.info(
                "round %d: state of step %d from rank %d to %s",
                self.round,
                plan.step,
                plan.sender,
                sorted(plan.receivers),
            )
        # the recovery's record: the first sender (who writes it), every receiver
        self._senders = [p.sender for p in plans]
        receivers = frozenset().union(*(p.receivers for p in plans))
        return rules.Handover(plans[0].sender, plans[0].step, receivers)

    def _transfer(self, state: Any, src: int) -> Any:
        """Broadcast `state` from rank `src` (pickled, as `broadcast_object_list` does):
        its size, then its bytes in chunks, each piece under the handover timeout. A piece
        that waited it out (`rules.handover_timed_out`): the replica at its other end did
        not answer; the round is declared failed and live recovery given up (the next round
        would wait for that replica too)."""
        timeout = datetime.timedelta(seconds=self.handover_timeout_s)
        sending = self.rank == src
        payload = pickle.dumps(state) if sending else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        started = time.monotonic()
        try:
            _broadcast(size, src, timeout)
            if sending:
                self._pause("transfer")
            data = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if sending
                else torch.empty(int(size.item()), dtype=torch.uint8)
            )
            for at in range(0, data.numel(), HANDOVER_CHUNK_BYTES):
                started = time.monotonic()
                _broadcast(data[at : at + HANDOVER_CHUNK_BYTES], src, timeout)
        except Exception as exc:
            waited = time.monotonic() - started
            why = rules.handover_timed_out(waited, self.handover_timeout_s)
            if why is None or not is_fault(exc):
                raise
            detail = (
                f"rank {src} sending the state of round {self.round}, no answer in "
                f"{waited:.1f}s (handover timeout {self.handover_timeout_s:.0f}s)"
            )
            log.warning("rank %d: %s: %s", self.rank, why.value, detail)
            self._declare_failed(self.round, f"{rules.BY_ERROR}rank {self.rank}: {why.value}")
            raise self._give_up(why, detail) from None
        return state if sending else pickle.loads(data.numpy().tobytes())

    # ------------------------------------------------------------------ stepping
    def commit(self, fn: Callable[[], Any]) -> bool:
        """Run `fn` (forward, backward, gradient reduction; not the optimizer step) and
        decide with every rank whether the step commits. True: apply it. False: a fault;
        the group was formed again and the state handed over: run the step again."""
        if not self.enabled:
            fn()
            return True
        self.begin_step()
        error: str | None = None  # not the exception: its frames would keep the group alive
        try:
            fn()
        except Exception as exc:
            if not is_fault(exc):
                self.cancel_step()
                raise
            error = _first_line(exc)
        return self.end_step(error)

    def begin_step(self) -> None:
        """`commit` in two halves, for a loop that runs the step's work itself (the rank
        agent's `Training`): the step's work begins (inside a step: the watch may end its
        connections). Then `end_step`."""
        self._voting = (self.round, self.seq)
        self._busy = (self.round, time.monotonic())

    def cancel_step(self) -> None:
        """The step's work raised what is not a fault (`fault_text`): no vote, the
        exception propagates."""
        self._busy = None

    def end_step(self, error: str | None) -> bool:
        """The step's work ended, with `error` (`fault_text`) when a collective of it failed
        because a peer did: the vote, as `commit`'s. True: apply the step; False: run it
        again (the group was formed again)."""
        self._busy = None
        if not self.enabled:
            return error is None
        r, seq = self._voting
        if error is None:
            self._pause("reduced")
        if error is None and self.store.add(self.keys.vote(r, seq), 1) >= self.world:
            self.store.compare_set(self.keys.decision(r, seq), "", rules.Decision.COMMIT.value)
        elif error is not None:
            self._declare_failed(r, f"{rules.BY_ERROR}rank {self.rank}: {error}")
            self.store.compare_set(self.keys.decision(r, seq), "", rules.Decision.ABORT.value)
        if self._decision(r, seq) is rules.Decision.COMMIT:
            self._pause("committed")
            self.seq += 1
            self.failed_in_a_row = 0
            if self._pending_record is not None:
                path, record = self._pending_record
                self._pending_record = None
                write_report(path, record.committed(time.time()))
            if self.rank == 0 and seq:  # every rank read the last step's decision before it
                for key in (self.keys.vote(r, seq - 1), self.keys.decision(r, seq - 1)):
                    self.store.delete_key(key)  # voted on this one: the store stays small
            return True
        self._recover(error or "a peer failed")
        return False

    def _decision(self, r: int, seq: int) -> rules.Decision:
        key = self.keys.decision(r, seq)
        started = time.monotonic()
        poll = datetime.timedelta(seconds=DECISION_POLL_S)
        if (decided := self._decided(key, poll)) is not None:
            return decided
        with _recovery_section():  # waiting for a peer's vote: not a hang of this rank
            while True:
                decision = rules.commit_decision(
                    int(self.store.add(self.keys.vote(r, seq), 0)),
                    self.world,
                    failed=self.store.check([self.keys.failed(r)]),
                    waited_s=time.monotonic() - started,
                    timeout_s=self.timeout.total_seconds(),
                )
                if decision is not rules.Decision.WAIT:
                    self.store.compare_set(key, "", decision.value)
                if (decided := self._decided(key, poll)) is not None:
                    return decided

    def _decided(self, key: str, poll: datetime.timedelta) -> rules.Decision | None:
        """The step's decision, once written within `poll`; None until then."""
        try:
            self.store.wait([key], poll)
        except dist.DistStoreError:
            return None  # not decided yet
        return rules.Decision(self.store.get(key).decode())

    def _recover(self, why: str) -> rules.Handover | None:
        with _recovery_section():
            return self._recover_in_section(why)

    def _recover_in_section(self, why: str) -> rules.Handover | None:
        started, failed_at = time.monotonic(), time.time()
        failed_round = self.round
        self._declare_failed(failed_round, why)
        _drop_group()
        r = self._next_round(failed_round)
        while True:
            try:
                self._form(r, self._step() if self._holds else None)
                for hook in self._hooks:
                    hook()
                plan = self._handover()
                break
            except LiveRecoveryFailed:
                raise
            except Exception as exc:
                if not is_fault(exc):
                    raise
                self._declare_failed(self.round, f"recovering: {exc}")
                _drop_group()
                r = self._next_round(self.round)
        took = time.monotonic() - started
        self.recoveries.append(
            {"failed_round": failed_round, "round": self.round, "why": why, "seconds": took}
        )
        log.warning("live recovery: round %d after %s in %.2fs", self.round, why, took)
        if self.rank == (plan.sender if plan is not None else 0):
            self._record(failed_round, failed_at, plan)
        return plan

    def _record(self, failed_round: int, failed_at: float, plan: rules.Handover | None) -> None:
        """The recovery's record in the run directory (one rank writes it), completed at
        the first step committed after it."""
        job, group = self._job()
        if job.run is None:
            return
        declared = self.store.get(self.keys.failed(failed_round)).decode()
        took = self.keys.took_over(self.round)
        took_over = int(self.store.get(took)) if self.store.check([took]) else None
        warm = self.keys.standby(self.round)
        standby = int(self.store.get(warm)) if self.store.check([warm]) else None
        by, _, why = declared.partition("|")
        record = LiveRecovery(
            round=self.round,
            failed_round=failed_round,
            why=why or declared,
            detected_by=by if why else None,
            failed_at=failed_at,
            formed_at=time.time(),
            step=self._step(),
            state_from=plan.sender if plan is not None else None,
            senders=self._senders if plan is not None and len(self._senders) > 1 else [],
            receivers=sorted(plan.receivers) if plan is not None else [],
            world_size=self.world,
            took_over=took_over,
            standby=standby,
            job_id=self.environ.get("SLURM_JOB_ID"),
            attempt=job.attempt,
        )
        path = job.run.live_record(job.attempt or 0, group, self.round)
        write_report(path, record)
        self._pending_record = (path, record)


def _broadcast(tensor: torch.Tensor, src: int, timeout: datetime.timedelta) -> None:
    """`dist.broadcast` on the default group, with its own `timeout` (the group's own is
    the collective timeout)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = src, 0, timeout
    dist.distributed_c10d._get_default_group().broadcast([tensor], opts).wait()


def _recovery_section() -> contextlib.AbstractContextManager[None]:
    """The rank agent's recovery section (its own, loose limit in the launcher's hang
    detection: no step advances while the group re-forms), where the script has an agent."""
    agent = rank_agent.current()
    return agent.section(RECOVERY_SECTION) if agent is not None else contextlib.nullcontext()


def _socket_fds() -> set[int]:
    """This process's open sockets (Linux; elsewhere none are known)."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except (OSError, ValueError):
            pass
    return found


def _inspect(fd: int) -> tuple[bool, tuple[str, int], tuple[str, int] | None] | None:
    """A TCP socket's (listening, local address, peer address or None), or None for any
    other file."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.type != socket.SOCK_STREAM:
            return None
        listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        local = sock.getsockname()[:2]
        try:
            peer = sock.getpeername()[:2]
        except OSError:
            peer = None
        return listening, local, peer
    except OSError:
        return None
    finally:
        sock.detach()


def _listeners(fds: set[int]) -> list[tuple[str, int]]:
    """The listening TCP sockets among `fds`: their addresses."""
    found = []
    for fd in fds:
        seen = _inspect(fd)
        if seen is not None and seen[0]:
            found.append(seen[1])
    return found


def _connections() -> list[tuple[int, tuple[str, int], tuple[str, int]]]:
    """This process's connected TCP sockets: (fd, local address, peer address)."""
    found = []
    for fd in _socket_fds():
        seen = _inspect(fd)
        if seen is not None and not seen[0] and seen[2] is not None:
            found.append((fd, seen[1], seen[2]))
    return found


def _addresses(addresses: list[tuple[str, int]]) -> str:
    return ",".join(f"{host}|{port}" for host, port in addresses)


def _parse_addresses(value: bytes | str) -> list[tuple[str, int]]:
    text = value.decode() if isinstance(value, bytes) else value
    found = []
    for item in filter(None, text.split(",")):
        host, _, port = item.rpartition("|")
        if port.isdigit():
            found.append((host, int(port)))
    return found


def _shut_down(fds: set[int]) -> int:
    """Shut the sockets `fds` down (not closed: their owner, the process group, closes
    them when it is destroyed): a read or write waiting on one ends with an error at once.
    How many were still open."""
    done = 0
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return done


def fault_text(exc: BaseException) -> str | None:
    """What `end_step` takes for an exception of a step's work: its first line when it is a
    fault (`is_fault`), None for any other (a bug of the training code: let it propagate)."""
    return _first_line(exc) if is_fault(exc) else None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _drop_group() -> None:
    """Abort and destroy the default process group, whatever state it is in."""
    if dist.is_initialized():
        try:
            dist.group.WORLD.abort()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - a broken group may refuse; destroying is what counts
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # torch names a default group by a count of the groups made, which destroying the
    # default group sets back to 0; a set-up that failed counted one without a group to
    # destroy. Every rank forms the next round's group under the same name (the keys it
    # meets the others at) only with the count back at 0.
    dist.distributed_c10d._world.group_count = 0
    # The group's sockets close when the last reference goes: a peer still blocked in a
    # collective with this rank then gets its error at once instead of at its timeout.
    gc.collect()


def init_process_group(backend: str = "gloo", **kwargs: Any) -> LiveGroup:
    """In place of `torch.distributed.init_process_group`: the default group of round 0 of
    a live group (or, without a coordinator store, a plain one)."""
    group = LiveGroup(backend, **kwargs)
    group.start()
    return group
