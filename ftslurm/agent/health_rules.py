"""The pre-flight health check's rules (pure): each check's pass or fail from what the shell
(`ftslurm.agent.health`) measured, the verdict of a node, and the `unhealthy` fault
injection's aim. No clock, file or process here: the shell measures, these judge.

A check that could not measure (a peer missing, a probe that timed out, the bound spent)
is inconclusive and passes: a dead node is peer-loss detection's to find
(`ftslurm.agent.peers`), and a check must never keep a healthy node out of its job.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from ftslurm.core.contract import EnvName
from ftslurm.core.contract.reports import Unhealthy
from ftslurm.core.inject import Injection, InjectKind


class Check(str, Enum):
    """The checks, in the order a launcher runs them (the cheap local ones first)."""

    CHECKPOINT_DIR = "checkpoint_dir"  # reachable, writable, write + fsync at a sane speed
    MEMORY = "memory"  # free memory above a floor
    DISK = "disk"  # free space of the checkpoint directory's file system above a floor
    GPU = "gpu"  # the GPUs the job asked for: present, a small kernel runs, memory free
    NETWORK = "network"  # a timed transfer to node rank 0, against the median node's
    SITE = "site"  # the site's own command (as Slurm's HealthCheckProgram)


MB = 1024 * 1024
# A launcher started without the daemon's checkpoint folder cannot know where its ranks write.
NO_CHECKPOINT_DIR = f"no checkpoint folder named ({EnvName.CHECKPOINT_DIR.value} unset)"


@dataclass(frozen=True)
class Result:
    """One check's outcome: passed or not, what it measured against which floor, in words."""

    check: Check
    ok: bool
    detail: str
    value: float | None = None
    floor: float | None = None
    skipped: bool = False  # not run (not asked for, nothing to measure, no time left)


def passed(check: Check, detail: str, **kw: float | None) -> Result:
    return Result(check, True, detail, **kw)  # type: ignore[arg-type]


def skipped(check: Check, why: str) -> Result:
    return Result(check, True, f"skipped: {why}", skipped=True)


def failed(
    check: Check, detail: str, value: float | None = None, floor: float | None = None
) -> Result:
    return Result(check, False, detail, value, floor)


# ------------------------------------------------------------------------ the rules
def write_speed(
    folder: str, nbytes: int, seconds: float | None, error: str | None, floor_mb_s: float
) -> Result:
    """A folder that must be writable (the checkpoint directory, a node-local one): the
    write + fsync of `nbytes` took `seconds`; `error`: what failed instead (not reachable,
    read-only, a timeout). Fails on an error, or below `floor_mb_s` MB/s."""
    if error is not None:
        return failed(Check.CHECKPOINT_DIR, f"{folder}: {error}")
    assert seconds is not None
    rate = nbytes / MB / max(seconds, 1e-9)
    said = f"{folder}: {rate:.1f} MB/s writing {nbytes // 1024} KiB with fsync"
    if rate < floor_mb_s:
        return failed(Check.CHECKPOINT_DIR, f"{said}, below {floor_mb_s:g} MB/s", rate, floor_mb_s)
    return passed(Check.CHECKPOINT_DIR, said, value=rate, floor=floor_mb_s)


def free_memory(available_bytes: int | None, floor_mb: float) -> Result:
    """Memory the node has free for the job (MemAvailable): at least `floor_mb` MB. Not
    known: passes (skipped)."""
    if available_bytes is None:
        return skipped(Check.MEMORY, "free memory not known on this system")
    mb = available_bytes / MB
    if mb < floor_mb:
        return failed(Check.MEMORY, f"{mb:.0f} MB free, below {floor_mb:g} MB", mb, floor_mb)
    return passed(Check.MEMORY, f"{mb:.0f} MB free", value=mb, floor=floor_mb)


def free_disk(folder: str, free_bytes: int | None, floor_mb: float) -> Result:
    """Free space of the checkpoint directory's file system: at least `floor_mb` MB."""
    if free_bytes is None:
        return skipped(Check.DISK, f"{folder}: not reachable (the checkpoint_dir check says)")
    mb = free_bytes / MB
    if mb < floor_mb:
        said = f"{folder}: {mb:.0f} MB free, below {floor_mb:g} MB"
        return failed(Check.DISK, said, mb, floor_mb)
    return passed(Check.DISK, f"{folder}: {mb:.0f} MB free", value=mb, floor=floor_mb)


@dataclass(frozen=True)
class GpuProbe:
    """What the shell found of the node's GPUs: how many torch sees, whether a small kernel
    ran on each (and its result was right), each one's free memory; `error`: what failed."""

    count: int
    kernel_ok: bool = True
    free_mb: tuple[float, ...] = ()
    error: str | None = None


