"""The demo's command line (`python -m fusedamp.demo`): options, presets, time budget, output."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from fusedamp.demo import budget as budgets
from fusedamp.demo import hardware as hardwares
from fusedamp.demo.data import FashionMNIST, Split, load_fashion_mnist, synthetic_fashion_mnist
from fusedamp.demo.models import MODELS, build_model
from fusedamp.demo.report import findings, memory_table, plot_results, results_table, seed_comparison
from fusedamp.demo.train import DTYPES, MODES, ModeResult, RunConfig, run_modes

__all__ = ["DEFAULT_TIME_BUDGET", "PRESETS", "Preset", "main"]

# Seconds from the start: with the build check and start-up `make demo` ends within 3 minutes
# on a 2-core machine, AVX2-only CPUs included (measured: see README). An AVX2-only CPU's
# half-precision convolutions are ~15x slower than fp32's, and the budget must still give each
# mode the steps it needs to learn (budget.MIN_STEPS).
DEFAULT_TIME_BUDGET = 150.0
# A warm-up run is repeated, and one at full batch size taken, only while a run costs less than
# this share of the budget; otherwise a single small probe stands in (see budget.measure).
CHEAP_SHARE = 0.02
# Modes the warm-up has not begun when this share of the time left is spent go unmeasured.
WARM_UP_SHARE = 0.5
# The plan fills this share of the time left: building the models, preparing the batches and
# a machine that slows down are not in its estimate (on the dev machine the training ran
# ~20% slower than the warm-up's best steps).
PLAN_SHARE = 0.75
# Speedups of one mode that differ by more than this factor between blocks mean a busy machine.
SPREAD_WARNING = 2.0


@dataclass(frozen=True)
class Preset:
    """A named experiment: the settings it gives the options the command line leaves out."""

    description: str
    model: str
    width: int
    epochs: int
    batch_size: int
    amp_batch_factor: int  # the AMP modes' batch size is this times fp32's
    modes: tuple[str, ...]
    train_size: int
    test_size: int


PRESETS = {
    "seed": Preset(
        "the seed experiment: ResNet-50 on FashionMNIST, 10 epochs, fp32 vs AMP at twice the batch size",
        model="resnet50", width=64, epochs=10, batch_size=128, amp_batch_factor=2,
        modes=("fp32", "torch-amp", "fusedamp"), train_size=60000, test_size=10000,
    ),
}


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
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="seed: " + PRESETS["seed"].description + " (batch 128 / 256), printed "
                             "beside the published figures; other options override its settings")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated modes to run (default: {','.join(MODES)})")
    parser.add_argument("--o2", action="store_true",
                        help="also run fusedamp-o2 when --modes leaves it out")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="default: resnet18, or with a time budget the largest of the demo's sizes "
                             f"that gives every mode {budgets.MIN_STEPS} optimizer steps (see --width)")
    parser.add_argument("--width", type=int, default=None,
                        help="channels of the first stage (default: 64 on CUDA, 16 on CPU; with a time "
                             "budget, where the warm-up finds too few steps fit: smaller, down to "
                             f"{budgets.SIZES['cpu'][-1]} on CPU; giving --model, --width or "
                             "--batch-size fixes the size)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="exactly this many full epochs, with no time budget unless "
                             "--time-budget is given too (default: 3, fewer and shorter ones "
                             "to fit the time budget)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="warm-up steps measure each mode, then the run is sized to end "
                             f"within SECONDS of the start (default: {DEFAULT_TIME_BUDGET:g}; none "
                             "when --epochs is given, or for --preset seed on CUDA; 0: none)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="micro-batch size (default: 128, smaller when the time budget shrinks the size)")
    parser.add_argument("--amp-batch-size", type=int, default=None,
                        help="micro-batch size of the mixed-precision modes (default: --batch-size; "
                             "--preset seed: twice it)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="accumulate gradients over N micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="half type of the AMP modes (default: fp16 on CUDA, bf16 on CPU)")
    parser.add_argument("--data-dir", default=None,
                        help="folder with the FashionMNIST IDX files (gz or raw); without it a "
                             "synthetic FashionMNIST-shaped set is used")
    parser.add_argument("--train-size", type=int, default=None,
                        help="training samples (default: all of the real set; synthetic: 60000 on "
                             "CUDA or with --preset seed, else 12000)")
    parser.add_argument("--test-size", type=int, default=None,
                        help="test samples (default: all of the real set; synthetic: 10000 on "
                             "CUDA or with --preset seed, else 2000)")
    parser.add_argument("--diag-every", type=int, default=10, metavar="N",
                        help="gradient statistics every N optimizer steps (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write all results as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="plot loss curves, loss scale and fp16 underflow (needs matplotlib)")
    args = parser.parse_args(argv)
    preset = PRESETS.get(args.preset)
    if args.modes is not None:
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    else:
        args.modes = list(preset.modes if preset else MODES)
    if args.o2 and "fusedamp-o2" not in args.modes:
        args.modes.append("fusedamp-o2")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"unknown modes {unknown}; choose among {', '.join(MODES)}")
    for name in ("epochs", "batch_size", "amp_batch_size", "accumulate"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.time_budget is not None and args.time_budget < 0:
        parser.error("--time-budget must be at least 0 (0: no budget)")
    if args.plot and not _have_matplotlib():
        parser.error("--plot needs matplotlib, which is not installed: `pip install matplotlib`, "
                     "or leave out --plot")
    return args


def _config(args: argparse.Namespace, preset: Preset | None, on_cuda: bool) -> RunConfig:
    default = budgets.SIZES["cuda" if on_cuda else "cpu"][0]
    batch_size = args.batch_size or (preset.batch_size if preset else default.batch_size)
    amp_batch_size = args.amp_batch_size or (preset.amp_batch_factor * batch_size if preset else None)
    return RunConfig(
        model=args.model or (preset.model if preset else default.model),
        width=args.width or (preset.width if preset else default.width),
        epochs=args.epochs or (preset.epochs if preset else 3),
        batch_size=batch_size, amp_batch_size=amp_batch_size, accumulate=args.accumulate, lr=args.lr,
        weight_decay=args.weight_decay, diag_every=args.diag_every, seed=args.seed,
    )


def _data(args: argparse.Namespace, preset: Preset | None, on_cuda: bool) -> FashionMNIST:
    if args.data_dir:
        data = load_fashion_mnist(args.data_dir)
        data.train = Split(data.train.images[:args.train_size], data.train.labels[:args.train_size])
        data.test = Split(data.test.images[:args.test_size], data.test.labels[:args.test_size])
        return data
    large = on_cuda or preset is not None
    train_size = args.train_size or (preset.train_size if preset else 60000 if large else 12000)
    test_size = args.test_size or (preset.test_size if preset else 10000 if large else 2000)
    return synthetic_fashion_mnist(train_size, test_size, seed=args.seed)


def _sizes(args: argparse.Namespace, preset: Preset | None, config: RunConfig,
           device: torch.device) -> list[budgets.Size]:
    """The sizes the time budget may choose among: the demo's, unless the preset or the
    command line fixed one."""
    fixed = (args.model, args.width, args.batch_size, args.amp_batch_size)
    if preset is not None or any(value is not None for value in fixed):
        return [budgets.Size(config.model, config.width, config.batch_size, 1.0)]
    return list(budgets.SIZES["cuda" if device.type == "cuda" else "cpu"])


def _parameters(config: RunConfig) -> float:
    """The model's parameters, in millions."""
    return sum(p.numel() for p in build_model(config.model, width=config.width).parameters()) / 1e6


