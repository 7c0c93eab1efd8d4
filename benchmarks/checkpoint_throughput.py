"""Checkpoint throughput: CheckpointManager.save against the raw write bandwidth of its disk.

In one run, on the same folder: the raw sequential write bandwidth (os.write in 8 MB chunks,
then fsync), `CheckpointManager.save` of a state of the same size (several float32 tensors;
includes hashing, fsyncs, manifest and pruning), and `save_async`: the time the training loop
is blocked (the snapshot to CPU memory) against the time until the checkpoint is durable.
With `--device cuda` the tensors live on the GPU, so the snapshot includes the copies to the
host. Sizes are in MB of 2**20 bytes; each figure is the median of `--repeat` runs.

    python benchmarks/checkpoint_throughput.py [--size-mb 512] [--dir DIR] [--repeat 3]
                                               [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ftslurm.checkpoint import CheckpointManager

MB = 1 << 20
CHUNK = 8 * MB


def raw_write_s(directory: Path, size_mb: int) -> float:
    """Seconds to write `size_mb` MB sequentially with os.write and fsync them."""
    chunk = os.urandom(CHUNK)
    path = directory / "raw-write.bin"
    remaining = size_mb * MB
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while remaining > 0:
            remaining -= os.write(fd, memoryview(chunk)[: min(CHUNK, remaining)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def make_state(size_mb: int, device: str) -> dict[str, torch.Tensor]:
    """Float32 tensors adding up to `size_mb` MB, at most 16 of them."""
    count = max(1, min(16, size_mb // 32))
    total = size_mb * MB // 4
    sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
    return {f"layer{i}.weight": torch.randn(n, device=device) for i, n in enumerate(sizes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="folder on the disk to measure (default: a temporary folder)",
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
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ftslurm-ckpt-bench-", dir=args.dir))
    try:
        state = make_state(args.size_mb, args.device)
        ckpt = CheckpointManager(work / "checkpoints", keep_last=1, rank=0, world_size=1,
                                 report=False)  # fmt: skip
        raw, save, blocking, total = [], [], [], []
        step = 0
        for _ in range(args.repeat):
            raw.append(raw_write_s(work, args.size_mb))
            step += 1
            start = time.perf_counter()
            ckpt.save(step, state)
            save.append(time.perf_counter() - start)
            step += 1
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            handle = ckpt.save_async(step, state)
            blocking.append(time.perf_counter() - start)
            handle.wait()
            total.append(time.perf_counter() - start)
        file_mb = ckpt.path_of(step).stat().st_size / MB
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw_s, save_s = statistics.median(raw), statistics.median(save)
    result = {
        "size_mb": args.size_mb, "file_mb": round(file_mb, 3), "device": args.device,
        "repeat": args.repeat, "raw_s": raw_s, "raw_mb_s": args.size_mb / raw_s,
        "save_s": save_s, "save_mb_s": args.size_mb / save_s,
        "save_fraction_of_raw": raw_s / save_s,
        "async_blocking_s": statistics.median(blocking),
        "async_total_s": statistics.median(total),
    }  # fmt: skip
    result["async_blocking_fraction"] = result["async_blocking_s"] / result["async_total_s"]
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoint throughput: {args.size_mb} MB on {args.device}, "
                        f"median of {args.repeat}")  # fmt: skip
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("raw sequential write", f"{result['raw_mb_s']:.0f} MB/s ({raw_s:.3f} s)"),
        ("CheckpointManager.save", f"{result['save_mb_s']:.0f} MB/s ({save_s:.3f} s)"),
        ("save / raw bandwidth", f"{result['save_fraction_of_raw']:.2f}"),
        ("save_async blocking (snapshot)", f"{result['async_blocking_s']:.3f} s"),
        ("save_async until durable", f"{result['async_total_s']:.3f} s"),
        ("blocking / total", f"{result['async_blocking_fraction']:.2f}"),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
