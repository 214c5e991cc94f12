"""The demo end to end at tiny size in every mode, its metrics, table, JSON and plot; the
hardware note, the time budget, the modes' turns and the seed preset; the ResNets; and the
benchmark runner (python -m benchmarks) on generated benchmark modules."""

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fusedamp.demo import budget, cli, hardware, memory, report, train
from fusedamp.demo.data import synthetic_fashion_mnist
from fusedamp.demo.models import build_model, resnet18, resnet50

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--train-size",
    "192",
    "--test-size",
    "64",
    "--batch-size",
    "32",
    "--epochs",
    "1",
    "--width",
    "4",
    "--diag-every",
    "2",
    "--device",
    "cpu",
]
FUSEDAMP_MODES = ["fusedamp", "fusedamp-o2"]
# An AVX2-only CPU as the detector would describe it (no bf16/fp16 instructions, oneDNN without bf16).
AVX2_CPU = hardware.describe_cpu(
    "AMD EPYC (AVX2 only)", {"avx", "avx2", "fma"}, "AVX2", {"bf16": False, "fp16": False}, None
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train as fast on one thread, and a busy 2-core machine then cannot stall
    every op at the thread pool's barrier (with two threads these tests ran 10x longer there)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference_metrics(predictions, targets, num_classes):
    precisions, recalls, f1s = [], [], []
    for c in range(num_classes):
        tp = sum(1 for p, t in zip(predictions, targets, strict=True) if p == c and t == c)
        predicted = sum(1 for p in predictions if p == c)
        actual = sum(1 for t in targets if t == c)
        precision = tp / predicted if predicted else 0.0
        recall = tp / actual if actual else 0.0
        precisions.append(precision)
        recalls.append(recall)
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    accuracy = sum(1 for p, t in zip(predictions, targets, strict=True) if p == t) / len(targets)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"accuracy": accuracy, "precision": mean(precisions), "recall": mean(recalls), "f1": mean(f1s)}


def test_classification_metrics_match_a_plain_reference():
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 6, (300,), generator=generator)
    predictions = torch.where(
        torch.rand(300, generator=generator) < 0.6, targets, torch.randint(0, 5, (300,), generator=generator)
    )  # class 5 under-predicted
    predictions[predictions == 4] = 3  # class 4 never predicted: precision 0 by convention
    got = train.classification_metrics(predictions, targets, 6)
    expected = reference_metrics(predictions.tolist(), targets.tolist(), 6)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("name, factory", [("resnet18", resnet18), ("resnet50", resnet50)])
def test_resnets_shapes_and_zero_init_residuals(name, factory):
    model = build_model(name, width=4)
    assert type(model) is type(factory(width=4))
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in factory(width=4).parameters())
    with pytest.raises(ValueError, match="unknown model 'resnet34'"):
        build_model("resnet34")


def test_resnet18_layout():
    model = resnet18(width=8)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 17  # stem + 8 blocks x 2: ResNet-18's 17 conv layers + fc = 18
    assert model.head.in_features == 64


def run_demo(tmp_path, *extra):
    json_path = tmp_path / "results.json"
    results = cli.main([*TINY, "--json", str(json_path), *extra])
    return results, json.loads(json_path.read_text())


@pytest.mark.parametrize("modes", ["fp32,torch-amp", *FUSEDAMP_MODES])
def test_demo_end_to_end(tmp_path, capsys, modes):
    results, saved = run_demo(tmp_path, "--modes", modes)
    out = capsys.readouterr().out
    assert "synthetic" in out and "NOT FashionMNIST" in out
    assert "hardware: " in out and "no time budget (--epochs given)" in out
    assert [r.mode for r in results] == modes.split(",")
    assert "time/epoch" in out and "final scale" in out and "opt. step" in out
    assert "memory per mode, counted from its tensors" in out and "what this run shows:" in out
    assert "quality: test accuracy" in out and "resident" in out  # says the process's RSS is left out
    for result, stored in zip(results, saved["results"], strict=True):
        assert stored["mode"] == result.mode
        assert len(result.losses) == 192 // 32 and all(l == l for l in result.losses)  # noqa: E741
        assert 0.0 <= result.accuracy <= 1.0 and result.memory.cuda_peak is None
        assert min(result.memory.weights, result.memory.grads, result.memory.moments) > 0
        assert result.memory.activations > 0 and len(result.step_times) == len(result.losses)
        assert stored["memory"]["activations"] == result.memory.activations
        assert [step for step, _ in result.underflow] == [0, 2, 4]
        assert f"{result.mode:<12} epoch 1/1" in out
        assert result.block_samples == [32] * 6  # 6 steps of 32, one per turn
        assert stored["samples_per_s"] == pytest.approx(result.samples_per_s) and result.samples_per_s > 0
        if result.mode == "fp32":
            assert result.scales == [] and result.skipped_steps is None
        else:
            assert len(result.scales) == len(result.losses) and result.final_scale == result.scales[-1]
            assert result.skipped_steps == 0 and result.final_scale == 65536.0
    assert saved["synthetic_data"] is True and saved["train_size"] == 192
    assert saved["time_budget"] is None and set(saved["hardware"]["native"]) == {"bf16", "fp16"}


