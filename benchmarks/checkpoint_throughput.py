"""Checkpoint throughput per tier: blocking and restore times against raw disk and memory speeds.

Everything below is measured in one run, so each tier can be set against a raw reference
taken on the same machine at the same time. A ratio is a fraction of the raw bandwidth (raw
seconds / tier seconds): 1.0 would be as fast as the raw reference. Sizes are in MB of 2**20
bytes; each figure is the median of `--repeat` runs.

Disk tier (`ftslurm.checkpoint`), in one folder (`--dir`, default a temporary folder):

* raw write: `--size-mb` MB written sequentially (os.write in 8 MB chunks), then fsync;
* raw read: the same file read back (8 MB reads into one buffer) after
  `posix_fadvise(DONTNEED)` asked the kernel to drop it from the page cache. The advice is
  advisory: the file system, a hypervisor or the storage may still serve the read from a
  cache (`page_cache_dropped` in the JSON says whether it could be given at all);
* `CheckpointManager.save` of a state of the same size (several float32 tensors; includes
  hashing, fsyncs, manifest and pruning), against the raw write;
* `save_async`: the time the training loop is blocked (the snapshot to CPU memory) against
  the time until the checkpoint is durable. With `--device cuda` the tensors live on the
  GPU, so the snapshot includes the copies to the host;
* `load_latest` of that checkpoint, dropped from the page cache the same way first (sha256
  check, then torch.load into CPU memory: a restart's restore), against the raw read.

Memory and peer tiers (`ftslurm.memory_checkpoint.MemoryTier`): two ranks, processes of this
machine in a gloo group over loopback, each on its own named node whose memory area is a
folder under `--memory-dir` (default a temporary folder in /dev/shm, else in the temporary
directory; it needs about 8 x `--size-mb` MB free), each with a state of `--size-mb` MB:

* `MemoryTier.save`: what the step stands still for (the snapshot; the rest runs in the
  background) and the whole save until `wait()` returns (serialising, keeping the state in
  its node's area, sending it to the partner rank and keeping the partner's replica);
* restore from memory: `load_latest` with every area intact; each rank reads (and verifies)
  its own node's copy, tier "memory";
* restore from the peer: `load_latest` after rank 1's own copy was deleted from its node's
  area (its replica of rank 0 stays), so rank 1 receives its state from the replica on
  rank 0's node: tier "peer" for rank 1, "memory" for rank 0. The run fails unless
  `load_latest` returned exactly those tiers and each rank's own state.

Each rank times each call from a barrier; a repeat counts the slower rank, and MB/s is one
rank's state size over that time. The raw reference of these tiers, "raw copy": os.write
of the same size into a new file under the memory dir (on a RAM file system, a memory copy
into fresh pages). With `--device cuda` (`memory_device` in the JSON) both ranks' states
live on the GPU: a save's blocking part copies them to the host (the tier keeps host
copies), and each restore ends with the state back on the GPU (the copy counted).

    python benchmarks/checkpoint_throughput.py [--size-mb 512] [--dir DIR] [--repeat 3]
                                               [--memory-dir DIR] [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftslurm.checkpoint import CheckpointManager
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.memory_checkpoint import MemoryTier

MB = 1 << 20
CHUNK = 8 * MB
MEMORY_RANKS = 2
PEER_RANK = 1  # the rank whose own copy is deleted before the peer restore
MEMORY_STATES_AT_PEAK = 8  # in the memory dir during a save: per node, two states at two steps
GROUP_TIMEOUT_S = 300  # a collective left waiting by a rank that died fails after this


class BenchmarkError(RuntimeError):
    """A part of the benchmark did not do what it measures; the message says what."""


# --------------------------------------------------------------------------- raw references
def write_file_s(path: Path, size_mb: int, fsync: bool) -> float:
    """Seconds to write `size_mb` MB into a new file at `path` sequentially with os.write
    (8 MB chunks) and, with `fsync`, to fsync it."""
    chunk = os.urandom(CHUNK)
    remaining = size_mb * MB
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while remaining > 0:
            remaining -= os.write(fd, memoryview(chunk)[: min(CHUNK, remaining)])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def drop_from_page_cache(path: Path) -> bool:
    """Ask the kernel to drop the (already fsynced) `path` from the page cache, so that the
    next read comes from the disk; advisory. False where the advice cannot be given."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def read_file_s(path: Path) -> float:
    """Seconds to read `path` sequentially (8 MB reads into one reused buffer)."""
    buffer = memoryview(bytearray(CHUNK))
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def raw_disk_s(directory: Path, size_mb: int) -> tuple[float, float, bool]:
    """(write seconds, read seconds, whether the page cache could be told to drop the file)
    of `size_mb` MB in `directory`: os.write + fsync, then read back from a dropped cache."""
    path = directory / "raw-disk.bin"
    try:
        write_s = write_file_s(path, size_mb, fsync=True)
        dropped = drop_from_page_cache(path)
        return write_s, read_file_s(path), dropped
    finally:
        path.unlink(missing_ok=True)


