"""fusedamp's main job: train a ResNet on FashionMNIST in fp32 and in mixed precision, compare.

    python -m fusedamp.demo                      # defaults finish in minutes on 2 CPU cores
    python -m fusedamp.demo --data-dir ~/fashion --model resnet50 --epochs 10 --plot amp.png

Modes (``--modes``, comma-separated; all four by default):

- ``fp32``: plain fp32 training, ``torch.optim.AdamW(fused=True)``;
- ``torch-amp``: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``;
- ``fusedamp``: ``fusedamp.autocast`` + ``fusedamp.GradScaler`` + ``fusedamp.FusedAdamW``;
- ``fusedamp-o2``: the model itself in half precision (``fusedamp.half_model``, BatchNorm kept
  fp32) + ``fusedamp.GradScaler`` + ``FusedAdamW`` with fp32 master weights.

Every mode starts from the same weights and sees the batches in the same order. The final
table gives time per epoch, throughput, speedup over fp32, peak memory (CUDA: max allocated;
CPU: peak resident set size of the process), test accuracy and macro precision/recall/F1,
skipped steps and the final loss scale. Gradient statistics (``fusedamp.diagnostics``) are taken
every ``--diag-every`` optimizer steps in every mode, on the unscaled gradients: the fraction
that fp16 would flush to zero without loss scaling. ``--json`` writes everything, ``--plot``
draws loss curves, loss-scale history and that fraction per step (needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fusedamp import diagnostics
from fusedamp.demo.data import (
    CLASSES,
    FashionMNIST,
    Split,
    batches,
    load_fashion_mnist,
    synthetic_fashion_mnist,
)
from fusedamp.demo.models import MODELS, build_model
from fusedamp.precision import half_model

__all__ = ["MODES", "ModeResult", "classification_metrics", "run_mode", "main", "plot_results"]

MODES = ("fp32", "torch-amp", "fusedamp", "fusedamp-o2")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModeResult:
    """What one training mode measured; ``losses`` has one entry per optimizer step,
    ``scales`` the loss scale after each step (empty without a scaler) and ``underflow`` the
    ``(step, fraction of |g| < 2^-24)`` pairs of the diagnostics.

    >>> ModeResult("fusedamp", epoch_times=[1.0]).speedup_vs(ModeResult("fp32", epoch_times=[2.0]))
    2.0
    """

    mode: str
    epoch_times: list[float] = field(default_factory=list)
    samples_per_s: float = 0.0
    peak_memory_bytes: int = 0
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
        return sum(self.epoch_times) / max(len(self.epoch_times), 1)

    def speedup_vs(self, baseline: ModeResult) -> float | None:
        """How many times faster than ``baseline`` per epoch (None when either has no time)."""
        if not self.epoch_times or not baseline.epoch_times:
            return None
        return baseline.time_per_epoch / self.time_per_epoch


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


class PeakMemory:
    """Peak memory of one mode: CUDA max allocated, or the process's peak RSS on CPU.

    On Linux the RSS high-water mark is reset per mode (``/proc/self/clear_refs``); freed heap
    is handed back to the OS first so each mode starts from the same floor. Elsewhere the
    number is the process's peak so far.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        with contextlib.suppress(OSError), open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    """The model, optimizer, scaler and autocast of ``mode`` (see the module docstring)."""
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
    """The settings every mode shares (from the command line)."""

    model: str = "resnet18"
    width: int = 16
    epochs: int = 3
    batch_size: int = 128
    accumulate: int = 1
    lr: float = 2e-3
    weight_decay: float = 0.05
    diag_every: int = 10
    seed: int = 0


def _evaluate(recipe: Recipe, data: FashionMNIST, device: torch.device, batch_size: int) -> dict[str, float]:
    recipe.model.eval()
    predictions = []
    with torch.no_grad(), recipe.forward_context():
        for images, _ in batches(data.test, batch_size, device=device):
            predictions.append(recipe.model(images).argmax(1).cpu())
    recipe.model.train()
    return classification_metrics(torch.cat(predictions), data.test.labels, len(CLASSES))


