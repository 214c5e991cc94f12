"""The demo end to end at tiny size in every mode, its metrics, table, JSON and plot; the
ResNets; and the benchmark runner (python -m benchmarks) on generated benchmark modules."""

import importlib.util
import json
import textwrap

import pytest
import torch

import fusedamp.demo as demo
from fusedamp.demo.data import synthetic_fashion_mnist
from fusedamp.demo.models import build_model, resnet18, resnet50

TINY = ["--train-size", "192", "--test-size", "64", "--batch-size", "32", "--epochs", "1",
        "--width", "4", "--diag-every", "2", "--device", "cpu"]
FUSEDAMP_MODES = ["fusedamp", "fusedamp-o2"]


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
    predictions = torch.where(torch.rand(300, generator=generator) < 0.6, targets,
                              torch.randint(0, 5, (300,), generator=generator))  # class 5 under-predicted
    predictions[predictions == 4] = 3  # class 4 never predicted: precision 0 by convention
    got = demo.classification_metrics(predictions, targets, 6)
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
    results = demo.main([*TINY, "--json", str(json_path), *extra])
    return results, json.loads(json_path.read_text())


@pytest.mark.parametrize("modes", ["fp32,torch-amp", *FUSEDAMP_MODES])
def test_demo_end_to_end(tmp_path, capsys, modes):
    results, saved = run_demo(tmp_path, "--modes", modes)
    out = capsys.readouterr().out
    assert "synthetic" in out and "NOT FashionMNIST" in out
    assert [r.mode for r in results] == modes.split(",")
    assert "time/epoch" in out and "final scale" in out
    for result, stored in zip(results, saved["results"], strict=True):
        assert stored["mode"] == result.mode
        assert len(result.losses) == 192 // 32 and all(l == l for l in result.losses)  # noqa: E741
        assert 0.0 <= result.accuracy <= 1.0 and result.peak_memory_bytes > 0
        assert [step for step, _ in result.underflow] == [0, 2, 4]
        assert f"{result.mode:<12} epoch 1/1" in out
        if result.mode == "fp32":
            assert result.scales == [] and result.skipped_steps is None
        else:
            assert len(result.scales) == len(result.losses) and result.final_scale == result.scales[-1]
            assert result.skipped_steps == 0 and result.final_scale == 65536.0
    assert saved["synthetic_data"] is True and saved["train_size"] == 192


def test_demo_modes_learn_the_same_thing():
    # Same weights, same batches: after a few steps fp32 and AMP losses agree closely.
    data = synthetic_fashion_mnist(256, 64)
    config = demo.RunConfig(width=4, epochs=1, batch_size=32, diag_every=0)
    modes = ["fp32", "torch-amp", *FUSEDAMP_MODES]
    results = [demo.run_mode(mode, data, config, torch.device("cpu"), torch.bfloat16) for mode in modes]
    for result in results[1:]:
        assert result.losses[0] == pytest.approx(results[0].losses[0], rel=0.05)
        assert result.losses[-1] == pytest.approx(results[0].losses[-1], rel=0.2)


def test_demo_accumulate_steps_once_per_group(tmp_path):
    results, saved = run_demo(tmp_path, "--modes", "fp32,torch-amp", "--accumulate", "2")
    assert [len(r.losses) for r in results] == [3, 3]
    assert saved["config"]["accumulate"] == 2
    with pytest.raises(ValueError, match="no full step"):
        demo.main([*TINY, "--modes", "fp32", "--accumulate", "7"])


def test_demo_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "amp.png"
    run_demo(tmp_path, "--modes", "fp32,torch-amp", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_plot_without_matplotlib_says_so(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_have_matplotlib", lambda: False)
    with pytest.raises(SystemExit):
        demo.main([*TINY, "--plot", "x.png"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--modes", "fp32,fp8"], "unknown modes"),
    (["--epochs", "0"], "--epochs must be at least 1"),
])
def test_demo_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.main(argv)
    assert message in capsys.readouterr().err


def test_results_table_speedups_against_fp32():
    fp32 = demo.ModeResult("fp32", epoch_times=[4.0], accuracy=0.9)
    amp = demo.ModeResult("torch-amp", epoch_times=[2.0], skipped_steps=1, final_scale=32768.0,
                          underflow=[(0, 0.25), (10, 0.15)])
    table = demo.results_table([fp32, amp]).splitlines()
    assert table[0].split()[:4] == ["mode", "time/epoch", "samples/s", "speedup"]
    assert "1.00x" in table[2] and "2.00x" in table[3]
    assert "20.00%" in table[3] and table[3].rstrip().endswith("32768")


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
        payload = {"benchmark": "unscale", "environment": {"device": "cpu"}, "rows": rows}
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
    runs = {name: runner.run_module(name, bench_package, timeout=60)
            for name in runner.discover(bench_package)}
    assert runs["bench_alpha"].status == "ok" and len(runs["bench_alpha"].rows) == 2
    assert runs["bench_gpu_only"].status == "skipped" and runs["bench_gpu_only"].message == "needs CUDA"
    assert runs["bench_broken"].status == "failed" and "boom" in runs["bench_broken"].message
    beta = runs["bench_beta"].rows
    assert beta[0]["bench"] == "unscale" and beta[0]["case"] == "bf16"
    assert beta[0]["impl"] == "fusedamp unscale_"
    assert beta[0]["time_ms"] == 1.0 and beta[0]["gbps"] == 8.0 and beta[0]["device"] == "cpu"


def test_runner_ratios_table_and_plot(bench_package, tmp_path):
    rows = [row for name in ("bench_alpha", "bench_beta")
            for row in runner.run_module(name, bench_package, timeout=60).rows]
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
    assert not runner.plot_rows([{"bench": "x", "case": "", "impl": "", "time_ms": 1.0}],
                                str(tmp_path / "none.png"), "test")


def test_runner_main_exit_status(monkeypatch, bench_package, tmp_path, capsys):
    monkeypatch.setattr(runner, "PACKAGE_DIR", bench_package)
    monkeypatch.setattr(runner, "discover", lambda: ["bench_alpha", "bench_gpu_only"])
    monkeypatch.setattr(runner, "run_module",
                        lambda name, timeout: runner_run_module(name, bench_package, timeout=60))
    out_json = tmp_path / "all.json"
    assert runner.main(["--json", str(out_json), "--plot", str(tmp_path / "all.png")]) == 0
    saved = json.loads(out_json.read_text())
    assert [m["status"] for m in saved["modules"]] == ["ok", "skipped"]
    assert len(saved["rows"]) == 2
    monkeypatch.setattr(runner, "discover", lambda: ["bench_alpha", "bench_broken"])
    assert runner.main(["--json", str(out_json)]) == 1
    with pytest.raises(SystemExit):
        runner.main(["--only", "nothing"])
    assert "no such benchmark modules" in capsys.readouterr().err
