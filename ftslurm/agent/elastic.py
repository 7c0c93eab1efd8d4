"""The launcher's elastic agent: torch's `LocalElasticAgent` with ftslurm's monitor.

Imported by `ftslurm.agent.launch` only after its signal handlers record (torch takes a
while to import). The agent keeps the decisions' state (`launch_core.LauncherState`) as an
attribute and does the I/O around them: at every monitor tick it reads what
`launch_core.due` asks for (loss reports, the straggler report, whether the rendezvous was
closed), hands it to `launch_core.on_tick`, judges the ranks' heartbeats (or CPU time) and
carries out the actions (`carry_out`); the in-job restart budget changes in one method
(`account`)."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

from ftslurm.agent import launch_core as core
from ftslurm.agent import live_rules
from ftslurm.agent import spares as sp
from ftslurm.agent.heartbeat import (
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
from ftslurm.agent.launch_io import (
    FailedHealthCheck,
    Stopped,
    cpu_seconds,
    frozen,
    kill_ranks,
    pause_for_tests,
    rendezvous_closed,
)
from ftslurm.agent.peers import poll_interval
from ftslurm.core.contract import EnvName, RunDir
from ftslurm.core.contract.reports import (
    HangClaim,
    HungNodeReport,
    HungRank,
    Kind,
    RoundRecord,
    StragglerReport,
    TakeOver,
)
from ftslurm.core.settings import DEFAULT_RUNNING_S
from ftslurm.runfiles import read_report, read_reports, write_report

log = logging.getLogger("ftslurm.launch")
pause_for_tests("imports")  # tests: the launcher stopped while it imports torch's agent

POLL_S = 0.25  # how often a wait for news of the peers reads again


@dataclass
class Standby:
    """This node's warm standby (live recovery): a process of the script started ahead of
    time, waiting in `live.init_process_group` to take a crashed rank's place. `slot`: its
    own local rank, past the node's ranks (its heartbeat folder's files), never reused."""

    handler: Any  # torch's SubprocessHandler, put in the crashed rank's slot on adoption
    slot: int


class Agent(LocalElasticAgent):
    """`node`: the launcher's shell (`ftslurm.agent.launch.Node`): its configuration,
    folders, signals, peer watch and report writers."""

    def __init__(self, node: Any, *, warm: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.node = node
        self.state = core.LauncherState(cfg=node.cfg, warm=warm)
        self.adopted: dict[int, int] = {}  # local rank -> the global rank it took over
        self.adopted_group: str | None = None  # and the live group (`live_rules.Keys`)
        self.adopted_world: int | None = None
        self.live_group: str | None = None  # the live group this node's ranks are in
        self.round_group: str | None = None  # the rendezvous round's (`agree_on_group`)
        self.last_result: RunResult | None = None  # the last round's ending (not HEALTHY)
        self.pace: dict[int, Pace] = {}
        self.cpu: dict[int, CpuWatch] = {}
        self.heartbeats = False  # a rank wrote heartbeats (else hangs are judged by CPU)
        self.held: dict[int, list[int]] = {}  # local rank -> signals waiting for its wrapper
        self.round_pending: tuple[Any, RoundRecord] | None = None
        self.standby: Standby | None = None
        self.spent_used: int | None = None  # the restarts used when the budget was spent
        self.standby_failures = 0  # standbys that died while waiting
        self.standby_slots = itertools.count(node.args.nproc_per_node)

    def run(self, *args: Any, **kwargs: Any) -> RunResult:
        try:
            return super().run(*args, **kwargs)
        finally:
            self.drop_standby()  # never left running after the ranks

    # ------------------------------------------------------------------ torch's hooks
    def _start_workers(self, worker_group):  # type: ignore[no-untyped-def]
        node = self.node
        pause_for_tests("ranks")
        if node.signals.stop is not None:  # told to stop before this round's ranks exist
            raise Stopped(node.signals.stop)
        spares = node.cfg.spares and node.run is not None
        gone = sp.gone_reports(node.run, node.attempt) if spares else {}
        self.state = core.on_round_start(self.state, gone)
        hb = node.hb
        olds = [hb.RECORDS, hb.READY, hb.LIVE, hb.WAITING]
        for old in [path for pattern in olds for path in hb.root.glob(pattern)]:
            old.unlink(missing_ok=True)
        self.pace, self.cpu = {}, {}  # a new round learns its pace again
        if spares and node.watch is not None and not self.state.warm:
            node.watch.set_role(sp.ACTIVE)
        pause_for_tests("spawn")
        started = super()._start_workers(worker_group)
        self.state = replace(self.state, live=True)
        came, node.early[:] = list(node.early), []  # what came before the ranks existed
        for sig in core.for_new_round(came, node.signals, node.cfg):
            self.deliver(sig)  # reaches them when ready (a stop while they started too)
        if self.state.warm:  # a warm spare's own group of one node: nothing to record
            return started
        if node.run is not None and worker_group.group_rank == 0:
            self.record_round(worker_group)
        if node.cfg.live and node.cfg.spares:
            self.publish_ranks()
        return started

    def _stop_workers(self, worker_group, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.state = replace(self.state, live=False)  # signals wait for the next round
        self.drop_standby()  # it belongs to this round (its environment is the round's)
        return super()._stop_workers(worker_group, *args, **kwargs)

    def _restart_workers(self, worker_group):  # type: ignore[no-untyped-def]
        """An in-job restart (torch's: stop the ranks, rendezvous, start them): the node's
        health check runs between the stop and the rendezvous, as before the job's first
        (a node that went bad under the last round leaves here, reported)."""
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        if self.node.signals.stop is None:
            code = self.node.health_check(between_rounds=True)
            if code is not None:
                raise FailedHealthCheck(code, code == core.health_exit(True))
        self._initialize_workers(worker_group)

    def _rendezvous(self, worker_group):  # type: ignore[no-untyped-def]
        while True:
            self.state = replace(self.state, joining=True)  # a stop now raises `Stopped`
            try:
                if self.node.signals.stop is not None:
                    raise Stopped(self.node.signals.stop)
                super()._rendezvous(worker_group)
                self.round_group = self.agree_on_group(worker_group)
                # The round's ranks read it (respawned ones and the standby too).
                os.environ[EnvName.LIVE_GROUP.value] = self.round_group
                return None
            except RendezvousTimeoutError:
                # A spare left waiting on the wait list times out with torch's join
                # timeout: it joins again while a spare can still be needed.
                run = self.node.run
                finished = run is not None and run.finished.exists()
                if not core.wait_on_as_spare(self.state, finished=finished):
                    raise
                log.info("waiting on as a spare")
            finally:
                self.state = replace(self.state, joining=False)

    @staticmethod
    def agree_on_group(worker_group) -> str:  # type: ignore[no-untyped-def]
        """The live group of this rendezvous round (`live_rules.Keys`' prefix), the same on
        every node of the round: the first node's proposal in the round's own store, the
        time it proposed it (a later round's group names sort after, as their records do).
        Torch's in-job restart count is not the same on every node: a node whose rank
        failed counts a restart, a node that restarts its ranks for the changed membership
        does not."""
        proposal = f"{time.time_ns() // 1000:x}"
        agreed = worker_group.store.compare_set(live_rules.GROUP_KEY, "", proposal)
        run_id = worker_group.spec.rdzv_handler.get_run_id()
        return live_rules.group_prefix(run_id, agreed.decode())

    def _exit_barrier(self):  # type: ignore[no-untyped-def]
        """With live recovery and spares, the nodes wait for each other at the end on the
        coordinator store, where a spare that took a lost node's ranks over counts for it
        (torch's barrier counts the nodes of its rendezvous, which a warm spare is not in:
        the lost node would be waited for until the timeout)."""
        cfg = self.node.cfg
        if not (cfg.live and cfg.spares and self.live_group):
            return super()._exit_barrier()
        key = live_rules.exit_key(self.live_group)
        nodes = sp.active_nodes(cfg.nnodes, cfg.spares)
        deadline = time.monotonic() + self._exit_barrier_timeout
        try:
            store = self.node.live_store()
            store.add(key, 1)
            while int(store.add(key, 0)) < nodes and time.monotonic() < deadline:
                time.sleep(POLL_S)
            # The store's host (node rank 0's launcher) leaves last: a node still looking
            # at the count would lose its connection otherwise.
            left = int(store.add(f"{key}/left", 1))
            while cfg.node_rank == 0 and left < nodes and time.monotonic() < deadline:
                time.sleep(POLL_S / 5)
                left = int(store.add(f"{key}/left", 0))
        except Exception as exc:  # noqa: BLE001 - the store is gone: the others have left
            log.info("exit barrier: %s", exc)

    def _monitor_workers(self, worker_group):  # type: ignore[no-untyped-def]
        self.restart_alone(worker_group)  # before torch sees a failed rank and stops them all
        result = self._judge_workers(worker_group)
        if result.state is not WorkerState.HEALTHY:
            self.last_result = result
            self.drop_standby()  # the round is over: nothing left to take a place in
        return result

    def _judge_workers(self, worker_group):  # type: ignore[no-untyped-def]
        result = super()._monitor_workers(worker_group)
        ranks = frozenset(
            self.adopted.get(w.local_rank, w.global_rank) for w in worker_group.workers
        )
        self.state = replace(self.state, ranks=ranks)
        if result.state is WorkerState.FAILED:
            return self.on_failed(result) or result
        if result.state is not WorkerState.HEALTHY:
            return result
        now = time.monotonic()
        pids = self._pcontext.pids() if self._pcontext else {}
        self.deliver_held(pids)
        self.note_first_step()
        ended = self.tick(worker_group, pids, now)
        if ended or self.state.warm:  # a warm spare's ranks wait: no hang to judge
            return ended or result
        self.keep_standby()
        return self.judge_ranks(pids, now) or result

    # ---------------------------------------------------------------- the decisions
    def account(self, budget: core.Budget) -> None:
        """The one place the in-job restart budget (torch's `_remaining_restarts`) moves
        outside torch: torch takes one for every restart it makes."""
        if budget is core.Budget.KEEP:  # undone by torch's count: no restart used
            self._remaining_restarts += 1
        elif budget is core.Budget.SPENT:  # leave: no rejoining the rendezvous
            if self.spent_used is None:  # what was used by then; the rest is not used
                self.spent_used = self.restarts_used()
            self._remaining_restarts = 0
        elif budget is core.Budget.USE:
            self._remaining_restarts -= 1
        elif budget is core.Budget.GIVE_BACK:
            self._remaining_restarts = min(self.node.cfg.max_restarts, self._remaining_restarts + 1)

    def restarts_used(self) -> int:
        """The in-job restarts torch made (swaps not counted; those left when the node
        left on purpose, `Budget.SPENT`, not either)."""
        if self.spent_used is not None:
            return self.spent_used
        return self.node.cfg.max_restarts - self._remaining_restarts

    def carry_out(
        self, actions: tuple[core.Action, ...], pids: dict[int, int], worker_group: Any = None
    ) -> RunResult | None:
        """Carry out the core's actions; the round's result when one ends it."""
        ended = None
        for action in actions:
            if isinstance(action, core.Log):
                getattr(log, action.level)("%s", action.text)
            elif isinstance(action, core.KillRanks):
                kill_ranks(pids.values())
            elif isinstance(action, core.Account):
                self.account(action.budget)
            elif isinstance(action, core.RestartAlone):
                self.respawn(action.local_rank, worker_group)
            elif isinstance(action, core.AdoptStandby):
                self.adopt_standby(action.local_rank, worker_group)
            elif isinstance(action, core.TakeOver) and not self.take_over(action.node_rank):
                self.state, more = core.take_over_failed(self.state)
                ended = self.carry_out(more, pids, worker_group) or ended
            elif isinstance(action, core.StepOut):
                self.node.write_bench(action.why, action.reason)
            elif isinstance(action, core.RecordFallback):
                self.node.write_live_fallback(action)
            elif isinstance(action, core.LookAtStop):
                self.hung_at_stop(worker_group, pids, time.monotonic())
            elif isinstance(action, core.EndRound) and action.succeeded:
                values = {r: None for r in self.state.ranks}
                ended = RunResult(state=WorkerState.SUCCEEDED, return_values=values)
            elif isinstance(action, core.EndRound):
                ended = RunResult(state=WorkerState.FAILED)
        return ended

    def on_failed(self, result: RunResult) -> RunResult | None:
        """The ranks failed: teardown only (success), or with spares, a loss under them?"""
        failures = {r: f.exitcode for r, f in result.failures.items()}
        stopped = self.node.stopped_ranks(self.state.ranks) if failures else {}
        signalled = self.node.signals.signalled
        self.state, actions = core.on_failed(self.state, failures, stopped, signalled)
        if any(isinstance(a, core.AwaitVerdict) for a in actions):
            actions = self.failure_verdict()
        elif any(isinstance(a, core.LossesUnderStop) for a in actions):
            self.state, actions = core.losses_under_stop(self.state, self.read_losses())
        return self.carry_out(actions, {})

    def restart_alone(self, worker_group: Any) -> None:
        """Ranks of this round that exited while the others run on: the ones that recover
        live are started again alone (`core.on_rank_exit`)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        workers = {w.local_rank: w.global_rank for w in worker_group.workers}
        for local_rank, handler in list(handlers.items()):
            code = handler.proc.poll()
            if code is None or code == 0:
                continue
            rank = workers.get(local_rank)
            stopped = rank is not None and bool(self.node.stopped_ranks([rank]))
            self.state, actions = core.on_rank_exit(
                self.state,
                local_rank,
                code,
                live=self.node.hb.live(local_rank).exists(),
                stopped=stopped,
                restarts_left=self._remaining_restarts,
                signals=self.node.signals,
                standby_ready=self.standby_ready(),
            )
            self.carry_out(actions, {}, worker_group)

    def respawn(self, local_rank: int, worker_group: Any) -> None:
        """Start local rank `local_rank` again as torch started it, told to rejoin the
        running ranks (`FTSLURM_LIVE_REJOIN`), with a fresh heartbeat record and pace."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            get_subprocess_handler,
        )

        pc = self._pcontext
        self.forget_rank(local_rank)
        handler = get_subprocess_handler(
            entrypoint=pc.entrypoint,
            args=pc.args[local_rank],
            env={**pc.envs[local_rank], EnvName.LIVE_REJOIN.value: "1"},
            stdout=pc.stdouts[local_rank],
            stderr=pc.stderrs[local_rank],
            local_rank_id=local_rank,
            numa_options=getattr(pc, "_numa_options", None),
        )
        self.put_in_slot(local_rank, handler, worker_group)

    def forget_rank(self, local_rank: int) -> None:
        """A rank's process is replaced: its heartbeat record, marks and pace go."""
        hb = self.node.hb
        for path in (hb.live(local_rank), hb.record(local_rank), hb.ready(local_rank)):
            path.unlink(missing_ok=True)
        self.pace.pop(local_rank, None)
        self.cpu.pop(local_rank, None)

    def put_in_slot(self, local_rank: int, handler: Any, worker_group: Any) -> None:
        """`handler`'s process runs local rank `local_rank` from now on, for torch too."""
        self._pcontext.subprocess_handlers[local_rank] = handler
        for worker in worker_group.workers:  # torch checks its workers' pids every tick
            if worker.local_rank == local_rank:
                worker.id = handler.proc.pid

    # ------------------------------------------------------------------- the standby
    def keep_standby(self) -> None:
        """Start a warm standby when one is wanted (`core.want_standby`); one that died
        while waiting is counted (and replaced while fewer than the limit died). Without
        the `live_recovery` setting (the usual case) nothing is looked at: this runs at every
        monitor tick."""
        if not self.state.cfg.live:
            return
        sb = self.standby
        if sb is not None and sb.handler.proc.poll() is not None:
            self.standby, self.standby_failures = None, self.standby_failures + 1
            log.warning(
                "the warm standby exited %s while waiting (%d of at most %d)",
                sb.handler.proc.returncode,
                self.standby_failures,
                core.MAX_STANDBY_FAILURES,
            )
            self.node.hb.waiting(sb.slot).unlink(missing_ok=True)
        wanted = core.want_standby(
            self.state,
            live_ranks=self.live_ranks(),
            have=self.standby is not None,
            failures=self.standby_failures,
            restarts_left=self._remaining_restarts,
            signals=self.node.signals,
        )
        if wanted:
            self.start_standby()

    def start_standby(self) -> None:
        """Local rank 0's command and environment, warm (`FTSLURM_LIVE_SPARE`) and in a
        slot of its own: it runs the script up to `live.init_process_group` and waits
        there. Outside torch's process context until it takes a rank's place, so torch's
        health checks, exit barrier and world size never count it."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            get_subprocess_handler,
        )

        pc = self._pcontext
        if pc is None or 0 not in pc.envs:
            return
        slot = next(self.standby_slots)
        env = {**pc.envs[0], EnvName.LIVE_SPARE.value: "1", "LOCAL_RANK": str(slot)}
        env.pop(EnvName.LIVE_REJOIN.value, None)
        env.pop("TORCHELASTIC_ERROR_FILE", None)  # rank 0's: not this process's to write
        # rank 0's output files ("": none, the launcher's own); the standby's beside them
        outputs = [f"{f}.standby-{slot}" if f else f for f in (pc.stdouts[0], pc.stderrs[0])]
        self.node.hb.waiting(slot).unlink(missing_ok=True)
        handler = get_subprocess_handler(
            entrypoint=pc.entrypoint,
            args=pc.args[0],
            env=env,
            stdout=outputs[0],
            stderr=outputs[1],
            local_rank_id=0,
            numa_options=getattr(pc, "_numa_options", None),
        )
        self.standby = Standby(handler, slot)
        log.info("warm standby started (pid %d): it takes a crashed rank's place", handler.proc.pid)

    def standby_ready(self) -> bool:
        """A standby is there and waits for a rank (its process runs, its mark is up)."""
        sb = self.standby
        return (
            sb is not None
            and sb.handler.proc.poll() is None
            and self.node.hb.waiting(sb.slot).exists()
        )

    def adopt_standby(self, local_rank: int, worker_group: Any) -> None:
        """The standby takes local rank `local_rank`'s place: told which rank it becomes
        (`TakeOver` with `local_rank`), and put in that rank's slot of torch's process
        context. Gone since it was judged ready: the rank is restarted cold instead."""
        sb, self.standby = self.standby, None
        member = self.membership()
        workers = {w.local_rank: w.global_rank for w in worker_group.workers}
        rank = self.adopted.get(local_rank, workers.get(local_rank))
        if sb is None or sb.handler.proc.poll() is not None or member is None or rank is None:
            log.warning("the warm standby is gone: local rank %d restarted cold", local_rank)
            if sb is not None:
                self.drop(sb)
            self.respawn(local_rank, worker_group)
            return
        hb = self.node.hb
        self.forget_rank(local_rank)
        group, world = member
        told = TakeOver(
            node_rank=self.node.cfg.node_rank,
            rank=rank,
            world_size=world,
            group=group,
            time=time.time(),
            local_rank=local_rank,
        )
        write_report(hb.takeover(sb.slot), told)
        if hb.ready(sb.slot).exists():  # its wrapper's handlers are in place: signals may go
            hb.ready(local_rank).touch()
        self.put_in_slot(local_rank, sb.handler, worker_group)

    def drop_standby(self) -> None:
        sb, self.standby = self.standby, None
        if sb is not None:
            self.drop(sb)

    def drop(self, sb: Standby) -> None:
        """End a standby's process (its command dies with its wrapper) and its mark."""
        kill_ranks([sb.handler.proc.pid])
        sb.handler.proc.poll()
        self.node.hb.waiting(sb.slot).unlink(missing_ok=True)

    def failure_verdict(self) -> tuple[core.Action, ...]:
        """Wait (at most the peer timeout and three polls) until every other active node is
        heard from twice, or a loss of one is reported."""
        node = self.node
        timeout = node.args.peer_timeout
        wait = core.Verdict(deadline=time.monotonic() + timeout + 3 * poll_interval(timeout))
        while True:
            losses = self.read_losses()
            others = [r for r in range(node.cfg.nnodes) if r != node.cfg.node_rank]
            leases = {r: sp.read_lease(node.run, node.attempt, r) for r in others}
            now = time.monotonic()
            self.state, wait, actions = core.on_verdict_poll(self.state, wait, losses, leases, now)
            if not any(isinstance(a, core.Wait) for a in actions):
                return actions
            time.sleep(POLL_S)

    def tick(self, worker_group: Any, pids: dict[int, int], now: float) -> RunResult | None:
        """A monitor tick: read what is due, decide, act."""
        node = self.node
        self.state, reads = core.due(self.state, now)
        losses = self.read_losses() if reads.losses else None
        straggler = None
        if reads.straggler:
            report = read_report(node.run.straggler_report, StragglerReport)
            straggler = sp.straggler_reason(report, node.attempt, node.node_name)
        if reads.collect and node.collector is not None:
            node.collector()
        closed = reads.closed and self.rendezvous_closed(worker_group)
        tick = core.Tick(
            now=now,
            restarts_left=self._remaining_restarts,
            signals=node.signals,
            losses=losses,
            straggler=straggler,
            closed=closed,
            live_ranks=self.live_ranks(),
            finished=closed and node.run is not None and node.run.finished.exists(),
        )
        self.state, actions = core.on_tick(self.state, tick)
        return self.carry_out(actions, pids, worker_group)

    def judge_ranks(self, pids: dict[int, int], now: float) -> RunResult | None:
        """The first rank judged hung, if any, and what its hang means (`on_hang`)."""
        for local_rank in range(self.node.args.nproc_per_node):
            why, beat = self.judge(local_rank, pids.get(local_rank), now)
            if why:
                step = beat.step if beat else None
                return self.on_hang(core.Hang(local_rank, why, step, time.time()), pids)
        return None

    def on_hang(self, hang: core.Hang, pids: dict[int, int]) -> RunResult | None:
        spares = bool(self.node.cfg.spares) and self.node.run is not None
        mine = self.claim_hang(hang, pids.get(hang.local_rank)) if spares else None
        started = time.monotonic()
        due, deadline = core.claims_until(started), core.hang_deadline(started)
        while True:
            losses = self.read_losses() if spares else None
            claims = self.read_claims(mine) if mine is not None else None
            left, now = self._remaining_restarts, time.monotonic()
            self.state, actions = core.on_hang(
                self.state,
                hang,
                losses,
                left,
                now,
                deadline,
                live_ranks=self.live_ranks(),
                claims=claims,
                claims_due=due,
            )
            ended = self.carry_out(actions, pids)
            if not any(isinstance(a, core.Wait) for a in actions):
                return ended
            time.sleep(POLL_S)

    def claim_hang(self, hang: core.Hang, pid: int | None) -> HangClaim | None:
        """Say that a rank of this node hung, with whether it is frozen (`frozen`: a look
        of half a second at its processes), for the other nodes that judge the same hang
        (`RunDir.hang_claim`). None: it could not be said (then this node decides alone,
        as the first to judge)."""
        node = self.node
        assert node.run is not None
        claim = sp.hang_claim(
            node_rank=node.cfg.node_rank,
            node=node.node_name,
            local_rank=hang.local_rank,
            reason=hang.reason,
            step=hang.step,
            frozen=pid is not None and frozen(pid),
            time=time.time(),
            job_id=node.job,
            attempt=node.attempt,
        )
        try:
            write_report(node.run.hang_claim(node.attempt, node.cfg.node_rank), claim)
        except OSError as exc:
            log.warning("could not write this node's hang claim: %s", exc)
            return None
        log.info("local rank %d hung (%s): comparing claims", hang.local_rank, claim.evidence)
        return claim

    def read_claims(self, mine: HangClaim) -> dict[int, HangClaim]:
        """The claims of the hang `mine` claims, this node's among them (`sp.same_hang`)."""
        node = self.node
        found: list[HangClaim] = read_reports(node.run, Kind.HANG_CLAIM, node.attempt)
        return sp.same_hang({c.node_rank: c for c in found if c.node_rank is not None}, mine)

    # --------------------------------------------------------------------- reading
    def read_losses(self) -> core.Losses:
        """The attempt's loss reports and bench records, with the roles of the new ones."""
        run, attempt = self.node.run, self.node.attempt
        gone = sp.gone_reports(run, attempt)
        roles = {}
        for r in core.new_gone(self.state, gone):
            lease = sp.read_lease(run, attempt, r)
            roles[r] = lease.role if lease is not None else None
        return core.Losses(gone=gone, roles=roles)

    def rendezvous_closed(self, worker_group: Any) -> bool:
        """Did another node's launcher give up (close the rendezvous)? (A warm spare's own
        group has a rendezvous of its own: the training's is the one asked.)"""
        return rendezvous_closed(self.node.main_handler or worker_group.spec.rdzv_handler)

    def judge(
        self, local_rank: int, pid: int | None, now: float, limits: Timeouts | None = None
    ) -> tuple[str | None, Beat | None]:
        """Whether a rank is hung: by its heartbeat record (with the running timeout learned
        from its pace), or by its CPU time when it has none."""
        node = self.node
        limits = limits or node.timeouts
        beat = read_beat(node.hb.root, local_rank)
        if beat is not None and beat.beats:
            self.heartbeats = True
            pace = observe_pace(self.pace.get(local_rank, Pace()), beat, limits)
            self.pace[local_rank] = pace
            return hang_reason(beat, learned(limits, pace, node.args.safety_factor), now), beat
        if pid is None:
            return None, None
        cpu = cpu_seconds(pid)
        if cpu is None:
            return None, None
        running = limits.out_of_section
        window = min(5.0, running / 3) if running else 5.0
        watch = watch_cpu(self.cpu.get(local_rank), cpu, now, window)
        self.cpu[local_rank] = watch
        return idle_reason(watch, running, now), None

    def hung_at_stop(self, worker_group: Any, pids: dict[int, int], now: float) -> None:
        """Judged when the checkpoint signal or SIGTERM comes: ranks that look hung, with
        the default running timeout where it was turned off, so the daemon can tell an
        attempt that sat hung until its wall limit from one that was merely stopped."""
        node = self.node
        if node.run_dir is None:
            return
        timeouts = node.timeouts
        limits = (
            timeouts
            if timeouts.out_of_section is not None
            else replace(timeouts, out_of_section=DEFAULT_RUNNING_S)
        )
        hung = []
        for local_rank in range(node.args.nproc_per_node):
            why, beat = self.judge(local_rank, pids.get(local_rank), now, limits)
            if why:
                workers = getattr(worker_group, "workers", None) or []
                rank = next((w.global_rank for w in workers if w.local_rank == local_rank), None)
                hung.append(
                    HungRank(
                        local_rank=local_rank,
                        rank=rank,
                        reason=why,
                        section=beat.section if beat else None,
                        silent_s=silence(beat, limits, now) if beat else None,
                    )
                )
        path = RunDir(node.run_dir).hung_node(node.attempt, node.args.node_rank)
        if hung:
            report = HungNodeReport(
                node_rank=node.args.node_rank, node=node.node_name, time=time.time(), hung=hung
            )
            write_report(path, report)
        else:
            path.unlink(missing_ok=True)

    # ---------------------------------------------------------------- live recovery
    def live_ranks(self) -> bool:
        """Every rank of this node recovers live (each touched its `HeartbeatDir.live`)."""
        hb = self.node.hb
        return all(hb.live(lr).exists() for lr in range(self.node.args.nproc_per_node))

    def publish_ranks(self) -> None:
        """Tell a warm spare which ranks this node runs, in which live group
        (`live_rules.node_key`), in the coordinator store."""
        pc = self._pcontext
        member = self.membership()
        if member is None:
            return
        envs = [pc.envs[lr] for lr in sorted(pc.envs)]
        ranks = tuple(self.adopted.get(lr, int(env["RANK"])) for lr, env in enumerate(envs))
        group, world = member
        record = live_rules.NodeRanks(group, world, ranks)
        self.live_group = group
        run_id = self.node.main_run_id()
        try:
            self.node.live_store().set(
                live_rules.node_key(run_id, self.node.cfg.node_rank), record.encode()
            )
        except Exception as exc:  # noqa: BLE001 - no coordinator: no live takeover of us
            log.warning("could not publish this node's ranks for a warm spare: %s", exc)

    def membership(self) -> tuple[str, int] | None:
        """The live group this node's ranks are in (`live_rules.Keys`' prefix) and its
        world size: the round's, or the lost node's that this spare took over."""
        pc = self._pcontext
        envs = [pc.envs[lr] for lr in sorted(pc.envs)] if pc is not None else []
        if not envs:
            return None
        group = self.adopted_group or self.round_group
        if group is None:
            return None
        return group, self.adopted_world or int(envs[0]["WORLD_SIZE"])

    def take_over(self, node_rank: int) -> bool:
        """Hand each waiting rank its rank of node `node_rank` (`HeartbeatDir.takeover`):
        they join the live group's next round and receive the state from a running rank.
        False: that node's ranks are not known (nothing handed over)."""
        node = self.node
        key = live_rules.node_key(node.main_run_id(), node_rank)
        try:
            record = live_rules.NodeRanks.decode(node.live_store().get(key))
        except Exception as exc:  # noqa: BLE001 - the coordinator is gone or never heard of it
            record = None
            log.warning("node rank %d's ranks are not known (%s)", node_rank, exc)
        if record is None or len(record.ranks) != node.args.nproc_per_node:
            log.warning("cannot take node rank %d over live: its ranks are unknown", node_rank)
            return False
        if node.watch is not None:
            node.watch.set_role(sp.ACTIVE)
        self.adopted = dict(enumerate(record.ranks))
        self.adopted_group, self.adopted_world = record.group, record.world
        now = time.time()
        for local_rank, rank in self.adopted.items():
            told = TakeOver(
                node_rank=node_rank,
                rank=rank,
                world_size=record.world,
                group=record.group,
                time=now,
            )
            write_report(node.hb.takeover(local_rank), told)
        self.publish_ranks()  # this node runs them now: a later loss of it is taken over too
        return True

    # ------------------------------------------------------------------ round records
    def record_round(self, worker_group: Any) -> None:
        """The launcher of global rank 0 records every in-job round after the first."""
        node = self.node
        run, attempt = node.run, node.attempt
        round_ = sp.rendezvous_round(worker_group.spec.rdzv_handler)
        self.round_pending = None
        if not round_:
            return
        named = sp.named_in_rounds(run, attempt)
        reports = sp.gone_reports(run, attempt)
        fresh = {r: rep for r, rep in reports.items() if sp.gone_name(r, rep) not in named}
        lost = sorted(sp.gone_name(r, rep) for r, rep in fresh.items())
        self.state, why = core.round_why(self.state, sp.swap_why(fresh) if fresh else None)
        workers = worker_group.workers or []
        record = sp.round_record(
            round_=round_,
            started_at=time.time(),
            world_size=workers[0].world_size if workers else 0,
            nnodes_active=worker_group.group_world_size,
            spares_left=sp.spares_left(reports, node.cfg.spares),
            why=why,
            lost=lost,
            job_id=node.job,
            attempt=attempt,
        )
        path = run.round_record(attempt, round_)
        write_report(path, record)
        self.round_pending = (path, record)

    def note_first_step(self) -> None:
        """The round record gets the time of the first step a rank of this node reports."""
        if self.round_pending is None:
            return
        beats = (read_beat(self.node.hb.root, lr) for lr in range(self.node.args.nproc_per_node))
        steps = [b.step for b in beats if b is not None and b.step is not None]
        if steps:
            path, record = self.round_pending
            write_report(path, record.at_first_step(time.time(), max(steps)))
            self.round_pending = None

    # ------------------------------------------------------------------------ signals
    def live_pids(self) -> dict[int, int]:
        """The ranks of the round running now (none between rounds and before the first)."""
        pcontext = getattr(self, "_pcontext", None)
        return pcontext.pids() if pcontext and self.state.live else {}

    def deliver(self, sig: int) -> None:
        for local_rank, pid in self.live_pids().items():
            self.send(local_rank, pid, sig)

    def send(self, local_rank: int, pid: int, sig: int) -> None:
        # A rank's wrapper that has not installed its handlers yet would die of USR1/2:
        # hold the signal until it says it is ready.
        if not self.node.hb.ready(local_rank).exists():
            self.held.setdefault(local_rank, []).append(sig)
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def deliver_held(self, pids: dict[int, int]) -> None:
        for local_rank in list(self.held):
            if local_rank in pids and self.node.hb.ready(local_rank).exists():
                for sig in self.held.pop(local_rank):
                    self.send(local_rank, pids[local_rank], sig)


def make_agent(node: Any, handler: Any, *, warm: bool = False) -> Agent:
    """The agent of this launcher's ranks, on the rendezvous `handler` (`warm`: a warm
    spare's, on a rendezvous of its own: its ranks wait to take a node over)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    args = node.args
    if node.cfg.spares:
        # A spare left on the wait list after a swap is no new member to make room for:
        # torch would restart the healthy ranks for it, over and over.
        handler.num_nodes_waiting = lambda: 0
    spec = WorkerSpec(
        role="trainer",
        local_world_size=args.nproc_per_node,
        entrypoint=sys.executable,
        args=("-m", "ftslurm.agent.task", "--", *args.command),
        rdzv_handler=handler,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
    )
    return Agent(
        node,
        warm=warm,
        spec=spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(node.hb.torch_logs)),
        start_method="spawn",
        shutdown_timeout=int(max(1, args.grace)),
        exit_barrier_timeout=60,
    )


def round_ending(result: RunResult | None) -> tuple[bool, dict[int, int]]:
    """Whether the last round succeeded, and its failures (rank -> exit code). None: the
    rendezvous ended under a node that trained before (a failure)."""
    if result is None:
        return False, {}
    failures = {r: f.exitcode for r, f in result.failures.items()}
    return result.state is WorkerState.SUCCEEDED, failures