def _micro_batches_per_epoch(data: FashionMNIST, config: RunConfig) -> int:
    # Rounded down to whole accumulation groups: every epoch ends on an optimizer step.
    micro = len(data.train) // config.batch_size
    return micro - micro % config.accumulate


def run_mode(mode: str, data: FashionMNIST, config: RunConfig, device: torch.device,
             dtype: torch.dtype, stream: Any = None) -> ModeResult:
    """Trains a fresh model in ``mode`` and evaluates it on the test split.

    >>> data = synthetic_fashion_mnist(256, 64)
    >>> run_mode("fp32", data, RunConfig(width=4, epochs=1), torch.device("cpu"), torch.bfloat16).mode
    'fp32'
    """
    torch.manual_seed(config.seed)
    model = build_model(config.model, num_classes=len(CLASSES), width=config.width).to(device)
    recipe = build_recipe(mode, model, device, dtype, config.lr, config.weight_decay)
    scaler = recipe.scaler
    history = diagnostics.ScaleHistory(initial_scale=scaler.get_scale() if scaler else None)
    result = ModeResult(mode)
    memory = PeakMemory(device)
    memory.reset()
    order = torch.Generator().manual_seed(config.seed)
    micro_batches = _micro_batches_per_epoch(data, config)
    if micro_batches == 0:
        raise ValueError(
            f"{len(data.train)} training samples make no full step of {config.batch_size} x "
            f"{config.accumulate}; lower --batch-size or --accumulate"
        )
    loss_history: list[Tensor] = []
    underflow: list[tuple[int, Tensor]] = []
    last_stats: diagnostics.GradStats | None = None
    step = 0
    for epoch in range(config.epochs):
        progress = Progress(f"{mode:<12} epoch {epoch + 1}/{config.epochs}",
                            micro_batches * config.batch_size, stream)
        start = time.perf_counter()
        last_draw = start
        running = torch.zeros((), device=device)
        loader = batches(data.train, config.batch_size, device=device, shuffle=True, generator=order,
                         drop_last=True)
        for index, (images, labels) in enumerate(itertools.islice(loader, micro_batches)):
            with recipe.forward_context():
                logits = recipe.model(images)
            loss = F.cross_entropy(logits.float(), labels) / config.accumulate
            (scaler.scale(loss) if scaler else loss).backward()
            running += loss.detach()
            if (index + 1) % config.accumulate:
                continue
            scale = _scale_tensor(scaler) if scaler else None
            if config.diag_every and step % config.diag_every == 0:
                inv_scale = None if scale is None else scale.double().reciprocal().float()
                last_stats = diagnostics.grad_stats(recipe.model, inv_scale=inv_scale)
                underflow.append((step, last_stats.underflow_fraction()))
            if scaler:
                scaler.step(recipe.optimizer)
                skipped = _skipped_flag(scaler)
                scaler.update()
                history.record(_scale_tensor(scaler), skipped)
            else:
                recipe.optimizer.step()
            recipe.optimizer.zero_grad(set_to_none=True)
            loss_history.append(running.clone())
            running.zero_()
            step += 1
            now = time.perf_counter()
            if now - last_draw > 0.5:  # reading the loss syncs with the device: not every step
                last_draw = now
                done = (index + 1) * config.batch_size
                progress.update(done, done / (now - start), loss_history[-1].item(),
                                _scale_tensor(scaler).item() if scaler else None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        result.epoch_times.append(elapsed)
        metrics = _evaluate(recipe, data, device, 512)
        result.epoch_accuracy.append(metrics["accuracy"])
        done = micro_batches * config.batch_size
        progress.finish(done, done / elapsed, loss_history[-1].item(),
                        _scale_tensor(scaler).item() if scaler else None,
                        f"{elapsed:6.1f} s  test acc {metrics['accuracy']:.2%}")
    result.peak_memory_bytes = memory.peak_bytes()
    result.samples_per_s = config.epochs * micro_batches * config.batch_size / sum(result.epoch_times)
    result.accuracy, result.precision = metrics["accuracy"], metrics["precision"]
    result.recall, result.f1 = metrics["recall"], metrics["f1"]
    result.losses = torch.stack(loss_history).tolist()
    if scaler:
        result.scales = history.scales()
        result.skipped_steps = history.num_skipped()
        result.final_scale = result.scales[-1]
    if underflow:
        fractions = torch.stack([fraction.cpu() for _, fraction in underflow]).tolist()
        result.underflow = [(at, fraction) for (at, _), fraction in zip(underflow, fractions, strict=True)]
    if last_stats is not None:
        result.advice = diagnostics.advice(last_stats, scale=result.final_scale)
    return result


def _format_bytes(count: int) -> str:
    return f"{count / 2**20:,.0f} MiB"


def results_table(results: list[ModeResult]) -> str:
    """The final comparison table as text (speedups against the fp32 row, when present)."""
    baseline = next((r for r in results if r.mode == "fp32"), None)
    header = ["mode", "time/epoch", "samples/s", "speedup", "peak mem", "accuracy", "precision",
              "recall", "F1", "<2^-24", "skipped", "final scale"]
    rows = [header]
    for r in results:
        speedup = r.speedup_vs(baseline) if baseline else None
        mean_underflow = sum(f for _, f in r.underflow) / len(r.underflow) if r.underflow else None
        rows.append([
            r.mode, f"{r.time_per_epoch:.1f} s", f"{r.samples_per_s:,.0f}",
            "-" if speedup is None else f"{speedup:.2f}x", _format_bytes(r.peak_memory_bytes),
            f"{r.accuracy:.2%}", f"{r.precision:.4f}", f"{r.recall:.4f}", f"{r.f1:.4f}",
            "-" if mean_underflow is None else f"{mean_underflow:.2%}",
            "-" if r.skipped_steps is None else str(r.skipped_steps),
            "-" if r.final_scale is None else f"{r.final_scale:g}",
        ])
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_results(results: list[ModeResult], path: str, title: str = "") -> None:
    """Loss curves, loss-scale history and the fp16-underflow fraction per step, in one PNG.

    Raises ImportError when matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, scales, underflow) = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, r in enumerate(results):
        style = {"label": r.mode, "color": colors[index % len(colors)]}
        # A moving average over ~2% of the run: per-step losses are too noisy to compare.
        window = max(1, len(r.losses) // 50)
        smooth = torch.tensor(r.losses).unfold(0, window, 1).mean(1).tolist() if r.losses else []
        losses.plot(range(window - 1, window - 1 + len(smooth)), smooth, **style)
        if r.scales:
            scales.step(range(1, len(r.scales) + 1), [math.log2(s) for s in r.scales], where="post",
                        **style)
        if r.underflow:
            underflow.plot([s for s, _ in r.underflow], [100 * f for _, f in r.underflow], **style)
    losses.set(title="training loss", xlabel="optimizer step", ylabel="cross-entropy")
    scales.set(title="loss scale", xlabel="optimizer step", ylabel="log2(scale)")
    underflow.set(title="gradients below 2^-24 (lost in fp16 unscaled)", xlabel="optimizer step",
                  ylabel="% of gradient values")
    for axes in (losses, scales, underflow):
        if axes.has_data():
            axes.legend()
        axes.grid(alpha=0.3)
    if not scales.has_data():
        scales.text(0.5, 0.5, "no mode used a loss scaler", ha="center", transform=scales.transAxes)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fusedamp.demo",
        description="Train a ResNet on FashionMNIST in fp32 and mixed precision (PyTorch AMP vs "
                    "fusedamp) and compare speed, memory, accuracy and gradient statistics.",
    )
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated modes to run, in order (default: {','.join(MODES)})")
    parser.add_argument("--o2", action="store_true",
                        help="also run fusedamp-o2 when --modes leaves it out")
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--width", type=int, default=None,
                        help="channels of the first stage (default: 64 on CUDA, 16 on CPU)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128, help="micro-batch size")
    parser.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="accumulate gradients over N micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="half type of the AMP modes (default: fp16 on CUDA, bf16 on CPU)")
    parser.add_argument("--data-dir", default=None,
                        help="folder with the FashionMNIST IDX files (gz or raw); without it a "
                             "synthetic FashionMNIST-shaped set is used")
    parser.add_argument("--train-size", type=int, default=None,
                        help="training samples (default: all of the real set; synthetic: 60000 on "
                             "CUDA, 12000 on CPU)")
    parser.add_argument("--test-size", type=int, default=None,
                        help="test samples (default: all of the real set; synthetic: 10000 on "
                             "CUDA, 2000 on CPU)")
    parser.add_argument("--diag-every", type=int, default=10, metavar="N",
                        help="gradient statistics every N optimizer steps (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write all results as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="plot loss curves, loss scale and fp16 underflow (needs matplotlib)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.o2 and "fusedamp-o2" not in args.modes:
        args.modes.append("fusedamp-o2")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"unknown modes {unknown}; choose among {', '.join(MODES)}")
    for name in ("epochs", "batch_size", "accumulate"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.plot and not _have_matplotlib():
        parser.error("--plot needs matplotlib, which is not installed: `pip install matplotlib`, "
                     "or leave out --plot")
    return args


def main(argv: list[str] | None = None) -> list[ModeResult]:
    """Runs the demo with command-line arguments ``argv``; returns the results per mode."""
    args = _parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("fp16" if on_cuda else "bf16")]
    config = RunConfig(
        model=args.model, width=args.width or (64 if on_cuda else 16), epochs=args.epochs,
        batch_size=args.batch_size, accumulate=args.accumulate, lr=args.lr,
        weight_decay=args.weight_decay, diag_every=args.diag_every, seed=args.seed,
    )
    if args.data_dir:
        data = load_fashion_mnist(args.data_dir)
        data.train = Split(data.train.images[:args.train_size], data.train.labels[:args.train_size])
        data.test = Split(data.test.images[:args.test_size], data.test.labels[:args.test_size])
    else:
        data = synthetic_fashion_mnist(args.train_size or (60000 if on_cuda else 12000),
                                       args.test_size or (10000 if on_cuda else 2000), seed=args.seed)
    parameters = sum(p.numel() for p in build_model(config.model, width=config.width).parameters())
    print(f"fusedamp demo: {config.model} (width {config.width}, {parameters / 1e6:.2f} M params), "
          f"{len(data.train)} train / {len(data.test)} test samples")
    if data.synthetic:
        print(f"data: {data.source} -- no --data-dir given, so this is NOT FashionMNIST: 10 "
              "garment-like classes drawn at random; accuracies are on this synthetic set")
    else:
        print(f"data: {data.source}")
    where = torch.cuda.get_device_name(device) if on_cuda else f"{torch.get_num_threads()} threads"
    print(f"device {device} ({where}), AMP dtype {str(dtype).removeprefix('torch.')}, batch "
          f"{config.batch_size} x accumulate {config.accumulate}, {config.epochs} epochs, "
          f"modes {', '.join(args.modes)}\n")

    results = [run_mode(mode, data, config, device, dtype) for mode in args.modes]
    print()
    print(results_table(results))
    for r in results:
        if r.advice:
            print(f"\ngradient diagnostics ({r.mode}, last measured step):")
            for line in r.advice:
                print(f"  - {line}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({
                "config": asdict(config), "device": str(device), "dtype": str(dtype),
                "data": data.source, "synthetic_data": data.synthetic,
                "train_size": len(data.train), "test_size": len(data.test),
                "results": [asdict(r) | {"time_per_epoch": r.time_per_epoch} for r in results],
            }, out, indent=1)
        print(f"\nresults written to {args.json}")
    if args.plot:
        plot_results(results, args.plot,
                     f"{config.model} on {'synthetic data' if data.synthetic else 'FashionMNIST'}, {device}")
        print(f"plot written to {args.plot}")
    return results

