"""The 8-bit optimizers on Transformer Engine's aggressive-settings protocol: how far
each one's fp32 params (fusedamp: its masters) stray from torch.optim.Adam in fp32, in multiples
of TE's tolerance (rtol = atol = 1e-2), step by step.

Run from the repository root (a minute on 2 CPU cores; bitsandbytes and torchao are optional
peers, skipped when not installed):

    python -m benchmarks.codec_accuracy [--json PATH]

The protocol is tests/test_optim_accuracy.py's: the params of a 1024-wide attention block with
fused QKV (4.2M elements), lr=1, betas=(0.1, 0.25), uniform [0, 1) grads rounded to bf16, 10
steps, a state-dict round trip into a new optimizer, 10 more. Every step's update is about 1, so
each moment's quantization error reaches the params. TE asserts 1e-2 for an 8-bit exp_avg only;
every optimizer here quantizes both moments (bitsandbytes and torchao keep tensors under 4096
elements in fp32).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import fusedamp

SHAPES = [(3072, 1024), (3072,), (1024, 1024), (1024,)]
OPTIONS = {"lr": 1.0, "betas": (0.1, 0.25), "eps": 1e-8, "weight_decay": 0.0}
STEPS, RESUME_AT, TOLERANCE = 20, 10, 1e-2


@dataclass(frozen=True)
class Contestant:
    """An optimizer under test: its params' dtype, how to build it over them, and the fp32 values
    compared with the reference (the params, or fusedamp's masters)."""

    name: str
    dtype: torch.dtype
    build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    compared: Callable[[torch.optim.Optimizer, torch.Tensor], torch.Tensor]


def contestants() -> list[Contestant]:
    found = [
        Contestant(
            "fusedamp FusedAdamW(moments='int8'), bf16 params + fp32 master",
            torch.bfloat16,
            lambda params: fusedamp.FusedAdamW(params, moments="int8", **OPTIONS),
            lambda opt, param: opt.master_of(param),
        ),
        Contestant(
            "fusedamp FusedAdamW(moments='fp32'), bf16 params + fp32 master (control)",
            torch.bfloat16,
            lambda params: fusedamp.FusedAdamW(params, **OPTIONS),
            lambda opt, param: opt.master_of(param),
        ),
    ]
    try:
        import bitsandbytes

        found.append(
            Contestant(
                f"bitsandbytes {bitsandbytes.__version__} AdamW8bit, fp32 params",
                torch.float32,
                lambda params: bitsandbytes.optim.AdamW8bit(params, **OPTIONS),
                lambda opt, param: param.detach(),
            )
        )
    except ImportError:
        print("bitsandbytes not installed: skipped")
    try:
        import torchao
        from torchao.optim import AdamW8bit

        found.append(
            Contestant(
                f"torchao {torchao.__version__} AdamW8bit, fp32 params",
                torch.float32,
                lambda params: AdamW8bit(params, **OPTIONS),
                lambda opt, param: param.detach(),
            )
        )
    except ImportError:
        print("torchao not installed: skipped")
    return found


def run(contestant: Contestant) -> list[float]:
    """Per step, the largest |value - reference| / (1e-2 + 1e-2 * |reference|) over all elements."""
    generator = torch.Generator().manual_seed(3)
    initial = [torch.randn(shape, generator=generator) * 0.02 for shape in SHAPES]
    params = [value.to(torch.bfloat16).to(contestant.dtype).requires_grad_() for value in initial]
    references = [p.detach().float().clone().requires_grad_() for p in params]
    torch_opt = torch.optim.Adam(references, **OPTIONS)
    opt = contestant.build(params)
    worst = []
    for step in range(STEPS):
        if step == RESUME_AT:
            # Not deep-copied (torchao's state tensors cannot be); the old optimizer is dropped.
            state = opt.state_dict()
            opt = contestant.build(params)
            opt.load_state_dict(state)
        for param, reference in zip(params, references, strict=True):
            grad = torch.rand(param.shape, generator=generator).to(torch.bfloat16)
            param.grad, reference.grad = grad.to(contestant.dtype), grad.float()
        opt.step()
        torch_opt.step()
        ratio = 0.0
        for param, reference in zip(params, references, strict=True):
            expected = reference.detach()
            error = (contestant.compared(opt, param).float() - expected).abs()
            ratio = max(ratio, (error / (TOLERANCE + TOLERANCE * expected.abs())).max().item())
        worst.append(ratio)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for contestant in contestants():
        start = time.perf_counter()
        worst = run(contestant)
        results[contestant.name] = {
            "worst_per_step": worst,
            "worst": max(worst),
            "within_tolerance": max(worst) <= 1,
        }
        print(
            f"{contestant.name}: worst {max(worst):.2f}x TE's tolerance "
            f"(per step {' '.join(f'{w:.2f}' for w in worst)}; {time.perf_counter() - start:.0f} s)"
        )
    if args.json:
        record = {
            "protocol": __doc__.split("\n\n")[2].replace("\n", " "),
            "torch": torch.__version__,
            "machine": f"{platform.machine()} {platform.processor()}".strip(),
            "results": results,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