def _time_budget(args: argparse.Namespace, on_cuda: bool) -> tuple[float | None, str]:
    """The budget in seconds (None: none) and why."""
    if args.time_budget is not None:
        return (args.time_budget or None), "--time-budget"
    if args.epochs is not None:
        return None, "--epochs given"
    if args.preset == "seed" and on_cuda:
        return None, "the seed preset on a GPU runs in full"
    return DEFAULT_TIME_BUDGET, "the default"


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _steps_text(modes: list[str], config: RunConfig, samples: int) -> str:
    by_batch: dict[int, list[str]] = {}
    for mode in modes:
        by_batch.setdefault(config.batch_size_of(mode), []).append(mode)
    return ", ".join(f"{_count(samples // (batch * config.accumulate), 'step')} of {batch} x "
                     f"{config.accumulate} ({', '.join(group)})" for batch, group in by_batch.items())


def _speedup(results: list[ModeResult]) -> tuple[str | None, float | None]:
    """The first mixed-precision mode (None: none ran) and its median speedup over fp32 (None
    without fp32)."""
    baseline = next((r for r in results if r.mode == "fp32"), None)
    amp = next((r for r in results if r.mode != "fp32"), None)
    if amp is None:
        return None, None
    return amp.mode, None if baseline is None else amp.speedup_vs(baseline)


