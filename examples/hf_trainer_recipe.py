"""A Hugging Face `Trainer` run under ftslurm: the training script as it is, plus one callback.

Run it once per rank (ftslurm's launcher, or torchrun, does that): the Trainer forms the
process group from torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on
CPU here). What ftslurm adds is two lines:

    callback = FtslurmCallback()   # the checkpoint signal and SIGTERM only set a flag
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(output_dir))

On the checkpoint signal (before the wall limit, or a preemption's SIGTERM) every rank saves
`checkpoint-<step>` at the same step and the process exits 0, "checkpointed, continue me";
the next attempt resumes from the newest complete checkpoint (a save cut short by a lost
node is skipped). The Trainer's own `--save-steps` checkpoints count too: after a node
failure the run goes on from the last of them. Everything is deterministic (seeded model,
data and shuffling, full precision, no dropout, no data-loader workers), so an interrupted
and resumed run ends with exactly the parameters of an uninterrupted one; rank 0 writes
them as a digest into `<output-dir>/final.json`.

    ftslurm submit -N 2 examples/hf_trainer_recipe.py -- --steps 400 --output-dir out
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_recipe.py --output-dir ref
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from ftslurm.integrations.transformers import FtslurmCallback, last_complete_checkpoint


class TinyRegressor(torch.nn.Module):
    """What the Trainer needs of a model: `forward(**batch)` returning a dict with "loss"."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(prediction, labels), "logits": prediction}


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, size: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 8, generator=g)
        self.y = torch.sin(self.x.sum(1, keepdim=True)) + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Pace(TrainerCallback):
    """--step-time: a slower step, so that a short run lasts long enough to be interrupted."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--output-dir", default="hf-out")
    args = parser.parse_args()

    callback = FtslurmCallback()  # before anything slow: from here a signal only sets a flag
    torch.manual_seed(0)
    model = TinyRegressor()
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        seed=0,
        data_seed=0,
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=50,
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
    )
    callbacks: list[TrainerCallback] = [callback]
    if args.step_time:
        callbacks.append(Pace(args.step_time))
    trainer = Trainer(model=model, args=training, train_dataset=Synthetic(), callbacks=callbacks)
    resume = last_complete_checkpoint(args.output_dir)
    rank = training.process_index
    if rank == 0:
        print(
            f"rank 0 of {training.world_size} starts from {resume or 'scratch'} "
            f"(attempt {os.environ.get('FTSLURM_ATTEMPT', '-')})",
            flush=True,
        )
    trainer.train(resume_from_checkpoint=resume)  # on ftslurm's stop: exits 0 inside
    if rank == 0:
        final = {"step": trainer.state.global_step, "digest": digest(model)}
        (Path(args.output_dir) / "final.json").write_text(json.dumps(final))
        print(f"finished at step {final['step']}, digest {final['digest']}", flush=True)
    # As the rank agent's scripts end: the process group torn down with a time limit, then
    # os._exit (gloo's threads may abort the interpreter's own exit after a good run).
    callback.agent.exit(0)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
