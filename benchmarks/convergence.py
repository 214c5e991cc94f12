"""Convergence of the coded optimizer modes on real text: a small byte-level transformer
language model trained on the Python standard library's own source files (present on every
machine with Python), fp32 AdamW against each new mode, and plain bf16 params without a master
as the control, over several seeds; FusedMuon's modes against torch's Muon + AdamW in fp32; the
offloaded fp32 AdamW with the one-step delayed update (after 40 undelayed steps, and from the
first) against the same without a delay.

Run from the repository root (minutes on 2 CPU cores; ``--modes`` picks some, by name):

    python -m benchmarks.convergence [--steps 300] [--seeds 0 1 2] [--modes ...] [--json PATH] [--plot PATH]

Every run sees the same batches for a seed (the seed also sets the init), so the modes differ
only in how the optimizer stores its state and rounds its params. The verdict: each new mode's
final loss (the mean over the last 10% of steps) at most the worst fp32 run plus MARGIN (within
the fp32 runs' seed spread plus the margin), and the control measurably worse: every control run
above every fp32 run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import fusedamp

MODES: dict[str, dict[str, Any]] = {
    "fp32 AdamW (fp32 params)": {"dtype": torch.float32, "options": {}},
    "int8 moments, fp32 master": {"dtype": torch.bfloat16, "options": {"moments": "int8"}},
    "int8 moments, remainder master": {
        "dtype": torch.bfloat16,
        "options": {"moments": "int8", "master_weights": "remainder"},
    },
    "int8 moments, stochastic bf16": {
        "dtype": torch.bfloat16,
        "options": {"moments": "int8", "master_weights": "stochastic"},
    },
    "bf16 moments, fp32 master": {"dtype": torch.bfloat16, "options": {"moments": "bf16"}},
    "control: bf16 params, no master": {"dtype": torch.bfloat16, "options": {"master_weights": False}},
    # Muon for the hidden matrices, AdamW for the rest (fusedamp.optim.muon_param_groups' split).
    "torch Muon + AdamW (fp32 params)": {"dtype": torch.float32, "optimizer": "torch-muon", "options": {}},
    "FusedMuon, remainder master": {
        "dtype": torch.bfloat16, "optimizer": "muon", "options": {"master_weights": "remainder"}
    },
    "FusedMuon, int8 momentum, fp32 master": {
        "dtype": torch.bfloat16, "optimizer": "muon", "options": {"moments": "int8"}
    },
    # The model on the CPU: the offloaded step's code with plain copies (docs/offload.md).
    "fp32 AdamW offloaded, delayed update after 40 steps": {
        "dtype": torch.float32, "options": {"offload": "cpu", "offload_delay": 1, "offload_delay_warmup": 40}
    },
    "fp32 AdamW offloaded, delayed update from the first step": {
        "dtype": torch.float32, "options": {"offload": "cpu", "offload_delay": 1, "offload_delay_warmup": 0}
    },
}
REFERENCE, CONTROL = "fp32 AdamW (fp32 params)", "control: bf16 params, no master"
MUON_REFERENCE = "torch Muon + AdamW (fp32 params)"
MUON_LR = 0.02  # the Muon groups' peak lr (the AdamW groups take --lr)
MARGIN = 0.005  # nats per byte: the allowance over the fp32 seed spread


def corpus(limit_bytes: int = 4 << 20) -> torch.Tensor:
    """The bytes of the standard library's .py files (sorted, so every machine reads the same
    order for its Python version), up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit_bytes:
            break
    return torch.frombuffer(bytes(data[:limit_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A GPT-style byte-level language model."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer(
            "mask", torch.triu(torch.full((context, context), -math.inf), 1), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        mask = self.mask[: tokens.shape[1], : tokens.shape[1]].to(x.dtype)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def train(
    mode: str, seed: int, data: torch.Tensor, steps: int, batch: int, context: int, lr: float
) -> list[float]:
    spec = MODES[mode]
    torch.manual_seed(seed)
    model = ByteLM(context=context).to(spec["dtype"])
    optimizers = make_optimizers(spec, model, lr, seed)
    for opt in optimizers:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    generator = torch.Generator().manual_seed(1000 + seed)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), window[:, 1:].reshape(-1))
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        # A short warm-up then cosine decay, as LM training runs use.
        progress = (step + 1) / steps
        for opt in optimizers:
            for group in opt.param_groups:
                warm_up = min(1.0, (step + 1) / (0.05 * steps))
                group["lr"] = group["peak_lr"] * warm_up * 0.5 * (1 + math.cos(math.pi * progress))
    return losses


def make_optimizers(
    spec: dict[str, Any], model: nn.Module, lr: float, seed: int
) -> list[torch.optim.Optimizer]:
    """The optimizers of a mode: one FusedAdamW, one FusedMuon over muon_param_groups' split, or
    torch's Muon and AdamW over the same split, each stepping its own params (as users combine
    them)."""
    kind = spec.get("optimizer", "adamw")
    options = spec["options"]
    if kind == "adamw":
        return [fusedamp.FusedAdamW(model.parameters(), lr=lr, weight_decay=0.01, seed=seed, **options)]
    groups = fusedamp.optim.muon_param_groups(model, muon={"lr": MUON_LR}, adamw={"lr": lr})
    if kind == "muon":
        return [fusedamp.FusedMuon(groups, weight_decay=0.01, seed=seed, **options)]
    muon, adamw = groups
    return [
        torch.optim.Muon(muon["params"], lr=MUON_LR, weight_decay=0.01),
        torch.optim.AdamW(adamw["params"], lr=lr, weight_decay=0.01),
    ]


def final_loss(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def verdicts(finals: dict[str, list[float]]) -> list[str]:
    """Each mode against its reference (fp32 AdamW, or torch's Muon + AdamW for the FusedMuon
    modes): within the reference runs' worst plus MARGIN; the control worse than every fp32 run."""
    lines = []
    for reference in (REFERENCE, MUON_REFERENCE):
        if reference not in finals:  # no mode of it was trained (--modes)
            continue
        values = finals[reference]
        spread = max(values) - min(values)
        lines.append(
            f"{reference}: final losses {[round(v, 4) for v in values]}: spread {spread:.4f}; "
            f"bound max + {MARGIN}"
        )
    for mode, values in finals.items():
        if mode in (REFERENCE, MUON_REFERENCE):
            continue
        reference = MUON_REFERENCE if MODES[mode].get("optimizer") == "muon" else REFERENCE
        ceiling = max(finals[reference]) + MARGIN
        mean = sum(values) / len(values)
        if mode == CONTROL:
            worse = min(values) > max(finals[reference])
            verdict = "worse than every fp32 run, as expected" if worse else "NOT measurably worse"
        else:
            verdict = "within" if max(values) <= ceiling else "OUTSIDE"
        lines.append(
            f"{mode}: final {[round(v, 4) for v in values]} (mean {mean:.4f}): {verdict} (<= {ceiling:.4f})"
        )
    return lines


def plot(curves: dict[str, list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for mode, runs in curves.items():
        steps = len(runs[0])
        window = max(1, steps // 30)
        mean = [sum(run[i] for run in runs) / len(runs) for i in range(steps)]
        smooth = [
            sum(mean[max(0, i - window) : i + 1]) / len(mean[max(0, i - window) : i + 1])
            for i in range(steps)
        ]
        axis.plot(smooth, label=mode, linestyle="--" if mode == CONTROL else "-")
    axis.set_xlabel("step")
    axis.set_ylabel(f"training loss (nats/byte, mean of {len(next(iter(curves.values())))} seeds, smoothed)")
    axis.set_title("Byte-level LM on the Python standard library: FusedAdamW and FusedMuon modes")
    axis.legend()
    axis.set_ylim(top=min(4.0, axis.get_ylim()[1]))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the modes to train (each one's reference is added)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    data = corpus()
    references = {MUON_REFERENCE if MODES[m].get("optimizer") == "muon" else REFERENCE for m in args.modes}
    modes = [mode for mode in MODES if mode in args.modes or mode in references]
    curves: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    start = time.perf_counter()
    for seed in args.seeds:
        for mode in modes:
            curves[mode].append(train(mode, seed, data, args.steps, args.batch, args.context, args.lr))
            print(
                f"seed {seed} {mode}: final {final_loss(curves[mode][-1]):.4f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    finals = {mode: [final_loss(run) for run in runs] for mode, runs in curves.items()}
    lines = verdicts(finals)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "corpus": f"{data.numel()} bytes of {sysconfig.get_paths()['stdlib']}/*.py (sorted)",
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "cpu": os.uname().machine,
                    "cpu_isa": fusedamp.build_info()["cpu_isa"],  # the CPU kernels' (FUSEDAMP_CPU_ISAS)
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "margin": MARGIN,
                    "final_losses": finals,
                    "verdicts": lines,
                    "curves": curves,
                },
                indent=1,
            )
        )
    if args.plot:
        plot(curves, args.plot)


if __name__ == "__main__":
    main()