def _print_hardware_advice(hardware: hardwares.Hardware, dtype_name: str, mode: str | None,
                           speedup: float | None) -> None:
    """What the hardware means for the mixed-precision ``mode``'s ``speedup`` (nothing when
    no such mode ran)."""
    if mode is None:
        return
    print(f"\nhardware ({dtype_name} on {hardware.device_type}):")
    for line in hardwares.advice(hardware, dtype_name, speedup, mode):
        print(f"  - {line}")


def _planned(speeds: dict[str, budgets.Speed], modes: list[str], data: FashionMNIST, config: RunConfig,
             deadline: float, epochs_fixed: bool) -> tuple[budgets.Plan, float, float]:
    """The plan for ``config`` at ``speeds`` in the time left before ``deadline``, the full
    run's estimated seconds and the seconds the plan may fill."""
    full_samples = config.epoch_samples(modes, len(data.train))
    full = budgets.estimate_seconds(speeds, config.epochs, full_samples, len(data.test))
    left = PLAN_SHARE * (deadline - time.perf_counter())
    plan = budgets.plan_run(speeds, left, config.epochs, full_samples, len(data.test),
                            config.epoch_unit(modes), epochs_fixed)
    return plan, full, left


def _steps(plan: budgets.Plan, left: float, modes: list[str], config: RunConfig) -> int:
    """Optimizer steps per mode of ``plan`` (0 when it does not fit in ``left`` seconds)."""
    return plan.steps(config.epoch_unit(modes)) if plan.seconds <= left else 0


def _use(size: budgets.Size, config: RunConfig) -> None:
    config.model, config.width, config.batch_size = size.model, size.width, size.batch_size


def _choose_size(modes: list[str], data: FashionMNIST, config: RunConfig, device: torch.device,
                 dtype: torch.dtype, seconds: float, deadline: float, warm_up_deadline: float,
                 epochs_fixed: bool, sizes: list[budgets.Size]) -> dict[str, budgets.Speed]:
    """Sets ``config`` to the largest of ``sizes`` (largest first) whose plan gives every mode
    ``budgets.MIN_STEPS`` optimizer steps, else the smallest; returns its measured speeds.

    The warm-up measures the smallest first, then each larger one while the last measured
    speeds, scaled by the sizes' ``cost``, predict that it would still get the steps: on a
    slow machine, measuring a size much too large would spend the budget by itself."""
    chosen: tuple[budgets.Size, dict[str, budgets.Speed]] | None = None
    steps: dict[budgets.Size, int] = {}
    for size in reversed(sizes):
        if chosen is not None:
            ratio = size.cost / chosen[0].cost
            predicted = {mode: budgets.Speed(s.train * ratio, s.test * ratio)
                         for mode, s in chosen[1].items()}
            _use(size, config)
            plan, _, left = _planned(predicted, modes, data, config, deadline, epochs_fixed)
            if _steps(plan, left, modes, config) < budgets.MIN_STEPS:
                break
        _use(size, config)
        begun = time.perf_counter()
        speeds = budgets.measure(modes, data, config, device, dtype, cheap=CHEAP_SHARE * seconds,
                                 deadline=warm_up_deadline)
        rates = ", ".join(f"{mode} {1 / speed.train:,.0f}" for mode, speed in speeds.items())
        label = f" of {size}" if len(sizes) > 1 else ""
        print(f"warm-up{label} ({time.perf_counter() - begun:.1f} s), training samples/s: {rates}")
        if len(speeds) < len(modes):
            if chosen is None:
                return speeds
            break
        plan, _, left = _planned(speeds, modes, data, config, deadline, epochs_fixed)
        steps[size] = _steps(plan, left, modes, config)
        if chosen is not None and steps[size] < budgets.MIN_STEPS:
            break
        chosen = (size, speeds)
        if len(sizes) == 1 or steps[size] < budgets.MIN_STEPS:
            break
    size, speeds = chosen
    _use(size, config)
    if len(sizes) > 1:
        head = f"size: {size} ({_parameters(config):.2f} M params)"
        if steps[size] < budgets.MIN_STEPS:
            print(f"{head}, the demo's smallest: only {_count(steps[size], 'optimizer step')} per mode fit, "
                  f"fewer than the {budgets.MIN_STEPS} a run needs to learn; expect a low accuracy, or give "
                  "it more time (--time-budget SECONDS)")
        elif size == sizes[0]:
            print(f"{head}, the default: every mode gets {_count(steps[size], 'optimizer step')} in the "
                  "budget")
        else:
            print(f"{head}, instead of the default {sizes[0]}: the largest size the warm-up found to give "
                  f"every mode at least {budgets.MIN_STEPS} optimizer steps in the budget (a run needs "
                  "them to learn), as this machine's slowest mode trains "
                  f"{min(1 / s.train for s in speeds.values()):,.0f} samples/s at this size")
    return speeds


