"""The launcher's decisions (pure): a frozen state and functions of what was observed and
`now` that return the next state and the actions to carry out (`ftslurm.agent.launch` and
`ftslurm.agent.elastic` are the shell: they read files and clocks, sleep, kill and write).

- `note`/`on_signal`: what a signal changes (`Signals`, written only by the signal handler)
  and where it goes (the live ranks, the next round, out of torch's join);
- `due`/`on_tick`: every monitor tick: news of a lost or benched node (swap, new job), the
  straggler report (step out), the rendezvous closed by another node (stop), the stop's
  grace deadline (kill), a look at hung ranks when a signal came;
- live recovery with warm spares: a survivor whose ranks recover live kills nothing on news
  of a loss; a warm spare's ranks take the lost node's over (`take_over`, the pairing
  `spare_rules.takeovers`);
- `on_hang`: a rank hung: restart in place, or with spares step out, or a peer's loss or
  bench explains it (swap, new job), after waiting `BENCH_WAIT_S` for one;
- `on_failed`/`on_verdict_poll`: the ranks failed: teardown only after every rank recorded
  its save (success), or with spares, was a node lost under them;
- restart accounting as one value (`Budget`): a swap uses no in-job restart, a new job or a
  step out leaves none, a restart that was never made (a stop before the ranks) is given
  back; the elastic agent applies it in one place;
- `decide_outcome`: the node's exit code and outcome; `node_report`: its report, every case.
"""

from __future__ import annotations

import signal
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from ftslurm.agent import live_rules
from ftslurm.agent import spare_rules as sp
from ftslurm.agent.boot import STOPS
from ftslurm.core.contract import NAMED_EXITS, ExitCode
from ftslurm.core.contract.reports import (
    HangClaim,
    NodeHang,
    NodeReport,
    Outcome,
    PeerLost,
    parse,
)
from ftslurm.core.contract.reports import LauncherFailed as FailedLauncher
from ftslurm.core.leases import Lease

LOSS_CHECK_S = 1.0  # how often a launcher with spares reads the loss reports
PEER_CHECK_S = 2.0  # how often it asks whether another node's launcher closed the run


# ------------------------------------------------------------------------------ values
@dataclass(frozen=True)
class Config:
    """What the launcher was started with (the decisions read it, never change it)."""

    node_rank: int = 0
    nnodes: int = 1
    spares: int = 0  # the job's spare nodes (0: none)
    max_restarts: int = 0
    grace: float = 30.0
    has_run: bool = True  # a run directory: the launchers meet and report in it
    checkpoint_sig: int = int(signal.SIGUSR2)
    collect_every: float | None = None  # the straggler collector's interval (node rank 0)
    live: bool = False  # live recovery: spares wait warm, a lost node's ranks are taken over


@dataclass(frozen=True)
class Signals:
    """What the signals that came so far changed; written by the signal handler alone."""

    stop: int | None = None  # the first TERM or INT: no round of ranks starts after it
    signalled: bool = False  # a signal other than USR1 came
    asked: int = 0  # how many of those: each asks for a look at ranks that look hung
    checkpoint_asked: bool = False  # every round that starts later gets the signal too
    stop_at: float | None = None  # SIGTERM: the ranks are killed after this (monotonic)


@dataclass(frozen=True)
class Hang:
    local_rank: int
    reason: str
    step: int | None
    time: float

    def report(self) -> NodeHang:
        """This hang as its node report gives it (`NodeReport.hangs`)."""
        return NodeHang(
            local_rank=self.local_rank, reason=self.reason, step=self.step, time=self.time
        )


@dataclass(frozen=True)
class LauncherState:
    cfg: Config = field(default_factory=Config)
    live: bool = False  # a round of ranks runs (signals go to them)
    joining: bool = False  # in torch's rendezvous join: a stop ends it
    ranks_started: bool = False
    ranks: frozenset[int] = frozenset()
    hangs: tuple[Hang, ...] = ()
    hung_round: bool = False  # the last round ended because a rank hung
    teardown: tuple[tuple[int, int], ...] = ()  # failures after every rank saved: rank, code
    looked: int = 0  # the signals whose look at hung ranks was taken
    lost: frozenset[int] = frozenset()  # node ranks lost or benched, as this node knows
    swaps: int = 0
    trained: bool = False  # (with spares) this node's ranks started once
    swap_why: str | None = None  # the next round record's `why`
    new_job: bool = False  # no spare can help: the run goes on in a new job
    benched: str | None = None  # why this node stepped out
    alone: int = 0  # ranks restarted alone (live recovery), each an in-job restart
    warm: bool = False  # a spare whose ranks wait warm (live recovery), not yet needed
    adopted: int | None = None  # the node rank whose ranks this spare's ranks took over
    # the nodes lost or stepped out in the order they went, with their lease's role then
    gone_order: tuple[tuple[int, str | None], ...] = ()
    next_loss_check: float = 0.0
    next_collect: float = 0.0
    next_peer_check: float = 0.0


