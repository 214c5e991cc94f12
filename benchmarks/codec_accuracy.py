"""The 8-bit optimizers' error per step, measured on the peers' own test protocols with every
optimizer in the same run: fusedamp's int8 moments, bitsandbytes' and torchao's 8-bit optimizers,
fusedamp's bf16 moments as a control, all against torch's fp32 optimizer.

Run from the repository root (a few minutes on 2 CPU cores; bitsandbytes and torchao are optional
peers, skipped when not installed):

    python -m benchmarks.codec_accuracy [--json PATH] [--quick]

The protocols (fp32 params everywhere, so that only the stored state differs; fusedamp is judged
by its params, or by its masters where they are bf16):
- adamw_drift: AdamW (torch's defaults, lr 1e-3), params randn * 0.1 of 1024 x 4097, grads
  randn * 0.01, 50 steps: the mean |param - torch AdamW's param| at the end.
- sgd_drift: SGD, momentum 0.9, lr 1e-2, 512 x 513, randn grads, 40 steps: the mean |param error|
  over the mean |displacement|, and the momentum buffer's relative L2 error at the end.
- bnb_per_step (bitsandbytes' test_optimizer8bit): 512 x 512, randn * 0.01 grads, 50 steps; after
  each, the 8-bit state dequantized is compared with torch's (elements outside atol 3e-3 / rtol
  1e-3: bitsandbytes asserts fewer than 20), then torch's state and params are set to the 8-bit
  optimizer's, so that every step starts from the same values. SGD's momentum and AdamW's
  exp_avg; the worst step's count.
- te_lr1 (Transformer Engine's precision-aware FusedAdam test): the params of a 1024-wide attention
  block with fused QKV (4.2M elements, bf16 values), lr 1, betas (0.1, 0.25), uniform [0, 1)
  grads, 10 steps, a state-dict round trip into a new optimizer, 10 more; every step's update is
  about 1, so each moment's quantization error reaches the params. The worst step's count of
  elements outside TE's tolerance (rtol = atol = 1e-2) and the largest |error| / tolerance; the
  largest error is one element's, so for an optimizer that rounds stochastically (fusedamp) the
  protocol runs under TE_SEEDS seeds of its rounding and reports the worst of each.
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

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True)
class Contestant:
    """An 8-bit optimizer (or a control) under test: how to build it over fp32 params for AdamW and
    for SGD (None: it has no such optimizer), and its state dequantized under torch's names."""

    name: str
    adamw: Callable[..., torch.optim.Optimizer] | None
    sgd: Callable[..., torch.optim.Optimizer] | None
    states: Callable[[torch.optim.Optimizer, torch.Tensor], dict[str, torch.Tensor]]
    stochastic: bool = False  # takes seed= (its roundings' random bits)


