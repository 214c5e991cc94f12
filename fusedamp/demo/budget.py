"""The demo's time budget: warm-up steps measure each mode's speed, then the run is sized to fit.

A comparison of several modes costs the sum of their times, and the slowest mode decides it:
on a CPU without native bf16 arithmetic an AMP step of the default ResNet-18 takes ~12x an
fp32 step. :func:`measure` times each mode briefly on a throwaway model; :func:`plan_run` then
picks how many training samples an epoch uses, how many test samples each epoch is tested on
and, unless the epochs were given, how many epochs there are, so that the whole comparison
fits the time left. A run must also learn: when the plan leaves a mode fewer than
:data:`MIN_STEPS` optimizer steps, the demo measures the next smaller of its :data:`SIZES`
(narrower, shallower, smaller batches) and takes the first that gets them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedamp.demo.data import FashionMNIST, Split, batches
from fusedamp.demo.train import EVAL_BATCH, ModeRun, RunConfig

__all__ = ["MIN_STEPS", "SIZES", "Size", "Speed", "Plan", "measure", "estimate_seconds", "plan_run"]

# Optimizer steps per mode a default run aims for: on the synthetic set every size below
# reaches 75-80% test accuracy after 60 steps at the default learning rate, and 30-60% after
# 30 (measured in fp32 on the dev machine).
MIN_STEPS = 60
PROBE = 32  # samples per micro-batch of the first, cheap measurement of a mode
TEST_SHARE = 0.25  # testing gets at most this share of the time: the comparison is about training
MIN_TEST = 100


@dataclass(frozen=True)
class Size:
    """A model and batch size the demo can train: ``model`` (a key of MODELS), ``width``
    (channels of the first stage), ``batch_size`` (every mode's micro-batch) and ``cost``, the
    multiply-adds of its convolutions per sample relative to the smallest size's (width
    squared times the blocks: a first guess at its time, before the warm-up measures it)."""

    model: str
    width: int
    batch_size: int
    cost: float

    def __str__(self) -> str:
        return f"{self.model} width {self.width}, batch {self.batch_size}"


# The sizes a time budget chooses among, largest first, by device type: the first is the
# default; each next one costs ~2-4x less per step (a quarter of the channels' products, half
# the blocks, or half the batch), for machines whose half-precision convolutions are slow.
SIZES = {
    "cuda": (Size("resnet18", 64, 128, 64.0), Size("resnet18", 32, 128, 16.0),
             Size("resnet18", 16, 128, 4.0), Size("resnet18", 8, 64, 1.0)),
    "cpu": (Size("resnet18", 16, 128, 8.0), Size("resnet18", 8, 128, 2.0), Size("resnet18", 8, 64, 2.0),
            Size("resnet10", 8, 64, 1.0), Size("resnet10", 8, 32, 1.0)),
}


@dataclass(frozen=True)
class Speed:
    """Seconds one sample takes a mode in training (whole optimizer steps) and in testing."""

    train: float
    test: float


@dataclass(frozen=True)
class Plan:
    """A run's size: epochs, training samples per epoch, test samples, and the estimated seconds."""

    epochs: int
    train_samples: int
    test_samples: int
    seconds: float

    def steps(self, unit: int) -> int:
        """Optimizer steps per mode when one step takes ``unit`` samples.

        >>> Plan(3, 1792, 2000, 59.76).steps(128)
        42
        """
        return self.epochs * (self.train_samples // unit)


def _timed(work: Callable[[int], int], size: int) -> float:
    """Seconds per sample of one run of ``work(size)``, which returns the samples it handled."""
    start = time.perf_counter()
    samples = work(size)
    return (time.perf_counter() - start) / samples


def _seconds_per_sample(work: Callable[[int], int], full: int, cheap: float) -> float:
    """Times ``work`` twice at size ``min(PROBE, full)``, keeping the faster (the first run pays
    one-time set-up: kernel selection, caches for new shapes, the optimizer state; on a busy
    2-core machine it took 5-7x a later one), then, while a run looks cheaper than ``cheap``
    seconds, twice at size ``full``, keeping the fastest run of the largest size (a shared
    machine's load may hit any run). A probe too slow to repeat at full size stands: it errs on
    the long side, as small batches cost more per sample."""
    probe = min(PROBE, full)
    seconds = min(_timed(work, probe), _timed(work, probe))
    if probe == full or seconds * full > cheap:
        return seconds
    return min(_timed(work, full), _timed(work, full))


def measure(modes: list[str], data: FashionMNIST, config: RunConfig, device: torch.device,
            dtype: torch.dtype, cheap: float, deadline: float) -> dict[str, Speed]:
    """Each mode's :class:`Speed`, from a few steps and test batches on a throwaway model (see
    :func:`_seconds_per_sample` for ``cheap``). Modes not begun by ``deadline`` (a
    ``time.perf_counter()`` value) are left out: the warm-up alone must not spend the budget."""
    speeds = {}
    for mode in modes:
        if time.perf_counter() > deadline:
            break
        run = ModeRun(mode, config, device, dtype)
        micro_batches = list(itertools.islice(batches(data.train, run.batch_size, device=device),
                                              config.accumulate))

        def train(size: int, run: ModeRun = run, micro_batches: list = micro_batches) -> int:
            for images, labels in micro_batches:
                run.micro_batch(images[:size], labels[:size])
            run.synchronize()
            return size * len(micro_batches)

        def test(size: int, run: ModeRun = run) -> int:
            run.evaluate(Split(data.test.images[:size], data.test.labels[:size]))  # ends on the host
            return size

        speeds[mode] = Speed(_seconds_per_sample(train, run.batch_size, cheap),
                             _seconds_per_sample(test, min(len(data.test), EVAL_BATCH), cheap))
    return speeds


def estimate_seconds(speeds: dict[str, Speed], epochs: int, train_samples: int, test_samples: int) -> float:
    """How long all the modes of ``speeds`` take together for a run of that size.

    >>> estimate_seconds({"fp32": Speed(0.01, 0.002), "torch-amp": Speed(0.1, 0.03)}, 2, 100, 10)
    22.64
    """
    train = sum(speed.train for speed in speeds.values())
    test = sum(speed.test for speed in speeds.values())
    return round(epochs * (train_samples * train + test_samples * test), 6)


def plan_run(speeds: dict[str, Speed], seconds: float, epochs: int, train_samples: int, test_samples: int,
             unit: int, epochs_fixed: bool) -> Plan:
    """The largest run within ``seconds``: the full one (``epochs`` of ``train_samples``, tested
    on ``test_samples``) if it fits; else the test set shrinks to at most a quarter of the time
    (not below ``MIN_TEST``), the epochs to the training samples left, in multiples of ``unit``
    (one optimizer step of every mode), and, unless ``epochs_fixed``, the epochs themselves
    when not even one step per epoch fits. The smallest run (one epoch of ``unit`` samples)
    comes back even when it does not fit: compare its ``seconds`` with the budget.

    >>> plan_run({"fp32": Speed(0.01, 0.001)}, 60, 3, 12000, 2000, 128, False)
    Plan(epochs=3, train_samples=1792, test_samples=2000, seconds=59.76)
    """
    full = estimate_seconds(speeds, epochs, train_samples, test_samples)
    if full <= seconds:
        return Plan(epochs, train_samples, test_samples, full)
    test_cost = max(sum(speed.test for speed in speeds.values()), 1e-12)
    test = min(test_samples, max(MIN_TEST, int(TEST_SHARE * seconds / (epochs * test_cost))))
    if not epochs_fixed:
        epochs = max(1, min(epochs, int(seconds / estimate_seconds(speeds, 1, unit, test))))
    train_cost = sum(speed.train for speed in speeds.values())
    train = int((seconds / epochs - test * test_cost) / train_cost) // unit * unit
    train = min(train_samples, max(unit, train))
    return Plan(epochs, train, test, estimate_seconds(speeds, epochs, train, test))