@dataclass(frozen=True)
class Losses:
    """The attempt's loss reports and bench records (node rank -> record), and the roles
    their leases said for those this node did not know of yet (`new_gone`)."""

    gone: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    roles: Mapping[int, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Reads:
    """What the shell reads for this tick."""

    losses: bool = False
    straggler: bool = False
    closed: bool = False
    collect: bool = False


@dataclass(frozen=True)
class Tick:
    now: float
    restarts_left: int
    signals: Signals = field(default_factory=Signals)
    losses: Losses | None = None  # read when `Reads.losses`
    straggler: str | None = None  # the straggler report names this node: why
    closed: bool = False  # the rendezvous was closed (or its store is gone)
    live_ranks: bool = False  # every rank of this node recovers live (`HeartbeatDir.live`)
    finished: bool = False  # the run's FINISHED is there (read when `closed`)


# ----------------------------------------------------------------------------- actions
class Budget(str, Enum):
    KEEP = "keep"  # this restart uses no in-job restart (a swap)
    SPENT = "spent"  # no restart left: the launcher leaves (new job, stepped out, run over)
    GIVE_BACK = "give_back"  # the restart torch counted was never made (a stop came first)
    USE = "use"  # one restart made outside torch: a rank restarted alone (live recovery)


@dataclass(frozen=True)
class Log:
    level: str  # "info" or "warning"
    text: str


@dataclass(frozen=True)
class KillRanks:
    pass


@dataclass(frozen=True)
class Account:
    budget: Budget


@dataclass(frozen=True)
class RestartAlone:
    """Start this local rank again, alone: the others keep running (live recovery)."""

    local_rank: int


@dataclass(frozen=True)
class AdoptStandby:
    """Put this node's warm standby in local rank `local_rank`'s place (live recovery): it
    becomes that rank and rejoins the others, as a rank restarted alone would, without a
    new process's start-up. A new standby is started afterwards (`want_standby`)."""

    local_rank: int


@dataclass(frozen=True)
class TakeOver:
    """This warm spare's ranks take over the ranks of node `node_rank` (live recovery):
    hand each its rank (`HeartbeatDir.takeover`); this node trains from now on."""

    node_rank: int


@dataclass(frozen=True)
class RecordFallback:
    """Live recovery cannot serve what happened: record why (`RunDir.live_fallback`, shown
    by `status` and `report`) before today's path (`recovery`: "new_job", the run goes on
    in a new job; None, every rank restarted in this one)."""

    why: live_rules.Fallback
    detail: str
    recovery: str | None = None


@dataclass(frozen=True)
class StepOut:
    """Write this node's bench record (`RunDir.benched`): a spare takes its place."""

    why: str
    reason: str


@dataclass(frozen=True)
class EndRound:
    succeeded: bool  # False: the round failed (torch restarts it while restarts are left)


@dataclass(frozen=True)
class LookAtStop:
    """Record the ranks that look hung now (`RunDir.hung_node`): a signal came."""


@dataclass(frozen=True)
class Collect:
    """Score the straggler report."""


@dataclass(frozen=True)
class Wait:
    """Nothing decided yet: read again shortly."""


@dataclass(frozen=True)
class AwaitVerdict:
    """The ranks failed with spares: was a node lost under them? Poll `on_verdict_poll`."""


@dataclass(frozen=True)
class LossesUnderStop:
    """The ranks failed under a stop, with spares and live recovery: read the loss reports
    once (`losses_under_stop`)."""


Action = (
    Log
    | KillRanks
    | Account
    | RestartAlone
    | AdoptStandby
    | TakeOver
    | RecordFallback
    | StepOut
    | EndRound
    | LookAtStop
    | Collect
    | Wait
    | AwaitVerdict
    | LossesUnderStop
)


# ----------------------------------------------------------------------------- signals
def note(signals: Signals, sig: int, cfg: Config, now: float) -> Signals:
    """What a signal changes, whenever it came (pure)."""
    stop = sig if signals.stop is None and sig in STOPS else signals.stop
    other = sig != signal.SIGUSR1
    stop_at = signals.stop_at
    if sig == signal.SIGTERM and stop_at is None:
        stop_at = now + cfg.grace
    return Signals(
        stop=stop,
        signalled=signals.signalled or other,
        asked=signals.asked + (1 if other else 0),
        checkpoint_asked=signals.checkpoint_asked or sig == cfg.checkpoint_sig,
        stop_at=stop_at,
    )


@dataclass(frozen=True)
class Route:
    deliver: bool  # to the live ranks now
    keep: bool  # for the next round's ranks (none live: before the first, between rounds)
    abort_join: bool  # raise out of torch's rendezvous join: no waiting for the others
    leaving: bool  # the job is being ended: this launcher's close is no death


def on_signal(
    signals: Signals, sig: int, cfg: Config, now: float, *, live: bool, joining: bool
) -> tuple[Signals, Route]:
    """A signal came while the handlers are in place: noted, and where it goes."""
    signals = note(signals, sig, cfg, now)
    stop = sig in STOPS
    if live:
        return signals, Route(deliver=True, keep=False, abort_join=False, leaving=stop)
    return signals, Route(deliver=False, keep=True, abort_join=stop and joining, leaving=stop)


def for_new_round(came: Sequence[int], signals: Signals, cfg: Config) -> tuple[int, ...]:
    """The signals a round's ranks get when they start: those that came while none were
    live, and the checkpoint signal when it came once (a round that died under it did not
    save)."""
    out = list(came)
    if signals.checkpoint_asked and cfg.checkpoint_sig not in out:
        out.append(cfg.checkpoint_sig)
    return tuple(out)


# ------------------------------------------------------------------------------ rounds
def on_round_start(state: LauncherState, gone_before: Collection[int]) -> LauncherState:
    """A round of ranks starts. With spares, the nodes reported lost before it formed are
    not in it: its ranks restart for news of a loss after it only."""
    state = replace(state, ranks_started=True, hung_round=False)
    if state.warm:  # a warm spare's ranks wait: it trains once they take a node over
        return state
    if state.cfg.spares and state.cfg.has_run:
        state = replace(state, trained=True, lost=state.lost | frozenset(gone_before))
    return state


def wait_on_as_spare(state: LauncherState, *, finished: bool) -> bool:
    """torch's join timed out: a spare on the wait list joins again while one can still be
    needed (no new job decided, the run not finished)."""
    return bool(state.cfg.spares) and not state.new_job and not finished


def spare_join(
    cfg: Config, leases: Mapping[int, Lease | None], gone: Collection[int]
) -> bool | None:
    """A spare held back from the first rendezvous (`leases`: those of the nodes that train
    first): True, join now (every one of them started its ranks, or one was lost or left);
    False, the training is over (one's launcher ended, other than by stepping out, which
    needs a spare); None, wait."""
    if any(
        lease is not None and lease.ended not in (None, sp.BENCHED) and lease.role == sp.ACTIVE
        for lease in leases.values()
    ):
        return False
    if sp.may_join(leases, cfg.nnodes, cfg.spares, gone):
        return True
    return None


def abandon_reason(
    *,
    stop: int | None,
    job: str,
    host_failed: Any,
    host_lease: Lease | None,
    host_lost: Any,
    stopped: str,
) -> str | None:
    """Why to stop waiting for the rendezvous host's endpoint: told to stop, or its
    launcher failed (`host_failed`: its record), was told to stop (its lease ended
    `stopped`) or was reported lost (`host_lost`: the report), in this job. None: wait on."""
    if stop is not None:
        return "told to stop"
    failed = parse(FailedLauncher, host_failed)
    if failed is not None and failed.job_id == job:
        return f"the rendezvous host's launcher (node rank 0) failed: {failed.error}"
    if host_lease is not None and host_lease.ended == stopped:
        return "the rendezvous host's launcher (node rank 0) was told to stop"
    lost = parse(PeerLost, host_lost)
    if lost is not None and lost.job_id == job:
        return "the rendezvous host (node rank 0) was reported lost"
    return None


def never_trained(state: LauncherState) -> bool:
    """A spare whose ranks never started: it closes nothing and leaves as a spare."""
    return bool(state.cfg.spares) and not state.trained


class AfterError(str, Enum):
    RAISE = "raise"  # the ranks ran: torch's own error, not the launcher's to report
    FAILED = "failed"  # the launcher failed in the rendezvous: report it
    SPARE_LEAVES = "spare_leaves"  # a spare never needed: the rendezvous closed or its host left


def after_error(state: LauncherState) -> AfterError:
    """What an error out of torch's agent means."""
    if never_trained(state):
        return AfterError.SPARE_LEAVES
    return AfterError.RAISE if state.ranks_started else AfterError.FAILED


class Leave(str, Enum):
    CLOSE = "close"  # close the rendezvous: the other nodes stop too
    QUIETLY = "quietly"  # stepped out: leave it without closing (the others go on)
    NOTHING = "nothing"  # a spare never needed: it closes nothing


def how_to_leave(state: LauncherState) -> Leave:
    if state.benched:
        return Leave.QUIETLY
    return Leave.NOTHING if never_trained(state) else Leave.CLOSE


def out_of_training(state: LauncherState, heartbeats: bool, used: int) -> Ending | None:
    """The ending of a node that leaves the training to the others (exit 0): a spare never
    needed or a node that stepped out (`used`: the in-job restarts it had made); None for a
    node whose ranks ended."""
    if never_trained(state):
        return SpareNeverNeeded()
    if state.benched:
        return SteppedOut(state, heartbeats, used)
    return None


def on_stopped(state: LauncherState) -> tuple[Action, ...]:
    """A stop came before a round's ranks started: after an earlier round, torch counted a
    restart it never made (the last round's ending stands)."""
    return (Account(Budget.GIVE_BACK),) if state.ranks_started else ()


def round_why(state: LauncherState, fresh: str | None) -> tuple[LauncherState, str]:
    """Why a new round started, for its round record: the swap decided here, or the losses
    the record did not name yet (`fresh`), or an in-job restart. Said once."""
    return replace(state, swap_why=None), state.swap_why or fresh or "in-job restart"


def new_gone(state: LauncherState, gone: Collection[int]) -> set[int]:
    """The lost or benched nodes this node did not know of (whose leases to read)."""
    return set(gone) - state.lost


def on_losses(
    state: LauncherState, losses: Losses, *, live: bool = False
) -> tuple[LauncherState, sp.Action, tuple[Action, ...]]:
    """News of active nodes lost or stepped out: SWAP (a spare takes the place) or NEW_JOB
    (no spare can); NONE when nothing new concerns the training. `live`: this node's ranks
    recover live (a SWAP keeps them running; only the words differ here)."""
    new = new_gone(state, losses.gone)
    if not new:
        return state, sp.Action.NONE, ()
    lost = state.lost | new
    went = sorted(new, key=lambda r: (losses.gone[r].time or 0.0, r))
    state = replace(
        state,
        lost=frozenset(lost),
        gone_order=(*state.gone_order, *((r, losses.roles.get(r)) for r in went)),
    )
    action = sp.loss_action(lost, {r: losses.roles.get(r) for r in new}, state.cfg.spares)
    names = ", ".join(sp.gone_name(r, losses.gone[r]) for r in sorted(new))
    if action is sp.Action.SWAP:
        state = replace(  # (a live takeover restarts nothing here: no swap counted)
            state,
            swaps=state.swaps + (0 if live else 1),
            swap_why=sp.swap_why({r: losses.gone[r] for r in new}),
        )
        left = sp.spares_left(lost, state.cfg.spares)
        if live:
            text = (
                f"node {names} lost or stepped out: the ranks keep running, a warm spare "
                f"takes its ranks over live ({left} left)"
            )
        else:
            text = (
                f"node {names} lost or stepped out: restarting the ranks with a spare ({left} left)"
            )
        return state, action, (Log("warning", text),)
    if action is sp.Action.NEW_JOB:
        first = not state.new_job
        state = replace(state, new_job=True)
        text = (
            f"node {names} lost and no spare can take its place: stopping (the run goes on "
            "in a new job)"
        )
        said: tuple[Action, ...] = (Log("warning", text),)
        why = live_rules.loss_fallback(lost, state.cfg.spares) if state.cfg.live else None
        if why is not None and first:  # live recovery asked for, and it cannot serve this
            said += (RecordFallback(why, f"node {names} lost", sp.Action.NEW_JOB.value),)
        return state, action, said
    return state, action, ()


def _step_out(
    state: LauncherState, why: str, reason: str, gone: Collection[int], restarts_left: int
) -> tuple[LauncherState, tuple[Action, ...]]:
    """Take this node out of the training when the one rule allows (`may_step_out`):
    leave for good (no restart left, no rejoining). Nothing when it may not."""
    cfg = state.cfg
    if not sp.may_step_out(cfg.node_rank, gone, cfg.spares):
        return state, ()
    state = replace(state, benched=why)
    said = Log("warning", f"{reason}: stepping out so that a spare takes this node's place")
    return state, (said, StepOut(why, reason), Account(Budget.SPENT))


_FAILED = (KillRanks(), EndRound(succeeded=False))


# ------------------------------------------------------------------------------- ticks
def due(state: LauncherState, now: float) -> tuple[LauncherState, Reads]:
    """What to read at this tick of the monitor (the shell reads it, then `on_tick`)."""
    cfg = state.cfg
    losses = bool(cfg.spares) and now >= state.next_loss_check
    collect = cfg.collect_every is not None and now >= state.next_collect
    closed = now >= state.next_peer_check
    state = replace(
        state,
        next_loss_check=now + LOSS_CHECK_S if losses else state.next_loss_check,
        next_collect=now + (cfg.collect_every or 0.0) if collect else state.next_collect,
        next_peer_check=now + PEER_CHECK_S if closed else state.next_peer_check,
    )
    return state, Reads(
        losses=losses, straggler=losses and cfg.has_run, closed=closed, collect=collect
    )


def on_tick(state: LauncherState, tick: Tick) -> tuple[LauncherState, tuple[Action, ...]]:
    """A monitor tick while the ranks are healthy. An `EndRound` among the actions ends the
    round; without one, the shell judges the ranks (`on_hang` for the first hung one)."""
    said: tuple[Action, ...] = ()
    if tick.losses is not None:
        live = state.cfg.live and (tick.live_ranks or state.warm or state.adopted is not None)
        state, action, said = on_losses(state, tick.losses, live=live)
        if state.warm and action is sp.Action.SWAP:  # a warm spare: none of its ranks train
            state, out = take_over(state)
            if out:
                return state, out
            said, action = (), sp.Action.NONE  # another spare takes that node over
        elif action is sp.Action.SWAP and live:  # the ranks recover live: they keep running
            return state, said
        if action is sp.Action.NONE and tick.straggler:
            gone = tick.losses.gone
            state, out = _step_out(state, sp.STRAGGLER, tick.straggler, gone, tick.restarts_left)
            if out:
                return state, (*said, *out, *_FAILED)
        if action is not sp.Action.NONE:
            budget = Budget.KEEP if action is sp.Action.SWAP else Budget.SPENT
            return state, (*said, Account(budget), *_FAILED)
    if tick.closed and state.adopted is not None and tick.finished:
        pass  # its ranks end the finished run (it is in no exit barrier of the others)
    elif tick.closed:
        text = "another node's launcher ended the run: stopping the ranks"
        return state, (*said, Log("warning", text), Account(Budget.SPENT), *_FAILED)
    stop_at = tick.signals.stop_at
    if stop_at is not None and tick.now > stop_at:
        text = f"ranks did not exit within the {state.cfg.grace:.0f}s grace period: killing them"
        return state, (*said, Log("warning", text), *_FAILED)
    if tick.signals.asked > state.looked:
        return replace(state, looked=tick.signals.asked), (*said, LookAtStop())
    return state, said


def take_over(state: LauncherState) -> tuple[LauncherState, tuple[Action, ...]]:
    """A warm spare after news of a loss: when the pairing (`sp.takeovers`) gives it a
    node, its ranks take that node's ranks over (live recovery); else it waits on."""
    cfg = state.cfg
    pairing = sp.takeovers(state.gone_order, cfg.nnodes, cfg.spares)
    mine = sorted(n for n, spare in pairing.items() if spare == cfg.node_rank)
    if not state.warm or not mine:
        return state, ()
    node = mine[0]
    state = replace(state, warm=False, trained=True, adopted=node, swap_why=None)
    text = f"taking over the ranks of node rank {node} live: the other ranks keep running"
    return state, (Log("warning", text), TakeOver(node))


def take_over_failed(state: LauncherState) -> tuple[LauncherState, tuple[Action, ...]]:
    """The node's ranks could not be handed over (the coordinator does not know them, or is
    gone): the warm ranks end, and the launcher waits as a spare without live recovery
    (the survivors, whose new round no one joins, give up and take today's path)."""
    node = state.adopted
    state = replace(state, warm=False, trained=False, adopted=None)
    text = (
        f"could not take node rank {node} over live: stopping the warm ranks, waiting as a "
        "spare without live recovery"
    )
    why = RecordFallback(live_rules.Fallback.TAKEOVER_FAILED, f"node rank {node}")
    return state, (Log("warning", text), why, Account(Budget.SPENT), *_FAILED)


def hang_deadline(now: float) -> float:
    """Until when a node with spares waits for a peer to step out or be lost (after the
    claims of the hang are compared, `claims_until`)."""
    return claims_until(now) + sp.BENCH_WAIT_S


def claims_until(now: float) -> float:
    """Until when a node with spares that found a rank hung waits for the other nodes'
    claims of the same hang before it decides who steps out (`sp.hang_culprit`)."""
    return now + sp.HANG_CLAIM_WAIT_S


def on_hang(
    state: LauncherState,
    hang: Hang,
    losses: Losses | None,
    restarts_left: int,
    now: float,
    deadline: float,
    *,
    live_ranks: bool = False,
    claims: Mapping[int, HangClaim] | None = None,
    claims_due: float = 0.0,
) -> tuple[LauncherState, tuple[Action, ...]]:
    """A rank of this node hung. With spares (`losses` read): a peer that was lost or
    stepped out explains it (SWAP, or NEW_JOB when no spare is left); else this node steps
    out when it may and, with `claims` (node rank -> the claims of this hang, this node's
    among them, `sp.same_hang`), once they are in (`claims_due`) only when they
    point at it (`sp.hang_culprit`: a hung rank blocks its peers, whose launchers judge a
    hang too); else `Wait` until `deadline` for a peer to. Then (or without spares) the
    ranks restart in place."""
    said: tuple[Action, ...] = ()
    if losses is not None and state.cfg.spares and state.cfg.has_run:
        live = state.cfg.live and live_ranks
        state, action, said = on_losses(state, losses, live=live)
        if action is sp.Action.SWAP and live:  # a peer's loss; a warm spare takes it over
            return state, said
        if action is sp.Action.NONE and claims is not None and now < claims_due:
            return state, (*said, Wait())  # the other nodes' claims of this hang come
        culprit = (
            state.cfg.node_rank
            if claims is None
            else sp.hang_culprit(claims, losses.gone, state.cfg.spares)
        )
        if action is sp.Action.NONE and culprit == state.cfg.node_rank:
            reason = f"local rank {hang.local_rank} hung: {hang.reason}"
            state, out = _step_out(state, sp.HANG, reason, losses.gone, restarts_left)
            if out:
                return replace(state, hangs=(*state.hangs, hang)), (*said, *out, *_FAILED)
        if action is sp.Action.SWAP:  # the hang was the peer's: not this node's
            return state, (*said, Account(Budget.KEEP), *_FAILED)
        if action is sp.Action.NEW_JOB:
            state = replace(state, hangs=(*state.hangs, hang))
            return state, (*said, Account(Budget.SPENT), *_FAILED)
        if now <= deadline:
            return state, (*said, Wait())
    text = f"local rank {hang.local_rank} hung: {hang.reason}; restarting the ranks"
    state = replace(state, hangs=(*state.hangs, hang), hung_round=True)
    return state, (*said, Log("warning", text), *_FAILED)


# ---------------------------------------------------------------------------- failures
def on_failed(
    state: LauncherState, failures: Mapping[int, int], stopped: Mapping[int, str], signalled: bool
) -> tuple[LauncherState, tuple[Action, ...]]:
    """The ranks failed (all are gone by now: torch elastic stops the rest). Failures after
    every rank recorded its save are teardown: no in-job restart, the save stands
    (`EndRound(succeeded=True)`). With spares and no signal: was an active node lost under
    them (`AwaitVerdict`)? With a signal and live recovery: a loss live recovery cannot
    serve is still said (`LossesUnderStop`). A rank's verdict (`NAMED_EXITS`: 16, resume
    on other hardware; 17; 93) ends the node's part: an in-job restart on the same nodes
    would only meet it again. Else the failure stands: torch restarts while it may."""
    if failures:
        decided = decide_outcome(
            succeeded=False,
            failures=dict(failures),
            ranks=set(state.ranks),
            stopped=dict(stopped),
            signalled=signalled,
            finished=False,
            max_restarts=0,
        )
        if decided.warnings:
            teardown = tuple(sorted(failures.items()))
            return replace(state, teardown=teardown), (EndRound(succeeded=True),)
        named = sorted({c for c in failures.values() if c in NAMED_EXITS})
        if named:
            said = ", ".join(f"{c} ({NAMED_EXITS[ExitCode(c)]})" for c in named)
            text = f"a rank exited {said}: no in-job restart on these nodes"
            return state, (Log("warning", text), Account(Budget.SPENT))
    if state.cfg.spares and not signalled:
        return state, (AwaitVerdict(),)
    if state.cfg.spares and state.cfg.live:
        return state, (LossesUnderStop(),)
    return state, ()


def losses_under_stop(
    state: LauncherState, losses: Losses
) -> tuple[LauncherState, tuple[Action, ...]]:
    """The ranks failed under a stop with live recovery asked for: a loss reported by now
    that leaves a new job (the batch host, more than the spares) is said and recorded
    (`RecordFallback`) as a monitor tick would have. The batch host's loss ends the job at
    once: its stop can come before the next look at the losses (`LOSS_CHECK_S`), and the
    fallback went unrecorded. Nothing for a loss a spare serves (the stop ends it all)."""
    after, action, said = on_losses(state, losses, live=True)
    if action is not sp.Action.NEW_JOB:
        return state, ()
    return after, said


def on_rank_exit(
    state: LauncherState,
    local_rank: int,
    code: int,
    *,
    live: bool,
    stopped: bool,
    restarts_left: int,
    signals: Signals,
    standby_ready: bool = False,
) -> tuple[LauncherState, tuple[Action, ...]]:
    """A rank of the running round exited with `code` while the others run on. A rank
    whose process group recovers live (`live`: it said so) and failed is restarted alone,
    using one in-job restart, and rejoins the others: by this node's warm standby when one
    waits (`standby_ready`: its process started, waiting for a rank), else by a new
    process. Otherwise (a clean exit, a stop under way, a rank that recorded its stop and
    died in teardown, no restart left, or a rank that does not recover live) nothing here:
    torch ends the round as before. A rank that left a failed round on purpose
    (`ExitCode.REJOIN`: stuck in a collective with a peer that left it) is restarted alone
    without using a restart: the fault was another's. A rank's verdict (`NAMED_EXITS`: exit
    16, resume elsewhere; 17, its result failed validation; 93, do not retry) is never
    restarted alone: it ends the round, as without live recovery."""
    if code == 0 or not live or stopped or signals.stop is not None or not state.live:
        return state, ()
    if state.new_job or state.benched is not None:
        return state, ()
    if code in NAMED_EXITS:
        said = NAMED_EXITS[ExitCode(code)]
        text = f"local rank {local_rank} exited {code} ({said}): the round ends, as it asks"
        return state, (Log("warning", text),)
    restart: Action = AdoptStandby(local_rank) if standby_ready else RestartAlone(local_rank)
    how = "its place taken by the warm standby" if standby_ready else "restarted alone"
    if code == ExitCode.REJOIN:  # it left a round another rank's fault broke: no restart used
        text = f"local rank {local_rank} left a failed live round: {how} to rejoin"
        return replace(state, alone=state.alone + 1), (Log("info", text), restart)
    if restarts_left <= 0:
        text = f"local rank {local_rank} exited {code}: no in-job restart left to restart it alone"
        return state, (Log("warning", text),)
    text = (
        f"local rank {local_rank} exited {code}: {how}, the other ranks keep "
        f"running (live recovery; {restarts_left - 1} in-job restarts left)"
    )
    return replace(state, alone=state.alone + 1), (
        Log("warning", text),
        Account(Budget.USE),
        restart,
    )


MAX_STANDBY_FAILURES = 3  # standbys that died while waiting: no more are started


def want_standby(
    state: LauncherState,
    *,
    live_ranks: bool,
    have: bool,
    failures: int,
    restarts_left: int,
    signals: Signals,
) -> bool:
    """Whether to start a warm standby beside this node's ranks now: with the
    `live_recovery` setting, once every rank of the running round recovers live
    (`live_ranks`) and an in-job restart is left to spend on one; never a second, nor on
    a warm spare's node (its ranks took another node's over), nor under a stop or once the
    node leaves the job, nor after `MAX_STANDBY_FAILURES` standbys died waiting (a
    script that cannot start twice on this node)."""
    return (
        state.cfg.live
        and state.live
        and live_ranks
        and not have
        and failures < MAX_STANDBY_FAILURES
        and restarts_left > 0
        and not state.warm
        and state.adopted is None
        and signals.stop is None
        and not state.new_job
        and state.benched is None
    )


@dataclass(frozen=True)
class Verdict:
    """Waiting, after the ranks failed, until every other active node is heard from twice
    (`first`: node rank -> the lease counter first read) or a loss is reported."""

    deadline: float
    first: tuple[tuple[int, int], ...] = ()


def on_verdict_poll(
    state: LauncherState,
    wait: Verdict,
    losses: Losses,
    leases: Mapping[int, Lease | None],
    now: float,
) -> tuple[LauncherState, Verdict, tuple[Action, ...]]:
    """One look while waiting for the verdict: `Wait` to look again, else what the failure
    means for the restart budget (a swap uses none; a new job leaves none)."""
    state, action, said = on_losses(state, losses)
    if action is sp.Action.NONE:
        others = {
            r: lease
            for r, lease in leases.items()
            if r != state.cfg.node_rank and r not in state.lost
        }
        first = dict(wait.first)
        for r, lease in others.items():
            if lease is not None and lease.role == sp.ACTIVE and lease.ended is None:
                first.setdefault(r, lease.seq)
        wait = replace(wait, first=tuple(sorted(first.items())))
        if not sp.alive_since(first, others) and now <= wait.deadline:
            return state, wait, (*said, Wait())
    if action is sp.Action.SWAP:
        return state, wait, (*said, Account(Budget.KEEP))
    if state.new_job:
        return state, wait, (*said, Account(Budget.SPENT))
    return state, wait, said


# ----------------------------------------------------------------------------- outcome
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
    stopped_finished = all_stopped and all(stopped[r] == Outcome.FINISHED for r in ranks)
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
        saved = Outcome.CHECKPOINTED if code == ExitCode.CONTINUE else Outcome.FINISHED
        return NodeOutcome(code, saved.value, warnings)
    codes = sorted(set(failures.values()))
    named = [c for c in NAMED_EXITS if c in codes]
    if named:
        code = named[0]
    elif max_restarts > 0:
        code = ExitCode.RESTARTS_EXHAUSTED
    else:
        code = next((c for c in codes if c > 0), 1)
    outcome = {**NAMED_EXITS, ExitCode.RESTARTS_EXHAUSTED: Outcome.RESTARTS_EXHAUSTED.value}.get(
        code, Outcome.FAILED.value
    )
    if hung and not named:
        outcome = Outcome.HUNG.value
    return NodeOutcome(code, outcome)


def ranks_outcome(
    state: LauncherState,
    *,
    succeeded: bool,
    failures: Mapping[int, int],
    stopped: Mapping[int, str],
    signalled: bool,
    finished: bool,
) -> NodeOutcome:
    """The outcome of a node whose ranks trained, from its last round's ending (a round
    that ended in teardown failures only succeeded, with their warnings)."""
    teardown = dict(state.teardown)
    return decide_outcome(
        succeeded=succeeded and not teardown,
        failures=teardown or dict(failures),
        ranks=set(state.ranks),
        stopped=dict(stopped),
        signalled=signalled,
        finished=finished,
        max_restarts=state.cfg.max_restarts,
        hung=state.hung_round,
    )


# ------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class NodeId:
    node_rank: int
    node: str
    job_id: str
    attempt: int
    max_restarts: int
    started_at: float


@dataclass(frozen=True)
class LauncherFailed:
    error: str
    phase: str
    time: float


@dataclass(frozen=True)
class StoppedBeforeRanks:
    signal: str  # its name
    code: int
    outcome: str  # `ftslurm.agent.task.STOPPED`, as a rank's wrapper stopped so says


@dataclass(frozen=True)
class SpareNeverNeeded:
    pass


@dataclass(frozen=True)
class SteppedOut:
    state: LauncherState
    heartbeats: bool
    used: int  # in-job restarts torch made before it stepped out (swaps not counted)


@dataclass(frozen=True)
class RanksEnded:
    state: LauncherState
    decided: NodeOutcome
    used: int  # in-job restarts torch made (swaps not counted)
    timeouts: Mapping[str, Any]
    heartbeats: bool
    withheld: list[int]


@dataclass(frozen=True)
class FailedHealth:
    """The node failed its pre-flight health check (`ftslurm.agent.health`) and left before
    the rendezvous: `benched`, a spare takes its place (exit 0, as a node that stepped out);
    otherwise the attempt ends (exit 1)."""

    words: str  # "health check failed: <check>: <detail>"
    benched: bool
    time: float


Ending = (
    LauncherFailed | StoppedBeforeRanks | SpareNeverNeeded | SteppedOut | RanksEnded | FailedHealth
)


def on_failed_health(state: LauncherState, benched: bool) -> LauncherState:
    """The node failed its health check between in-job rounds and leaves: stepped out (a
    spare takes its place: the others go on, `how_to_leave` leaves quietly) or not (the
    rendezvous is closed: the attempt ends)."""
    return replace(state, benched=sp.UNHEALTHY if benched else None)


def health_exit(benched: bool) -> int:
    """The exit code of a launcher whose node failed its health check: 0 when a spare takes
    its place (srun's exit status is the highest of its tasks': the verdict is the nodes'
    that train), 1 otherwise."""
    return int(ExitCode.FINISHED if benched else ExitCode.FAILED)


def launcher_failed_record(who: NodeId, end: LauncherFailed) -> FailedLauncher:
    """`recovery/launcher-failed-<n>.json` (and the first fields of the node report)."""
    return FailedLauncher(
        node_rank=who.node_rank,
        node=who.node,
        job_id=who.job_id,
        attempt=who.attempt,
        error=end.error,
        phase=end.phase,
        exit_code=int(ExitCode.FAILED),
        time=end.time,
    )


def node_report(end: Ending, who: NodeId, *, ended_at: float, peers_lost: list[int]) -> NodeReport:
    """The node report (`RunDir.node_report`) of every way a launcher ends."""
    ident = dict(node_rank=who.node_rank, node=who.node, job_id=who.job_id, attempt=who.attempt)
    times = dict(started_at=who.started_at, ended_at=ended_at, peers_lost=peers_lost)
    if isinstance(end, LauncherFailed):
        failed = launcher_failed_record(who, end).to_json()
        return NodeReport(
            **failed,
            outcome=Outcome.LAUNCHER_FAILED.value,
            in_job_restarts=0,
            max_restarts=who.max_restarts,
            **times,
        )
    if isinstance(end, StoppedBeforeRanks):
        return NodeReport(
            **ident,
            outcome=end.outcome,
            signal=end.signal,
            exit_code=end.code,
            in_job_restarts=0,
            max_restarts=who.max_restarts,
            **times,
        )
    if isinstance(end, FailedHealth):
        return NodeReport(
            **ident,
            role=sp.ACTIVE if end.benched else None,
            outcome=(Outcome.BENCHED if end.benched else Outcome.UNHEALTHY).value,
            benched=sp.UNHEALTHY if end.benched else None,
            exit_code=health_exit(end.benched),
            error=end.words,
            phase=sp.UNHEALTHY,
            time=end.time,
            in_job_restarts=0,
            max_restarts=who.max_restarts,
            **times,
        )
    if isinstance(end, SpareNeverNeeded):
        return NodeReport(
            **ident,
            role=sp.SPARE,
            outcome=Outcome.SPARE.value,
            exit_code=int(ExitCode.FINISHED),
            in_job_restarts=0,
            spare_swaps=0,
            **times,
        )
    s = end.state
    if isinstance(end, SteppedOut):
        return NodeReport(
            **ident,
            role=sp.ACTIVE,
            outcome=Outcome.BENCHED.value,
            exit_code=int(ExitCode.FINISHED),
            benched=s.benched,
            in_job_restarts=end.used + s.swaps,
            max_restarts=who.max_restarts,
            spare_swaps=s.swaps,
            hangs=[h.report() for h in s.hangs],
            heartbeats=end.heartbeats,
            **times,
        )
    return NodeReport(
        **ident,
        in_job_restarts=end.used + s.swaps,
        max_restarts=who.max_restarts,
        spare_swaps=s.swaps,
        role=sp.ACTIVE if s.cfg.spares else None,
        recovery=sp.Action.NEW_JOB.value if s.new_job else None,
        hangs=[h.report() for h in s.hangs],
        outcome=end.decided.outcome,
        exit_code=end.decided.code,
        teardown_failures=list(end.decided.warnings),
        timeouts=dict(end.timeouts),
        heartbeats=end.heartbeats,  # False: hangs were judged by CPU use alone
        # ranks whose processes never caught the checkpoint signal (ftslurm.agent.task)
        checkpoint_signal_withheld_ranks=end.withheld,
        **times,
    )