def _fit_to_budget(modes: list[str], data: FashionMNIST, config: RunConfig, device: torch.device,
                   dtype: torch.dtype, seconds: float, deadline: float, epochs_fixed: bool,
                   preset: Preset | None,
                   sizes: list[budgets.Size]) -> budgets.Plan | dict[str, budgets.Speed]:
    """Measures the modes, chooses among ``sizes`` (see :func:`_choose_size`) and sizes the run
    (changes ``config`` and ``data.test``); returns the plan, or the speeds measured when the
    warm-up ran out of time or not even the smallest run fits (with ``epochs_fixed``, the
    smallest run with those epochs goes ahead regardless)."""
    started = time.perf_counter()
    speeds = _choose_size(modes, data, config, device, dtype, seconds, deadline,
                          started + WARM_UP_SHARE * (deadline - started), epochs_fixed, sizes)
    if len(speeds) < len(modes):
        print(f"the warm-up took over half of the {seconds:g} s budget before measuring "
              f"{', '.join(mode for mode in modes if mode not in speeds)}: not training. Give it "
              "more time (--time-budget SECONDS; 0: none), fewer or smaller modes (--modes, "
              "--width, --batch-size), or --epochs N to run regardless.")
        return speeds
    plan, full, left = _planned(speeds, modes, data, config, deadline, epochs_fixed)
    full_samples = config.epoch_samples(modes, len(data.train))
    if preset is not None and device.type == "cpu":
        print(f"warning: the seed preset is a GPU experiment; here its {config.epochs} epochs of "
              f"{full_samples:,} samples would take ~{full / 3600:,.1f} h. The time budget cuts "
              f"it short; --epochs {config.epochs} runs it in full.")
    if plan.seconds > left and not epochs_fixed:
        print(f"even the smallest run ({_count(plan.epochs, 'epoch')} of {plan.train_samples:,} samples, "
              f"tested on {plan.test_samples:,}) takes ~{plan.seconds:,.0f} s here, more than the "
              f"{left:,.0f} s left of the {seconds:g} s budget: not training. Give it more time "
              "(--time-budget SECONDS; 0: none), fewer or smaller modes (--modes, --width, "
              "--batch-size), or --epochs N to run regardless.")
        return speeds
    if full <= left:
        print(f"time budget {seconds:g} s: the full run fits (~{full:,.0f} s)")
    elif plan.seconds > left:
        print(f"time budget {seconds:g} s: even the shortest epochs ({plan.train_samples:,} samples, "
              f"tested on {plan.test_samples:,}) take ~{plan.seconds:,.0f} s for the "
              f"{_count(plan.epochs, 'epoch')} asked for, more than the {left:,.0f} s left: running "
              "them anyway")
    else:
        print(f"time budget {seconds:g} s: the full run ({config.epochs} epochs of {full_samples:,} "
              f"samples, tested on {len(data.test):,}) would take ~{full:,.0f} s; chosen to fit the "
              f"{left:,.0f} s left: {_count(plan.epochs, 'epoch')} of {plan.train_samples:,} samples "
              f"({_steps_text(modes, config, plan.train_samples)}), tested on {plan.test_samples:,} "
              f"samples, ~{plan.seconds:,.0f} s")
    config.epochs = plan.epochs
    config.samples_per_epoch = plan.train_samples
    data.test = Split(data.test.images[:plan.test_samples], data.test.labels[:plan.test_samples])
    return plan


