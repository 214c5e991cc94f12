"""Gradient diagnostics for mixed precision: would these gradients survive fp16?

:func:`grad_stats` reads every gradient once on its device (one ``fusedamp::grad_stats``
launch per device) and counts, per parameter and overall, the values that fp16 would lose or
degrade: nonzero ``|g| < 2^-24`` (below the smallest fp16 subnormal: flushed to zero without
loss scaling), nonzero ``|g| < 2^-14`` (fp16 subnormals: fewer mantissa bits), non-finite
values, and the largest finite ``|g|`` (overflow risk: fp16 tops out at 65504). Nothing syncs
with the host until a number is read. :class:`ScaleHistory` records a loss scaler's scale per
step, and :func:`advice` turns the statistics into a few sentences.

    stats = fusedamp.diagnostics.grad_stats(model, inv_scale=1 / scaler.get_scale())
    print(stats.total())
    for line in fusedamp.diagnostics.advice(stats, scale=scaler.get_scale()):
        print(line)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fusedamp import _C  # noqa: F401  (importing the extension registers torch.ops.fusedamp)

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "BF16_MAX",
    "LayerStats",
    "GradStats",
    "grad_stats",
    "ScaleHistory",
    "advice",
]

FP16_MIN_SUBNORMAL = 2.0**-24
FP16_MIN_NORMAL = 2.0**-14
FP16_MAX = 65504.0
BF16_MAX = torch.finfo(torch.bfloat16).max


@torch.library.register_fake("fusedamp::grad_stats")
def _grad_stats_fake(grads: list[Tensor], inv_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    device = grads[0].device if grads else inv_scale.device
    counts = torch.empty(len(grads), 3, dtype=torch.int64, device=device)
    return counts, torch.empty(len(grads), dtype=torch.float32, device=device)


@dataclass(frozen=True)
class LayerStats:
    """Host-side statistics of one gradient (or of all of them, as ``name == "total"``).

    Fractions are over all ``numel`` values; ``max_abs`` is the largest ``|g|`` over the finite
    stored values (``inf`` when unscaling one overflows float32).

    >>> LayerStats("fc.weight", 100, 0.25, 0.5, 0, 3.0).underflow_fp16
    0.25
    """

    name: str
    numel: int
    underflow_fp16: float  # fraction with 0 < |g| < 2^-24
    subnormal_fp16: float  # fraction with 0 < |g| < 2^-14 (includes the above)
    non_finite: int
    max_abs: float

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.numel} values, {self.underflow_fp16:.2%} below 2^-24, "
            f"{self.subnormal_fp16:.2%} below 2^-14, {self.non_finite} non-finite, "
            f"max |g| {self.max_abs:.3g}"
        )


class GradStats:
    """Per-gradient statistics, kept on the gradients' device until read.

    ``counts`` is ``(num_grads, 3)`` int64 (below 2^-24, below 2^-14, non-finite) and
    ``max_abs`` is ``(num_grads,)`` float32; both may span several devices (one pair per
    device, concatenated on read). :meth:`underflow_fraction` stays on the device, so a
    training loop can record it every step without a host sync.

    >>> model = torch.nn.Linear(4, 2)
    >>> model(torch.randn(8, 4)).sum().backward()
    >>> stats = grad_stats(model)
    >>> [layer.name for layer in stats.layers()]
    ['weight', 'bias']
    """

    def __init__(self, names: list[str], numels: list[int], parts: list[tuple[list[int], Tensor, Tensor]]):
        self.names = names
        self.numels = numels
        # (positions in `names`, counts, max_abs) per device.
        self._parts = parts

    def underflow_fraction(self) -> Tensor:
        """Fraction of all gradient values with ``0 < |g| < 2^-24``, as a 0-dim float32 tensor
        on the first device (no host sync)."""
        if not self._parts:
            return torch.zeros((), dtype=torch.float32)
        device = self._parts[0][1].device
        below = sum(counts[:, 0].sum().to(device) for _, counts, _ in self._parts)
        return below.float() / max(sum(self.numels), 1)

    def _host(self) -> tuple[list[list[int]], list[float]]:
        counts: list[list[int]] = [[0, 0, 0] for _ in self.names]
        max_abs = [0.0 for _ in self.names]
        for positions, part_counts, part_max in self._parts:
            rows = zip(positions, part_counts.tolist(), part_max.tolist(), strict=True)
            for position, row, largest in rows:
                counts[position] = row
                max_abs[position] = largest
        return counts, max_abs

    def layers(self) -> list[LayerStats]:
        """One :class:`LayerStats` per gradient, in the order given (syncs with the device)."""
        counts, max_abs = self._host()
        return [
            LayerStats(name, numel, row[0] / max(numel, 1), row[1] / max(numel, 1), row[2], largest)
            for name, numel, row, largest in zip(self.names, self.numels, counts, max_abs, strict=True)
        ]

    def total(self) -> LayerStats:
        """All gradients together (syncs with the device)."""
        counts, max_abs = self._host()
        numel = sum(self.numels)
        below = [sum(row[column] for row in counts) for column in range(3)]
        return LayerStats(
            "total", numel, below[0] / max(numel, 1), below[1] / max(numel, 1), below[2],
            max(max_abs, default=0.0),
        )


def _named_grads(
    source: nn.Module | Iterable[tuple[str, Tensor]] | Iterable[Tensor],
) -> list[tuple[str, Tensor]]:
    items = source.named_parameters() if isinstance(source, nn.Module) else source
    named = []
    for index, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) else (str(index), item)
        # Parameters contribute their .grad; plain tensors are taken as the gradients.
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else tensor
        if grad is not None:
            named.append((name, grad))
    return named


def grad_stats(
    source: nn.Module | Iterable[tuple[str, Tensor]] | Iterable[Tensor],
    inv_scale: Tensor | float | None = None,
) -> GradStats:
    """Statistics of the gradients of ``source``, in one read of each gradient.

    ``source`` is a module (its parameters' ``.grad``), ``(name, parameter)`` pairs, or
    gradient tensors. ``inv_scale`` (the inverse loss scale, a float or a one-element tensor)
    multiplies every value first, so scaled gradients are judged by their true size. Parameters
    without a gradient are left out.

    >>> stats = grad_stats([torch.tensor([1e-9, 1e-6, 0.0, float("inf")])])
    >>> stats.total().underflow_fp16, stats.total().non_finite
    (0.25, 1)
    """
    named = _named_grads(source)
    by_device: dict[torch.device, list[int]] = {}
    for position, (_, grad) in enumerate(named):
        by_device.setdefault(grad.device, []).append(position)
    parts = []
    for device, positions in by_device.items():
        scale = inv_scale
        if scale is not None and not isinstance(scale, Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32, device=device)
        elif scale is not None:
            scale = scale.detach().to(device=device, dtype=torch.float32).reshape(())
        grads = [named[position][1].detach() for position in positions]
        counts, max_abs = torch.ops.fusedamp.grad_stats(grads, scale)
        parts.append((positions, counts, max_abs))
    return GradStats([name for name, _ in named], [grad.numel() for _, grad in named], parts)


class ScaleHistory:
    """The loss scale after every step, and which steps were skipped.

    ``record`` keeps tensors as they are (no host sync in the training loop); the lists are
    built when read. A step counts as skipped when ``skipped`` says so or, when it is not
    given, when the scale dropped (PyTorch's scaler backs off exactly on skipped steps).

    >>> history = ScaleHistory(initial_scale=65536.0)
    >>> history.record(65536.0); history.record(32768.0)
    >>> history.scales(), history.skipped()
    ([65536.0, 32768.0], [False, True])
    """

    def __init__(self, initial_scale: float | None = None) -> None:
        self.initial_scale = initial_scale
        self._scales: list[Tensor | float] = []
        self._skipped: list[Tensor | bool | None] = []

    def record(self, scale: Tensor | float, skipped: Tensor | bool | None = None) -> None:
        """Adds one step: the scale after it and, when known, whether it was skipped."""
        self._scales.append(scale.detach().clone() if isinstance(scale, Tensor) else float(scale))
        self._skipped.append(skipped.detach().clone() if isinstance(skipped, Tensor) else skipped)

    def __len__(self) -> int:
        return len(self._scales)

    def scales(self) -> list[float]:
        """The recorded scales as floats (syncs with the device once)."""
        return [float(value) for value in _to_host(self._scales)]

    def skipped(self) -> list[bool]:
        """Whether each recorded step was skipped."""
        scales = self.scales()
        given = _to_host(self._skipped)
        previous = [self.initial_scale, *scales[:-1]]
        return [
            bool(flag) if flag is not None else (before is not None and scale < before)
            for flag, scale, before in zip(given, scales, previous, strict=True)
        ]

    def num_skipped(self) -> int:
        """How many recorded steps were skipped."""
        return sum(self.skipped())


def _to_host(values: list) -> list:
    tensors = [value for value in values if isinstance(value, Tensor)]
    if not tensors:
        return list(values)
    # One transfer for all recorded tensors instead of one sync per entry.
    host = iter(torch.stack([t.reshape(()).float().cpu() for t in tensors]).tolist())
    return [next(host) if isinstance(value, Tensor) else value for value in values]


def advice(stats: GradStats | LayerStats, scale: float | None = None) -> list[str]:
    """Short advice on fp16 vs bf16 derived from gradient statistics.

    ``stats`` should describe unscaled gradients (pass ``inv_scale`` to :func:`grad_stats`);
    ``scale`` is the loss scale in use, if any.

    >>> advice(LayerStats("total", 1000, 0.25, 0.4, 0, 2.0))[0]
    'fp16 needs a loss scaler here: 25.00% of gradient values are below 2^-24 and would flush to zero.'
    """
    total = stats.total() if isinstance(stats, GradStats) else stats
    lines = []
    if total.underflow_fp16 > 1e-3:
        lines.append(
            f"fp16 needs a loss scaler here: {total.underflow_fp16:.2%} of gradient values are "
            "below 2^-24 and would flush to zero."
        )
    else:
        lines.append(
            f"fp16 would lose only {total.underflow_fp16:.2%} of gradient values to underflow "
            "without a loss scaler."
        )
    if total.subnormal_fp16 > 0.01:
        lines.append(
            f"{total.subnormal_fp16:.2%} of gradient values are below 2^-14, where fp16 is "
            "subnormal and keeps fewer mantissa bits."
        )
    if scale is not None and total.max_abs * scale > FP16_MAX:
        lines.append(
            f"fp16 would overflow at loss scale {scale:g} (max |g| x scale = "
            f"{total.max_abs * scale:.3g} > 65504): the scaler will back off."
        )
    if total.max_abs > FP16_MAX:
        lines.append(f"fp16 overflows even unscaled (max |g| = {total.max_abs:.3g}): use bf16.")
    if total.non_finite:
        lines.append(
            f"{total.non_finite} gradient values are inf/NaN: a GradScaler skips this step; if "
            "this persists at small scales the model is diverging, not just out of range."
        )
    elif total.max_abs < BF16_MAX:
        lines.append(
            f"bf16 would not overflow (max |g| = {total.max_abs:.3g}) and needs no loss scaler, "
            "at the price of 8 mantissa bits instead of fp16's 11."
        )
    return lines
