"""The demo's training: each mode's recipe, one trainer per mode, and the modes taking turns.

An epoch is cut into a few blocks of optimizer steps, and the modes take turns block by block
(fp32's block 1, torch-amp's block 1, ..., then every mode's block 2), so that the load of a
shared machine hits every mode alike: each block gives one speedup per mode against fp32's
block, timed seconds apart, and the table shows their median and range.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fusedamp import diagnostics
from fusedamp.demo.data import CLASSES, FashionMNIST, Split, batches
from fusedamp.demo.memory import MemoryBreakdown, optimizer_state_bytes, saved_activation_bytes, tensor_bytes
from fusedamp.demo.models import build_model
from fusedamp.precision import half_model

__all__ = [
    "MODES",
    "DTYPES",
    "ModeResult",
    "RunConfig",
    "ModeRun",
    "build_recipe",
    "classification_metrics",
    "run_modes",
]

MODES = ("fp32", "torch-amp", "fusedamp", "fusedamp-o2", "fusedamp-lowmem")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EVAL_BATCH = 512
BLOCKS_PER_EPOCH = 8  # at most; an epoch of fewer optimizer steps (of every mode) has fewer


@dataclass
class ModeResult:
    """What one training mode measured; ``losses`` has one entry per optimizer step,
    ``scales`` the loss scale after each step (empty without a scaler) and ``underflow`` the
    ``(step, fraction of |g| < 2^-24)`` pairs of the diagnostics, ``step_times`` the seconds
    of each optimizer step (unscale, step, scaler update, zeroing the grads) and ``memory``
    the bytes of the mode's tensors (:mod:`fusedamp.demo.memory`).

    >>> ModeResult("fusedamp", epoch_times=[1.0]).speedup_vs(ModeResult("fp32", epoch_times=[2.0]))
    2.0
    """

    mode: str
    batch_size: int = 0
    samples_per_epoch: int = 0
    epoch_times: list[float] = field(default_factory=list)
    block_samples: list[int] = field(default_factory=list)
    block_times: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    accuracy: float = 0.0
    precision: float = 0.0
    recall: float = 0.0
    f1: float = 0.0
    skipped_steps: int | None = None
    final_scale: float | None = None
    epoch_accuracy: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    underflow: list[tuple[int, float]] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def time_per_epoch(self) -> float:
        """An epoch's samples at the median rate (:attr:`samples_per_s`): unlike the raw
        ``epoch_times``, a block slowed by a shared machine's load does not move it."""
        rate = self.samples_per_s
        return self.samples_per_epoch / rate if rate else 0.0

    @property
    def samples_per_s(self) -> float:
        """Training throughput: the median over the blocks."""
        rates = [n / t for n, t in zip(self.block_samples, self.block_times, strict=True)]
        return statistics.median(rates) if rates else 0.0

    @property
    def step_seconds(self) -> float:
        """The median optimizer step's seconds, leaving out the first (which makes the state)
        when there are more (0.0 without steps)."""
        times = self.step_times[1:] or self.step_times
        return statistics.median(times) if times else 0.0

    @property
    def step_share(self) -> float:
        """The optimizer steps' share of the training time: the rest is forward and backward."""
        trained = sum(self.block_times)
        return sum(self.step_times) / trained if trained else 0.0

    def speedups_vs(self, baseline: ModeResult) -> list[float]:
        """How many times faster than ``baseline`` in each block (or epoch, without blocks) both
        ran: the same samples, in turns seconds apart."""
        own, base = (self.block_times, baseline.block_times) if self.block_times else \
            (self.epoch_times, baseline.epoch_times)
        return [b / o for b, o in zip(base, own, strict=False)]

    def speedup_vs(self, baseline: ModeResult) -> float | None:
        """The median of :meth:`speedups_vs` (None when either has no time)."""
        speedups = self.speedups_vs(baseline)
        return statistics.median(speedups) if speedups else None


def classification_metrics(predictions: Tensor, targets: Tensor, num_classes: int) -> dict[str, float]:
    """Accuracy and macro-averaged precision, recall and F1 (a class never predicted has
    precision 0, as scikit-learn's ``zero_division=0``).

    >>> classification_metrics(torch.tensor([0, 1, 1]), torch.tensor([0, 1, 0]), 2)["accuracy"]
    0.6666666666666666
    """
    confusion = torch.bincount(targets * num_classes + predictions, minlength=num_classes**2)
    confusion = confusion.reshape(num_classes, num_classes).double()
    true_positive = confusion.diag()
    predicted = confusion.sum(0)
    actual = confusion.sum(1)
    precision = torch.where(predicted > 0, true_positive / predicted.clamp(min=1), 0.0)
    recall = torch.where(actual > 0, true_positive / actual.clamp(min=1), 0.0)
    denominator = precision + recall
    f1 = torch.where(denominator > 0, 2 * precision * recall / denominator.clamp(min=1e-12), 0.0)
    return {
        "accuracy": float(true_positive.sum() / max(len(targets), 1)),
        "precision": float(precision.mean()),
        "recall": float(recall.mean()),
        "f1": float(f1.mean()),
    }


