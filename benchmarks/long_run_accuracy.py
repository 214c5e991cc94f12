"""8-bit and bf16 optimizer states over long runs: how far each optimizer's params move compared
with torch.optim.AdamW in fp32 (``--optimizer muon``: torch.optim.Muon in fp32), measured as the
projection of the displacement on the reference's (sum(d * d_ref) / sum(d_ref^2): 1.000 is the
same step), after 200, 1000, 3000 and 10,000 steps.

Run from the repository root (a few minutes on 2 CPU cores; bitsandbytes and torchao are optional
peers, skipped when not installed):

    python -m benchmarks.long_run_accuracy [--optimizer adamw|muon] [--steps 10000] [--json PATH]

The task: 32,768 params, gradient = a fixed sign per element + noise * N(0, 1) (noise 0: a steady
gradient), weight_decay=0, beta1=0.9; every config is a param group of one optimizer per
contestant, all fed the same gradients. fp32 params move in proportion to lr (Adam's step does
not depend on the gradients' scale), so fp32-param contestants run at lr=1e-3 only, the bf16-param
modes also at lr=1e-5 (a step far below a bf16 ulp), and bitsandbytes' and torchao's AdamW8bit
(slow on a CPU: one step per param group) at the default beta2 = 0.999 only. A moment stored
with too little resolution loses the changes of (1 - beta2) of its distance to g^2 each step, so
the second moment lags and the step grows as the run gets longer.

Muon: the same task on a 128 x 64 matrix, with momentum in place of beta2 (0.9 to 0.999);
FusedMuon's momentum in int8 or bf16, its params in fp32 or bf16 (remainder or stochastic), and
torch's Muon on bf16 params (no master, a bf16 buffer) as the peer a user would otherwise pick.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
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
MUON_SHAPE = (128, 64)  # an orthogonalization per group and step: a smaller matrix than NUMEL
MUON_MOMENTA = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)


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


def muon_contestants() -> list[Contestant]:
    def fused(**options: object) -> Callable[[list[dict]], torch.optim.Optimizer]:
        return lambda groups: fusedamp.FusedMuon(groups, **options)

    return [
        Contestant("torch Muon, fp32 (reference)", torch.float32, lambda g: torch.optim.Muon(g), _param),
        Contestant("fusedamp int8, fp32 params", torch.float32, fused(moments="int8"), _param),
        Contestant(
            "fusedamp int8, bf16 + remainder",
            torch.bfloat16,
            fused(moments="int8", master_weights="remainder"),
            _master,
        ),
        Contestant(
            "fusedamp int8, bf16 stochastic",
            torch.bfloat16,
            fused(moments="int8", master_weights="stochastic"),
            _param,
        ),
        Contestant("fusedamp bf16 momentum, fp32 params", torch.float32, fused(moments="bf16"), _param),
        Contestant(
            "torch Muon, bf16 params", torch.bfloat16, lambda g: torch.optim.Muon(g), _param, peer=True
        ),
    ]


def _start(shape: tuple[int, ...] = (NUMEL,)) -> torch.Tensor:
    # bf16-representable, so that the bf16 contestants start where the reference does.
    start = 0.01 * torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(1))
    return start.bfloat16().float().reshape(shape)


def run(steps: int, optimizer: str = "adamw") -> dict:
    checkpoints = [c for c in CHECKPOINTS if c <= steps]
    muon = optimizer == "muon"
    shape = MUON_SHAPE if muon else (NUMEL,)
    entries = []
    for index, contestant in enumerate(muon_contestants() if muon else contestants()):
        # The reference and the bf16-param modes run every config; fp32-param ones lr=1e-3's.
        if contestant.peer and not muon:
            configs = PEER_CONFIGS
        elif muon:
            configs = list(itertools.product(MUON_MOMENTA, LRS, NOISES))
            if index != 0 and contestant.dtype == torch.float32:
                configs = [config for config in configs if config[1] == LRS[0]]
        else:
            configs = CONFIGS if index == 0 or contestant.dtype != torch.float32 else FP32_CONFIGS
        params = [torch.nn.Parameter(_start(shape).to(contestant.dtype)) for _ in configs]
        opt = contestant.build(
            [
                {"params": [p], "lr": lr, "weight_decay": 0.0}
                | ({"momentum": first} if muon else {"betas": (0.9, first)})
                for p, (first, lr, _) in zip(params, configs, strict=True)
            ]
        )
        generator = torch.Generator().manual_seed(2)
        signs = (torch.randint(0, 2, shape, generator=generator).float() * 2 - 1)
        positions: dict[tuple, dict[int, torch.Tensor]] = {config: {} for config in configs}
        began = time.perf_counter()
        for step in range(1, steps + 1):
            noise = torch.randn(shape, generator=generator)
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
    start = _start(shape).double()
    reference = entries[0]["positions"]
    results = []
    for entry in entries[1:]:
        rows = []
        for (first, lr, level), by_step in entry["positions"].items():
            ratios = {}
            for step in checkpoints:
                ref = reference[(first, lr, level)][step] - start
                moved = by_step[step] - start
                ratios[step] = float((moved * ref).sum() / (ref * ref).sum())
            first_key = "momentum" if muon else "beta2"
            rows.append({first_key: first, "lr": lr, "noise": level, "projection": ratios})
        results.append({"name": entry["name"], "seconds": entry["seconds"], "rows": rows})
    return {
        "optimizer": optimizer,
        "checkpoints": checkpoints,
        "numel": math.prod(shape),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "results": results,
    }


def table(report: dict) -> str:
    """One row per (beta2 or momentum, lr, noise), one column per contestant: the projection at the
    last checkpoint, and the one farthest from 1 over all checkpoints ("-": not run)."""
    names = [r["name"] for r in report["results"]]
    last = report["checkpoints"][-1]
    muon = report.get("optimizer") == "muon"
    first_key = "momentum" if muon else "beta2"
    lines = [
        f"| {first_key} | lr | noise | {' | '.join(names)} |",
        "| --- | --- | --- |" + " --- |" * len(names),
    ]
    configs = itertools.product(MUON_MOMENTA, LRS, NOISES) if muon else CONFIGS
    for first, lr, level in configs:
        cells = []
        for result in report["results"]:
            row = next(
                (r for r in result["rows"] if (r[first_key], r["lr"], r["noise"]) == (first, lr, level)), None
            )
            if row is None:
                cells.append("-")
                continue
            projection = {int(step): value for step, value in row["projection"].items()}
            worst = max(projection.values(), key=lambda value: abs(value - 1.0))
            cells.append(f"{projection[last]:.3f} ({worst:.3f})")
        lines.append(f"| {first} | {lr:g} | {level} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--steps", type=int, default=CHECKPOINTS[-1])
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    report = run(args.steps, args.optimizer)
    reference = "torch Muon" if args.optimizer == "muon" else "torch AdamW"
    print(
        f"\nprojection on {reference}'s displacement after {report['checkpoints'][-1]} steps "
        f"(in brackets: the farthest from 1 of steps {report['checkpoints']}), {report['numel']} params"
    )
    print(table(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
