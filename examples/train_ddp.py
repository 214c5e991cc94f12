"""Data-parallel training with fusedamp, launched by torchrun on one or many machines.

One process per GPU (NCCL), or per CPU process when there is no GPU (gloo):

    # one machine, every GPU
    torchrun --nproc_per_node=gpu examples/train_ddp.py
    # two machines with 8 GPUs each: run on both, the first one's address as the rendezvous
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=node0.example.com:29500 examples/train_ddp.py
    # CPU only (gloo), two processes
    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 20

Each step runs the forward under ``fusedamp.autocast``, scales the loss with
``fusedamp.GradScaler`` and lets ``fusedamp.FusedAdamW`` unscale, check for inf/NaN, clip and
update in one fused kernel, without a host sync. DistributedDataParallel averages the grads
over the ranks, so an overflow on any rank reaches every rank and all of them skip that step.

``--checkpoint PATH`` saves model, optimizer and scaler (rank 0, every ``--save-every`` steps
and at the end); starting again with the same path resumes from it, bitwise where the data
order is the same. The checkpoint holds only tensors and plain values: it loads with
``torch.load(weights_only=True)``, on any device (``map_location``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fusedamp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="autocast dtype (float16 needs the loss scaling most)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save to / resume from")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args()


def setup() -> tuple[int, int, torch.device]:
    """Joins the process group torchrun describes (a single process when run without it)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "MASTER_ADDR" not in os.environ:  # plain `python examples/train_ddp.py`
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=(
        device if device.type == "cuda" else None))
    return rank, world_size, device


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))


def batch(step: int, rank: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch: a fixed random regression problem."""
    generator = torch.Generator().manual_seed(step * 100_003 + rank)
    inputs = torch.randn(batch_size, 32, generator=generator)
    target = inputs[:, :8].sin().sum(dim=1, keepdim=True)
    return inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DistributedDataParallel(make_model().to(device))
    optimizer = fusedamp.FusedAdamW(model.parameters(), lr=args.lr, max_grad_norm=args.max_grad_norm)
    scaler = fusedamp.GradScaler(device.type)
    dtype = getattr(torch, args.dtype)

    start = 0
    if args.checkpoint is not None and args.checkpoint.exists():
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start}")

    skipped = torch.zeros((), dtype=torch.int64, device=device)
    for step in range(start, args.steps):
        inputs, target = batch(step, rank, args.batch_size, device)
        optimizer.zero_grad(set_to_none=True)
        with fusedamp.autocast(device.type, dtype=dtype):
            loss = nn.functional.mse_loss(model(inputs).float(), target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        skipped += scaler.step_skipped  # on the device: no sync
        scaler.update()
        done = step + 1
        if args.checkpoint is not None and (done % args.save_every == 0 or done == args.steps):
            # state_dict() syncs with the device; only rank 0 writes, the others wait for it.
            checkpoint = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "step": done,
            }
            if rank == 0:
                args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
                torch.save(checkpoint, args.checkpoint.with_suffix(".tmp"))
                args.checkpoint.with_suffix(".tmp").replace(args.checkpoint)
            dist.barrier()
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            # One sync per log line.
            print(f"step {done}: loss {loss.item():.4f}, scale {scaler.get_scale():g}, "
                  f"{int(skipped.item())} skipped, grad norm {optimizer.last_grad_norm.item():.3f}, "
                  f"{world_size} ranks")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