def gpus(asked: int, probe: GpuProbe | None, floor_mb: float) -> Result:
    """The GPUs the job asked for (`asked` per node; 0: a CPU job, skipped): at least that
    many present, a small kernel right on each, each with `floor_mb` MB free."""
    if asked <= 0:
        return skipped(Check.GPU, "the job asked for no GPU")
    if probe is None:
        return skipped(Check.GPU, "the GPU probe did not finish within the bound: inconclusive")
    if probe.error is not None:
        return failed(Check.GPU, probe.error)
    if probe.count < asked:
        return failed(
            Check.GPU, f"{probe.count} GPU(s) usable, the job asked for {asked}", probe.count, asked
        )
    if not probe.kernel_ok:
        return failed(Check.GPU, "a small kernel gave a wrong result")
    low = min(probe.free_mb, default=None)
    if low is not None and low < floor_mb:
        said = f"{low:.0f} MB free on a GPU, below {floor_mb:g} MB"
        return failed(Check.GPU, said, low, floor_mb)
    return passed(Check.GPU, f"{probe.count} GPU(s), kernel ran, {low or 0:.0f} MB free at least")


# A rate measured by fewer nodes than this tells nothing about a median.
MIN_NETWORK_PEERS = 3


def bandwidth(own: float | None, others: Iterable[float], ratio: float) -> Result:
    """This node's transfer rate to node rank 0 (`own`, MB/s; None: not measured) against the
    median of every node's that measured one (`others` and its own): below `ratio` x the
    median fails. Fewer than MIN_NETWORK_PEERS rates, or none of its own: inconclusive,
    passes (a peer missing or slow to start is not this node's fault)."""
    if own is None:
        return skipped(Check.NETWORK, "no transfer measured (no peer to measure against in time)")
    rates = [*others, own]
    if len(rates) < MIN_NETWORK_PEERS:
        return skipped(
            Check.NETWORK, f"{own:.0f} MB/s; {len(rates)} node(s) measured: no median to judge by"
        )
    median = statistics.median(rates)
    floor = ratio * median
    said = f"{own:.0f} MB/s to node rank 0, median {median:.0f} MB/s of {len(rates)} nodes"
    if own < floor:
        return failed(Check.NETWORK, f"{said}: below {ratio:g} x the median", own, floor)
    return passed(Check.NETWORK, said, value=own, floor=floor)


def site(command: str, exit_code: int | None, timed_out: bool, output: str) -> Result:
    """The site's command: exit 0 passes; any other exit, or no exit within the bound, fails
    (its last line of output said)."""
    last = output.strip().splitlines()[-1][:200] if output.strip() else ""
    tail = f": {last}" if last else ""
    if timed_out:
        return failed(Check.SITE, f"{command!r} did not finish within the bound{tail}")
    if exit_code != 0:
        return failed(Check.SITE, f"{command!r} exited {exit_code}{tail}", exit_code, 0)
    return passed(Check.SITE, f"{command!r} exited 0")


def verdict(results: Sequence[Result]) -> Result | None:
    """The node's verdict: the first check that failed (None: healthy)."""
    return next((r for r in results if not r.ok), None)


# ------------------------------------------------------------------------ injection
def injected(
    injections: Iterable[Injection],
    *,
    node: str,
    node_rank: int,
    nnodes: int,
    elapsed_s: float,
    fired: Iterable[str],
) -> Injection | None:
    """The `unhealthy` injection that fails this node's check now (pure): one aimed at it
    (by name, or by index into the allocation; none given: the last node), due (`elapsed_s`
    into the attempt, at or after its time) and not fired before in the run."""
    done = set(fired)
    for i in injections:
        if i.kind is not InjectKind.UNHEALTHY or i.spec() in done or elapsed_s < i.at_s:
            continue
        if i.node is not None:
            aimed = i.node == node
        else:
            aimed = (nnodes - 1 if i.node_index is None else i.node_index) == node_rank
        if aimed:
            return i
    return None


def injected_failure(first: Check, spec: str) -> Result:
    """The result an injection gives the first check the launcher runs."""
    return failed(first, f"injected ({spec})")


def node_dirs(templates: Iterable[str], node: str) -> list[str]:
    """The configured folders with `{node}` replaced by the node's name."""
    return [t.replace("{node}", node) for t in templates]


def gpus_asked(environ: Mapping[str, str]) -> int:
    """How many GPUs the job asked for on this node, from what Slurm tells the job
    (`SLURM_GPUS_ON_NODE`, else the devices it was given in `CUDA_VISIBLE_DEVICES` under
    Slurm's GPU binding); 0: a CPU job."""
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit():
        return int(on_node)
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        listed = environ.get(name, "").strip()
        if listed:
            return len([x for x in listed.split(",") if x])
    return 0


def report(
    result: Result,
    *,
    node: str,
    node_rank: int,
    job_id: str,
    attempt: int,
    benched: bool,
    spec: str | None,
    time: float,
) -> Unhealthy:
    """The content of `recovery/unhealthy-<n>.json` (pure)."""
    return Unhealthy(
        node_rank=node_rank,
        node=node,
        job_id=job_id,
        attempt=attempt,
        check=result.check.value,
        detail=result.detail,
        value=result.value,
        floor=result.floor,
        benched=benched,
        injected=spec,
        time=time,
    )
