"""FSDP2 training with fusedamp, checkpointed with torch.distributed.checkpoint (DCP): save on one
number of ranks, resume on the same or another.

One process per GPU (NCCL), or per CPU process when there is no GPU (gloo):

    # train 6 steps on 2 ranks, saving a checkpoint after step 3
    torchrun --nproc_per_node=2 examples/fsdp2_dcp.py --steps 6 --save-at 3 --checkpoint ckpt
    # resume from it on 2 ranks: the same final weights, bit for bit
    torchrun --nproc_per_node=2 examples/fsdp2_dcp.py --steps 6 --checkpoint ckpt
    # or on 1 rank: the checkpoint is resharded as it loads
    torchrun --nproc_per_node=1 examples/fsdp2_dcp.py --steps 6 --checkpoint ckpt

Each layer and the model are sharded with ``fully_shard``; ``FusedAdamW`` steps each rank's shards
(int8 moments by default), and its ``state_dict()`` holds DTensors laid out like the params, so
DCP saves every element once and loads it under any sharding. Rank 0 prints the loss and a digest
of the full weights at the end: a resume on the same number of ranks gives the digest of the run
that never stopped (docs/distributed-checkpoint.md). On another number of ranks the gradients are
summed in another order, so the weights agree to float rounding instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusedamp

FEATURES = 16
GLOBAL_BATCH = 32  # split between the ranks: each rank sees GLOBAL_BATCH / world size rows a step


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a DCP checkpoint folder: resumed from when it exists")
    parser.add_argument("--save-at", type=int, default=None, help="save to --checkpoint after this step")
    parser.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="int8")
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def setup() -> tuple[int, int, DeviceMesh]:
    """Joins the process group torchrun describes; a one-dimensional mesh over every rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:  # plain `python examples/fsdp2_dcp.py`: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29501", RANK="0", WORLD_SIZE="1")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_rank(), world_size, init_device_mesh(device_type, (world_size,))


def make_model(mesh: DeviceMesh) -> nn.Module:
    """The same initial weights on every rank and for any number of ranks, each layer its own
    FSDP2 unit."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    ).to(mesh.device_type)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, world_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch (a fixed regression problem)."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    target = inputs[:, :4].sin()
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    return inputs[rows].to(device), target[rows].to(device)


def save(model: nn.Module, optimizer: fusedamp.FusedAdamW, step: int, path: Path) -> None:
    """Every rank writes its shards: the model's and the optimizer's state (DTensors), and the step."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=path)


def load(model: nn.Module, optimizer: fusedamp.FusedAdamW, path: Path) -> int:
    """Loads the checkpoint into this run's sharding (whatever the saving run's was); the step to
    go on from. The optimizer must have the saving run's ``moments`` and ``master_weights``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def digest(model: nn.Module) -> str:
    """A digest of the full (gathered) weights' bits; every rank takes part in the gathers."""
    hasher = hashlib.sha256()
    for param in model.parameters():
        hasher.update(param.full_tensor().detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    rank, world_size, mesh = setup()
    model = make_model(mesh)
    optimizer = fusedamp.FusedAdamW(model.parameters(), lr=args.lr, moments=args.moments, max_grad_norm=1.0)

    start = 0
    if args.checkpoint is not None and args.checkpoint.exists():
        start = load(model, optimizer, args.checkpoint)
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start} on {world_size} ranks")
    loss = torch.zeros((), device=mesh.device_type)
    for step in range(start, args.steps):
        inputs, target = batch(step, rank, world_size, mesh.device_type)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()  # FSDP2 reduce-scatters the grads: each rank gets the mean over all ranks
        optimizer.step()
        if args.checkpoint is not None and step + 1 == args.save_at:
            save(model, optimizer, step + 1, args.checkpoint)
            if rank == 0:
                print(f"saved {args.checkpoint} after step {step + 1} on {world_size} ranks")
    final = digest(model)
    total = loss.detach().clone()
    dist.all_reduce(total)  # the last step's loss over the whole global batch
    if rank == 0:
        print(f"step {args.steps}: loss {total.item() / world_size:.6f}, weights {final}, {world_size} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
