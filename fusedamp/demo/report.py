"""The demo's output: the comparison table, the seed experiment beside this run, and the plot."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fusedamp.demo.train import ModeResult

__all__ = [
    "SEED", "results_table", "memory_table", "findings", "speedup_text", "seed_comparison", "plot_results",
]

# Optimizer steps per mode beyond which the step's median time is worth comparing.
MIN_COMPARED_STEPS = 10
# The seed experiment as published: ResNet-50 on FashionMNIST, 10 epochs on a GPU, AMP at
# twice fp32's batch size. Training times in seconds for all 10 epochs.
SEED = {"fp32_seconds": 333.0, "amp_seconds": 141.0, "speedup": 2.36, "underflow": 0.25, "epochs": 10}


def _format_bytes(count: int) -> str:
    """Bytes in MiB, or KiB below one MiB.

    >>> _format_bytes(300 * 2**20), _format_bytes(3 * 2**20), _format_bytes(2**9), _format_bytes(0)
    ('300 MiB', '3.00 MiB', '0.5 KiB', '0')
    """
    if not count:
        return "0"
    mib = count / 2**20
    if mib >= 100:
        return f"{mib:,.0f} MiB"
    return f"{mib:.2f} MiB" if mib >= 1 else f"{count / 2**10:.1f} KiB"


def _columns(rows: list[list[str]]) -> str:
    # The first column left-aligned, the others right-aligned, a rule under the header.
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def speedup_text(result: ModeResult, baseline: ModeResult | None) -> str:
    """The median speedup over ``baseline`` and its range over the epochs: ``1.72x [1.65-1.80]``.

    >>> fp32 = ModeResult("fp32", epoch_times=[2.0, 2.0, 2.0])
    >>> speedup_text(ModeResult("amp", epoch_times=[1.0, 2.0, 1.0]), fp32)
    '2.00x [1.00-2.00]'
    """
    speedups = [] if baseline is None else result.speedups_vs(baseline)
    if not speedups:
        return "-"
    median = result.speedup_vs(baseline)
    if len(speedups) == 1:
        return f"{median:.2f}x"
    return f"{median:.2f}x [{min(speedups):.2f}-{max(speedups):.2f}]"


def _mean_underflow(result: ModeResult) -> float | None:
    return sum(f for _, f in result.underflow) / len(result.underflow) if result.underflow else None


def results_table(results: list[ModeResult]) -> str:
    """The final comparison table as text (speedups against the fp32 row, when present: the
    median over the epochs, and in brackets the lowest and highest)."""
    baseline = next((r for r in results if r.mode == "fp32"), None)
    header = ["mode", "batch", "steps", "time/epoch", "samples/s", "speedup [min-max]", "opt. step",
              "accuracy", "precision", "recall", "F1", "<2^-24", "skipped", "final scale"]
    rows = [header]
    for r in results:
        mean_underflow = _mean_underflow(r)
        rows.append([
            r.mode, str(r.batch_size), str(len(r.losses)), f"{r.time_per_epoch:.1f} s",
            f"{r.samples_per_s:,.0f}", speedup_text(r, baseline),
            f"{1000 * r.step_seconds:.2f} ms ({r.step_share:.1%})" if r.step_times else "-",
            f"{r.accuracy:.2%}", f"{r.precision:.4f}", f"{r.recall:.4f}", f"{r.f1:.4f}",
            "-" if mean_underflow is None else f"{mean_underflow:.2%}",
            "-" if r.skipped_steps is None else str(r.skipped_steps),
            "-" if r.final_scale is None else f"{r.final_scale:g}",
        ])
    return _columns(rows)


def memory_table(results: list[ModeResult]) -> str:
    """Each mode's bytes by role (see :mod:`fusedamp.demo.memory`), then the optimizer state by
    key and dtype; a CUDA peak column when the modes ran on CUDA."""
    cuda = any(r.memory.cuda_peak is not None for r in results)
    header = ["mode", "batch", "weights", "grads", "masters", "moments", "other state", "activations",
              "total"]
    rows = [header + (["CUDA peak"] if cuda else [])]
    for r in results:
        m = r.memory
        row = [r.mode, str(r.batch_size), *(_format_bytes(n) for n in (
            m.weights, m.grads, m.masters, m.moments, m.other, m.activations, m.total))]
        rows.append(row + ([_format_bytes(m.cuda_peak or 0)] if cuda else []))
    lines = [_columns(rows)]
    for r in results:
        state = ", ".join(f"{key} {_format_bytes(n)}" for key, n in r.memory.state.items()) or "none"
        lines.append(f"  {r.mode} optimizer state: {state}")
    return "\n".join(lines)


def _ratio(part: float, whole: float) -> str:
    return f"{part / whole:.2f}x" if whole else "-"


def _activations_per_sample(r: ModeResult) -> float:
    # Modes may train at different batch sizes (--amp-batch-size, the seed preset): compare per sample.
    return r.memory.activations / max(r.batch_size, 1)


def findings(results: list[ModeResult], native: bool, dtype: str) -> list[str]:
    """What the run shows on this machine, whatever its speed: the modes' quality side by
    side, their memory against fp32's, and the optimizer step's time against torch's (``native``:
    whether the hardware computes ``dtype`` natively)."""
    lines = []
    accuracies = [r.accuracy for r in results]
    lines.append("quality: test accuracy " + ", ".join(f"{r.mode} {r.accuracy:.2%}" for r in results)
                 + (f" (a spread of {100 * (max(accuracies) - min(accuracies)):.1f} points), macro F1 "
                    f"{min(r.f1 for r in results):.4f}-{max(r.f1 for r in results):.4f}"
                    if len(results) > 1 else ""))
    baseline = next((r for r in results if r.mode == "fp32"), None)
    amp = [r for r in results if r.mode != "fp32"]
    if baseline is not None and amp:
        def against_fp32(part: Callable[[ModeResult], float]) -> str:
            return ", ".join(f"{r.mode} {_ratio(part(r), part(baseline))}" for r in amp)

        lines.append("memory against fp32's: activations saved for backward (per sample) "
                     + against_fp32(_activations_per_sample) + "; weights + grads "
                     + against_fp32(lambda r: r.memory.weights + r.memory.grads) + "; optimizer state "
                     + against_fp32(lambda r: r.memory.optimizer))
    torch_amp = next((r for r in results if r.mode == "torch-amp" and r.step_times), None)
    ours = [r for r in results if r.mode.startswith("fusedamp") and r.step_times]
    if torch_amp is not None and ours:
        compared = min(len(r.step_times) for r in [torch_amp, *ours]) > MIN_COMPARED_STEPS

        def against_torch(r: ModeResult) -> str:
            speed = f" ({torch_amp.step_seconds / r.step_seconds:.2f}x as fast)" if compared else ""
            return f"{r.mode} {1000 * r.step_seconds:.2f} ms{speed}"

        lines.append("optimizer step (unscale, AdamW, scaler update): torch-amp "
                     f"{1000 * torch_amp.step_seconds:.2f} ms, " + ", ".join(map(against_torch, ours))
                     + ("" if compared else f" (too few steps to compare: more than {MIN_COMPARED_STEPS} "
                                            "per mode make a median)")
                     + "; forward and backward take the rest: "
                     + ", ".join(f"{r.mode} {1 - r.step_share:.1%}" for r in [torch_amp, *ours])
                     + " of the training time")
    if not native and amp:
        lines.append(f"speed: no AMP speedup to show here, as this hardware has no native {dtype} "
                     "arithmetic (below); forward and backward are torch's own ops in every AMP mode "
                     "(fusedamp.autocast is torch.autocast), so what fusedamp changes here is the step "
                     "and the memory above")
    return lines


def seed_comparison(results: list[ModeResult], full_epochs: int, full_samples: int) -> list[str]:
    """The seed experiment's published figures beside this run's, one line per figure. When
    the run was shorter than ``full_epochs`` of ``full_samples`` (a time budget), each training
    time is also extrapolated to the full run at the speed measured."""
    baseline = next((r for r in results if r.mode == "fp32"), None)
    amp = [r for r in results if r.mode != "fp32"]

    def training_time(r: ModeResult) -> str:
        text = f"{sum(r.epoch_times):,.1f} s"
        trained = sum(r.block_samples)
        if trained < full_epochs * full_samples:
            full = full_epochs * full_samples / r.samples_per_s
            text += f" for {trained:,} samples (~{full:,.0f} s for {full_epochs} epochs of {full_samples:,})"
        return text

    def each(rows: list[ModeResult], text: Callable[[ModeResult], str]) -> str:
        return ", ".join(f"{r.mode} {text(r)}" for r in rows) or "-"

    def underflow(r: ModeResult) -> str:
        fraction = _mean_underflow(r)
        return "-" if fraction is None else f"{fraction:.1%}"

    return [
        f"the seed experiment as published (GPU, {SEED['epochs']} epochs) | this run:",
        f"  fp32 training time:         {SEED['fp32_seconds']:.0f} s | "
        + (each([baseline], training_time) if baseline else "-"),
        f"  AMP training time:          {SEED['amp_seconds']:.0f} s | {each(amp, training_time)}",
        f"  AMP speedup:                {SEED['speedup']:.2f}x | "
        + (each(amp, lambda r: speedup_text(r, baseline)) if baseline else "-"),
        "  precision / recall / F1:    the same in fp32 and AMP | "
        + each(results, lambda r: f"{r.precision:.4f} / {r.recall:.4f} / {r.f1:.4f}"),
        f"  fp16 grads < 2^-24 unscaled: about {SEED['underflow']:.0%} | {each(results, underflow)}",
        "  activations saved for backward (per sample): halved by AMP | "
        + (each(amp, lambda r: f"{_ratio(_activations_per_sample(r), _activations_per_sample(baseline))} "
                               "fp32's") if baseline else "-"),
        "  optimizer state:            the same in fp32 and AMP | "
        + (each(amp, lambda r: f"{_ratio(r.memory.optimizer, baseline.memory.optimizer)} fp32's")
           if baseline else "-"),
    ]


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
