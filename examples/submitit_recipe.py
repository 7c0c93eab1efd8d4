"""A submitit-style training task, run by ftslurm as it is (CPU, one rank, deterministic).

    ftslurm submit examples/submitit_recipe.py --steps 2000 --step-time 0.05
    python examples/submitit_recipe.py --steps 300      # outside ftslurm: the same run

`Trainer` is written as a submitit user writes one: a `submitit.helpers.Checkpointable` whose
state lives in attributes (model, optimizer, step) and whose `checkpoint()` returns
`DelayedSubmission(self, ...)`, so the whole object is pickled and called again with the same
arguments. `ftslurm.agent.submitit_compat.run` stands in for submitit's job runner: on the
checkpoint signal (USR2) or SIGTERM it calls `checkpoint()`, stores the continuation and
exits 0, and the ftslurm daemon submits the continuation; the next attempt resumes from it.

submitit calls `checkpoint()` from inside the signal handler, wherever the training is:
possibly between `optimizer.step()` and `self.step += 1`. So the trainer keeps, in one
attribute replaced whole after every step, the state of the last complete step, and a
resumed trainer starts from that: an interrupted-and-resumed run ends with exactly the
parameters of an uninterrupted one (the data of step k depends only on k).

The one ftslurm line in `Trainer` is `progress.report_step(...)`, which tells the daemon how
far training got (and does nothing outside ftslurm, under plain submitit too). At the end
the trainer writes `final.json` (step and a parameter digest) into the output folder
(`--output-dir`, else $FTSLURM_CHECKPOINT_DIR, else ./checkpoints) and returns the digest.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import submitit
import torch

import ftslurm
from ftslurm.agent import progress, submitit_compat

recipe = ftslurm.Recipe(
    name="submitit-trainer", nodes=1, ntasks_per_node=1, cpus_per_task=1, time="30"
)


def batch(step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic data of one step: a noisy linear target, seeded by the step."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, 16, generator=g)
    weights = torch.arange(16, dtype=torch.float32).unsqueeze(1) / 16
    return x, x @ weights + 0.1 * torch.randn(size, 1, generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(",".join(float(v).hex() for v in p.detach().flatten().tolist()).encode())
    return h.hexdigest()[:16]


class Trainer(submitit.helpers.Checkpointable):
    """Linear regression by SGD with momentum, checkpointable the submitit way."""

    def __init__(self, lr: float = 0.05) -> None:
        self.lr = lr
        self.model: torch.nn.Linear | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self.last_complete: dict[str, Any] | None = None  # step, model and optimizer states

    def __call__(self, steps: int, output_dir: str | None = None, step_time: float = 0.0) -> str:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        self.step = 0
        if self.last_complete is not None:  # a continuation: back to its last complete step
            self.model.load_state_dict(self.last_complete["model"])
            self.optimizer.load_state_dict(self.last_complete["optimizer"])
            self.step = self.last_complete["step"]
        print(f"starting at step {self.step} of {steps}", flush=True)
        while self.step < steps:
            x, y = batch(self.step)
            self.optimizer.zero_grad()
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizer.step()
            self.step += 1
            # One assignment: checkpoint() sees the previous complete step or this one.
            self.last_complete = {
                "step": self.step,
                "model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            }
            progress.report_step(self.step)
            if step_time:
                time.sleep(step_time)
        result = digest(self.model)
        out = Path(output_dir or os.environ.get("FTSLURM_CHECKPOINT_DIR") or "checkpoints")
        out.mkdir(parents=True, exist_ok=True)
        (out / "final.json").write_text(json.dumps({"step": self.step, "digest": result}))
        print(f"finished at step {self.step}, digest {result}", flush=True)
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        step = self.last_complete["step"] if self.last_complete else 0
        print(f"checkpoint at step {step}", flush=True)
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument(
        "--output-dir",
        help="default: $FTSLURM_CHECKPOINT_DIR of the attempt that finishes, else ./checkpoints",
    )
    args = parser.parse_args()
    # A later attempt resumes the stored continuation, with the arguments stored in it.
    submitit_compat.run(
        Trainer(), steps=args.steps, output_dir=args.output_dir, step_time=args.step_time
    )


if __name__ == "__main__":
    main()
