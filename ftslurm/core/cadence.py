"""How often to checkpoint: the interval that loses the least work to failures and saves.

Pure arithmetic, shared by the daemon (which writes the interval into the run directory) and
the goodput simulation. Two quantities decide it:

* w, the blocking cost of one checkpoint (seconds the training stands still for it), measured
  by the run itself (`checkpoint_saved(step, seconds)`), or a prior until it has saved once;
* M, the job's mean time between failures: M = 1 / (rate x nodes), the node failure rate
  being what this cluster has shown (node failures per node-day in the daemon's own history)
  blended with a prior (`failure_rate_prior` failures per 1000 node-days, worth
  `failure_prior_node_days` node-days of evidence): the mean of the Gamma posterior, so a few
  days of a small cluster barely move it and a large history speaks for itself.

The interval is Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3), 2006): for w < 2M,

    tau = sqrt(2 w M) * (1 + sqrt(w / 2M) / 3 + (w / 2M) / 9) - w,     tau = M otherwise,

of computation between the ends of two checkpoints; Young's first-order sqrt(2 w M) is what it
refines. An interval is never shorter than the background write of the previous checkpoint
(an asynchronous save), since a save cannot start before the last one is written.

Two tiers. A run that also keeps its states in node memory (`ftslurm.memory_checkpoint`,
reported with tier "memory") gets two intervals, each Daly's optimum for its own tier: the
memory tier's from its own w and the job's M (it serves the restarts inside an allocation),
and the disk tier's from the disk's w and the time between the failures memory cannot
serve, M / (1 - c), c being the share of failures a memory restore serves
(`memory_tier_coverage`, a prior). The disk interval is never shorter than the memory one:
every disk checkpoint is also a memory one.

Live recovery. A run whose ranks recover live (`ftslurm.agent.live`, reported in
`progress.json`) reads no checkpoint when a node is lost inside its allocation and a spare
takes its place: the healthy ranks keep their processes and the state comes from a live
replica. Only the losses the live path cannot serve need a checkpoint, so the disk's
interval is Daly's optimum for the time between those, M / (1 - c_live), with c_live the
share of node failures live recovery serves (`live_coverage`, the rule below). With a
memory tier as well, the disk's time between failures is M / (1 - max(c_mem, c_live)): both
serve failures inside the allocation, and those that end it (the batch host, more losses
than spares) leave neither the node memory nor a live replica behind, so what live recovery
serves is among what memory serves, not independent of it ((1 - c_mem)(1 - c_live) would
count the same failures twice). The memory tier's own interval is Daly's for
M / (1 - c_live) too: the failures inside the allocation that a memory restore served
before (a spare taking a lost node's place) are served live now, so what is left for
either tier is what the live path cannot serve; the memory tier, being cheaper, saves more
often than the disk for those.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ftslurm.core.timefmt import format_duration

DAY_S = 86400.0
# Change the written interval only when the new one differs by more than this fraction (or
# a source changed): each rewrite is read by every rank.
REWRITE_TOLERANCE = 0.1


def young(w_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 w M)."""
    _check(w_s, mtbf_s)
    return math.sqrt(2.0 * w_s * mtbf_s)


