"""Training helpers of the end-to-end tests: one mixed-precision model and one AMP training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import fusedamp


class MixedPrecisionNet(nn.Module):
    """An fp32 layer, a bf16 layer for an fp32 master and, given four ``features`` (in, hidden,
    hidden, out) rather than three, a bf16 layer for a bf16 remainder; ``param_groups`` sets those
    modes. Float32 out. Built from its own seed: two instances start equal, whatever the global
    RNG holds."""

    def __init__(self, features: tuple[int, ...] = (6, 16, 16, 3), seed: int = 0) -> None:
        super().__init__()
        assert len(features) in (3, 4)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fp32 = nn.Linear(features[0], features[1])
            self.master = nn.Linear(features[1], features[2]).to(torch.bfloat16)
            self.remainder = None
            if len(features) == 4:
                self.remainder = nn.Linear(features[2], features[3]).to(torch.bfloat16)

    def layers(self) -> list[nn.Linear]:
        return [self.fp32, self.master] + ([self.remainder] if self.remainder is not None else [])

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = torch.relu(self.fp32(inputs))
        hidden = self.master(hidden.to(torch.bfloat16))
        if self.remainder is not None:
            hidden = self.remainder(torch.relu(hidden))
        return hidden.float()

    def param_groups(self) -> list[dict[str, Any]]:
        """One group per layer: fp32, fp32 master weights, bf16 remainders."""
        layers = self.layers()
        modes = [{}, {"master_weights": True}, {"master_weights": "remainder"}][: len(layers)]
        return [
            {"params": list(layer.parameters()), **mode} for layer, mode in zip(layers, modes, strict=True)
        ]


def seeded_batch(seed: int, rows: int, net: MixedPrecisionNet, device: str = "cpu") -> tuple[Tensor, Tensor]:
    """(inputs, target) for ``net`` that depend only on ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(rows, net.fp32.in_features, generator=generator)
    target = torch.randn(rows, net.layers()[-1].out_features, generator=generator)
    return inputs.to(device), target.to(device)


@dataclass
class TrainLog:
    """Per step: whether the scaler skipped it, the scale after update(), whether any param changed."""

    skipped: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    changed: list[bool] = field(default_factory=list)


def amp_train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: fusedamp.GradScaler,
    steps: Iterable[int],
    batch: Callable[[int], tuple[Tensor, Tensor]],
    *,
    corrupt: Callable[[int], None] | None = None,
    autocast: torch.dtype | None = torch.bfloat16,
    compile_with: str | None = None,
    unscale_first: bool = False,
) -> TrainLog:
    """AMP training: per step, ``batch(step)``, zeroed grads, the MSE loss of ``model`` under
    fusedamp.autocast to ``autocast`` (None: no autocast), scaled and backpropagated,
    ``corrupt(step)`` (to write an overflow into a grad), then [``scaler.unscale_``,]
    ``scaler.step`` and ``scaler.update``.

    ``compile_with``: the scaled loss compiles with aot_eager and [unscale_,] step and update with
    this backend, both with ``fullgraph=True`` (any graph break fails).
    """
    device = next(model.parameters()).device.type

    def scaled_loss(inputs: Tensor, target: Tensor) -> Tensor:
        return scaler.scale(nn.functional.mse_loss(model(inputs), target))

    def step_and_update() -> Tensor:
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return scaler.step_skipped

    if compile_with is not None:
        scaled_loss = torch.compile(scaled_loss, backend="aot_eager", fullgraph=True)
        step_and_update = torch.compile(step_and_update, backend=compile_with, fullgraph=True)
    log = TrainLog()
    for step in steps:
        inputs, target = batch(step)
        opt.zero_grad()
        if autocast is None:
            loss = scaled_loss(inputs, target)
        else:
            with fusedamp.autocast(device, dtype=autocast):
                loss = scaled_loss(inputs, target)
        loss.backward()
        if corrupt is not None:
            corrupt(step)
        before = [param.detach().clone() for param in model.parameters()]
        log.skipped.append(bool(step_and_update()))
        log.scales.append(scaler.get_scale())
        log.changed.append(
            not all(torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
        )
    return log
