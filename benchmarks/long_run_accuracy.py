"""8-bit and bf16 optimizer states over long runs: how far each optimizer's params move compared
with torch.optim.AdamW in fp32, measured as the projection of the displacement on AdamW's
(sum(d * d_ref) / sum(d_ref^2): 1.000 is the same step), after 200, 1000, 3000 and 10,000 steps.

Run from the repository root (a few minutes on 2 CPU cores; bitsandbytes and torchao are optional
peers, skipped when not installed):

    python -m benchmarks.long_run_accuracy [--steps 10000] [--json PATH]

The task: 32,768 params, gradient = a fixed sign per element + noise * N(0, 1) (noise 0: a steady
gradient), weight_decay=0, beta1=0.9; every config is a param group of one optimizer per
contestant, all fed the same gradients. fp32 params move in proportion to lr (Adam's step does
not depend on the gradients' scale), so fp32-param contestants run at lr=1e-3 only, the bf16-param
modes also at lr=1e-5 (a step far below a bf16 ulp), and bitsandbytes' and torchao's AdamW8bit
(slow on a CPU: one step per param group) at the default beta2 = 0.999 only. A moment stored
with too little resolution loses the changes of (1 - beta2) of its distance to g^2 each step, so
the second moment lags and the step grows as the run gets longer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fusedamp

NUMEL = 32768
CHECKPOINTS = (200, 1000, 3000, 10_000)
BETA2S = (0.95, 0.999, 0.9999)
LRS = (1e-3, 1e-5)
NOISES = (0.0, 0.5, 3.0)
CONFIGS = list(itertools.product(BETA2S, LRS, NOISES))
# The configs an fp32-param contestant runs, and a peer (see the docstring).
FP32_CONFIGS = [config for config in CONFIGS if config[1] == LRS[0]]
PEER_CONFIGS = [config for config in FP32_CONFIGS if config[0] == 0.999]


@dataclass(frozen=True)
class Contestant:
    """An optimizer under test: its params' dtype, how to build it over param groups, and the fp32
    value of a param it is judged by (the param, or fusedamp's master)."""

    name: str
    dtype: torch.dtype
    build: Callable[[list[dict]], torch.optim.Optimizer]
    observed: Callable[[torch.optim.Optimizer, torch.Tensor], torch.Tensor]
    peer: bool = False  # a peer library: runs PEER_CONFIGS


def _param(opt: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    return param.detach()


def _master(opt: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    return opt.master_of(param)


def contestants() -> list[Contestant]:
    found = [
        Contestant("torch AdamW, fp32 (reference)", torch.float32, lambda g: torch.optim.AdamW(g), _param),
        Contestant(
            "fusedamp int8, fp32 params",
            torch.float32,
            lambda g: fusedamp.FusedAdamW(g, moments="int8"),
            _param,
        ),
        Contestant(
            "fusedamp int8, bf16 + remainder",
            torch.bfloat16,
            lambda g: fusedamp.FusedAdamW(g, moments="int8", master_weights="remainder"),
            _master,
        ),
        Contestant(
            "fusedamp int8, bf16 stochastic",
            torch.bfloat16,
            lambda g: fusedamp.FusedAdamW(g, moments="int8", master_weights="stochastic"),
            _param,
        ),
        Contestant(
            "fusedamp bf16 moments, fp32 params",
            torch.float32,
            lambda g: fusedamp.FusedAdamW(g, moments="bf16"),
            _param,
        ),
    ]
    try:
        import bitsandbytes as bnb

        found.append(
            Contestant(
                f"bitsandbytes {bnb.__version__} AdamW8bit",
                torch.float32,
                lambda g: bnb.optim.AdamW8bit(g),
                _param,
                peer=True,
            )
        )
    except ImportError:
        print("bitsandbytes is not installed: its row is skipped")
    try:
        import torchao
        from torchao.optim import AdamW8bit

        found.append(
            Contestant(
                f"torchao {torchao.__version__} AdamW8bit",
                torch.float32,
                lambda g: AdamW8bit(g),
                _param,
                peer=True,
            )
        )
    except ImportError:
        print("torchao is not installed: its row is skipped")
    return found


def _start() -> torch.Tensor:
    # bf16-representable, so that the bf16 contestants start where the reference does.
    return (0.01 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))).bfloat16().float()


def run(steps: int) -> dict:
    checkpoints = [c for c in CHECKPOINTS if c <= steps]
    entries = []
    for index, contestant in enumerate(contestants()):
        # The reference and the bf16-param modes run every config; fp32-param ones lr=1e-3's.
        if contestant.peer:
            configs = PEER_CONFIGS
        else:
            configs = CONFIGS if index == 0 or contestant.dtype != torch.float32 else FP32_CONFIGS
        params = [torch.nn.Parameter(_start().to(contestant.dtype)) for _ in configs]
        opt = contestant.build(
            [
                {"params": [p], "lr": lr, "betas": (0.9, beta2), "weight_decay": 0.0}
                for p, (beta2, lr, _) in zip(params, configs, strict=True)
            ]
        )
        generator = torch.Generator().manual_seed(2)
        signs = torch.randint(0, 2, (NUMEL,), generator=generator).float() * 2 - 1
        positions: dict[tuple, dict[int, torch.Tensor]] = {config: {} for config in configs}
        began = time.perf_counter()
        for step in range(1, steps + 1):
            noise = torch.randn(NUMEL, generator=generator)
            for param, (_, _, level) in zip(params, configs, strict=True):
                param.grad = (signs + level * noise).to(contestant.dtype)
            opt.step()
            if step in checkpoints:
                for param, config in zip(params, configs, strict=True):
                    positions[config][step] = contestant.observed(opt, param).double().clone()
        entries.append(
            {"name": contestant.name, "positions": positions, "seconds": time.perf_counter() - began}
        )
        print(f"{contestant.name}: {entries[-1]['seconds']:.0f} s", flush=True)
    start = _start().double()
    reference = entries[0]["positions"]
    results = []
    for entry in entries[1:]:
        rows = []
        for (beta2, lr, level), by_step in entry["positions"].items():
            ratios = {}
            for step in checkpoints:
                ref = reference[(beta2, lr, level)][step] - start
                moved = by_step[step] - start
                ratios[step] = float((moved * ref).sum() / (ref * ref).sum())
            rows.append({"beta2": beta2, "lr": lr, "noise": level, "projection": ratios})
        results.append({"name": entry["name"], "seconds": entry["seconds"], "rows": rows})
    return {
        "checkpoints": checkpoints,
        "numel": NUMEL,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "results": results,
    }


def table(report: dict) -> str:
    """One row per (beta2, lr, noise), one column per contestant: the projection at the last
    checkpoint, and the one farthest from 1 over all checkpoints ("-": not run)."""
    names = [r["name"] for r in report["results"]]
    last = report["checkpoints"][-1]
    lines = [
        f"| beta2 | lr | noise | {' | '.join(names)} |",
        "| --- | --- | --- |" + " --- |" * len(names),
    ]
    for beta2, lr, level in CONFIGS:
        cells = []
        for result in report["results"]:
            row = next(
                (r for r in result["rows"] if (r["beta2"], r["lr"], r["noise"]) == (beta2, lr, level)), None
            )
            if row is None:
                cells.append("-")
                continue
            projection = row["projection"]
            worst = max(projection.values(), key=lambda value: abs(value - 1.0))
            cells.append(f"{projection[last]:.3f} ({worst:.3f})")
        lines.append(f"| {beta2} | {lr:g} | {level} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=CHECKPOINTS[-1])
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    report = run(args.steps)
    print(
        f"\nprojection on torch AdamW's displacement after {report['checkpoints'][-1]} steps "
        f"(in brackets: the farthest from 1 of steps {report['checkpoints']}), {NUMEL} params"
    )
    print(table(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