def test_demo_modes_learn_the_same_thing():
    # Same weights, same batches, whatever the turns: after a few steps fp32 and AMP losses agree closely.
    data = synthetic_fashion_mnist(256, 64)
    config = train.RunConfig(width=4, epochs=1, batch_size=32, diag_every=0)
    modes = ["fp32", "torch-amp", *FUSEDAMP_MODES]
    results = train.run_modes(modes, data, config, torch.device("cpu"), torch.bfloat16, io.StringIO())
    for result in results[1:]:
        assert result.losses[0] == pytest.approx(results[0].losses[0], rel=0.05)
        assert result.losses[-1] == pytest.approx(results[0].losses[-1], rel=0.2)
    # The same run without the others: taking turns changes nothing in a mode's training.
    alone = train.run_modes(["torch-amp"], data, config, torch.device("cpu"), torch.bfloat16, io.StringIO())
    assert alone[0].losses == results[1].losses


def test_modes_take_turns_block_by_block():
    data = synthetic_fashion_mnist(320, 32)
    config = train.RunConfig(width=4, epochs=2, batch_size=32, diag_every=0)
    out = io.StringIO()
    results = train.run_modes(["fp32", "torch-amp"], data, config, torch.device("cpu"), torch.bfloat16, out)
    # 10 steps per epoch in 8 blocks, the same for both modes, twice.
    blocks = [32, 32, 64, 32, 32, 64, 32, 32]
    assert [r.block_samples for r in results] == [blocks * 2] * 2
    assert all(sum(r.block_times[:8]) == pytest.approx(r.epoch_times[0]) for r in results)
    speedups = results[1].speedups_vs(results[0])
    assert len(speedups) == 16
    assert speedups == pytest.approx(
        [f / a for f, a in zip(results[0].block_times, results[1].block_times, strict=True)]
    )
    lines = [line.split()[:3] for line in out.getvalue().splitlines()]
    assert lines == [
        ["fp32", "epoch", "1/2"],
        ["torch-amp", "epoch", "1/2"],
        ["fp32", "epoch", "2/2"],
        ["torch-amp", "epoch", "2/2"],
    ]


def two_linears():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))


WEIGHTS = 8 * 16 + 16 + 16 * 4  # values of two_linears()'s three parameters


def test_saved_activations_of_a_model_whose_bytes_are_known():
    images = torch.randn(5, 8)  # data: no grad, so the first layer's weight is not saved
    model = two_linears()
    # fp32: the first layer's input and the ReLU's output (also the second layer's input); the
    # second layer's weight is saved too, but it is the model's own, counted as weights.
    out, saved = memory.saved_activation_bytes(model, lambda: model(images))
    assert saved == 5 * 8 * 4 + 5 * 16 * 4 and out.shape == (5, 4)
    # autocast: the same in bf16, plus the bf16 copy of the second weight autocast made.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, saved = memory.saved_activation_bytes(model, lambda: model(images))
    assert saved == 5 * 8 * 2 + 5 * 16 * 2 + 16 * 4 * 2
    # half weights (O2): the weights are the model's own again.
    half = train.half_model(two_linears(), torch.bfloat16)
    _, saved = memory.saved_activation_bytes(half, lambda: half(images))
    assert saved == 5 * 8 * 2 + 5 * 16 * 2


@pytest.mark.parametrize("master_weights", [False, True])
def test_optimizer_state_of_a_model_whose_bytes_are_known(master_weights):
    from fusedamp.optim import FusedAdamW

    model = train.half_model(two_linears(), torch.bfloat16) if master_weights else two_linears()
    optimizer = FusedAdamW(model.parameters(), master_weights=master_weights)
    model(torch.randn(3, 8)).float().sum().backward()
    optimizer.step()
    kinds, by_key = memory.optimizer_state_bytes(optimizer)
    masters = 4 * WEIGHTS if master_weights else 0
    assert kinds == {"masters": masters, "moments": 2 * 4 * WEIGHTS, "other": 3 * 4}  # a step per param
    assert by_key["exp_avg fp32"] == by_key["exp_avg_sq fp32"] == 4 * WEIGHTS
    assert by_key.get("master fp32", 0) == masters
    assert memory.tensor_bytes(model.parameters()) == (2 if master_weights else 4) * WEIGHTS


def test_optimizer_state_is_split_by_key_and_dtype_for_any_optimizer():
    # Low-memory modes keep other keys and dtypes (int8 codes with fp32 block scales, no
    # master, a seed): each lands in its column, and a storage shared by two entries counts once.
    param = torch.nn.Parameter(torch.randn(300))
    optimizer = torch.optim.SGD([param], lr=0.1)
    shared = torch.zeros(4, dtype=torch.int64)
    optimizer.state[param] = {
        "exp_avg": torch.zeros(300, dtype=torch.int8), "exp_avg_scale": torch.zeros(2),
        "exp_avg_sq": torch.zeros(300, dtype=torch.bfloat16),
        "master_remainder": torch.zeros(300, dtype=torch.int16),
        "seed": shared, "seed_view": shared[:2], "step": 7,
    }
    kinds, by_key = memory.optimizer_state_bytes(optimizer)
    assert kinds == {"masters": 600, "moments": 300 + 8 + 600, "other": 32}
    assert by_key == {"exp_avg int8": 300, "exp_avg_scale fp32": 8, "exp_avg_sq bf16": 600,
                      "master_remainder int16": 600, "seed int64": 32}
    assert [memory.state_kind(key) for key in ("momentum_buffer", "max_exp_avg_sq", "master")] == [
        "moments", "moments", "masters"]


