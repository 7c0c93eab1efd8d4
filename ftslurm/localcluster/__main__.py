"""`python -m ftslurm.localcluster up|down|status|destroy|fail-node N|revive-node N|...`."""

from __future__ import annotations

import argparse
import logging
import sys

from ftslurm.localcluster.harness import DEFAULT_ROOT, ClusterError, LocalCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftslurm.localcluster",
                                     description="A local 4-node Slurm cluster on loopback.")
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="the cluster's folder")
    parser.add_argument("command", choices=["up", "down", "status", "destroy", "fail-node",
                                            "revive-node", "stop-controller", "start-controller",
                                            "env"])
    parser.add_argument("node", nargs="?")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cluster = LocalCluster(args.root)
    try:
        match args.command:
            case "up":
                cluster.up()
                print(f"local Slurm cluster up: {', '.join(cluster.layout.node_names)} idle")
                print(f"use it with: . {cluster.layout.env_file}")
            case "down":
                cluster.down()
                print("local Slurm cluster stopped")
            case "destroy":
                cluster.destroy()
                print(f"local Slurm cluster stopped and {cluster.layout.root} removed")
            case "status":
                for d in cluster.daemons():
                    print(f"{d.name:<12} {'running pid ' + str(d.pid) if d.alive else 'stopped'}")
                states = cluster.node_states()
                for node in cluster.layout.node_names:
                    print(f"node {node:<7} {states.get(node, 'unreachable')}")
                return 0 if cluster.is_up() else 1
            case "env":
                print(f"export SLURM_CONF={cluster.layout.slurm_conf}")
            case "fail-node" | "revive-node":
                if not args.node:
                    parser.error(f"{args.command} needs a node name")
                if args.command == "fail-node":
                    print(f"killed {len(cluster.fail_node(args.node))} processes of {args.node}")
                else:
                    cluster.revive_node(args.node)
                    print(f"{args.node} is back")
            case "stop-controller":
                cluster.stop_controller()
            case "start-controller":
                cluster.start_controller()
    except ClusterError as exc:
        print(f"Error: {exc.user_message()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