def daly(w_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (see the module doc)."""
    _check(w_s, mtbf_s)
    if w_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = w_s / (2.0 * mtbf_s)
    return young(w_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - w_s


def _check(w_s: float, mtbf_s: float) -> None:
    if not (w_s > 0 and mtbf_s > 0 and math.isfinite(w_s)):
        raise ValueError(f"need w > 0 and M > 0, got w={w_s!r}, M={mtbf_s!r}")


@dataclass(frozen=True)
class FailureHistory:
    """What the daemon has seen on this cluster: node failures and the node-days they came
    from (every attempt's nodes times its run time)."""

    failures: int = 0
    node_days: float = 0.0


def node_failure_rate(
    history: FailureHistory, prior_per_1000: float, prior_node_days: float
) -> float:
    """Node failures per node-day: the prior blended with the history (Gamma-Poisson mean)."""
    prior = prior_per_1000 / 1000.0 * prior_node_days
    return (prior + history.failures) / (prior_node_days + history.node_days)


def live_coverage(nodes: int, spares: int) -> float:
    """The share of node failures live recovery serves without a checkpoint, for a job that
    trains on `nodes` N nodes with `spares` K hot spares (`spare_nodes`):

        c_live = S / (1 + S),    S = (N - 1) (1 - (1 - 1/N)^K)

    The rule of `ftslurm.core.recovery`: a loss is served inside the allocation (a spare takes
    the node's place, the ranks recover live) unless it is the batch host (node rank 0), or it
    is one more loss than there are spares; either ends the job, and the run goes on from a
    checkpoint in a new job, which has K spares again. Assumptions: each loss strikes one of
    the N training nodes at random, independently (a spare that took a place trains, so the
    batch host is always 1 of N: a loss is the batch host's with probability 1/N); an
    allocation ends only by a loss it cannot serve. Then each allocation sees the G losses of
    other nodes before the batch host's (geometric: P(G >= j) = (1 - 1/N)^j), serves
    min(G, K) of them and ends with one that needs a checkpoint; by renewal-reward the share
    served is E[min(G, K)] / (E[min(G, K)] + 1), and E[min(G, K)] = sum over j = 1..K of
    (1 - 1/N)^j = S. It is 0 without spares or with one node, at most K / (K + 1) and
    tends to 1 - 1/N with many spares.

    Left out: allocations that end at their time limit (the next job has its K spares again,
    so spares last longer than here); losses of idle spares (each uses one up without
    stopping the training: spares last shorter, a small effect while K is small against N);
    a live recovery given up (a fault during it, a rank that does not rejoin in time), which
    falls back to a checkpoint. Rank crashes are served live too, but the failure history
    behind M counts node failures (`node_lost` events) only, so they are not in this share."""
    if nodes < 1 or spares < 0:
        raise ValueError(f"need nodes >= 1 and spares >= 0, got {nodes!r}, {spares!r}")
    served = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** spares)
    return served / (1.0 + served)


@dataclass(frozen=True)
class Cadence:
    """The checkpoint interval of a run and what it came from (written into the run
    directory as JSON; `interval_s` None: no periodic checkpoints)."""

    interval_s: float | None
    how: str  # "tuned", "pinned" or "off"
    save_s: float | None = None  # w used
    save_measured: bool = False  # w measured by the run (not the prior)
    write_s: float | None = None  # the longest background write, the interval's floor
    mtbf_s: float | None = None  # the job's M
    rate_per_1000: float | None = None  # node failures per 1000 node-days behind M
    failures: int = 0  # of the history behind the rate
    node_days: float = 0.0
    nodes: int = 1
    # With a memory tier (`interval_s` is then the memory tier's): the disk tier's interval,
    # the memory save's w (measured), and the share c of failures memory serves. None: one
    # tier, every periodic checkpoint goes to disk.
    disk_interval_s: float | None = None
    memory_save_s: float | None = None
    memory_coverage: float | None = None
    # The share of node failures live recovery serves (`live_coverage`), for a run whose
    # ranks recover live; None: the run does not, every failure is a restart from a checkpoint.
    live_coverage: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Cadence | None:
        """The cadence of a file's JSON, or None when it is not one."""
        if not isinstance(data, dict):
            return None
        try:
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            cadence = cls(**known)
        except TypeError:
            return None
        for iv in (cadence.interval_s, cadence.disk_interval_s):
            if iv is not None and not (isinstance(iv, (int, float)) and iv > 0):
                return None
        return cadence

    def tier_interval(self, tier: str) -> float | None:
        """The interval of `tier` ("memory" or "disk"): with one tier, both are `interval_s`."""
        if tier == "disk" and self.disk_interval_s is not None:
            return self.disk_interval_s
        return self.interval_s

    def describe(self) -> str:
        """One line for `status` and `report`."""
        if self.interval_s is None:
            return "periodic checkpoints off"
        save = f"save {_span(self.save_s)}" if self.save_s is not None else "no save measured"
        if self.how == "pinned":
            return f"checkpoint every {_span(self.interval_s)} (pinned; {save})"
        measured = "measured" if self.save_measured else "prior, until one is measured"
        disk = self.tier_interval("disk")
        floor = (
            ", the background write's floor"
            if self.write_s is not None and disk is not None and disk <= self.write_s
            else ""
        )
        mtbf = (
            f"job MTBF {_span(self.mtbf_s)} on {self.nodes} node"
            f"{'s' if self.nodes != 1 else ''} at {self.rate_per_1000:.3g} node failures per"
            f" 1000 node-days; {self.failures} seen in {self.node_days:.1f} node-days"
        )
        live = (
            f"; live recovery serves ~{self.live_coverage:.0%} of node failures"
            if self.live_coverage is not None
            else ""
        )
        if self.disk_interval_s is None:
            return (
                f"checkpoint every {_span(self.interval_s)} (tuned{floor}: {save} "
                f"({measured}){live}, {mtbf})"
            )
        return (
            f"checkpoint to memory every {_span(self.interval_s)} (save "
            f"{_span(self.memory_save_s)} measured), to disk every {_span(disk)} "
            f"(tuned{floor}: {save} ({measured}); memory serves "
            f"{self.memory_coverage or 0:.0%} of failures, a prior{live}), {mtbf})"
        )

    def differs(self, other: Cadence | None) -> bool:
        """Whether `other` (what was written) is stale enough to write this one instead."""
        if (
            other is None
            or other.how != self.how
            or other.save_measured != self.save_measured
            or (other.live_coverage is None) != (self.live_coverage is None)
        ):
            return True
        return any(
            _moved(getattr(self, k), getattr(other, k)) for k in ("interval_s", "disk_interval_s")
        )


def _moved(new: float | None, old: float | None) -> bool:
    if new is None or old is None:
        return new != old
    return abs(new - old) > REWRITE_TOLERANCE * old


def cadence(
    setting: float | str | None,
    *,
    nodes: int,
    save_s: float | None,
    save_prior_s: float,
    write_s: float | None,
    history: FailureHistory,
    prior_per_1000: float,
    prior_node_days: float,
    memory_save_s: float | None = None,
    memory_coverage: float = 0.5,
    live_coverage: float | None = None,
) -> Cadence:
    """The run's interval: `setting` is the recipe's `checkpoint_interval` ("auto", seconds,
    or "off"/None); `save_s` the measured blocking disk save (None before the first),
    `write_s` the longest background write seen; `memory_save_s` the measured memory-tier
    save (None: the run keeps no memory tier), `memory_coverage` the share c of failures a
    memory restore serves; `live_coverage` the share of node failures live recovery serves
    (`live_coverage(nodes, spares)`; None: the run does not recover live, the result is the
    same as without it), which spaces the disk's checkpoints for the failures left (see the
    module doc). A pinned interval is the same for both tiers."""
    if setting is None or setting == "off":
        return Cadence(None, "off")
    if not isinstance(setting, str):
        return Cadence(
            float(setting),
            "pinned",
            save_s=save_s,
            save_measured=save_s is not None,
            write_s=write_s,
            nodes=nodes,
        )
    if not 0 <= memory_coverage < 1:
        raise ValueError(f"memory_coverage must be in [0, 1), got {memory_coverage!r}")
    if live_coverage is not None and not 0 <= live_coverage < 1:
        raise ValueError(f"live_coverage must be in [0, 1), got {live_coverage!r}")
    live = live_coverage or 0.0
    w = save_s if save_s is not None and save_s > 0 else save_prior_s
    rate = node_failure_rate(history, prior_per_1000, prior_node_days)
    mtbf = DAY_S / (rate * max(1, nodes))
    tiers: dict[str, Any] = {}
    if live_coverage is not None:
        tiers["live_coverage"] = round(live_coverage, 4)
    if memory_save_s is not None and memory_save_s > 0:
        memory = daly(memory_save_s, mtbf / (1.0 - live))
        served = max(memory_coverage, live)
        disk = max(daly(w, mtbf / (1.0 - served)), write_s or 0.0, memory)
        interval = memory
        tiers |= {
            "disk_interval_s": round(disk, 3),
            "memory_save_s": memory_save_s,
            "memory_coverage": memory_coverage,
        }
    else:
        interval = max(daly(w, mtbf / (1.0 - live)), write_s or 0.0)
    return Cadence(
        round(interval, 3),
        "tuned",
        save_s=w,
        save_measured=w == save_s,
        write_s=write_s,
        mtbf_s=round(mtbf, 1),
        rate_per_1000=round(rate * 1000, 4),
        failures=history.failures,
        node_days=round(history.node_days, 3),
        nodes=nodes,
        **tiers,
    )


def _span(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(seconds)
