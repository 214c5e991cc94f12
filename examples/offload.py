"""Training with the optimizer offloaded to the CPU: bf16 params and grads on the GPU, the AdamW
state (an exact fp32 master as a bf16 remainder, int8 moments) and the step on the host.

    python examples/offload.py                       # on the GPU if there is one, else the CPU
    python examples/offload.py --offload-gradients   # free each grad on the GPU once on the host
    python examples/offload.py --step-in-backward    # step each param as its grad lands (no clipping)

With the model on the CPU the same code runs with plain copies (useful to try it, not faster).
It prints the loss, then the optimizer's memory per param, measured from its tensors.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import fusedamp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024, help="hidden size of the MLP blocks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--master-weights", default="remainder", choices=["remainder", "stochastic", "True"])
    parser.add_argument("--moments", default="int8", choices=["fp32", "bf16", "int8"])
    parser.add_argument("--offload-gradients", action="store_true")
    parser.add_argument("--step-in-backward", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    width = args.width
    blocks = [
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(args.layers)
    ]
    model = nn.Sequential(*blocks, nn.LayerNorm(width), nn.Linear(width, 1)).to(device, torch.bfloat16)
    master_weights = True if args.master_weights == "True" else args.master_weights
    opt = fusedamp.FusedAdamW(
        model.parameters(), lr=1e-4, offload="cpu", master_weights=master_weights, moments=args.moments,
        max_grad_norm=None if args.step_in_backward else 1.0,  # a global norm needs every grad first
        offload_gradients=args.offload_gradients, step_in_backward=args.step_in_backward,
    )
    inputs = torch.randn(64, args.width, device=device, dtype=torch.bfloat16)
    target = inputs.float().mean(dim=1, keepdim=True)

    for step in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(inputs).float(), target)
        loss.backward()  # each grad goes to the host as backward makes it
        opt.step()  # the CPU steps; params stream back; the next forward waits for them on the GPU
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}  {1e3 * (time.perf_counter() - start):7.1f} ms")

    params = sum(param.numel() for param in model.parameters())
    measured = opt.state_bytes()
    print(f"{params / 1e6:.1f}M bf16 params on {device}; optimizer on the host: {measured}")
    state = sum(measured[kind] for kind in ("masters", "moments", "scales", "other"))
    print(
        f"host bytes per param: {measured['host'] / params:.2f} (state {state / params:.2f}, host copy "
        f"of the params {measured['params'] / params:.2f}, grads {measured['grads'] / params:.2f})"
    )
    if device == "cuda":
        print(f"GPU memory allocated: {torch.cuda.memory_allocated() / params:.2f} bytes per param")


if __name__ == "__main__":
    main()
