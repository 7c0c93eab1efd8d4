"""Result validation's decisions (pure): is a result suspicious, what a re-run in place
makes of it, what the ranks do together, and which injected result faults fire.

A rank validates one number per step (the loss, before the optimizer applies the step).
It is suspicious when it is NaN or infinite, or a *spike*: above `spike_factor` times the
median of the last `window` accepted results, once `warmup` of them were seen (a spike
needs a positive median: a loss that may be negative is checked for NaN/Inf only). A
suspicious result is re-run in place, from the state captured before the step; then:

| first result | re-run                         | verdict      | the group           |
|--------------|--------------------------------|--------------|---------------------|
| sane         | (none)                         | ok           | goes on             |
| suspicious   | differs, sane                  | transient    | goes on (re-run's)  |
| suspicious   | differs, suspicious            | re-run again | (then: persistent)  |
| sane         | suspicious (a peer's re-run)   | re-run again | (then: persistent)  |
| suspicious   | the same, bit for bit          | persistent   | checkpoint, exit 16 |
| nan/inf      | the same, disambiguation run * | model        | exit 17             |
| spike        | the same, disambiguation run * | correct      | goes on             |

(*: in the disambiguation run, at the step it disambiguates. "Re-run again": up to
`max_reruns` re-runs of one step.)

*Transient*: the machine computed wrong once: the rank's node is blamed (recorded) and the
re-run's result is used. *Persistent*: the same wrong result twice on this hardware: either
the machine or the model; the last good state (the one before the step) is checkpointed
and the rank exits 16, so the daemon flags the attempt's nodes and re-runs on others (the
disambiguation run, `FTSLURM_DISAMBIGUATE`). There the same step reproduces the same way:
*model* for a NaN/Inf (exit 17: the run ends FAILED, the model's fault, not the
machine's), *correct* for a spike (a correct result: the model's own spike, accepted,
training goes on). A suspicious result at another step of a disambiguation run is judged
as in any attempt.

`report_stats` mode never stops: suspicious results are re-run and counted (and, with
`stats_every`, every such step is re-run to measure non-determinism); the verdict is
`counted` and the group goes on.

All ranks act alike: each rank's wish is an `Action`, and the group does the most severe
one of any rank (a MAX all-reduce): one rank's suspicious result re-runs the step on every
rank, one rank's exit 16 ends every rank with 16.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from statistics import median

from ftslurm.core.contract.reports import ResultVerdict as Verdict
from ftslurm.core.inject import Injection, InjectKind

SPIKE_INJECTED = 1000.0  # how many times larger an injected spike makes the result


class Mode(str, Enum):
    ENFORCE = "enforce"  # suspicious results are re-run and acted on (exit 16 / 17)
    REPORT_STATS = "report_stats"  # re-runs counted and reported, never acted on


class Finding(str, Enum):
    OK = "ok"
    NAN = "nan"
    INF = "inf"
    SPIKE = "spike"
    SAMPLED = "sampled"  # report_stats: a sane result re-run to measure non-determinism


class Action(IntEnum):
    """What a rank wants the group to do, by severity: the group does the largest."""

    GO_ON = 0
    RERUN = 1
    EXIT_16 = 2
    EXIT_17 = 3

    @property
    def word(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Settings:
    """`spike_factor`: a result above that many times the running median is a spike (0: no
    spike check); `window`: how many accepted results the median is over; `warmup`: how
    many must be seen before spikes are looked for; `max_reruns`: re-runs of one step before
    a result that keeps changing counts as persistent; `mode`: enforce or report_stats;
    `stats_every`: in report_stats, also re-run every that many steps (0: only suspicious
    ones)."""

    spike_factor: float = 10.0
    window: int = 20
    warmup: int = 10
    max_reruns: int = 2
    mode: Mode = Mode.ENFORCE
    stats_every: int = 0

    def __post_init__(self) -> None:
        if self.spike_factor != 0 and self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be above 1 (or 0: off), not {self.spike_factor}")
        if self.window < 1 or self.warmup < 1 or self.warmup > self.window:
            raise ValueError(
                f"need 1 <= warmup <= window: warmup {self.warmup}, window {self.window}"
            )
        if self.max_reruns < 1 or self.stats_every < 0:
            raise ValueError(
                f"max_reruns must be 1 or more, stats_every 0 or more: "
                f"{self.max_reruns}, {self.stats_every}"
            )
        object.__setattr__(self, "mode", Mode(self.mode))


@dataclass(frozen=True)
class Recent:
    """The last accepted results (the running statistic of the spike check)."""

    values: tuple[float, ...] = ()

    def add(self, value: float, window: int) -> Recent:
        if not math.isfinite(value):
            return self
        return Recent((*self.values, value)[-window:])

    @property
    def reference(self) -> float | None:
        return median(self.values) if self.values else None


def check(value: float, recent: Recent, settings: Settings) -> Finding:
    """Whether `value` is suspicious (the module doc)."""
    if math.isnan(value):
        return Finding.NAN
    if math.isinf(value):
        return Finding.INF
    ref = recent.reference
    if (
        settings.spike_factor
        and len(recent.values) >= settings.warmup
        and ref is not None
        and ref > 0
        and value > settings.spike_factor * ref
    ):
        return Finding.SPIKE
    return Finding.OK


def same(a: float, b: float) -> bool:
    """Bit for bit the same result (two NaNs count as the same)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a.hex() == b.hex()


