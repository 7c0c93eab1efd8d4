"""A Lightning training run under ftslurm (CPU, DDP over gloo, deterministic).

    ftslurm submit examples/lightning_recipe.py -- --steps 2000 --step-time 0.05
    torchrun --standalone --nproc-per-node 2 examples/lightning_recipe.py --steps 300
    python examples/lightning_recipe.py --steps 300       # one process, outside ftslurm

The LightningModule and the Trainer are plain Lightning; ftslurm adds three things
(`ftslurm.integrations.lightning`):

- `FtslurmCallback()` in the Trainer's callbacks: when the daemon asks for a checkpoint
  (its signal before the wall limit, SIGTERM at a preemption, or its tuned interval) every
  rank saves at the same step, after the optimizer step, with `trainer.save_checkpoint`
  (never inside a signal handler); on a stop request the ranks stop and `ft.exit()` leaves
  with 0, "checkpointed, continue me". Lightning's SLURM auto-requeue never runs.
- `plugins=plugins()`: the ranks as ftslurm's launcher started them (torch elastic's
  variables), not as Slurm's variables describe the launchers.
- `ckpt_path=ft.resume_path()`: a continuation, or a retry after a lost node, resumes from
  the newest complete checkpoint.

Lightning restores the model, the optimizer and `trainer.global_step`, but the position
inside a plain DataLoader only with a stateful loader; so the data of each step is drawn
from the global step and the rank (`batch`), and the loader only counts the steps
(Lightning's warning on resuming, "your dataloader is not resumable", does not apply). An
interrupted-and-resumed run then ends with exactly the parameters of an uninterrupted one:
with two ranks DDP's gradient sum does not depend on the order of its buckets. With more
ranks DDP can regroup its buckets after the first iteration, which changes the order of the
floating-point sums (`examples/recipe.py` all-reduces per parameter in a fixed order for
that reason). Rank 0 writes `final.json` (step and a parameter digest) into `--output-dir`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import lightning.pytorch as L
import torch

import ftslurm
from ftslurm.integrations.lightning import FtslurmCallback, plugins

recipe = ftslurm.Recipe(name="lightning", nodes=2, ntasks_per_node=1, cpus_per_task=1, time="30")


def batch(seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic data of one rank's step: a noisy linear target."""
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(size, 16, generator=g)
    weights = torch.arange(16, dtype=torch.float32).unsqueeze(1) / 16
    return x, x @ weights + 0.1 * torch.randn(size, 1, generator=g)


class Regression(L.LightningModule):
    def __init__(self, step_time: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 1)
        self.step_time = step_time

    def training_step(self, _index: torch.Tensor, _batch_idx: int) -> torch.Tensor:
        x, y = batch(self.global_step * self.trainer.world_size + self.global_rank)
        if self.step_time:
            time.sleep(self.step_time)
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_start(self) -> None:
        print(
            f"rank {self.global_rank} of {self.trainer.world_size} starts at step "
            f"{self.global_step} (attempt {os.environ.get('FTSLURM_ATTEMPT', '0')})",
            flush=True,
        )


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(",".join(float(v).hex() for v in p.detach().flatten().tolist()).encode())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument(
        "--output-dir",
        help="where rank 0 writes final.json (default: the checkpoint folder, "
        "$FTSLURM_CHECKPOINT_DIR or ./checkpoints)",
    )
    parser.add_argument("--checkpoint-dir", help="the callback's folder (default: its own)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    # The job's shape as the launcher (or torchrun) started it; one process otherwise.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // per_node
    ft = FtslurmCallback(args.checkpoint_dir)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=nodes,
        strategy="ddp" if per_node * nodes > 1 else "auto",
        plugins=plugins(),
        callbacks=[ft],
        max_steps=args.steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regression(args.step_time)
    steps = torch.utils.data.DataLoader(range(args.steps), batch_size=None)  # counts steps
    trainer.fit(module, steps, ckpt_path=ft.resume_path())
    if ft.stopped:
        print(f"rank {trainer.global_rank} stopped at step {ft.saved_step}", flush=True)
    elif trainer.is_global_zero:
        out = Path(args.output_dir or ft.dirpath.parent)
        out.mkdir(parents=True, exist_ok=True)
        result = {"step": trainer.global_step, "digest": digest(module)}
        (out / "final.json").write_text(json.dumps(result))
        print(f"finished at step {trainer.global_step}, digest {result['digest']}", flush=True)
    ft.exit(0)  # after a stop: "checkpointed, continue me"


if __name__ == "__main__":
    main()
