"""A small real data-parallel PyTorch training run that checkpoints and resumes (CPU, gloo).

Run it once per rank (srun does that): it reads its rank from torch's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or else from Slurm's (SLURM_PROCID, SLURM_NTASKS,
the first node, a port derived from the job id). Everything is deterministic: the model
and the synthetic data depend only on the seed and the step, so an interrupted-and-resumed
run ends with exactly the parameters of an uninterrupted one.

- Every `--ckpt-every` steps it saves the whole training state (model, optimizer, step,
  RNG states) with `ftslurm.checkpoint.CheckpointManager` into `--checkpoint-dir` (or
  FTSLURM_CHECKPOINT_DIR): rank 0 takes a snapshot and writes it in the background,
  atomically (temporary file, fsync, rename, a manifest with the sha256), and on start
  every rank loads the newest checkpoint that verifies, skipping a truncated or corrupt
  one.
- It uses ftslurm's rank agent (`ftslurm.agent.rank`): timed sections and heartbeats the
  launcher watches for hangs (the forward and backward pass in a "compute" section, whose
  durations become the straggler scores); on SIGTERM or the checkpoint signal (SIGUSR2)
  the handler only sets a flag, and `should_checkpoint()` makes all ranks agree at the same
  step (an all-reduce); they save a checkpoint and exit 0: "checkpointed, continue me".
  `should_checkpoint()` also answers True when the checkpoint interval the daemon tuned for
  the run has passed (the ranks save and train on). It reports checkpoints, with the time
  each save took, and the end of training to the daemon. Outside ftslurm it works the same.
- Every checkpoint is also kept in node memory with a replica on another node
  (`ftslurm.memory_checkpoint`; `--no-memory-tier` turns it off): once the daemon has seen
  a memory save it tunes two intervals, and `agent.checkpoint_tier` says whether a periodic
  checkpoint stays in memory or also goes to disk; of the `--ckpt-every` ones, every
  `--disk-every`'th goes to disk.
- `--fail-at-step N --fail-rank R` makes rank R exit 3 whenever it reaches step N (with
  `--fail-once`, only before the launcher's first in-job restart; to try
  in-job restarts and retries).
- When the last step is done it writes `final.json` (step and a parameter digest).

    python examples/recipe.py --steps 200 --checkpoint-dir ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftslurm.agent import live
from ftslurm.agent import rank as fta
from ftslurm.checkpoint import CheckpointManager, restore_training_state, training_state
from ftslurm.memory_checkpoint import MemoryTier


def dist_env() -> tuple[int, int, str, str]:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    # A fresh port per attempt: the previous attempt's sockets may linger in TIME_WAIT.
    port = os.environ.get("MASTER_PORT") or str(20000 + (job * 17 + attempt) % 20000)
    return rank, world, addr, port


def batch(step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, 16, generator=g)
    weights = torch.arange(16, dtype=torch.float32).unsqueeze(1) / 16
    return x, x @ weights + 0.1 * torch.randn(size, 1, generator=g)


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Data parallelism, as DDP does it, but one all-reduce per parameter in a fixed order:
    DDP regroups its gradient buckets after the first iteration, which changes the order of
    the floating-point sums with more than two ranks, so a resumed run would differ from an
    uninterrupted one in the last bits."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(",".join(float(v).hex() for v in p.detach().flatten().tolist()).encode())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument(
        "--checkpoint-dir", default=os.environ.get("FTSLURM_CHECKPOINT_DIR", "checkpoints")
    )
    parser.add_argument(
        "--disk-every",
        type=int,
        default=1,
        help="every how many checkpoints also go to disk (the others are "
        "kept in node memory only, with a replica on another node)",
    )
    parser.add_argument("--no-memory-tier", action="store_true", help="checkpoint to disk only")
    parser.add_argument(
        "--live",
        action="store_true",
        help="live recovery: a fault costs one step, the healthy ranks keep running",
    )
    parser.add_argument("--fail-at-step", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument(
        "--fail-once",
        action="store_true",
        help="with --fail-at-step: only before the launcher's first in-job restart",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="with --live: treat the state as sharded (as FSDP's): a rank that lost its part "
        "is not given it by a peer; every rank restores from the memory tier or disk",
    )
    args = parser.parse_args()

    rank, world, addr, port = dist_env()
    # Built before the process group: a warm spare's rank (live recovery) waits in
    # `init_process_group` with its model and optimizer built already.
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # With --live and a coordinator store (the launcher's), a fault costs one step: the
    # healthy ranks keep running and a restarted rank receives the state from them
    # (`ftslurm.agent.live`). Otherwise a plain process group.
    group = live.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", live=args.live)
    rank, world = dist.get_rank(), dist.get_world_size()  # a warm spare's: the rank it took
    agent = fta.init()  # signal handlers (flag only), heartbeats, sections
    if not group.rejoining:  # the same start on every rank, as DDP would broadcast
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    ckpt_dir = Path(args.checkpoint_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # Saves are asynchronous: the training stands still only for the snapshot, the file is
    # written in the background, and the manager tells the daemon of each save once it is
    # on disk (with both times: the daemon tunes the checkpoint interval from them).
    manager = CheckpointManager(ckpt_dir, keep_last=2)
    # Every checkpoint is also kept in node memory, with a replica on another node: after a
    # lost node the ranks restore from memory when it holds a step as new as the disk's.
    memory = None if args.no_memory_tier else MemoryTier()
    step, tier = 0, "nothing"
    with agent.section("setup"):
        if group.rejoining:  # restarted alone: the state comes from the running ranks
            tier = "a live peer"
        else:
            on_disk = manager.steps()
            got = memory.load_latest(min_step=on_disk[-1] if on_disk else None) if memory else None
            if got is not None:
                step, tier = restore_training_state(got[1], model, optim), got[2]
            else:
                latest = manager.load_latest()  # the newest checkpoint that verifies
                if latest is not None:
                    step, tier = restore_training_state(latest[1], model, optim), "disk"

    saves, saved_at, stop = 0, -1, False
    # --fail-once: a restarted process (torch's restart count above 0) does not fail again
    once_failed = args.fail_once and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"

    # A live recovery hands over what decides the ranks' next collectives too: the count
    # of saves and the step saved last (a rank that lacked them would save alone).
    def load(state: dict) -> None:  # a live recovery's handover, on a rank that lacks it
        nonlocal step, saves, saved_at
        step = restore_training_state(state["training"], model, optim)
        saves, saved_at = state["saves"], state["saved_at"]

    group.attach(
        state=lambda: {
            "training": training_state(model, optim, step),
            "saves": saves,
            "saved_at": saved_at,
        },
        load=load,
        step=lambda: step,
        on_regroup=[memory.regroup] if memory is not None else [],
        replicated=not args.sharded,
    )
    if rank == 0 or group.rejoining:
        print(
            f"rank {rank} of {world} starts at step {step} "
            f"(attempt {os.environ.get('FTSLURM_ATTEMPT', '0')}, in-job restart "
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}) from {tier}",
            flush=True,
        )
    if tier in ("memory", "peer"):  # which tier each rank's state came from
        print(
            f"rank {rank} restored step {step} from "
            f"{'its node memory' if tier == 'memory' else 'a peer replica'}",
            flush=True,
        )

    def checkpoint(disk: bool = False) -> None:
        nonlocal saves, saved_at
        with agent.section("checkpointing"):
            state = training_state(model, optim, step)
            if memory is not None:
                memory.save(step, state)  # a collective: every rank, this step
            saves += 1
            if memory is None or disk or saves % args.disk_every == 0:
                manager.checkpoint(step, state)  # rank 0 writes
            dist.barrier()
        saved_at = step
        agent.save_observed()  # the sections' timings, for the next attempt's timeouts

    def iteration() -> None:
        """Everything of one step that talks to the other ranks; the optimizer step comes
        after the commit (with --live, a fault in here costs this step alone)."""
        nonlocal stop
        if step and step % args.ckpt_every == 0 and saved_at != step:
            checkpoint()
        # The same answer on every rank at this step: the checkpoint signal, or the
        # periodic interval the daemon tuned for this run (Daly's optimum) has passed.
        if agent.should_checkpoint():
            # To memory, or also to disk: a stop's, and the disk tier's longer interval.
            checkpoint(disk=agent.checkpoint_tier == "disk")
            if agent.should_stop():  # the signal, not the periodic one
                stop = True
                return
            if rank == 0:
                print(
                    f"periodic checkpoint at step {step} to {agent.checkpoint_tier} (every "
                    f"{agent.checkpoint_interval or 0:.3g} s, disk every "
                    f"{agent.disk_checkpoint_interval or 0:.3g} s)",
                    flush=True,
                )
        with agent.section("step"):
            with agent.section("compute"):  # this rank's own work, without collectives
                x, y = batch(step * world + rank)
                optim.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                if args.step_time:
                    time.sleep(args.step_time)
            average_gradients(model, world)

    while step < args.steps:
        if not group.commit(iteration):
            agent.heartbeat(step)  # a fault: the group was formed again; this step again
            continue
        if stop:
            if rank == 0:
                print(
                    f"checkpointed at step {step} on request; exiting for a continuation",
                    flush=True,
                )
            agent.exit(0)  # the process group torn down, then os._exit: never returns
        optim.step()
        step += 1
        agent.heartbeat(step)
        if step == args.fail_at_step and rank == args.fail_rank and not once_failed:
            print(f"rank {rank} fails at step {step} (--fail-at-step)", flush=True)
            os._exit(3)
    if step % args.ckpt_every == 0 and saved_at != step:
        checkpoint()
    if rank == 0:
        (ckpt_dir / "final.json").write_text(json.dumps({"step": step, "digest": digest(model)}))
        print(f"finished at step {step}, digest {digest(model)}", flush=True)
        agent.finished(step)
    if memory is not None:
        memory.clear()  # the run is over: its states leave this node's memory
    # Not destroy_process_group() and a return: gloo's worker threads may still be dropping
    # their last work items while the interpreter finalises, and abort it (exit 134).
    agent.exit(0)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
