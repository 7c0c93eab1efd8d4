"""A plain data-parallel script written for torchrun, with no ftslurm in it (CPU, gloo).

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py 500 0.1 out
    ftslurm submit -t 5 torchrun -- --nproc-per-node 2 examples/torchrun_ddp.py 500 0.1 out

Arguments: STEPS, STEP_SECONDS (an extra sleep per step), OUTPUT_DIR. It catches SIGUSR2,
ftslurm's default checkpoint signal (the handler only sets a flag). Every step all-reduces
the gradients together with a "stop" flag, so all ranks see a request at the same step:
rank 0 saves the model, the optimizer and the step (written to a temporary file, then
renamed), and every rank exits 0. A later start resumes from that file. Under ftslurm the
daemon sends the signal before the wall limit and starts the continuation; under torchrun
alone nothing sends it and the script simply runs to the end.

Deterministic: the data of a step comes from a seed of the step and the rank, so a run
interrupted and resumed ends with exactly the parameters of an uninterrupted one; rank 0
writes them, as a digest, to OUTPUT_DIR/final.json.
"""

import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    steps, step_s, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stop = []
    signal.signal(signal.SIGUSR2, lambda *_: stop.append(1))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = os.path.join(out, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    print(f"rank {rank} of {world} starts at step {step}", flush=True)
    params = list(model.parameters())
    while step < steps:
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        # the gradients and the stop flag in one all-reduce: every rank sees the same flag
        flat = torch.cat([p.grad.flatten() for p in params] + [torch.tensor([float(bool(stop))])])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / world)
            offset += p.numel()
        opt.step()
        step += 1
        time.sleep(step_s)
        if flat[-1] > 0:  # a rank was asked to checkpoint: all stop at this step
            if rank == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(state, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            print(f"rank {rank} checkpointed at step {step} on request", flush=True)
            dist.destroy_process_group()
            sys.exit(0)
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params))
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"step": step, "digest": digest.hexdigest()}, f)
    print(f"rank {rank} finished at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
