"""A small real data-parallel PyTorch training run that checkpoints and resumes (CPU, gloo).

Run it once per rank (srun does that): it reads its rank from torch's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or else from Slurm's (SLURM_PROCID, SLURM_NTASKS,
the first node, a port derived from the job id). Everything is deterministic: the model
and the synthetic data depend only on the seed and the step, so an interrupted-and-resumed
run ends with exactly the parameters of an uninterrupted one.

- The ftslurm part is `ftslurm.Training` (`ftslurm.agent.loop`): a handful of lines around
  the loop. Every `--ckpt-every` steps it saves the whole training state (model,
  optimizer, step, RNG states) with `ftslurm.checkpoint.CheckpointManager` into
  `--checkpoint-dir` (or FTSLURM_CHECKPOINT_DIR): rank 0 takes a snapshot and writes it in
  the background, atomically (temporary file, fsync, rename, a manifest with the sha256),
  and on start every rank loads the newest checkpoint that verifies, skipping a truncated
  or corrupt one.
- Through the rank agent (`ftslurm.agent.rank`): timed sections and heartbeats the
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
- With `--live`, a fault costs one step (`ftslurm.agent.live`): the healthy ranks keep
  running, the step runs again, and a restarted rank receives the state from them.
- `--fail-at-step N --fail-rank R` makes rank R exit 3 whenever it reaches step N (with
  `--fail-once`, only before the launcher's first in-job restart; with `--fail-by-kill`,
  it SIGKILLs itself instead; to try in-job restarts and retries).
- With `--validate`, each step's loss is validated before the update (`train.validate`,
  docs/agent.md#result-validation): a NaN, Inf or spike re-runs the step in place; one that
  reproduces saves the last good state and exits 16, and the daemon re-runs it on other
  nodes (`--report-stats`: only count re-runs and non-determinism). `--nan-at-step N` makes
  rank 0's batch of step N hold a NaN on every run and every node: the model's fault, which
  validation ends with exit 17 once the disambiguation run reproduced it.
- When the last step is done it writes `final.json` (step and a parameter digest).

    python examples/recipe.py --steps 200 --checkpoint-dir ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from ftslurm import Training
from ftslurm.agent import live
from ftslurm.agent.validation_rules import Mode, Settings


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
    parser.add_argument(
        "--handover-timeout",
        type=float,
        default=live.HANDOVER_TIMEOUT_S,
        help="with --live: seconds a replica handing the state over may not answer before "
        "live recovery is given up (today's path then)",
    )
    parser.add_argument("--fail-at-step", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument(
        "--fail-once",
        action="store_true",
        help="with --fail-at-step: only before the launcher's first in-job restart",
    )
    parser.add_argument(
        "--fail-by-kill",
        action="store_true",
        help="with --fail-at-step: the rank SIGKILLs itself (as the kernel's OOM killer "
        "would) instead of exiting 3",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="with --live: treat the state as sharded (as FSDP's): a rank that lost its part "
        "is not given it by a peer; every rank restores from the memory tier or disk",
    )
    parser.add_argument(
        "--validate", action="store_true", help="validate each step's loss (re-run in place)"
    )
    parser.add_argument(
        "--report-stats",
        action="store_true",
        help="with --validate: count re-runs and non-determinism, never stop",
    )
    parser.add_argument(
        "--nan-at-step",
        type=int,
        default=-1,
        help="rank 0's batch of this step holds a NaN (a fault of the model, everywhere)",
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
    group = live.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        live=args.live,
        handover_timeout_s=args.handover_timeout,
    )
    rank, world = dist.get_rank(), dist.get_world_size()  # a warm spare's: the rank it took
    train = Training(
        model,
        optim,
        checkpoint_dir=args.checkpoint_dir,
        every=args.ckpt_every,
        disk_every=args.disk_every,
        memory=not args.no_memory_tier,
        group=group,
        replicated=not args.sharded,
        validate=Settings(mode=Mode.REPORT_STATS) if args.report_stats else args.validate,
    )
    if not train.rejoining:  # the same start on every rank, as DDP would broadcast
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    # --fail-once: a restarted process (torch's restart count above 0) does not fail again
    once_failed = args.fail_once and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"

    for step in train.steps(args.steps):  # restores; checkpoints; stops when asked to
        with train.step():  # everything that talks to the other ranks; then optim.step()
            with train.section("compute"):  # this rank's own work, without collectives
                x, y = batch(step * world + rank)
                if step == args.nan_at_step and rank == 0:
                    x[0, 0] = float("nan")
                optim.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if args.step_time:
                    time.sleep(args.step_time)
            average_gradients(model, world)
            if args.validate or args.report_stats:
                train.validate(loss)  # a suspicious loss: this step again, in place
        at = train.steps_done
        if train.committed and at == args.fail_at_step and rank == args.fail_rank:
            if not once_failed:
                print(f"rank {rank} fails at step {at} (--fail-at-step)", flush=True)
                if args.fail_by_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(3)
    if rank == 0:
        final = {"step": train.steps_done, "digest": digest(model)}
        (train.directory / "final.json").write_text(json.dumps(final))
        print(f"finished at step {final['step']}, digest {final['digest']}", flush=True)
    train.finish()  # the end reported, exit 0 (never returns)


if __name__ == "__main__":
    raise SystemExit(main())
