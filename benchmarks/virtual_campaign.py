"""How fast the virtual-clock mock simulates long campaigns (target: 30 days x 2048 nodes
in well under 60 s on 2 cores).

For each job size it simulates one 30-day campaign with Llama 3's unexpected-interruption
rate (3.79 per 1000 node-days), Slurm's defaults (SlurmdTimeout 300 s, requeue delay 120 s),
a checkpoint every 30 min costing 60 s and a 300 s restart, and prints the wall time, the
simulated-to-wall speed-up and the cost relative to the smallest size measured in the same
run, plus the ETTR the plain continuation policy reached.

    python benchmarks/virtual_campaign.py [--sizes 128,1024,2048] [--days 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from ftslurm.backends.mock.virtual import JobModel, simulate_campaign


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,1024,2048")
    parser.add_argument("--days", type=float, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    job = JobModel(
        work_s=args.days * 86400,
        checkpoint_interval_s=1800,
        checkpoint_cost_s=60,
        restart_cost_s=300,
    )
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        start = time.perf_counter()
        stats = simulate_campaign(
            nodes=size,
            spare_nodes=max(2, size // 50),
            days=args.days,
            job=job,
            failures_per_node_day=3.79 / 1000,
            seed=args.seed,
        )
        took = time.perf_counter() - start
        rows.append(
            {
                "nodes": size,
                "wall_s": took,
                "simulated_days": stats.wall_s / 86400,
                "speedup": stats.wall_s / took if took else float("inf"),
                "node_failures": stats.node_failures,
                "attempts": stats.attempts,
                "events": stats.events,
                "ettr": stats.ettr,
            }
        )
    for row in rows:
        row["cost_vs_smallest"] = row["wall_s"] / rows[0]["wall_s"] if rows[0]["wall_s"] else 0
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{'nodes':>6} {'wall s':>8} {'sim days':>9} {'speed-up':>10} {'x smallest':>10} "
        f"{'failures':>8} {'events':>7} {'ETTR':>6}"
    )
    for r in rows:
        print(
            f"{r['nodes']:>6} {r['wall_s']:>8.2f} {r['simulated_days']:>9.1f} "
            f"{r['speedup']:>10.0f} {r['cost_vs_smallest']:>10.1f} {r['node_failures']:>8} "
            f"{r['events']:>7} {r['ettr']:>6.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