class CudaPeakMeter:
    """The CUDA allocator's peak for each mode as if it had run alone, although the modes take
    turns in one process and all their models stay in memory: the bytes allocated before any
    mode was built (:attr:`baseline`), plus the mode's own tensors between turns (weights,
    buffers, optimizer state), plus the most that one of its turns added on top of what was
    allocated when the turn began (gradients, activations, workspaces).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        gc.collect()
        self.baseline = self.begin()

    def begin(self) -> int:
        """Resets the peak; returns the bytes allocated now."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def added_since(self, in_use: int) -> int:
        """How far the peak since :meth:`begin` rose above ``in_use``."""
        return max(0, torch.cuda.max_memory_allocated(self.device) - in_use)


class Progress:
    """One progress line per epoch: redrawn in place on a terminal, printed once otherwise."""

    def __init__(self, label: str, total: int, stream: Any = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()

    def _line(self, done: int, rate: float, loss: float, scale: float | None) -> str:
        width = 24
        filled = int(width * done / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        scale_text = "-" if scale is None else f"{scale:g}"
        return (f"{self.label} [{bar}] {done:>6}/{self.total} {rate:8.0f} samples/s  "
                f"loss {loss:.4f}  scale {scale_text}")

    def update(self, done: int, rate: float, loss: float, scale: float | None) -> None:
        if self.live:
            self.stream.write("\r" + self._line(done, rate, loss, scale))
            self.stream.flush()

    def finish(self, done: int, rate: float, loss: float, scale: float | None, note: str) -> None:
        prefix = "\r" if self.live else ""
        self.stream.write(prefix + self._line(done, rate, loss, scale) + f"  {note}\n")
        self.stream.flush()


@dataclass
class Recipe:
    """What a mode trains with: the model, its optimizer, a loss scaler or None, and the
    context manager its forward passes run under."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    forward_context: Callable[[], contextlib.AbstractContextManager]


def build_recipe(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 lr: float, weight_decay: float) -> Recipe:
    """The model, optimizer, scaler and autocast of ``mode`` (see fusedamp.demo)."""
    if mode == "fp32":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
        return Recipe(model, optimizer, None, contextlib.nullcontext)
    if mode == "torch-amp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
        return Recipe(model, optimizer, torch.amp.GradScaler(device.type),
                      lambda: torch.autocast(device.type, dtype=dtype))
    # Imported here so that fp32 and torch-amp run even where only part of fusedamp is built.
    from fusedamp.autocast import autocast
    from fusedamp.grad_scaler import GradScaler
    from fusedamp.optim import FusedAdamW

    # The grads are zeroed right after each step: no need for the step to write them back unscaled.
    if mode == "fusedamp":
        optimizer = FusedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, master_weights=False,
                               write_unscaled_grads=False)
        return Recipe(model, optimizer, GradScaler(device.type),
                      lambda: autocast(device.type, dtype=dtype))
    if mode == "fusedamp-o2":
        half_model(model, dtype, keep_norm_fp32=True)
        optimizer = FusedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, master_weights=True,
                               write_unscaled_grads=False)
        return Recipe(model, optimizer, GradScaler(device.type), contextlib.nullcontext)
    if mode == "fusedamp-lowmem":
        # bf16 whatever the AMP dtype (remainders complete bf16 params only); bf16 needs no scaler.
        half_model(model, torch.bfloat16, keep_norm_fp32=True)
        optimizer = FusedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                               master_weights="remainder", moments="int8", write_unscaled_grads=False)
        return Recipe(model, optimizer, None, contextlib.nullcontext)
    raise ValueError(f"unknown mode {mode!r}; choose among {', '.join(MODES)}")


def _scale_tensor(scaler: Any) -> Tensor | None:
    # The scale as the device tensor both scalers keep (torch's and fusedamp's `_scale`):
    # get_scale() would sync with the device on every step.
    return getattr(scaler, "_scale", None)


def _skipped_flag(scaler: Any) -> Tensor | None:
    # fusedamp's scaler says on the device whether the step was skipped (read it before
    # update()); torch's does not, and ScaleHistory infers it from the scale dropping (torch
    # backs off exactly on skipped steps).
    flag = getattr(scaler, "step_skipped", None)
    return None if flag is None else flag.clone()


@dataclass
class RunConfig:
    """The settings every mode shares (from the command line).

    ``amp_batch_size`` is the micro-batch size of the mixed-precision modes (None: the same as
    fp32's ``batch_size``); ``samples_per_epoch`` caps the training samples of an epoch (None:
    the whole training split), each epoch drawing them afresh from a new shuffle.
    """

    model: str = "resnet18"
    width: int = 16
    epochs: int = 3
    batch_size: int = 128
    amp_batch_size: int | None = None
    samples_per_epoch: int | None = None
    accumulate: int = 1
    lr: float = 4e-3
    weight_decay: float = 0.05
    diag_every: int = 10
    seed: int = 0

    def batch_size_of(self, mode: str) -> int:
        """The micro-batch size ``mode`` trains with."""
        return self.batch_size if mode == "fp32" or self.amp_batch_size is None else self.amp_batch_size

    def epoch_unit(self, modes: list[str]) -> int:
        """Samples per epoch come in multiples of this: one optimizer step of the mode with the
        largest batch, so every mode trains on exactly the same samples."""
        return max(self.batch_size_of(mode) for mode in modes) * self.accumulate

    def epoch_samples(self, modes: list[str], train_size: int) -> int:
        """The training samples of one epoch, in whole optimizer steps of every mode."""
        unit = self.epoch_unit(modes)
        wanted = min(train_size, self.samples_per_epoch or train_size)
        if wanted < unit:
            raise ValueError(
                f"{wanted} training samples make no full step of {unit // self.accumulate} x "
                f"{self.accumulate}; lower --batch-size or --accumulate"
            )
        return wanted - wanted % unit


class ModeRun:
    """One mode's model, optimizer and scaler, trained a block of steps at a time so that the
    modes can take turns; :meth:`result` collects what it measured. Every mode starts from the same
    weights (the model is built right after seeding) and draws its batches from its own
    generator with the same seed, so all modes see the same samples in the same order.
    """

    def __init__(self, mode: str, config: RunConfig, device: torch.device, dtype: torch.dtype) -> None:
        torch.manual_seed(config.seed)
        model = build_model(config.model, num_classes=len(CLASSES), width=config.width).to(device)
        self.recipe = build_recipe(mode, model, device, dtype, config.lr, config.weight_decay)
        self.mode = mode
        self.config = config
        self.device = device
        self.batch_size = config.batch_size_of(mode)
        scaler = self.recipe.scaler
        self.history = diagnostics.ScaleHistory(initial_scale=scaler.get_scale() if scaler else None)
        self.order = torch.Generator().manual_seed(config.seed)
        self.epoch_times: list[float] = []
        self.block_times: list[float] = []
        self.block_samples: list[int] = []
        self.epoch_accuracy: list[float] = []
        self.metrics: dict[str, float] = {}
        self.samples_per_epoch = 0
        self.steps = 0
        self.most_added_bytes = 0  # the largest memory one turn added (see CudaPeakMeter)
        self.memory: MemoryBreakdown | None = None  # counted on the first micro-batch
        self._step_timers: list[tuple[Any, Any]] = []
        self._micro_batches = 0  # since the last optimizer step
        self._running = torch.zeros((), device=device)
        self._losses: list[Tensor] = []
        self._underflow: list[tuple[int, Tensor]] = []
        self._last_stats: diagnostics.GradStats | None = None
        # The epoch under way (set by start_epoch).
        self._epoch_loader: Iterator[tuple[Tensor, Tensor]] = iter(())
        self._epoch_seconds = 0.0
        self._epoch_done = 0
        self._progress = Progress(mode, 0)

    def _scale(self) -> float | None:
        scale = _scale_tensor(self.recipe.scaler)
        return None if scale is None else scale.item()

    def micro_batch(self, images: Tensor, labels: Tensor) -> None:
        """Forward and backward of one micro-batch; an optimizer step after every
        ``accumulate`` of them."""
        recipe, scaler, config = self.recipe, self.recipe.scaler, self.config

        def forward() -> Tensor:
            with recipe.forward_context():
                return recipe.model(images)

        if self.memory is None:
            logits, activations = saved_activation_bytes(recipe.model, forward)
            self.memory = MemoryBreakdown(activations=activations)
        else:
            logits = forward()
        loss = F.cross_entropy(logits.float(), labels) / config.accumulate
        (scaler.scale(loss) if scaler else loss).backward()
        if not self.memory.grads:
            self.memory.grads = tensor_bytes(p.grad for p in recipe.model.parameters() if p.grad is not None)
        self._running += loss.detach()
        self._micro_batches += 1
        if self._micro_batches < config.accumulate:
            return
        self._micro_batches = 0
        scale = _scale_tensor(scaler) if scaler else None
        if config.diag_every and self.steps % config.diag_every == 0:
            inv_scale = None if scale is None else scale.double().reciprocal().float()
            self._last_stats = diagnostics.grad_stats(recipe.model, inv_scale=inv_scale)
            self._underflow.append((self.steps, self._last_stats.underflow_fraction()))
        timer = self._timer()
        if scaler:
            scaler.step(recipe.optimizer)
            skipped = _skipped_flag(scaler)
            scaler.update()
            self.history.record(_scale_tensor(scaler), skipped)
        else:
            recipe.optimizer.step()
        recipe.optimizer.zero_grad(set_to_none=True)
        self._step_timers.append((timer, self._timer()))
        self._losses.append(self._running.clone())
        self._running.zero_()
        self.steps += 1

    def _timer(self) -> Any:
        # A CUDA event times the device's work without a sync in the loop; on a CPU the clock does.
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _step_seconds(self) -> list[float]:
        if self.device.type != "cuda":
            return [end - start for start, end in self._step_timers]
        self.synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in self._step_timers]

    def synchronize(self) -> None:
        """Waits for the device, so that a timer read next covers all the work queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def evaluate(self, test: Split) -> dict[str, float]:
        """Accuracy and macro precision/recall/F1 on ``test``."""
        model = self.recipe.model
        model.eval()
        predictions = []
        with torch.no_grad(), self.recipe.forward_context():
            for images, _ in batches(test, EVAL_BATCH, device=self.device):
                predictions.append(model(images).argmax(1).cpu())
        model.train()
        return classification_metrics(torch.cat(predictions), test.labels, len(CLASSES))

    def start_epoch(self, train: Split, samples: int, epochs: int, stream: Any = None) -> None:
        """Begins an epoch over the first ``samples`` samples of a fresh shuffle of ``train``."""
        self.samples_per_epoch = samples
        self._epoch_loader = batches(train, self.batch_size, device=self.device, shuffle=True,
                                     generator=self.order, drop_last=True)
        self._epoch_seconds = 0.0
        self._epoch_done = 0
        self._progress = Progress(f"{self.mode:<12} epoch {len(self.epoch_times) + 1}/{epochs}", samples,
                                  stream)

    def train_block(self, samples: int) -> None:
        """Trains on the epoch's next ``samples`` samples (whole optimizer steps), timed."""
        start = time.perf_counter()
        for images, labels in itertools.islice(self._epoch_loader, samples // self.batch_size):
            self.micro_batch(images, labels)
        self.synchronize()
        elapsed = time.perf_counter() - start
        self.block_times.append(elapsed)
        self.block_samples.append(samples)
        self._epoch_seconds += elapsed
        self._epoch_done += samples
        # Reading the loss syncs with the device: once per block, outside the timed part.
        self._progress.update(self._epoch_done, self._epoch_done / self._epoch_seconds,
                              self._losses[-1].item(), self._scale())

    def end_epoch(self, test: Split) -> None:
        """Closes the epoch (cut short when the time budget ran out): records its time, tests,
        prints its line."""
        self.epoch_times.append(self._epoch_seconds)
        self.metrics = self.evaluate(test)
        self.epoch_accuracy.append(self.metrics["accuracy"])
        self._progress.finish(self._epoch_done, self._epoch_done / self._epoch_seconds,
                              self._losses[-1].item(), self._scale(),
                              f"{self._epoch_seconds:6.1f} s  test acc {self.metrics['accuracy']:.2%}")

    def memory_breakdown(self, cuda_peak: int | None = None) -> MemoryBreakdown:
        """The bytes of this mode's tensors: weights and buffers and optimizer state as they are
        now, grads and saved activations as the first micro-batch counted them."""
        model, optimizer = self.recipe.model, self.recipe.optimizer
        memory = self.memory or MemoryBreakdown()
        kinds, by_key = optimizer_state_bytes(optimizer)
        return MemoryBreakdown(
            weights=tensor_bytes([*model.parameters(), *model.buffers()]), grads=memory.grads,
            masters=kinds["masters"], moments=kinds["moments"], other=kinds["other"],
            activations=memory.activations, state=by_key, cuda_peak=cuda_peak,
        )

    def result(self, cuda_peak: int | None = None) -> ModeResult:
        """What this mode measured, as a :class:`ModeResult` (``cuda_peak``: see
        :class:`CudaPeakMeter`)."""
        result = ModeResult(
            self.mode, batch_size=self.batch_size, samples_per_epoch=self.samples_per_epoch,
            epoch_times=self.epoch_times, block_samples=self.block_samples, block_times=self.block_times,
            step_times=self._step_seconds(), epoch_accuracy=self.epoch_accuracy,
            memory=self.memory_breakdown(cuda_peak), **self.metrics,
            losses=torch.stack(self._losses).tolist() if self._losses else [],
        )
        if self.recipe.scaler:
            result.scales = self.history.scales()
            result.skipped_steps = self.history.num_skipped()
            result.final_scale = result.scales[-1] if result.scales else None
        if self._underflow:
            fractions = torch.stack([fraction.cpu() for _, fraction in self._underflow]).tolist()
            steps = [step for step, _ in self._underflow]
            result.underflow = list(zip(steps, fractions, strict=True))
        if self._last_stats is not None:
            result.advice = diagnostics.advice(self._last_stats, scale=result.final_scale)
        return result

    def state_bytes(self) -> int:
        """Bytes of this mode's weights, buffers and optimizer state: what it holds between turns."""
        memory = self.memory_breakdown()
        return memory.weights + memory.optimizer


def _blocks(samples: int, unit: int) -> list[int]:
    """``samples`` cut into at most BLOCKS_PER_EPOCH blocks of whole ``unit``s, as even as can be.

    >>> _blocks(10 * 128, 128)
    [128, 128, 256, 128, 128, 256, 128, 128]
    """
    units = samples // unit
    count = min(BLOCKS_PER_EPOCH, units)
    bounds = [round(i * units / count) for i in range(count + 1)]
    return [(end - begin) * unit for begin, end in itertools.pairwise(bounds)]


def run_modes(modes: list[str], data: FashionMNIST, config: RunConfig, device: torch.device,
              dtype: torch.dtype, stream: Any = None, deadline: float | None = None) -> list[ModeResult]:
    """Trains every mode in ``modes`` for ``config.epochs`` epochs, taking turns block by block
    (see the module docstring), and tests each after every epoch.

    ``deadline`` (a ``time.perf_counter()`` value) stops the run before a round of blocks that,
    as long as the last round and the last tests took, would end after it; the epoch under way
    is then tested as it stands. A time budget so holds even when the machine gets slower than
    the warm-up measured.

    >>> import io
    >>> from fusedamp.demo.data import synthetic_fashion_mnist
    >>> data, config = synthetic_fashion_mnist(256, 64), RunConfig(width=4, epochs=1)
    >>> results = run_modes(["fp32"], data, config, torch.device("cpu"), torch.bfloat16, io.StringIO())
    >>> [r.mode for r in results]
    ['fp32']
    """
    samples = config.epoch_samples(modes, len(data.train))
    blocks = _blocks(samples, config.epoch_unit(modes))
    meter = CudaPeakMeter(device) if device.type == "cuda" else None
    runs = [ModeRun(mode, config, device, dtype) for mode in modes]
    out = stream or sys.stdout
    last_round = last_tests = 0.0

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() + last_round + last_tests > deadline

    for epoch in range(config.epochs):
        if epoch and out_of_time():
            out.write(f"time budget: stopping after {epoch} of {config.epochs} epochs (the machine is "
                      "slower than the warm-up measured)\n")
            break
        for run in runs:
            run.start_epoch(data.train, samples, config.epochs, stream)
        done = 0
        for block in blocks:
            if done and out_of_time():
                break
            round_start = time.perf_counter()
            for run in runs:
                in_use = meter.begin() if meter else 0
                run.train_block(block)
                if meter:
                    run.most_added_bytes = max(run.most_added_bytes, meter.added_since(in_use))
            last_round = time.perf_counter() - round_start
            done += 1
        tests_start = time.perf_counter()
        for run in runs:
            run.end_epoch(data.test)
        last_tests = time.perf_counter() - tests_start
        if done < len(blocks):
            out.write(f"time budget: stopping in epoch {epoch + 1} of {config.epochs} after {done} of "
                      f"{len(blocks)} blocks (the machine is slower than the warm-up measured)\n")
            break
    if meter is None:
        return [run.result() for run in runs]
    return [run.result(meter.baseline + run.state_bytes() + run.most_added_bytes) for run in runs]
