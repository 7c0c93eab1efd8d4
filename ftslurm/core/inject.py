"""Fault injection: one spec language for the CLI (`--inject`) and the Python API.

    KIND@TIME[:TARGET]

TIME is how long after the job (each attempt) starts: `90`, `90s`, `5m`, `2h`, `1d`. The
kinds a rank carries out itself (crash, hang, straggler, nan, spike) count from that rank's
start (its wrapper's, after the launcher's set-up; again after an in-job restart), and
`unhealthy` from the job's start where Slurm gives it (`SLURM_JOB_START_TIME`), else the
launcher's.

| kind      | what happens                            | TARGET (default)                 |
|-----------|-----------------------------------------|----------------------------------|
| node_fail | a node of the allocation dies           | node name or index (last node)   |
| preempt   | the scheduler preempts the job          | none                             |
| crash     | a rank is killed (exits non-zero)       | rank (0)                         |
| hang      | a rank stops making progress (SIGSTOP)  | rank (0)                         |
| straggler | a node runs slower by a factor          | NODE*FACTOR or FACTOR (last, 2)  |
| timeout   | the attempt's wall limit becomes TIME   | none                             |
| unhealthy | a node fails its pre-flight health check| node name or index (last node)   |
| nan       | a rank's validated loss becomes NaN     | RANK[:persistent] (0)            |
| spike     | a rank's validated loss jumps 1000-fold | RANK[:persistent] (0)            |

Each injection fires once, in the first attempt that runs long enough to reach it; the node
a straggler slows stays slow for the rest of the run (a bad node: moving off it helps), and
so does the node of a `persistent` nan or spike: every step its rank validates there from
TIME on is wrong, in every attempt that runs on that node (a rank off it computes right).
`unhealthy` fails the first health check a launcher runs on that node at or after TIME
into the attempt (the checks run before the first rendezvous of each job and before
each in-job restart's). The daemon
records what fired in the run (`reached`; the ranks' reports for crash and hang) and a later
job of the run carries only the rest (`still_to_fire`). On the mock scheduler node_fail,
preempt, crash, hang and timeout act on the simulated cluster; the kinds a job can do to
itself (crash, hang, straggler, unhealthy, nan, spike) also travel to the job in the
`FTSLURM_INJECT` environment variable, for the launcher (unhealthy: its health check) and
the rank agent to act on, on a real cluster too.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import Enum

from ftslurm.errors import ConfigError


class InjectKind(str, Enum):
    NODE_FAIL = "node_fail"
    PREEMPT = "preempt"
    CRASH = "crash"
    HANG = "hang"
    STRAGGLER = "straggler"
    TIMEOUT = "timeout"
    UNHEALTHY = "unhealthy"
    NAN = "nan"
    SPIKE = "spike"

    @property
    def in_job(self) -> bool:
        """Whether the job itself can carry it out (so it works on a real cluster too)."""
        return self not in (InjectKind.NODE_FAIL, InjectKind.PREEMPT, InjectKind.TIMEOUT)

    @property
    def on_node(self) -> bool:
        """Whether its target is a node (a name or an index into the allocation)."""
        return self in (InjectKind.NODE_FAIL, InjectKind.STRAGGLER, InjectKind.UNHEALTHY)

    @property
    def on_result(self) -> bool:
        """Whether it corrupts a rank's result (the rank agent's `validate` acts on it)."""
        return self in (InjectKind.NAN, InjectKind.SPIKE)


PERSISTENT = "persistent"  # the suffix of a nan or spike that stays on its node


@dataclass(frozen=True)
class Injection:
    kind: InjectKind
    at_s: float
    node: str | None = None  # node_fail / straggler: a name
    node_index: int | None = None  # node_fail / straggler: an index into the allocation
    rank: int | None = None  # crash / hang / nan / spike
    factor: float | None = None  # straggler
    persistent: bool = False  # nan / spike: wrong every time on the rank's node, not once

    def spec(self) -> str:
        """The canonical text form (parse_injection(x.spec()) == x)."""
        target = ""
        if self.kind.on_node:
            where = (
                self.node
                if self.node is not None
                else (str(self.node_index) if self.node_index is not None else "")
            )
            if self.kind is InjectKind.STRAGGLER:
                where = f"{where}*{self.factor:g}" if where else f"{self.factor:g}"
            target = where
        elif self.rank is not None:
            target = str(self.rank)
        if self.persistent:
            target = f"{target}:{PERSISTENT}"
        return f"{self.kind.value}@{self.at_s:g}" + (f":{target}" if target else "")


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<time>[^:]+)(?::(?P<target>.+))?$")


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise ConfigError(f"malformed duration {text!r}", hint="use e.g. 90, 90s, 5m, 2h, 1d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_injection(spec: str) -> Injection:
    """Parse `KIND@TIME[:TARGET]`; raise ConfigError with a one-line message otherwise."""
    match = _SPEC.match(spec.strip())
    if not match:
        raise ConfigError(f"malformed --inject {spec!r}", hint="use KIND@TIME[:TARGET]")
    try:
        kind = InjectKind(match["kind"])
    except ValueError:
        kinds = ", ".join(k.value for k in InjectKind)
        raise ConfigError(
            f"unknown injection kind {match['kind']!r}; choose one of {kinds}"
        ) from None
    at = parse_duration(match["time"])
    target = match["target"]
    if kind in (InjectKind.PREEMPT, InjectKind.TIMEOUT):
        if target:
            raise ConfigError(f"--inject {spec!r}: {kind.value} takes no target")
        if kind is InjectKind.TIMEOUT and at <= 0:
            raise ConfigError(f"--inject {spec!r}: the wall limit must be longer than zero")
        return Injection(kind, at)
    if kind in (InjectKind.CRASH, InjectKind.HANG):
        if target is not None and not target.isdigit():
            raise ConfigError(f"--inject {spec!r}: the target of {kind.value} is a rank number")
        return Injection(kind, at, rank=int(target) if target else 0)
    if kind.on_result:
        rank_text, _, flag = (target or "").partition(":")
        if rank_text == PERSISTENT and not flag:
            rank_text, flag = "", PERSISTENT
        if (rank_text and not rank_text.isdigit()) or flag not in ("", PERSISTENT):
            raise ConfigError(
                f"--inject {spec!r}: the target of {kind.value} is RANK or RANK:{PERSISTENT}"
            )
        return Injection(
            kind, at, rank=int(rank_text) if rank_text else 0, persistent=flag == PERSISTENT
        )
    factor = None
    where = target or ""
    if kind is InjectKind.STRAGGLER:
        where, _, factor_text = where.rpartition("*") if "*" in where else ("", "", where)
        try:
            factor = float(factor_text) if factor_text else 2.0
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: the slowdown factor must be a number") from None
        if factor <= 1.0:
            raise ConfigError(f"--inject {spec!r}: the slowdown factor must be above 1")
    if where.isdigit():
        return Injection(kind, at, node_index=int(where), factor=factor)
    return Injection(kind, at, node=where or None, factor=factor)


def parse_injections(specs: list[str] | tuple[str, ...]) -> tuple[Injection, ...]:
    return tuple(parse_injection(s) for s in specs)


def env_value(injections: tuple[Injection, ...]) -> str:
    """What travels to the job in FTSLURM_INJECT: the in-job kinds, comma-separated."""
    return ",".join(i.spec() for i in injections if i.kind.in_job)


def reached(injections: Iterable[Injection], ran_s: float | None) -> tuple[str, ...]:
    """The specs of the injections the scheduler carries out (node_fail, preempt, timeout)
    that an attempt which ran for `ran_s` seconds reached: a timeout (its wall limit) as soon
    as it started, the others at their time. None: it never ran, so none. The kinds a job
    does to itself are timed by its ranks, which report what they did."""
    if ran_s is None:
        return ()
    return tuple(
        i.spec()
        for i in injections
        if not i.kind.in_job and (i.kind is InjectKind.TIMEOUT or ran_s >= i.at_s)
    )


def still_to_fire(injections: Iterable[Injection], fired: Collection[str]) -> tuple[Injection, ...]:
    """What a new job of the run carries: the injections not fired yet (`fired`: their
    specs), and a straggler or a persistent nan or spike always (the node it spoiled stays
    bad; its ranks remember which node that is)."""
    return tuple(
        i
        for i in injections
        if i.kind is InjectKind.STRAGGLER or i.persistent or i.spec() not in fired
    )
