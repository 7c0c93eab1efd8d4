"""Result validation in a plain PyTorch loop (the rank agent's API, without `Training`).

Each step's loss is checked before the optimizer applies the step (`agent.validate`, a
collective: every rank gets the same answer). A NaN, an Inf or a spike re-runs the step in
place: the script gives the hooks that put back what the step changed before its update,
here the random generators (the step draws noise) and the data position (an iterator over
batches); the model and the optimizer have not changed yet, and the gradients are zeroed.
When the re-run gives the same wrong result, `checkpoint` saves the last good state and
the rank exits 16 (the daemon re-runs the job on other nodes); in that disambiguation run,
a result that reproduces again exits 17 (the model's fault). docs/agent.md#result-validation.

Run it once per rank with torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

    python examples/validated_loop.py --steps 60 --checkpoint-dir ckpt

It resumes from the newest checkpoint, and writes `final.json` (step, parameter digest)
into the checkpoint folder at the end. `--nan-at-step N`: rank 0's batch of step N holds a
NaN on every run (a fault of the model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftslurm.agent import rank as fta
from ftslurm.agent.validation import capture_rng, restore_rng


class Batches:
    """A data source with a position (as a sampler's or a dataloader's state would be)."""

    def __init__(self, rank: int, world: int, position: int = 0) -> None:
        self.rank, self.world, self.position = rank, world, position

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7_000 + self.position * self.world + self.rank)
        self.position += 1
        x = torch.randn(32, 16, generator=g)
        return x, x.sum(dim=1, keepdim=True) / 4


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(",".join(float(v).hex() for v in p.detach().flatten().tolist()).encode())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--nan-at-step", type=int, default=-1)
    parser.add_argument("--no-validate", action="store_true", help="the same loop, unchecked")
    parser.add_argument(
        "--report-stats", action="store_true", help="count re-runs and non-determinism only"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    folder = Path(args.checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    saved = folder / "state.pt"
    start = 0
    if saved.exists():
        state = torch.load(saved, weights_only=False)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"]
        restore_rng(state["rng"])
    data = Batches(rank, world, position=start)
    step = start

    def checkpoint() -> None:
        """The last good state: the model and optimizer before this step's update."""
        if rank == 0:
            tmp = saved.with_suffix(".tmp")
            state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
            torch.save({**state, "rng": rng_before}, tmp)
            os.replace(tmp, saved)
        dist.barrier()

    agent = fta.init()
    # defaults: a spike is over 10x the median of the last 20 losses, after 10
    agent.validation(checkpoint=checkpoint, mode="report_stats" if args.report_stats else "enforce")

    def capture() -> dict[str, Any]:
        return {"rng": capture_rng(), "position": data.position}

    def restore(state: dict[str, Any]) -> None:
        restore_rng(state["rng"])
        data.position = state["position"]
        optim.zero_grad()

    for step in range(start, args.steps):
        rng_before = capture_rng()
        before = capture()
        while True:
            x, y = data.next()
            if step == args.nan_at_step and rank == 0:
                x[0, 0] = float("nan")
            optim.zero_grad()
            noisy = x + 0.01 * torch.randn_like(x)  # the step draws from the global RNG
            loss = torch.nn.functional.mse_loss(model(noisy), y)
            loss.backward()
            for p in model.parameters():  # data parallel, one all-reduce per parameter
                dist.all_reduce(p.grad)
                p.grad /= world
            if args.no_validate or agent.validate(loss, step) is fta.GO_ON:
                break
            restore(before)  # a suspicious result: this step again, in place
        optim.step()
        agent.heartbeat(step + 1)
    if rank == 0:
        final = {"step": args.steps, "digest": digest(model)}
        (folder / "final.json").write_text(json.dumps(final))
        print(f"finished at step {args.steps}, digest {final['digest']}", flush=True)
    agent.finished(args.steps)
    agent.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