def _fusedamp_states(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    index = next(i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is param)
    state = opt.torch_state_dict()["state"][index]
    return {name: state[name] for name in MOMENTS if name in state}


def _bnb_states(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    import bitsandbytes.functional as F

    state = opt.state[param]
    names = ("momentum_buffer",) if "state2" not in state else ("exp_avg", "exp_avg_sq")
    found = {}
    for number, name in enumerate(names, start=1):
        found[name] = F.dequantize_blockwise(
            state[f"state{number}"],
            absmax=state[f"absmax{number}"],
            code=state[f"qmap{number}"],
            blocksize=256,
        ).view_as(param)
    return found


def _torchao_states(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    state = opt.state[param]
    return {name: state[name].dequantize().view_as(param) for name in ("exp_avg", "exp_avg_sq")}


def contestants() -> list[Contestant]:
    found = [
        Contestant(
            "fusedamp int8",
            lambda params, **o: fusedamp.FusedAdamW(params, moments="int8", **o),
            lambda params, **o: fusedamp.FusedSGD(params, moments="int8", **o),
            _fusedamp_states,
            stochastic=True,
        ),
        Contestant(
            "fusedamp bf16 (control)",
            lambda params, **o: fusedamp.FusedAdamW(params, moments="bf16", **o),
            lambda params, **o: fusedamp.FusedSGD(params, moments="bf16", **o),
            _fusedamp_states,
        ),
    ]
    try:
        import bitsandbytes as bnb

        found.append(
            Contestant(
                f"bitsandbytes {bnb.__version__}",
                # min_8bit_size=0: bitsandbytes keeps tensors under 4096 elements in fp32 by default.
                lambda params, **o: bnb.optim.AdamW8bit(params, min_8bit_size=0, **o),
                lambda params, **o: bnb.optim.SGD8bit(params, min_8bit_size=0, **o),
                _bnb_states,
            )
        )
    except ImportError:
        print("bitsandbytes is not installed: its column is skipped")
    try:
        import torchao
        from torchao.optim import AdamW8bit

        found.append(
            Contestant(
                f"torchao {torchao.__version__}",
                lambda params, **o: AdamW8bit(params, block_size=256, **o),
                None,
                _torchao_states,
            )
        )
    except ImportError:
        print("torchao is not installed: its column is skipped")
    return found


def _pair(
    shape: tuple[int, ...], generator: torch.Generator, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randn(shape, generator=generator) * scale
    return start.clone().requires_grad_(), start.clone().requires_grad_()


def adamw_drift(contestant: Contestant, shape: tuple[int, int] = (1024, 4097), steps: int = 50) -> dict:
    generator = torch.Generator().manual_seed(1)
    param, reference = _pair(shape, generator, 0.1)
    opt, torch_opt = contestant.adamw([param], lr=1e-3), torch.optim.AdamW([reference], lr=1e-3)
    for _ in range(steps):
        grad = torch.randn(shape, generator=generator) * 0.01
        param.grad, reference.grad = grad.clone(), grad
        opt.step()
        torch_opt.step()
    return {"mean_abs_error": (param - reference).abs().mean().item()}


def sgd_drift(contestant: Contestant, shape: tuple[int, int] = (512, 513), steps: int = 40) -> dict:
    generator = torch.Generator().manual_seed(2)
    param, reference = _pair(shape, generator, 0.1)
    start = reference.detach().clone()
    options = {"lr": 1e-2, "momentum": 0.9}
    opt, torch_opt = contestant.sgd([param], **options), torch.optim.SGD([reference], **options)
    for _ in range(steps):
        grad = torch.randn(shape, generator=generator)
        param.grad, reference.grad = grad.clone(), grad
        opt.step()
        torch_opt.step()
    buffer = contestant.states(opt, param)["momentum_buffer"]
    expected = torch_opt.state[reference]["momentum_buffer"]
    return {
        "error_over_displacement": (
            (param - reference).abs().mean() / (reference - start).abs().mean()
        ).item(),
        "buffer_relative_l2": ((buffer - expected).norm() / expected.norm()).item(),
    }


def bnb_per_step(
    contestant: Contestant, kind: str, shape: tuple[int, int] = (512, 512), steps: int = 50
) -> dict:
    generator = torch.Generator().manual_seed(3)
    param, reference = _pair(shape, generator, 0.1)
    if kind == "sgd":
        options, key = {"lr": 1e-2, "momentum": 0.9}, "momentum_buffer"
        opt, torch_opt = contestant.sgd([param], **options), torch.optim.SGD([reference], **options)
    else:
        options, key = {"lr": 1e-3}, "exp_avg"
        opt, torch_opt = contestant.adamw([param], **options), torch.optim.AdamW([reference], **options)
    worst = 0
    for _ in range(steps):
        grad = torch.randn(shape, generator=generator) * 0.01
        param.grad, reference.grad = grad.clone(), grad
        opt.step()
        torch_opt.step()
        states = contestant.states(opt, param)
        outside = ~torch.isclose(states[key], torch_opt.state[reference][key], atol=3e-3, rtol=1e-3)
        worst = max(worst, int(outside.sum()))
        with torch.no_grad():
            for name, value in states.items():
                torch_opt.state[reference][name].copy_(value)
            param.copy_(reference)
    return {"worst_step_outside": worst, "numel": param.numel()}


TE_SHAPES = [(3072, 1024), (3072,), (1024, 1024), (1024,)]
TE_OPTIONS = {"lr": 1.0, "betas": (0.1, 0.25), "eps": 1e-8, "weight_decay": 0.0}
TE_STEPS, TE_RESUME_AT, TE_TOLERANCE, TE_SEEDS = 20, 10, 1e-2, 4


def te_lr1(contestant: Contestant, steps: int = TE_STEPS, seed: int | None = None) -> dict:
    generator = torch.Generator().manual_seed(3)
    initial = [(torch.randn(shape, generator=generator) * 0.02).bfloat16().float() for shape in TE_SHAPES]
    params = [value.clone().requires_grad_() for value in initial]
    references = [value.clone().requires_grad_() for value in initial]
    torch_opt = torch.optim.Adam(references, **TE_OPTIONS)
    options = TE_OPTIONS if seed is None else {**TE_OPTIONS, "seed": seed}
    opt = contestant.adamw(params, **options)
    worst_ratio, worst_outside = 0.0, 0
    for step in range(steps):
        if step == TE_RESUME_AT:
            # Not deep-copied (torchao's state tensors cannot be); the old optimizer is dropped.
            state = opt.state_dict()
            opt = contestant.adamw(params, **options)
            opt.load_state_dict(state)
        for param, reference in zip(params, references, strict=True):
            grad = torch.rand(param.shape, generator=generator).bfloat16().float()
            param.grad, reference.grad = grad.clone(), grad
        opt.step()
        torch_opt.step()
        outside = 0
        for param, reference in zip(params, references, strict=True):
            ratio = (param - reference).abs() / (TE_TOLERANCE + TE_TOLERANCE * reference.abs())
            worst_ratio = max(worst_ratio, ratio.max().item())
            outside += int((ratio > 1).sum())
        worst_outside = max(worst_outside, outside)
    return {
        "worst_step_outside": worst_outside,
        "worst_ratio": worst_ratio,
        "numel": sum(p.numel() for p in params),
    }


def run(quick: bool = False) -> dict:
    scale = {"adamw_shape": (256, 4097), "te_steps": 4} if quick else {}
    results: dict[str, dict] = {}
    for contestant in contestants():
        began = time.perf_counter()
        row = {"adamw_drift": adamw_drift(contestant, scale.get("adamw_shape", (1024, 4097)))}
        if contestant.sgd is not None:
            row["sgd_drift"] = sgd_drift(contestant)
            row["bnb_per_step_sgd"] = bnb_per_step(contestant, "sgd")
        row["bnb_per_step_adamw"] = bnb_per_step(contestant, "adamw")
        runs = [
            te_lr1(contestant, scale.get("te_steps", TE_STEPS), seed)
            for seed in (range(TE_SEEDS) if contestant.stochastic else [None])
        ]
        row["te_lr1"] = {
            "worst_step_outside": max(run["worst_step_outside"] for run in runs),
            "worst_ratio": max(run["worst_ratio"] for run in runs),
            "worst_ratio_per_seed": [run["worst_ratio"] for run in runs],
            "numel": runs[0]["numel"],
        }
        row["seconds"] = time.perf_counter() - began
        results[contestant.name] = row
        print(f"{contestant.name}: {row['seconds']:.0f} s", flush=True)
    return {
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "quick": quick,
        "results": results,
    }


def table(report: dict) -> str:
    """The protocols as rows, the contestants as columns ("-": the contestant has no such
    optimizer)."""
    names = list(report["results"])
    rows = [
        (
            "AdamW 1024 x 4097, 50 steps: mean abs param error",
            "adamw_drift",
            lambda r: f"{r['mean_abs_error']:.2e}",
        ),
        (
            "SGD momentum 0.9, 40 steps: param error / displacement",
            "sgd_drift",
            lambda r: f"{100 * r['error_over_displacement']:.2f}%",
        ),
        (
            "SGD momentum buffer: relative L2 error",
            "sgd_drift",
            lambda r: f"{100 * r['buffer_relative_l2']:.2f}%",
        ),
        (
            "bitsandbytes' per-step test, SGD momentum: elements outside (of 262k)",
            "bnb_per_step_sgd",
            lambda r: str(r["worst_step_outside"]),
        ),
        (
            "bitsandbytes' per-step test, AdamW exp_avg: elements outside (of 262k)",
            "bnb_per_step_adamw",
            lambda r: str(r["worst_step_outside"]),
        ),
        (
            "TE lr = 1: params outside 1e-2 at the worst step (of 4.2M)",
            "te_lr1",
            lambda r: str(r["worst_step_outside"]),
        ),
        (
            "TE lr = 1: largest error / tolerance",
            "te_lr1",
            lambda r: (
                f"{r['worst_ratio']:.2f}x"
                + (
                    f" ({min(r['worst_ratio_per_seed']):.1f}-{max(r['worst_ratio_per_seed']):.1f} over seeds)"
                    if len(r["worst_ratio_per_seed"]) > 1
                    else ""
                )
            ),
        ),
    ]
    lines = [f"| protocol | {' | '.join(names)} |", "| --- |" + " --- |" * len(names)]
    for label, key, cell in rows:
        cells = [
            cell(report["results"][name][key]) if key in report["results"][name] else "-" for name in names
        ]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="smaller AdamW shape, 4 TE steps (a smoke test)")
    args = parser.parse_args()
    report = run(args.quick)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
