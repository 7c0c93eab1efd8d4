"""What a rank's start costs on a node: the start-up that live recovery keeps and a restart
of every rank pays again.

From the interpreter's start to the end of the first optimizer step, in phases: `import
torch`, the device's context (CUDA: the first allocation), the model built and moved to the
device (a stack of transformer-block-sized projections, `--layers` blocks of width `--dim`:
12 x dim^2 parameters each, built on the CPU and moved, as plain PyTorch code does), and the
first step (forward, backward, AdamW's state created). One JSON object on stdout. The figure
stands for the part of a rank's set-up that torch and the device cost; a real training adds
its data loader, its process group and its checkpoint load (measured elsewhere:
`live_recovery.py`, `checkpoint_throughput.py`).

    python benchmarks/rank_setup.py [--device cuda|cpu] [--layers 8] [--dim 4096]
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # as early as the script can take it: before torch's import

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=8, help="blocks (default: 1.6e9 params)")
    parser.add_argument("--dim", type=int, default=4096, help="width of a block")
    args = parser.parse_args()
    if args.layers < 1 or args.dim < 8:
        parser.error("--layers must be at least 1 and --dim at least 8")
    import torch

    imported = time.monotonic()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    torch.zeros(1, device=args.device)
    sync()
    context = time.monotonic()
    d = args.dim
    blocks: list[torch.nn.Module] = []
    for _ in range(args.layers):  # q/k/v, output, and the MLP's two projections
        blocks += [
            torch.nn.Linear(d, 3 * d),
            torch.nn.Linear(d, d),
            torch.nn.Linear(d, 4 * d),
            torch.nn.Linear(4 * d, d),
        ]
    model = torch.nn.Sequential(*blocks).to(args.device, dtype=torch.bfloat16)
    sync()
    built = time.monotonic()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    h = torch.randn(8, d, device=args.device, dtype=torch.bfloat16)
    for layer in model:
        h = layer(h)
        if h.shape[-1] == 3 * d:  # one of q, k, v goes on
            h = h[..., :d]
    h.float().sum().backward()
    optimizer.step()
    sync()
    stepped = time.monotonic()
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "import_s": round(imported - STARTED, 3),
        "context_s": round(context - imported, 3),
        "model_build_s": round(built - context, 3),
        "first_step_s": round(stepped - built, 3),
        "total_s": round(stepped - STARTED, 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