def test_memory_table_per_mode_from_the_tensors():
    data = synthetic_fashion_mnist(64, 16)
    config = train.RunConfig(width=4, epochs=1, batch_size=32, diag_every=0)
    modes = ["fp32", "torch-amp", "fusedamp", "fusedamp-o2", "fusedamp-lowmem"]
    results = train.run_modes(modes, data, config, torch.device("cpu"), torch.bfloat16, io.StringIO())
    model = build_model("resnet18", width=4)
    values = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
                for p in m.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    steps = 4 * len(list(model.parameters()))
    by_mode = {r.mode: r.memory for r in results}
    for mode in ("fp32", "torch-amp", "fusedamp"):
        m = by_mode[mode]
        assert (m.weights, m.grads, m.masters, m.moments, m.other) == (
            4 * values + buffers, 4 * values, 0, 8 * values, steps)
    o2 = by_mode["fusedamp-o2"]
    halves = values - norms  # BatchNorm stays fp32; everything else is bf16 with an fp32 master
    assert (o2.weights, o2.grads, o2.masters, o2.moments, o2.other) == (
        2 * halves + 4 * norms + buffers, 2 * halves + 4 * norms, 4 * halves, 8 * values, steps)
    # Low memory: bf16 weights and grads as in O2, int16 remainders, int8 moments (1 byte a value
    # and a bf16 scale per 256): half of fp32 AdamW's optimizer state, a third of O2's.
    low = by_mode["fusedamp-lowmem"]
    scales = sum(2 * 2 * -(-p.numel() // 256) for p in model.parameters())
    assert (low.weights, low.grads, low.masters, low.moments, low.other) == (
        o2.weights, o2.grads, 2 * halves, 2 * values + scales, steps)
    assert low.optimizer < 0.51 * by_mode["fp32"].optimizer and low.optimizer < 0.34 * o2.optimizer
    assert low.weights + low.grads + low.optimizer < 0.51 * (
        by_mode["fp32"].weights + by_mode["fp32"].grads + by_mode["fp32"].optimizer)
    # bf16 activations: about half of fp32's (BatchNorm keeps some fp32 statistics).
    for mode in ("torch-amp", "fusedamp", "fusedamp-o2", "fusedamp-lowmem"):
        assert 0.4 < by_mode[mode].activations / by_mode["fp32"].activations < 0.75
    assert by_mode["torch-amp"].activations == by_mode["fusedamp"].activations
    assert all(m.total == m.weights + m.grads + m.optimizer + m.activations for m in by_mode.values())
    table = report.memory_table(results)
    assert table.splitlines()[0].split() == ["mode", "batch", "weights", "grads", "masters", "moments",
                                             "other", "state", "activations", "total"]
    assert "fusedamp-o2 optimizer state: step fp32" in table and "master fp32" in table
    shows = report.findings(results, native=False, dtype="bf16")
    memory_line = "memory against fp32's: activations saved for backward (per sample) torch-amp 0."
    assert any(line.startswith(memory_line) for line in shows)
    assert any("optimizer step" in line and "fusedamp-o2" in line and "too few steps to compare" in line
               for line in shows)  # 2 steps per mode
    for r in results:
        r.step_times = [0.004] + [0.002 if r.mode == "torch-amp" else 0.001] * 11
    step_line = next(line for line in report.findings(results, native=True, dtype="bf16") if "step" in line)
    assert "torch-amp 2.00 ms, fusedamp 1.00 ms (2.00x as fast), fusedamp-o2 1.00 ms (2.00x" in step_line
    assert any("no AMP speedup to show here" in line for line in shows)


def test_demo_accumulate_steps_once_per_group(tmp_path):
    results, saved = run_demo(tmp_path, "--modes", "fp32,torch-amp", "--accumulate", "2")
    assert [len(r.losses) for r in results] == [3, 3]
    assert saved["config"]["accumulate"] == 2
    with pytest.raises(ValueError, match="no full step"):
        cli.main([*TINY, "--modes", "fp32", "--accumulate", "7"])


def test_demo_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "amp.png"
    run_demo(tmp_path, "--modes", "fp32,torch-amp", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_plot_without_matplotlib_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_have_matplotlib", lambda: False)
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--plot", "x.png"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "fp32,fp8"], "unknown modes"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--amp-batch-size", "0"], "--amp-batch-size must be at least 1"),
        (["--time-budget", "-1"], "--time-budget must be at least 0"),
        (["--preset", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_demo_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


def test_results_table_speedups_against_fp32():
    fp32 = report.ModeResult(
        "fp32", epoch_times=[4.0], block_samples=[64, 64, 64], block_times=[1.0, 2.0, 1.0], accuracy=0.9
    )
    amp = report.ModeResult(
        "torch-amp",
        epoch_times=[2.0],
        block_samples=[64, 64, 64],
        block_times=[0.5, 0.5, 1.0],
        skipped_steps=1,
        final_scale=32768.0,
        underflow=[(0, 0.25), (10, 0.15)],
        losses=[1.0, 0.5, 0.25],
        step_times=[0.002, 0.001, 0.003],
    )
    table = report.results_table([fp32, amp]).splitlines()
    assert table[0].split()[:9] == ["mode", "batch", "steps", "time/epoch", "samples/s", "speedup",
                                    "[min-max]", "opt.", "step"]
    # The optimizer step: its median time and its share of the training time (6 ms of 2 s).
    assert " 3 " in table[3] and "2.00 ms (0.3%)" in table[3] and table[2].split()[8] == "-"
    # Per block 1/0.5, 2/0.5, 1/1: median 2, range 1 to 4; samples/s the median block's 64/0.5.
    assert "1.00x [1.00-1.00]" in table[2] and "2.00x [1.00-4.00]" in table[3]
    assert " 128 " in table[3] and "20.00%" in table[3] and table[3].rstrip().endswith("32768")


def test_demo_stays_out_of_the_library():
    # `import fusedamp` is the library alone; `python -m fusedamp.demo` still runs.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = "import sys, fusedamp; assert not [m for m in sys.modules if m.startswith('fusedamp.demo')]"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, check=True)
    helped = subprocess.run(
        [sys.executable, "-m", "fusedamp.demo", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--time-budget SECONDS" in helped.stdout and "--preset {seed}" in helped.stdout


# ------------------------------------------------------------------------------- hardware


def test_cpu_without_bf16_instructions_is_not_native():
    assert AVX2_CPU.native == {"bf16": False, "fp16": False}
    assert AVX2_CPU.reasons["bf16"] == "no AVX512-BF16, AMX-BF16 or Arm BF16 instructions"
    assert "bf16 NOT native" in AVX2_CPU.summary() and "torch CPU kernels AVX2" in AVX2_CPU.summary()


@pytest.mark.parametrize(
    "flags, onednn, cap, native, reason",
    [
        ({"avx512f", "avx512_bf16"}, {"bf16": True, "fp16": False}, None, True, "AVX512-BF16"),
        ({"amx_bf16", "amx_tile"}, {"bf16": True, "fp16": True}, None, True, "AMX-BF16"),
        (
            {"avx512f", "avx512_bf16"},
            {"bf16": True, "fp16": False},
            "avx2",
            False,
            "AVX512-BF16, but oneDNN is capped at avx2",
        ),
        ({"avx512f", "avx512_bf16"}, {"bf16": True, "fp16": False}, "AVX512_CORE_AMX", True, "AVX512-BF16"),
        (
            {"avx512f", "avx512_bf16"},
            {"bf16": False, "fp16": False},
            None,
            False,
            "AVX512-BF16, but oneDNN reports no bf16 support",
        ),
        ({"avx512f", "avx512_bf16"}, {"bf16": None, "fp16": None}, None, True, "AVX512-BF16"),  # torch silent
        (
            {"avx512f", "avx512bw"},
            {"bf16": True, "fp16": False},
            None,
            False,  # AVX-512 emulation only
            "no AVX512-BF16, AMX-BF16 or Arm BF16 instructions",
        ),
    ],
)
def test_cpu_bf16_verdicts(flags, onednn, cap, native, reason):
    cpu = hardware.describe_cpu("cpu", flags, "AVX512", onednn, cap)
    assert cpu.native["bf16"] is native and cpu.reasons["bf16"] == reason


@pytest.mark.parametrize(
    "capability, native",
    [
        ((6, 1), {"bf16": False, "fp16": False}),
        ((7, 5), {"bf16": False, "fp16": True}),
        ((8, 0), {"bf16": True, "fp16": True}),
        ((9, 0), {"bf16": True, "fp16": True}),
    ],
)
def test_gpu_tensor_cores_by_compute_capability(capability, native):
    gpu = hardware.describe_cuda("GPU", capability)
    assert gpu.native == native
    assert f"compute capability {capability[0]}.{capability[1]}" in gpu.summary()


def test_detect_reads_this_cpu(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    flags, _ = hardware._cpu_flags_and_name()
    cpu = hardware.detect(torch.device("cpu"))
    assert cpu.device_type == "cpu" and set(cpu.native) == {"bf16", "fp16"}
    if not {"avx512_bf16", "amx_bf16", "bf16"} & flags:
        assert not cpu.native["bf16"]
    if (
        hardware._guarded(lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported())
        and {"avx512_bf16", "amx_bf16"} & flags
    ):
        assert cpu.native["bf16"]
    # What an AVX2-only machine reports, from the facts detect() gathers.
    monkeypatch.setattr(hardware, "_cpu_flags_and_name", lambda: ({"avx2", "fma"}, "Old CPU"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    old = hardware.detect(torch.device("cpu"))
    assert old.name == "Old CPU" and old.native == {"bf16": False, "fp16": False}
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in old.facts


def test_advice_explains_a_cpu_without_bf16():
    lines = hardware.advice(AVX2_CPU, "bf16", 0.08, "torch-amp")
    assert lines[0].startswith("This CPU has no native bf16 arithmetic (no AVX512-BF16")
    assert "so AMP is slower here: torch-amp ran at 0.08x the speed of fp32" in lines[0]
    assert "on a GPU with Tensor Cores" in lines[1] and "2.36x" in lines[1]
    native = hardware.describe_cpu("cpu", {"avx512_bf16"}, "AVX512", {"bf16": True, "fp16": False}, None)
    assert hardware.advice(native, "bf16", 1.7, "fusedamp") == [
        "This CPU computes bf16 natively (AVX512-BF16): fusedamp ran 1.70x as fast as fp32 here."
    ]
    assert "did not pay off" in hardware.advice(native, "bf16", 0.9)[1]
    assert "--dtype fp16" in hardware.advice(hardware.describe_cuda("T4", (7, 5)), "bf16", 0.9)[-1]


def test_demo_on_a_cpu_without_bf16_says_why_amp_is_slower(monkeypatch, capsys):
    monkeypatch.setattr(hardware, "detect", lambda device: AVX2_CPU)
    cli.main([*TINY, "--modes", "fp32,torch-amp"])
    out = capsys.readouterr().out
    assert "hardware: AMD EPYC (AVX2 only) [torch CPU kernels AVX2]: bf16 NOT native" in out
    assert "This CPU has no native bf16 arithmetic" in out and "on a GPU with Tensor Cores" in out


# ---------------------------------------------------------------------------- time budget


def test_plan_keeps_the_full_run_when_it_fits():
    speeds = {"fp32": budget.Speed(1e-4, 1e-5), "torch-amp": budget.Speed(1e-4, 1e-5)}
    plan = budget.plan_run(speeds, 100.0, 3, 12000, 2000, 128, False)
    assert plan == budget.Plan(3, 12000, 2000, budget.estimate_seconds(speeds, 3, 12000, 2000))
    assert plan.seconds == pytest.approx(3 * (12000 * 2e-4 + 2000 * 2e-5))


@pytest.mark.parametrize("seconds, epochs", [(20.0, 1), (60.0, 2), (120.0, 3)])
def test_plan_shrinks_an_avx2_run_into_the_budget(seconds, epochs):
    # An AVX2-only CPU: bf16 autocast ~12x slower than fp32 (a 2-core EPYC: 300 vs 26 samples/s).
    fp32, amp = budget.Speed(1 / 300, 1 / 900), budget.Speed(1 / 26, 1 / 80)
    speeds = {"fp32": fp32, "torch-amp": amp, "fusedamp": amp, "fusedamp-o2": amp}
    plan = budget.plan_run(speeds, seconds, 3, 11904, 2000, 128, False)
    assert plan.seconds <= seconds and plan.train_samples % 128 == 0 and plan.train_samples >= 128
    assert budget.MIN_TEST <= plan.test_samples < 2000
    assert plan.seconds == budget.estimate_seconds(speeds, plan.epochs, plan.train_samples, plan.test_samples)
    # Not wasteful: one more step per epoch would not fit.
    bigger = budget.estimate_seconds(speeds, plan.epochs, plan.train_samples + 128, plan.test_samples)
    assert bigger > seconds
    assert plan.epochs == epochs  # fewer epochs only when not even one step each fits


def test_plan_with_fixed_epochs_and_the_smallest_run():
    slow = {"fp32": budget.Speed(0.1, 0.01)}
    fixed = budget.plan_run(slow, 10.0, 5, 12800, 1000, 128, True)
    assert fixed.epochs == 5 and fixed.train_samples == 128 and fixed.seconds > 10.0
    smallest = budget.plan_run(slow, 10.0, 5, 12800, 1000, 128, False)
    assert (smallest.epochs, smallest.train_samples, smallest.test_samples) == (1, 128, 100)
    assert smallest.seconds == pytest.approx(128 * 0.1 + 100 * 0.01) and smallest.seconds > 10.0


def test_warm_up_measures_every_mode():
    data = synthetic_fashion_mnist(128, 64)
    config = train.RunConfig(width=4, batch_size=64, accumulate=2, diag_every=0)
    speeds = budget.measure(
        ["fp32", "fusedamp-o2"],
        data,
        config,
        torch.device("cpu"),
        torch.bfloat16,
        cheap=60.0,
        deadline=time.perf_counter() + 60.0,
    )
    assert list(speeds) == ["fp32", "fusedamp-o2"]
    assert all(0 < s.train < 1 and 0 < s.test < 1 for s in speeds.values())
    late = budget.measure(
        ["fp32"], data, config, torch.device("cpu"), torch.bfloat16, cheap=60.0, deadline=time.perf_counter()
    )
    assert late == {}


def test_warm_up_repeats_only_cheap_runs(monkeypatch):
    # A fake clock that advances 0.1 ms per sample of work, so that the choice does not depend on
    # how busy the machine is.
    clock = [0.0]
    monkeypatch.setattr(budget.time, "perf_counter", lambda: clock[0])
    sizes = []

    def work(size):
        sizes.append(size)
        clock[0] += size * 1e-4
        return size

    assert budget._seconds_per_sample(work, 128, cheap=10.0) == pytest.approx(1e-4)
    assert sizes == [32, 32, 128, 128]  # set-up run, probe, and the full size twice
    sizes.clear()
    budget._seconds_per_sample(work, 128, cheap=0.006)  # a probe run costs 3.2 ms, a full one 12.8 ms
    assert sizes == [32, 32]
    sizes.clear()
    # Too slow to repeat at full size: the probe still runs twice (the first pays the set-up).
    assert budget._seconds_per_sample(work, 128, cheap=0.001) == pytest.approx(1e-4)
    assert sizes == [32, 32]


def avx2_speeds(modes, data, config, device, dtype, cheap, deadline):
    # What the warm-up measures on an AVX2-only CPU: AMP 12x slower than fp32.
    return {mode: budget.Speed(1e-3 if mode == "fp32" else 12e-3, 1e-4) for mode in modes}


def test_demo_fits_a_slow_amp_into_the_budget(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(budget, "measure", avx2_speeds)
    tiny_budget = [a for a in TINY if a not in ("--epochs", "1")]
    argv = [*tiny_budget, "--train-size", "1024", "--time-budget", "12", "--json", str(tmp_path / "r.json")]
    results = cli.main(argv)
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    # 0.75 x the ~11 s left, over 3 epochs at 1 + 3 x 12 ms per sample of the 4 modes: ~64 samples each.
    plan = saved["plan"]
    assert plan["epochs"] == 3 and plan["train_samples"] < 1024 and plan["train_samples"] % 32 == 0
    assert plan["seconds"] <= cli.PLAN_SHARE * 12
    assert "chosen to fit" in out and f"3 epochs of {plan['train_samples']:,} samples" in out
    # Three epochs unless a busy machine made the deadline stop the run early, for every mode alike.
    assert all(r.samples_per_epoch == plan["train_samples"] for r in results)
    assert len({len(r.epoch_times) for r in results}) == 1 and 1 <= len(results[0].epoch_times) <= 3


@pytest.mark.parametrize("fp32_seconds, chosen, measured", [
    (1e-5, 0, [4, 3, 2, 1, 0]),  # fast: the default, reached from the smallest up
    # AMP 12x slower: resnet18 width 8 gets its steps at batch 64; at 128 it is not even measured
    (2e-4, 2, [4, 3, 2]),
    (8e-4, 4, [4]),  # slower still: the smallest, and nothing larger is measured
    (1e-1, 4, [4]),  # too slow even for that: the smallest, with a warning
])
def test_budget_chooses_the_largest_size_that_gets_the_steps(monkeypatch, capsys, fp32_seconds, chosen,
                                                              measured):
    sizes = list(budget.SIZES["cpu"])
    tried = []

    def measure(modes, data, config, device, dtype, cheap, deadline):
        size = next(s for s in sizes if (s.model, s.width, s.batch_size) ==
                    (config.model, config.width, config.batch_size))
        tried.append(sizes.index(size))
        return {mode: budget.Speed(size.cost * fp32_seconds * (1 if mode == "fp32" else 12), 1e-6)
                for mode in modes}

    monkeypatch.setattr(budget, "measure", measure)
    config = train.RunConfig()
    data = synthetic_fashion_mnist(12000, 10)
    modes = ["fp32", "torch-amp", "fusedamp", "fusedamp-o2"]  # the sizes above are worked out for four
    speeds = cli._choose_size(modes, data, config, torch.device("cpu"), torch.bfloat16, 100.0,
                              time.perf_counter() + 100.0, time.perf_counter() + 50.0, False, sizes)
    out = capsys.readouterr().out
    assert tried == measured and set(speeds) == set(modes)
    assert (config.model, config.width, config.batch_size) == (sizes[chosen].model, sizes[chosen].width,
                                                                sizes[chosen].batch_size)
    assert f"size: {sizes[chosen]} (" in out
    plan, _, left = cli._planned(speeds, modes, data, config, time.perf_counter() + 100.0, False)
    steps = cli._steps(plan, left, modes, config)
    if fp32_seconds == 1e-1:
        assert steps < budget.MIN_STEPS and "fewer than the 60 a run needs to learn" in out
    else:
        assert steps >= budget.MIN_STEPS
        assert ("the default" if chosen == 0 else "instead of the default") in out


def test_a_size_given_on_the_command_line_is_kept():
    args = cli._parse_args(["--width", "12"])
    config = cli._config(args, None, on_cuda=False)
    assert cli._sizes(args, None, config, torch.device("cpu")) == [budget.Size("resnet18", 12, 128, 1.0)]
    args = cli._parse_args([])
    assert cli._sizes(args, None, cli._config(args, None, False), torch.device("cpu")) == list(
        budget.SIZES["cpu"])


def test_explicit_epochs_are_exact_under_a_budget(monkeypatch, capsys):
    monkeypatch.setattr(budget, "measure", avx2_speeds)
    results = cli.main(
        [*TINY, "--epochs", "2", "--train-size", "1024", "--time-budget", "1", "--modes", "fp32,torch-amp"]
    )
    assert "for the 2 epochs asked for" in capsys.readouterr().out and len(results) == 2
    assert all(len(r.epoch_times) == 2 and r.samples_per_epoch == 32 for r in results)


def test_demo_stops_when_the_warm_up_runs_out_of_time(monkeypatch, capsys):
    monkeypatch.setattr(budget, "measure", lambda *args, **kwargs: {"fp32": budget.Speed(1e-3, 1e-4)})
    tiny_budget = [a for a in TINY if a not in ("--epochs", "1")]
    assert cli.main([*tiny_budget, "--modes", "fp32,torch-amp", "--time-budget", "20"]) == []
    assert "before measuring torch-amp: not training" in capsys.readouterr().out


def test_demo_refuses_a_run_that_cannot_fit(monkeypatch, capsys):
    monkeypatch.setattr(
        budget,
        "measure",
        lambda *args, **kwargs: {"fp32": budget.Speed(1.0, 0.1), "torch-amp": budget.Speed(12.0, 1.0)},
    )
    tiny_budget = [a for a in TINY if a not in ("--epochs", "1")]
    assert cli.main([*tiny_budget, "--modes", "fp32,torch-amp", "--time-budget", "20"]) == []
    out = capsys.readouterr().out
    assert "even the smallest run (1 epoch of 32 samples" in out and "not training" in out
    assert "torch-amp (in the warm-up) " in out and "0.08x" in out


def test_deadline_stops_before_a_round_that_cannot_end_in_time():
    data = synthetic_fashion_mnist(64, 16)
    config = train.RunConfig(width=4, epochs=3, batch_size=32, diag_every=0)
    out = io.StringIO()
    results = train.run_modes(
        ["fp32", "torch-amp"],
        data,
        config,
        torch.device("cpu"),
        torch.bfloat16,
        out,
        deadline=time.perf_counter(),
    )
    # One round of blocks always runs; the epoch under way is then tested as it stands.
    for result in results:
        assert result.block_samples == [32] and len(result.epoch_times) == 1 and result.epoch_accuracy
        assert result.samples_per_epoch == 64 and result.time_per_epoch == pytest.approx(
            64 / result.samples_per_s
        )
    assert "time budget: stopping in epoch 1 of 3 after 1 of 2 blocks" in out.getvalue()
    assert "fp32         epoch 1/3 [############------------]     32/64" in out.getvalue()


@pytest.mark.parametrize(
    "argv, cuda, expected",
    [
        ([], False, cli.DEFAULT_TIME_BUDGET),
        ([], True, cli.DEFAULT_TIME_BUDGET),
        (["--epochs", "2"], False, None),
        (["--time-budget", "0"], False, None),
        (["--time-budget", "50", "--epochs", "2"], False, 50.0),
        (["--preset", "seed"], False, cli.DEFAULT_TIME_BUDGET),
        (["--preset", "seed"], True, None),
    ],
)
def test_when_the_budget_applies(argv, cuda, expected):
    assert cli._time_budget(cli._parse_args(argv), cuda)[0] == expected


# ------------------------------------------------------------------------------ seed preset


def test_seed_preset_settings_and_overrides():
    seed = cli._config(cli._parse_args(["--preset", "seed"]), cli.PRESETS["seed"], on_cuda=False)
    assert (seed.model, seed.width, seed.epochs, seed.batch_size, seed.amp_batch_size) == (
        "resnet50",
        64,
        10,
        128,
        256,
    )
    assert seed.batch_size_of("fp32") == 128 and seed.batch_size_of("torch-amp") == 256
    assert cli._parse_args(["--preset", "seed"]).modes == ["fp32", "torch-amp", "fusedamp"]
    smaller = cli._config(
        cli._parse_args(["--preset", "seed", "--batch-size", "16", "--width", "4"]),
        cli.PRESETS["seed"],
        on_cuda=False,
    )
    assert (smaller.width, smaller.batch_size, smaller.amp_batch_size) == (4, 16, 32)


def test_seed_preset_prints_the_published_figures_beside_this_run(capsys):
    results = cli.main(
        [
            "--preset",
            "seed",
            "--width",
            "2",
            "--train-size",
            "256",
            "--test-size",
            "32",
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--diag-every",
            "2",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert out.startswith("preset seed: the seed experiment: ResNet-50 on FashionMNIST")
    assert "warning: the seed preset is a GPU experiment" in out
    assert [(r.mode, r.batch_size, r.samples_per_epoch) for r in results] == [
        ("fp32", 32, 256),
        ("torch-amp", 64, 256),
        ("fusedamp", 64, 256),
    ]
    assert "the seed experiment as published (GPU, 10 epochs) | this run:" in out
    for figure in ("333 s |", "141 s |", "2.36x |", "the same in fp32 and AMP |", "about 25% |"):
        assert figure in out
    assert "(~" in out and "for 10 epochs of 256)" in out  # extrapolated: 1 epoch ran, not 10
    assert "activations saved for backward (per sample): halved by AMP | torch-amp 0." in out
    assert "optimizer state:            the same in fp32 and AMP | torch-amp 1.00x fp32's" in out
    assert "memory per mode, counted from its tensors" in out  # the table, as in every run


def test_seed_comparison_lines():
    fp32 = report.ModeResult(
        "fp32",
        samples_per_epoch=1000,
        epoch_times=[20.0] * 10,
        block_samples=[1000] * 10,
        block_times=[20.0] * 10,
        precision=0.9,
        recall=0.8,
        f1=0.85,
        underflow=[(0, 0.2), (10, 0.3)],
        memory=memory.MemoryBreakdown(weights=400, grads=400, moments=800, other=8, activations=1000),
    )
    amp = report.ModeResult(
        "torch-amp",
        samples_per_epoch=1000,
        epoch_times=[10.0] * 10,
        block_samples=[1000] * 10,
        block_times=[10.0] * 10,
        memory=memory.MemoryBreakdown(weights=400, grads=400, moments=800, other=8, activations=520),
    )
    lines = report.seed_comparison([fp32, amp], full_epochs=10, full_samples=1000)
    assert lines[6].endswith("halved by AMP | torch-amp 0.52x fp32's")  # per sample: the same batch
    assert lines[7].endswith("the same in fp32 and AMP | torch-amp 1.00x fp32's")
    assert lines[1].endswith("333 s | fp32 200.0 s")  # the full run: nothing extrapolated
    assert lines[2].endswith("141 s | torch-amp 100.0 s")
    assert lines[3].endswith("2.36x | torch-amp 2.00x [2.00-2.00]")
    assert "fp32 0.9000 / 0.8000 / 0.8500" in lines[4] and lines[5].endswith("fp32 25.0%, torch-amp -")


# ----------------------------------------------------------------------- benchmark runner

runner = pytest.importorskip("benchmarks.__main__")
runner_run_module = runner.run_module  # the real one, for tests that replace it on the module

MODULES = {
    "bench_alpha": """
        import json, sys
        rows = [
            {"bench": "adamw", "case": "fp32 1M", "impl": "fusedamp", "device": "cpu", "time_ms": 2.0,
             "gbps": 14.0, "ceiling_gbps": 20.0},
            {"bench": "adamw", "case": "fp32 1M", "impl": "torch", "device": "cpu", "time_ms": 3.0,
             "gbps": 9.3, "ceiling_gbps": 20.0},
        ]
        json.dump(rows, open(sys.argv[sys.argv.index("--json") + 1], "w"))
    """,
    # The table style of benchmarks/common.py: aliases, a copy row as the ceiling.
    "bench_beta": """
        import json, sys
        rows = [{"dtype": "bf16", "op": "fusedamp unscale_", "ms": 1.0, "GB/s": 8.0, "vs torch unscale": 1.5},
                {"dtype": "bf16", "op": "copy", "ms": 0.5, "GB/s": 16.0}]
        payload = {"benchmark": "unscale", "environment": {"device": "cpu"}, "rows": rows,
                   "targets": ["target fusedamp unscale_ bf16: 1.50x torch unscale (>= 1.2x): met"]}
        json.dump(payload, open(sys.argv[sys.argv.index("--json") + 1], "w"))
    """,
    "bench_gpu_only": """
        import sys
        print("needs CUDA")
        sys.exit(77)
    """,
    "bench_broken": """
        raise RuntimeError("boom")
    """,
    "not_a_bench": "raise SystemExit(1)",
}


@pytest.fixture
def bench_package(tmp_path):
    package = tmp_path / "fakebench"
    package.mkdir()
    for name, source in MODULES.items():
        (package / f"{name}.py").write_text(textwrap.dedent(source))
    return str(package)


def test_runner_discovers_and_classifies_modules(bench_package):
    assert runner.discover(bench_package) == ["bench_alpha", "bench_beta", "bench_broken", "bench_gpu_only"]
    runs = {
        name: runner.run_module(name, bench_package, timeout=60) for name in runner.discover(bench_package)
    }
    assert runs["bench_alpha"].status == "ok" and len(runs["bench_alpha"].rows) == 2
    assert runs["bench_gpu_only"].status == "skipped" and runs["bench_gpu_only"].message == "needs CUDA"
    assert runs["bench_broken"].status == "failed" and "boom" in runs["bench_broken"].message
    beta = runs["bench_beta"].rows
    assert beta[0]["bench"] == "unscale" and beta[0]["case"] == "bf16"
    assert beta[0]["impl"] == "fusedamp unscale_"
    assert beta[0]["time_ms"] == 1.0 and beta[0]["gbps"] == 8.0 and beta[0]["device"] == "cpu"
    assert runs["bench_beta"].targets == ["target fusedamp unscale_ bf16: 1.50x torch unscale (>= 1.2x): met"]
    assert runs["bench_alpha"].targets == []


def test_runner_ratios_table_and_plot(bench_package, tmp_path):
    rows = [
        row
        for name in ("bench_alpha", "bench_beta")
        for row in runner.run_module(name, bench_package, timeout=60).rows
    ]
    runner.add_ratios(rows)
    torch_row = next(row for row in rows if row["impl"] == "torch")
    assert torch_row["fusedamp_speedup"] == pytest.approx(1.5)
    assert torch_row["fraction_of_ceiling_gbps"] == pytest.approx(9.3 / 20.0)
    unscale = next(row for row in rows if row["impl"] == "fusedamp unscale_")
    assert unscale["ceiling_gbps"] == 16.0 and unscale["fraction_of_ceiling_gbps"] == pytest.approx(0.5)
    table = runner.format_table(rows)
    assert "1.50x" in table and "vs torch unscale 1.50x" in table and "70%" in table
    if importlib.util.find_spec("matplotlib"):
        assert runner.plot_rows(rows, str(tmp_path / "bench.png"), "test")
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert not runner.plot_rows(
        [{"bench": "x", "case": "", "impl": "", "time_ms": 1.0}], str(tmp_path / "none.png"), "test"
    )


def test_runner_main_exit_status(monkeypatch, bench_package, tmp_path, capsys):
    monkeypatch.setattr(runner, "PACKAGE_DIR", bench_package)
    monkeypatch.setattr(runner, "discover", lambda: ["bench_alpha", "bench_beta", "bench_gpu_only"])
    monkeypatch.setattr(
        runner, "run_module", lambda name, timeout: runner_run_module(name, bench_package, timeout=60)
    )
    out_json = tmp_path / "all.json"
    assert runner.main(["--json", str(out_json), "--plot", str(tmp_path / "all.png")]) == 0
    saved = json.loads(out_json.read_text())
    assert [m["status"] for m in saved["modules"]] == ["ok", "ok", "skipped"]
    assert len(saved["rows"]) == 4
    assert saved["modules"][1]["targets"] == [
        "target fusedamp unscale_ bf16: 1.50x torch unscale (>= 1.2x): met"
    ]
    assert "targets:\ntarget fusedamp unscale_ bf16: 1.50x" in capsys.readouterr().out
    monkeypatch.setattr(runner, "discover", lambda: ["bench_alpha", "bench_broken"])
    assert runner.main(["--json", str(out_json)]) == 1
    with pytest.raises(SystemExit):
        runner.main(["--only", "nothing"])
    assert "no such benchmark modules" in capsys.readouterr().err


def test_runner_replaces_one_results_file_per_platform_and_plots_only_when_asked(
    monkeypatch, bench_package, tmp_path
):
    monkeypatch.setattr(runner, "PACKAGE_DIR", bench_package)
    monkeypatch.setattr(runner, "discover", lambda: ["bench_alpha"])
    monkeypatch.setattr(
        runner, "run_module", lambda name, timeout: runner_run_module(name, bench_package, timeout=60)
    )
    results = tmp_path / "results"
    for _ in range(2):
        assert runner.main(["--results-dir", str(results)]) == 0
    name = runner.platform_name()
    assert re.fullmatch(r"(cpu|cuda)-[a-z0-9-]+", name)
    assert sorted(path.name for path in results.iterdir()) == [f"{name}.json"]
    saved = json.loads((results / f"{name}.json").read_text())
    assert saved["platform"] == name and saved["environment"]["command"].startswith("python -m benchmarks")
    assert {"date", "commit", "processor", "threads", "torch"} <= set(saved["environment"])
    assert not list(tmp_path.rglob("*.png"))