def raw_copy_s(directory: Path, size_mb: int) -> float:
    """Seconds to write `size_mb` MB into a new file in the memory dir (no fsync: on a RAM
    file system this is a memory copy into fresh pages, what the memory tier's writes are)."""
    path = directory / "raw-copy.bin"
    try:
        return write_file_s(path, size_mb, fsync=False)
    finally:
        path.unlink(missing_ok=True)


def make_state(size_mb: int, device: str) -> dict[str, torch.Tensor]:
    """Float32 tensors adding up to `size_mb` MB, at most 16 of them."""
    count = max(1, min(16, size_mb // 32))
    total = size_mb * MB // 4
    sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
    return {f"layer{i}.weight": torch.randn(n, device=device) for i, n in enumerate(sizes)}


def same_state(got: dict[str, Any], want: dict[str, torch.Tensor]) -> bool:
    """Whether a restore returned `want` (a benchmark that restored wrong data measured
    nothing)."""
    return got.keys() == want.keys() and all(
        torch.equal(got[k].cpu(), v.cpu()) for k, v in want.items()
    )


# --------------------------------------------------------------------------- disk tier
def disk_tier(work: Path, size_mb: int, repeat: int, device: str) -> dict[str, Any]:
    """The disk part (module doc): lists of seconds per repeat, and the checkpoint size."""
    state = make_state(size_mb, device)
    ckpt = CheckpointManager(work / "checkpoints", keep_last=1, rank=0, world_size=1, report=False)
    out: dict[str, Any] = {k: [] for k in ("raw", "read", "save", "blocking", "total", "restore")}
    out["dropped"] = True
    step = 0
    for _ in range(repeat):
        write_s, read_s, dropped = raw_disk_s(work, size_mb)
        out["raw"].append(write_s)
        out["read"].append(read_s)
        out["dropped"] = out["dropped"] and dropped
        step += 1
        start = time.perf_counter()
        ckpt.save(step, state)
        out["save"].append(time.perf_counter() - start)
        step += 1
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        handle = ckpt.save_async(step, state)
        out["blocking"].append(time.perf_counter() - start)
        handle.wait()
        out["total"].append(time.perf_counter() - start)
        out["dropped"] = drop_from_page_cache(ckpt.path_of(step)) and out["dropped"]
        start = time.perf_counter()
        got = ckpt.load_latest()
        out["restore"].append(time.perf_counter() - start)
        if got is None or got[0] != step or not same_state(got[1], state):
            raise BenchmarkError(f"disk: load_latest did not restore the state of step {step}")
        del got
    out["file_mb"] = ckpt.path_of(step).stat().st_size / MB
    return out


# --------------------------------------------------------------------------- memory tiers
def memory_rank(rank: int, port: int, work: str, size_mb: int, repeat: int, device: str) -> None:
    """One rank of the memory part, in a process of its own: measures (`measure_memory`),
    writes its result (or its error) to `<work>/rank-<rank>.json` and leaves the way a
    training rank does (a bounded teardown of the process group, then os._exit)."""
    from ftslurm.agent.rank import leave

    code = 0
    try:
        result = measure_memory(rank, port, Path(work), size_mb, repeat, device)
    except Exception as exc:
        traceback.print_exc()
        # a failed check says more than the error of a rank whose partner went away
        result = {"error": str(exc) or type(exc).__name__, "check": isinstance(exc, BenchmarkError)}
        code = 1
    write_json_atomic(Path(work) / f"rank-{rank}.json", result)
    leave(code)


def measure_memory(
    rank: int, port: int, work: Path, size_mb: int, repeat: int, device: str
) -> dict[str, Any]:
    """What `memory_rank` measures: per repeat, the seconds of save, of the restore from
    memory and of the restore from the peer, and the tiers load_latest returned."""
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=MEMORY_RANKS, timeout=timeout
    )
    tier = MemoryTier(base=work / "areas", run="bench", node=f"node-{rank}")
    state = make_state(size_mb, device)
    out: dict[str, Any] = {
        "rank": rank,
        "node": tier.node,
        "save": [],
        "save_blocking": [],
        "memory": [],
        "peer": [],
        "memory_tiers": [],
        "peer_tiers": [],
    }

    def save_and_wait(step: int, state: dict[str, Any]) -> float:
        """The save (asynchronous: it returns after the snapshot) and its background part;
        returns the blocking seconds."""
        start = time.perf_counter()
        tier.save(step, state)
        blocking = time.perf_counter() - start
        tier.wait()
        return blocking

    def restore(step: int) -> tuple[int, dict[str, Any], str] | None:
        """load_latest, with the state back on the training's device."""
        got = tier.load_latest(step)
        if got is None or device == "cpu":
            return got
        moved = {k: v.to(device) for k, v in got[1].items()}
        torch.cuda.synchronize()
        return got[0], moved, got[2]

    def timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        dist.barrier()  # every rank starts the collective together
        start = time.perf_counter()
        got = call(*args)
        return got, time.perf_counter() - start

    for step in range(1, repeat + 1):
        blocking, whole = timed(save_and_wait, step, state)
        out["save"].append(whole)
        out["save_blocking"].append(blocking)
        for phase in ("memory", "peer"):
            expected = "peer" if phase == "peer" and rank == PEER_RANK else "memory"
            if phase == "peer" and rank == PEER_RANK:
                own = list(tier.area.glob(f"shard-{rank}-step-{step}.*"))
                if len(own) != 2:
                    raise BenchmarkError(
                        f"rank {rank}: expected its step file and manifest "
                        f"of step {step} in {tier.area}, found {len(own)}"
                    )
                for path in own:
                    path.unlink()
            got, seconds = timed(restore, step)
            if got is None:
                raise BenchmarkError(
                    f"rank {rank}: {phase} restore of step {step}: load_latest returned None"
                )
            if got[2] != expected:
                raise BenchmarkError(
                    f"rank {rank}: {phase} restore of step {step} came from "
                    f"tier {got[2]!r}, expected {expected!r}"
                )
            if got[0] != step or not same_state(got[1], state):
                raise BenchmarkError(
                    f"rank {rank}: {phase} restore of step {step} returned "
                    f"step {got[0]} or a state other than its own"
                )
            out[phase].append(seconds)
            out[f"{phase}_tiers"].append(got[2])
            del got
    dist.barrier()  # no rank leaves while another is still in a collective
    return out


def memory_tiers(work: Path, size_mb: int, repeat: int, device: str) -> list[dict[str, Any]]:
    """Run the memory part's ranks (spawned processes; a TCP store of this process on a free
    loopback port) and return each rank's result; BenchmarkError if any rank failed."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=memory_rank,
            name=f"memory-rank-{rank}",
            args=(rank, store.port, str(work), size_mb, repeat, device),
        )
        for rank in range(MEMORY_RANKS)
    ]
    limit_s = GROUP_TIMEOUT_S + 2 * size_mb * repeat  # a safety net: ranks time out first
    deadline = time.monotonic() + limit_s
    failed: list[int] = []
    try:
        for proc in procs:
            proc.start()
        pending = list(procs)
        while pending and not failed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchmarkError(f"memory part: ranks still running after {limit_s} s")
            ready = multiprocessing.connection.wait([p.sentinel for p in pending], left)
            for proc in [p for p in pending if p.sentinel in ready]:
                proc.join()
                pending.remove(proc)
                if proc.exitcode != 0:
                    failed.append(procs.index(proc))
    finally:
        for proc in procs:
            if proc.is_alive():  # a rank left waiting for one that failed
                proc.terminate()
            if proc.pid is not None:
                proc.join()
    if failed:
        errors = {rank: read_json(work / f"rank-{rank}.json") or {} for rank in failed}
        rank = next((r for r in failed if errors[r].get("check")), failed[0])
        error = errors[rank].get("error") or f"rank {rank} exited with {procs[rank].exitcode}"
        raise BenchmarkError(f"memory part: {error}")
    results = [read_json(work / f"rank-{rank}.json") for rank in range(MEMORY_RANKS)]
    expected = ["memory" if r != PEER_RANK else "peer" for r in range(MEMORY_RANKS)]
    for rank, result in enumerate(results):  # what the ranks checked, checked again here
        if not isinstance(result, dict) or len(result.get("peer", [])) != repeat:
            raise BenchmarkError(f"memory part, rank {rank}: no complete result")
        tiers = (set(result["memory_tiers"]), set(result["peer_tiers"]))
        if tiers != ({"memory"}, {expected[rank]}):
            raise BenchmarkError(
                f"memory part, rank {rank}: restored from tiers "
                f"{result['memory_tiers']} and {result['peer_tiers']}"
            )
    return results


def slowest(results: list[dict[str, Any]], key: str) -> float:
    """The median over repeats of the slower rank's seconds."""
    return statistics.median(max(times) for times in zip(*(r[key] for r in results), strict=True))


# --------------------------------------------------------------------------- main
def folder(parser: argparse.ArgumentParser, option: str, path: Path) -> Path:
    """`path` created if needed; a one-line parser error when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"{option} {path}: {exc.strerror or exc}")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mb",
        type=int,
        default=512,
        help="size of the state (of each rank's, for the memory tiers)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="folder on the disk to measure (default: a temporary folder)",
    )
    parser.add_argument(
        "--memory-dir",
        type=Path,
        default=None,
        help="folder for the memory tier's node areas (default: a temporary folder in "
        "/dev/shm, else in the temporary directory)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.size_mb < 1 or args.repeat < 1:
        parser.error("--size-mb and --repeat must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.dir is not None:
        folder(parser, "--dir", args.dir)
    if args.memory_dir is not None:
        memory_root = folder(parser, "--memory-dir", args.memory_dir)
    else:
        shm = Path("/dev/shm")
        memory_root = shm if shm.is_dir() else Path(tempfile.gettempdir())
    fs = os.statvfs(memory_root)
    need_mb = MEMORY_STATES_AT_PEAK * args.size_mb
    if fs.f_bavail * fs.f_frsize < need_mb * MB:
        parser.error(
            f"{memory_root} has {fs.f_bavail * fs.f_frsize // MB} MB free; the memory "
            f"tiers need about {need_mb} MB: give --memory-dir or a smaller --size-mb"
        )
    work = Path(tempfile.mkdtemp(prefix="ftslurm-ckpt-bench-", dir=args.dir))
    memory_work = Path(tempfile.mkdtemp(prefix="ftslurm-ckpt-bench-memory-", dir=memory_root))
    try:
        disk = disk_tier(work, args.size_mb, args.repeat, args.device)
        copy = [raw_copy_s(memory_work, args.size_mb) for _ in range(args.repeat)]
        ranks = memory_tiers(memory_work, args.size_mb, args.repeat, args.device)
    except BenchmarkError as exc:
        print(f"checkpoint_throughput: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory_work, ignore_errors=True)
    size = args.size_mb
    raw_s, save_s = statistics.median(disk["raw"]), statistics.median(disk["save"])
    result: dict[str, Any] = {
        "size_mb": size,
        "file_mb": round(disk["file_mb"], 3),
        "device": args.device,
        "repeat": args.repeat,
        "raw_s": raw_s,
        "raw_mb_s": size / raw_s,
        "save_s": save_s,
        "save_mb_s": size / save_s,
        "save_fraction_of_raw": raw_s / save_s,
        "async_blocking_s": statistics.median(disk["blocking"]),
        "async_total_s": statistics.median(disk["total"]),
    }
    result["async_blocking_fraction"] = result["async_blocking_s"] / result["async_total_s"]
    read_s, copy_s = statistics.median(disk["read"]), statistics.median(copy)
    result.update(
        {
            "raw_read_s": read_s,
            "raw_read_mb_s": size / read_s,
            "page_cache_dropped": disk["dropped"],
            "raw_copy_s": copy_s,
            "raw_copy_mb_s": size / copy_s,
            "memory_device": args.device,
            "memory_ranks": MEMORY_RANKS,
            "memory_restore_tiers": [r["memory_tiers"][0] for r in ranks],
            "peer_restore_tiers": [r["peer_tiers"][0] for r in ranks],
        }
    )
    measured = {
        "disk_restore": (statistics.median(disk["restore"]), read_s),
        "memory_save": (slowest(ranks, "save"), copy_s),
        "memory_save_blocking": (slowest(ranks, "save_blocking"), copy_s),
        "memory_restore": (slowest(ranks, "memory"), copy_s),
        "peer_restore": (slowest(ranks, "peer"), copy_s),
    }
    for name, (seconds, raw) in measured.items():
        result[f"{name}_s"] = seconds
        result[f"{name}_mb_s"] = size / seconds
        result[f"{name}_fraction_of_raw"] = raw / seconds
    if args.json:
        print(json.dumps(result))
        return 0
    print_table(result)
    return 0


def print_table(r: dict[str, Any]) -> None:
    """The result as a rich table, one group of rows per tier."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"checkpoint throughput: {r['size_mb']} MB, disk tier on {r['device']}, "
        f"memory tiers on {r['memory_device']} with {r['memory_ranks']} ranks, "
        f"median of {r['repeat']}"
    )
    table.add_column("tier")
    table.add_column("measure")
    for name in ("seconds", "MB/s", "fraction"):
        table.add_column(name, justify="right")

    def row(tier: str, measure: str, key: str, ratio: str = "", end: bool = False) -> None:
        mb_s = f"{r[key + '_mb_s']:.0f}" if key + "_mb_s" in r else ""
        table.add_row(tier, measure, f"{r[key + '_s']:.3f}", mb_s, ratio, end_section=end)

    row("raw", "disk write (os.write + fsync)", "raw")
    cached = "" if r["page_cache_dropped"] else ", page cache not dropped"
    row("raw", f"disk read (after fadvise DONTNEED{cached})", "raw_read")
    row("raw", "memory copy (os.write into the memory dir)", "raw_copy", end=True)
    row("disk", "CheckpointManager.save", "save", f"{r['save_fraction_of_raw']:.2f} of raw write")
    row(
        "disk",
        "save_async blocking (snapshot)",
        "async_blocking",
        f"{r['async_blocking_fraction']:.2f} of until durable",
    )
    row("disk", "save_async until durable", "async_total")
    row(
        "disk",
        "load_latest (restore)",
        "disk_restore",
        f"{r['disk_restore_fraction_of_raw']:.2f} of raw read",
        end=True,
    )
    row(
        "memory",
        "MemoryTier.save blocking (snapshot)",
        "memory_save_blocking",
        f"{r['memory_save_blocking_s'] / r['memory_save_s']:.2f} of the whole save",
    )
    row(
        "memory",
        "MemoryTier.save until kept and replicated",
        "memory_save",
        f"{r['memory_save_fraction_of_raw']:.2f} of raw copy",
    )
    row(
        "memory",
        "load_latest from this node's memory",
        "memory_restore",
        f"{r['memory_restore_fraction_of_raw']:.2f} of raw copy",
        end=True,
    )
    row(
        "peer",
        "load_latest from the partner's replica",
        "peer_restore",
        f"{r['peer_restore_fraction_of_raw']:.2f} of raw copy",
    )
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
