"""Live recovery's decisions: pure functions of what the coordinator store holds.

The shell (`ftslurm.agent.live`) reads the store, asks these, and acts. Nothing here does
I/O or reads a clock: the time waited is passed in.

- `commit_decision`: a step commits only when every rank voted that its gradient
  reduction succeeded; a rank that failed, a round declared failed (by a rank or by the
  launcher that saw a rank die) or a vote that waited too long aborts it. The first rank to
  decide writes the decision (compare-and-set), every rank follows the written one: no rank
  ever applies a step another rank did not.
- `join_state`: a new round is ready when every rank of the world joined; it falls back
  when the wait ran out or the round itself was declared failed.
- `shard_handovers`: who hands the state to the members that lack it (the member holding
  the newest step; the lowest rank among equals), and which members must load it; per
  part for a state sharded over groups of ranks (HSDP: a part's sender is a rank of
  another replica holding the same part; a replicated state is one part).
- `fallback`: whether to give live recovery up (too many faults in a row), and why;
  `handover_fallback` (a part nobody holds), `handover_timed_out` (a replica that does not
  answer in time), `loss_fallback` (the launcher's: the batch host lost, no spare left).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from ftslurm.core.recovery import BATCH_NODE_RANK


class Decision(str, Enum):
    COMMIT = "commit"
    ABORT = "abort"
    WAIT = "wait"


class Join(str, Enum):
    READY = "ready"
    WAIT = "wait"
    FAILED = "failed"  # this round failed while forming: try the next one
    TIMED_OUT = "timed_out"  # a rank never came: give live recovery up


class Fallback(str, Enum):
    """Why live recovery was given up (today's path then: the in-job restart from the
    memory tier or disk, then a new job). The text goes into the round record."""

    JOIN_TIMEOUT = "a rank did not join the new round in time"
    TOO_MANY_ROUNDS = "faults kept coming during the recovery"
    NO_STATE = "no member holds a training state"
    NO_COORDINATOR = "the coordinator store is gone (the batch host was lost)"
    IN_SETUP = "a rank failed while the ranks were still setting up"
    SHARDED = "a rank lacks its shard of a sharded state, which no peer holds"
    NO_ANSWER = "a replica did not answer in time"  # the handover's timeout
    # The launcher's (`launch_core`): a loss that live recovery cannot serve.
    NO_SPARE = "more nodes lost than there are spares: no warm spare left to take over"
    TAKEOVER_FAILED = "a warm spare could not take the lost node's ranks over"


def commit_decision(
    votes: int, world: int, *, failed: bool, waited_s: float, timeout_s: float
) -> Decision:
    """The decision on one step from the votes counted so far. All votes in commits, even
    when a failure was declared after the last one: the step was finished everywhere, and
    the failure belongs to the next step."""
    if votes >= world:
        return Decision.COMMIT
    if failed or waited_s >= timeout_s:
        return Decision.ABORT
    return Decision.WAIT


def join_state(joined: int, world: int, *, failed: bool, waited_s: float, timeout_s: float) -> Join:
    if failed:
        return Join.FAILED
    if joined >= world:
        return Join.READY
    if waited_s >= timeout_s:
        return Join.TIMED_OUT
    return Join.WAIT


@dataclass(frozen=True)
class Handover:
    sender: int  # the rank that broadcasts its state
    step: int  # the step it holds
    receivers: frozenset[int]  # the ranks that load it (they hold an older step or none)


def shard_handovers(
    members: Mapping[int, int | None], parts: int
) -> tuple[tuple[Handover, ...], frozenset[int]]:
    """A state in `parts` parts, rank r holding part r % parts (HSDP's layout: the ranks of
    one replica are consecutive; 1: every rank holds it whole, a replicated state; the
    world size: each rank its own part, no replica): one handover per part that a member
    lacks at the newest step, from the lowest rank holding that part at it; and the members
    whose part nobody holds at it (`stranded`: their part is lost). Nothing when no member
    holds a state."""
    holding = {r: s for r, s in members.items() if s is not None}
    if not holding:
        return (), frozenset()
    step = max(holding.values())
    plans, stranded = [], set()
    for part in range(parts):
        ranks = sorted(r for r in members if r % parts == part)
        lacking = frozenset(r for r in ranks if members[r] != step)
        holders = [r for r in ranks if members[r] == step]
        if lacking and holders:
            plans.append(Handover(holders[0], step, lacking))
        elif lacking:
            stranded |= lacking
    return tuple(plans), frozenset(stranded)


def handover_fallback(stranded: Collection[int]) -> Fallback | None:
    """A handover that cannot be made: a part of a sharded state that no member holds (its
    ranks lost it, and no replica has it: FSDP without a replica dimension) cannot be
    copied to the ranks that lack it."""
    return Fallback.SHARDED if stranded else None


def handover_timed_out(waited_s: float, timeout_s: float) -> Fallback | None:
    """A piece of the handover (the state's size, or a chunk of it) that failed after
    waiting the whole handover timeout: the replica at the other end did not answer (a
    stalled process, not a lost one: a lost peer's closed sockets fail it at once). The
    next round would wait for that replica too: give live recovery up. One that failed
    sooner is a lost peer: the next round."""
    return Fallback.NO_ANSWER if waited_s >= timeout_s else None


def loss_fallback(lost: Collection[int], spare_nodes: int) -> Fallback | None:
    """Why a launcher with live recovery falls back to a new job on losing these node
    ranks (every node lost or stepped out in the attempt so far), or None while a warm
    spare can take each over: the batch host hosts the coordinator store; a loss beyond
    the spares leaves a node nobody takes over."""
    lost = set(lost)
    if BATCH_NODE_RANK in lost:
        return Fallback.NO_COORDINATOR
    if len(lost) > spare_nodes:
        return Fallback.NO_SPARE
    return None


def fallback(rounds_in_a_row: int, max_rounds: int) -> Fallback | None:
    """Given up after `max_rounds` rounds failed one after the other without a committed
    step between them (a fault during the recovery is retried that often)."""
    return Fallback.TOO_MANY_ROUNDS if rounds_in_a_row > max_rounds else None


ROOT = "ftslurm-live"


# Where the nodes of one rendezvous round agree on their live group: the round's own store
# (torch's, prefixed by the round), the first node's proposal kept.
GROUP_KEY = "ftslurm/live-group"


def group_prefix(run_id: str, group: int | str) -> str:
    """The key prefix of a live group of a rendezvous `run_id`: `group` names one round of
    it, the same on every node (its launchers' `GROUP_KEY`; without them, torch's restart
    count)."""
    return f"{ROOT}/{run_id}/{group}"


def node_key(run_id: str, node_rank: int) -> str:
    """Where a node's launcher publishes the ranks of the group its node runs
    (`NodeRanks`), for a warm spare that takes them over."""
    return f"{ROOT}/{run_id}/node/{node_rank}"


def exit_key(group: str) -> str:
    """The nodes of a live group that ended their ranks (the launchers' exit barrier)."""
    return f"{group}/exited"


@dataclass(frozen=True)
class NodeRanks:
    """The live group a node's ranks are in and their global ranks by local rank."""

    group: str
    world: int
    ranks: tuple[int, ...]

    def encode(self) -> str:
        return f"{self.world}|{','.join(map(str, self.ranks))}|{self.group}"

    @staticmethod
    def decode(value: bytes | str) -> NodeRanks | None:
        text = value.decode() if isinstance(value, bytes) else value
        world, _, rest = text.partition("|")
        ranks, _, group = rest.partition("|")
        try:
            return NodeRanks(group, int(world), tuple(int(r) for r in ranks.split(",") if r))
        except ValueError:
            return None


@dataclass(frozen=True)
class Keys:
    """The coordinator store's keys of one live group: `prefix` names the group (one round
    of the launchers' rendezvous: `group_prefix`), `r` a round of the group, `seq` the n-th
    commit of a round."""

    prefix: str

    def round(self) -> str:
        return f"{self.prefix}/round"

    def failed(self, r: int) -> str:
        return f"{self.prefix}/r{r}/failed"

    def took_over(self, r: int) -> str:
        """The node rank whose ranks a warm spare's ranks took over, joining round `r`."""
        return f"{self.prefix}/r{r}/took-over"

    def standby(self, r: int) -> str:
        """The rank a node's warm standby became (a crashed rank's), joining round `r`."""
        return f"{self.prefix}/r{r}/standby"

    def joined(self, r: int) -> str:
        return f"{self.prefix}/r{r}/joined"

    def member(self, r: int, rank: int) -> str:
        return f"{self.prefix}/r{r}/member/{rank}"

    def group(self, r: int) -> str:
        return f"{self.prefix}/r{r}/pg/"

    def listener(self, r: int, rank: int) -> str:
        """Where rank `rank`'s group of round r accepts its peers' connections."""
        return f"{self.prefix}/r{r}/listener/{rank}"

    def vote(self, r: int, seq: int) -> str:
        return f"{self.prefix}/r{r}/s{seq}/votes"

    def decision(self, r: int, seq: int) -> str:
        return f"{self.prefix}/r{r}/s{seq}/decision"


def rejoin_round(current: int, *, was_member: bool, failed: bool) -> tuple[int, bool]:
    """The round a restarted rank joins, and whether it declares `current` failed first: a
    round it was a member of (its former process was) lost that member; a round forming
    without it waits for it."""
    if was_member or failed:
        return current + 1, was_member and not failed
    return current, False


def member_step(value: bytes | str) -> int | None:
    """A member record's step ("" or "-": it holds no state)."""
    text = value.decode() if isinstance(value, bytes) else value
    return int(text) if text.lstrip("-").isdigit() and not text.startswith("-") else None


# A round's `failed` record says who declared it: a rank whose collective raised (it is
# running, holding the state of the last committed step) or a restarted rank (maybe every
# other rank is stuck in a collective with a peer that left it).
BY_ERROR = "error|"
BY_RESTART = "restart|"


class Stuck(Enum):
    """What a rank does when still inside its step after its round was declared failed."""

    WAIT = "wait"  # its own error may yet come
    INTERRUPT = "interrupt"  # end the round's connections: its collective raises, the
    # process and its state stay and it recovers as from any fault
    LEAVE = "leave"  # exit to be restarted alone (the state stays with a running rank)


def round_connection(
    local: tuple[str, int],
    peer: tuple[str, int],
    listeners: Iterable[tuple[str, int]],
    own: set[int],
) -> bool:
    """Whether a connected socket (its local and peer address) belongs to a round's group:
    it was accepted by this rank's listener (local port in `own`), or it reaches a peer's
    listener (an address in `listeners`; a wildcard host matches the port alone)."""
    if local[1] in own:
        return True
    host = _plain(peer[0])
    return any(
        port == peer[1] and (_plain(h) in WILDCARD_HOSTS or _plain(h) == host)
        for h, port in listeners
    )


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def _plain(host: str) -> str:
    return host.removeprefix("::ffff:")


def stuck(declared: str | None, busy_s: float, grace_s: float, can_interrupt: bool) -> Stuck:
    """A rank inside its step `busy_s` after its round was declared failed: on gloo an
    operation posted on a connection a peer closed, or on one to a peer that went silent (a
    node lost without its sockets closing), waits out the whole collective timeout. After
    `grace_s` it ends the round's own connections where it knows them; otherwise it leaves,
    only when a running rank declared the round failed (that rank holds the state)."""
    if not declared or busy_s < grace_s:
        return Stuck.WAIT
    if can_interrupt:
        return Stuck.INTERRUPT
    return Stuck.LEAVE if declared.startswith(BY_ERROR) else Stuck.WAIT