def first_action(finding: Finding, step: int, settings: Settings) -> Action:
    """A rank's wish after its first result of a step: re-run when it is suspicious (or,
    in report_stats with `stats_every`, on a sampled step)."""
    sampled = (
        settings.mode is Mode.REPORT_STATS
        and settings.stats_every > 0
        and step % settings.stats_every == 0
    )
    return Action.RERUN if finding is not Finding.OK or sampled else Action.GO_ON


@dataclass(frozen=True)
class Suspect:
    """A step being re-run: its first result and how many re-runs it had."""

    step: int
    value: float
    finding: Finding
    reruns: int = 0


def classify(
    first: Suspect, rerun: float, rerun_finding: Finding, settings: Settings, disambiguating: bool
) -> Verdict:
    """The verdict on a step after a re-run in place (the module doc's table). `first`:
    the first result (its `reruns` counts this one); `disambiguating`: this attempt is the
    disambiguation run of this very step (`disambiguated_step`)."""
    reproduced = same(first.value, rerun)
    bad_first = first.finding not in (Finding.OK, Finding.SAMPLED)
    bad_rerun = rerun_finding is not Finding.OK
    if bad_rerun and not reproduced:  # it keeps changing: once more, then it is the node
        if first.reruns < settings.max_reruns:
            return Verdict.RERUN
        return Verdict.COUNTED if settings.mode is Mode.REPORT_STATS else Verdict.PERSISTENT
    if not bad_first:
        return Verdict.OK
    if settings.mode is Mode.REPORT_STATS:
        return Verdict.COUNTED
    if not reproduced:
        return Verdict.TRANSIENT
    if disambiguating:
        return Verdict.CORRECT if first.finding is Finding.SPIKE else Verdict.MODEL
    return Verdict.PERSISTENT


ACTION = {
    Verdict.OK: Action.GO_ON,
    Verdict.RERUN: Action.RERUN,
    Verdict.TRANSIENT: Action.GO_ON,
    Verdict.PERSISTENT: Action.EXIT_16,
    Verdict.MODEL: Action.EXIT_17,
    Verdict.CORRECT: Action.GO_ON,
    Verdict.COUNTED: Action.GO_ON,
}


def agree(actions: Iterable[Action | int]) -> Action:
    """The group's action: the most severe of its ranks' (what a MAX all-reduce gives)."""
    return Action(max((int(a) for a in actions), default=int(Action.GO_ON)))


def disambiguated_step(step: int, in_disambiguation: bool, suspect_steps: Collection[int]) -> bool:
    """Whether `step` is the one this attempt disambiguates: the attempt is a
    disambiguation run (`in_disambiguation`) and the attempt that exited 16 recorded the
    step (`suspect_steps`: the steps of its persistent verdicts; none known, from a script
    of its own: any step)."""
    return in_disambiguation and (not suspect_steps or step in suspect_steps)


# ----------------------------------------------------------------------------- injection
def corrupt(value: float, injection: Injection) -> float:
    """What an injected nan or spike makes of a result."""
    if injection.kind is InjectKind.NAN:
        return math.nan
    return value * SPIKE_INJECTED if value else SPIKE_INJECTED


def fires(
    injection: Injection,
    *,
    rank: int,
    node: str,
    since_start_s: float,
    fired: Collection[str],
    spoiled: Mapping[str, str],
    warm: bool = True,
    rerun: bool = False,
) -> bool:
    """Whether an injected nan/spike spoils this rank's result now: from its time on (a
    spike once the spike check is `warm`: past its warm-up, so that it can be seen); a
    transient one once in the run, on its rank (`fired`: the specs this rank carried out),
    and never a re-run in place (`rerun`): a transient fault strikes one computation, so two
    due at once strike two steps, each re-run computing right; a persistent one on its rank
    until it first fires, then on every rank of the node it spoiled (`spoiled`: spec ->
    node), in every attempt that runs there, re-runs too."""
    if not injection.kind.on_result or since_start_s < injection.at_s:
        return False
    if rerun and not injection.persistent:
        return False
    if injection.kind is InjectKind.SPIKE and not warm:
        return False
    spec = injection.spec()
    if injection.persistent and spec in spoiled:
        return spoiled[spec] == node
    return rank == (injection.rank or 0) and (injection.persistent or spec not in fired)
