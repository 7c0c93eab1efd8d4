"""The pre-flight health check's time per node: the product's own checks
(`ftslurm.agent.health.run_checks`, as a launcher runs them before the rendezvous) with the
default settings, on this machine, repeated; and the same with the network probe of a job
of 8 nodes (node rank 0 answering, 7 nodes measuring and comparing with the median, all on
this machine's loopback) and with a site command (`true`, the cost of starting one).

    python benchmarks/health_check.py [--repeat 20] [--checkpoint-dir DIR] [--json]

Prints the median and the slowest of each, against the bound the checks run within
(`HealthConfig.timeout_s`, 5 s by default). The checkpoint directory is a temporary folder
unless given: pass the file system a run would use to time its write + fsync there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from ftslurm.agent import health as hc
from ftslurm.core.contract import HealthConfig, RunDir

NODES = 8  # of the job whose network probe is timed


def local(config: HealthConfig, folder: str) -> hc.Health:
    return hc.run_checks(
        config,
        checkpoint_dir=folder,
        node="bench",
        node_rank=0,
        nnodes=1,
        job="bench",
        attempt=0,
        run=None,
        environ={},
    )


def with_network(config: HealthConfig, folder: str, round_: int, base: Path) -> list[float]:
    """Every node's check of a job of NODES nodes on this machine: seconds per node."""
    run = RunDir(base / f"run-{round_}")
    run.attempt(0).mkdir(parents=True)
    took: dict[int, float] = {}

    def node(r: int) -> None:
        started = time.perf_counter()
        health = hc.run_checks(
            config,
            checkpoint_dir=folder,
            node=f"n{r}",
            node_rank=r,
            nnodes=NODES,
            job=f"bench-{round_}",
            attempt=0,
            run=run,
            environ={},
            host="127.0.0.1",
        )
        assert health.failure is None, hc.said(health)
        took[r] = time.perf_counter() - started

    threads = [threading.Thread(target=node, args=(r,)) for r in range(NODES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [took[r] for r in sorted(took)]


def summary(samples: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(samples), "max_s": max(samples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint_dir or str(Path(tmp) / "ckpt")
        config = HealthConfig()
        plain = [local(config, folder).seconds for _ in range(args.repeat)]
        site = [
            local(config.model_copy(update={"command": "true"}), folder).seconds
            for _ in range(args.repeat)
        ]
        network = [
            s
            for i in range(max(1, args.repeat // 4))
            for s in with_network(config, folder, i, Path(tmp))
        ]
    out = {
        "bound_s": config.timeout_s,
        "local_checks": summary(plain),
        "with_site_command": summary(site),
        f"with_network_probe_{NODES}_nodes": summary(network),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"pre-flight health check per node (bound {config.timeout_s:g} s), {args.repeat} runs")
    for name, figures in out.items():
        if isinstance(figures, dict):
            print(
                f"  {name:32s} median {figures['median_s'] * 1000:7.1f} ms   "
                f"slowest {figures['max_s'] * 1000:7.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
