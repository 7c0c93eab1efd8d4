"""`python -m ftslurm.localcluster [--version 24.11] up|down|status|destroy|fail-node N|...`.

Without `--version` it is the host's Slurm (22.05); `--version 24.11` is a second cluster,
run from a Debian trixie root filesystem, with its own folder and ports (both can run).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ftslurm.localcluster.config import render_env_sh
from ftslurm.localcluster.harness import ClusterError, LocalCluster, default_root
from ftslurm.localcluster.rootfs import DEFAULT_CACHE, HOST_RELEASE, VERSIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ftslurm.localcluster",
        description="A local 4-node Slurm cluster on loopback.",
    )
    parser.add_argument(
        "--version",
        default=HOST_RELEASE,
        choices=VERSIONS,
        help=f"the Slurm release (default {HOST_RELEASE}, the host's own)",
    )
    parser.add_argument(
        "--root",
        help="the cluster's folder (default: "
        + ", ".join(f"{v}: {default_root(v)}" for v in VERSIONS)
        + ")",
    )
    parser.add_argument(
        "--cache",
        default=str(DEFAULT_CACHE),
        help="where another release's root filesystem is built and kept",
    )
    parser.add_argument(
        "command",
        choices=[
            "up",
            "down",
            "status",
            "destroy",
            "fail-node",
            "revive-node",
            "kill-tasks",
            "stop-controller",
            "start-controller",
            "slurmd-timeout",
            "add-user",
            "read-only-dir",
            "writable-dir",
            "env",
        ],
    )
    parser.add_argument(
        "node",
        nargs="?",
        help="the node (fail-node, revive-node, kill-tasks), the seconds or "
        "'default' (slurmd-timeout), the user name (add-user), the folder (read-only-dir, "
        "writable-dir)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cluster = LocalCluster(args.root, version=args.version, cache=args.cache)
        return _run(cluster, args, parser)
    except ClusterError as exc:
        print(f"Error: {exc.user_message()}", file=sys.stderr)
        return 2


def _run(cluster: LocalCluster, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """One command on the cluster; its exit status."""
    if args.command in ("read-only-dir", "writable-dir"):
        if not args.node:
            parser.error(f"{args.command} needs a folder")
        cluster.read_only_dir(args.node, read_only=args.command == "read-only-dir")
        return 0
    if args.command in ("fail-node", "revive-node", "kill-tasks", "slurmd-timeout", "add-user"):
        _on_node(cluster, args, parser)
        return 0
    match args.command:
        case "up":
            cluster.up()
            if cluster.build_s:
                print(f"built the Slurm {args.version} root filesystem in {cluster.build_s:.0f} s")
            print(
                f"local Slurm {args.version} cluster up: "
                f"{', '.join(cluster.layout.node_names)} idle"
            )
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
            print(render_env_sh(cluster.layout), end="")
        case "stop-controller":
            cluster.stop_controller()
        case "start-controller":
            cluster.start_controller()
    return 0


def _on_node(
    cluster: LocalCluster, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> None:
    """The commands that take a node, a number of seconds or a user."""
    match args.command:
        case "fail-node" | "revive-node" | "kill-tasks":
            if not args.node:
                parser.error(f"{args.command} needs a node name")
            if args.command == "revive-node":
                cluster.revive_node(args.node)
                print(f"{args.node} is back")
            else:
                killed = (
                    cluster.fail_node if args.command == "fail-node" else cluster.kill_job_processes
                )(args.node)
                print(
                    f"killed {len(killed)} processes of {args.node} "
                    f"(pids {' '.join(map(str, killed))})"
                )
        case "slurmd-timeout":
            if args.node != "default" and not (args.node or "").isdigit():
                parser.error("slurmd-timeout needs a number of seconds or 'default'")
            cluster.set_slurmd_timeout(None if args.node == "default" else int(args.node))
            print(f"SlurmdTimeout={args.node}")
        case "add-user":
            if not args.node:
                parser.error("add-user needs a user name")
            opened = cluster.add_user(args.node)
            for path in opened:
                print(f"opened {path} to other users (search only)")
            print(
                f"{args.node} is a user of the local Slurm {args.version} cluster; "
                "fault controls through sudo"
            )


if __name__ == "__main__":
    sys.exit(main())