def main(argv: list[str] | None = None) -> list[ModeResult]:
    """Runs the demo with command-line arguments ``argv``; returns the results per mode (none
    when the time budget cannot fit even the smallest run)."""
    started = time.perf_counter()
    args = _parse_args(argv)
    preset = PRESETS.get(args.preset)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    dtype_name = args.dtype or ("fp16" if on_cuda else "bf16")
    dtype = DTYPES[dtype_name]
    config = _config(args, preset, on_cuda)
    modes = args.modes
    data = _data(args, preset, on_cuda)
    hardware = hardwares.detect(device)
    if preset is not None:
        print(f"preset {args.preset}: {preset.description}")
    print(f"fusedamp demo: {config.model} (width {config.width}, {_parameters(config):.2f} M params), "
          f"{len(data.train)} train / {len(data.test)} test samples")
    if data.synthetic:
        print(f"data: {data.source} -- no --data-dir given, so this is NOT FashionMNIST: 10 "
              "garment-like classes drawn at random; accuracies are on this synthetic set")
    else:
        print(f"data: {data.source}")
    print(f"hardware: {hardware.summary()}")
    where = torch.cuda.get_device_name(device) if on_cuda else f"{torch.get_num_threads()} threads"
    batch = str(config.batch_size) if config.amp_batch_size in (None, config.batch_size) else \
        f"{config.batch_size} (AMP {config.amp_batch_size})"
    print(f"device {device} ({where}), AMP dtype {dtype_name}, batch {batch} x accumulate "
          f"{config.accumulate}, {config.epochs} epochs, modes {', '.join(modes)}")
    full_samples = config.epoch_samples(modes, len(data.train))  # refuses sizes without a full step
    seconds, why = _time_budget(args, on_cuda)
    plan = None
    if seconds is None:
        print(f"no time budget ({why}): {config.epochs} epochs of {full_samples:,} samples")
        if preset is not None and not on_cuda:
            print(f"warning: the seed preset is a GPU experiment: {_count(config.epochs, 'epoch')} of "
                  "ResNet-50 on a CPU take hours")
    else:
        fitted = _fit_to_budget(modes, data, config, device, dtype, seconds, started + seconds,
                                args.epochs is not None, preset, _sizes(args, preset, config, device))
        if not isinstance(fitted, budgets.Plan):
            baseline = fitted.get("fp32")
            amp = next((mode for mode in modes if mode != "fp32"), None)
            measured = fitted.get(amp) if amp else None
            speedup = baseline.train / measured.train if baseline and measured else None
            _print_hardware_advice(hardware, dtype_name, amp and f"{amp} (in the warm-up)", speedup)
            return []
        plan = fitted
    print()

    # An explicit --epochs is exact: the deadline may only cut epochs the budget chose.
    deadline = started + seconds if seconds is not None and args.epochs is None else None
    results = run_modes(modes, data, config, device, dtype, deadline=deadline)
    print()
    print(results_table(results))
    baseline = next((r for r in results if r.mode == "fp32"), None)
    print(f"samples/s and speedup: the median over the {_count(len(results[0].block_times), 'block')} "
          "of steps the modes took turns with, so that the machine's load hit each of them alike "
          "(speedup: [lowest-highest]); time/epoch: an epoch's samples at that rate")
    spreads = [max(s) / min(s) for r in results if baseline and (s := r.speedups_vs(baseline))]
    if spreads and max(spreads) > SPREAD_WARNING:
        print(f"the speedups spread over more than {SPREAD_WARNING}x: other work on this machine "
              "disturbed the timings; trust the medians, or better a run on a quiet machine")
    print()
    print("memory per mode, counted from its tensors (activations: those saved for backward in one "
          "micro-batch"
          + ("; CUDA peak: the allocator's, as if the mode ran alone" if on_cuda else "")
          + "; a CPU process's resident set, torch's and the data set's, is left out):")
    print(memory_table(results))
    print("\nwhat this run shows:")
    for line in findings(results, hardware.native[dtype_name], dtype_name):
        print(f"  - {line}")
    _print_hardware_advice(hardware, dtype_name, *_speedup(results))
    for r in results:
        if r.advice:
            print(f"\ngradient diagnostics ({r.mode}, last measured step):")
            for line in r.advice:
                print(f"  - {line}")
    if preset is not None:
        print()
        print("\n".join(seed_comparison(results, preset.epochs, full_samples)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({
                "config": asdict(config), "modes": modes, "preset": args.preset, "device": str(device),
                "dtype": str(dtype), "hardware": asdict(hardware), "time_budget": seconds,
                "plan": None if plan is None else asdict(plan),
                "data": data.source, "synthetic_data": data.synthetic,
                "train_size": len(data.train), "test_size": len(data.test),
                "results": [asdict(r) | {"time_per_epoch": r.time_per_epoch, "samples_per_s": r.samples_per_s,
                                         "speedups": r.speedups_vs(baseline) if baseline else []}
                            for r in results],
            }, out, indent=1)
        print(f"\nresults written to {args.json}")
    if args.plot:
        plot_results(results, args.plot,
                     f"{config.model} on {'synthetic data' if data.synthetic else 'FashionMNIST'}, {device}")
        print(f"plot written to {args.plot}")
    return results
