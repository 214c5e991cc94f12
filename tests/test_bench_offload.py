"""benchmarks/bench_offload.py runs (on a GPT-2 of one block and a small vocabulary, one round,
without DeepSpeed) and writes the rows that the runner compares and benchmarks.summary renders;
bench_offload_loop.py's training loops run on a tiny GPT-2 and a tiny 7B-shaped decoder on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_offload, bench_offload_loop, summary

ROOT = Path(__file__).resolve().parents[1]


def test_gpt2_small_shapes_hold_124m_params() -> None:
    shapes = bench_offload.gpt2_shapes()
    assert len(shapes) == 148
    assert sum(bench_offload.torch.Size(shape).numel() for shape in shapes) == 124_439_808


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("offload") / "rows.json"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    command = [
        sys.executable, "-m", "benchmarks.bench_offload", "--device", "cpu", "--layers", "1", "--vocab", "64",
        "--rounds", "1", "--threads", "1,2", "--no-deepspeed", "--json", str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def test_rows_compare_at_the_same_precision(results: dict) -> None:
    rows = {(row["bench"], row["impl"]): row for row in results["rows"]}
    assert set(rows) == {
        ("offload adamw", "torch fused"), ("offload adamw", "fusedamp"),
        ("offload adamw", "fusedamp bf16 remainder int8"), ("offload adamw", "fusedamp bf16 stochastic int8"),
        ("offload sgd", "torch fused"), ("offload sgd", "fusedamp"),
    }
    adamw = rows[("offload adamw", "fusedamp")]
    assert set(adamw["speedup"]) == {"torch fused"} and "vs torch fused" in adamw
    coded = rows[("offload adamw", "fusedamp bf16 remainder int8")]
    assert "speedup" not in coded and set(coded["speedup, other precision"]) == {"fusedamp", "torch fused"}
    # fp32 param, grad and two moments (and a 4-byte step count per tensor); SGD: one moment.
    assert adamw["host B/param"] == pytest.approx(16.0, abs=1e-4)
    assert rows[("offload sgd", "fusedamp")]["host B/param"] == pytest.approx(12.0, abs=1e-4)
    assert 8.0 < coded["host B/param"] < 8.1  # bf16 param, grad, remainder; int8 moments and scales
    for row in results["rows"]:
        assert row["case"] == f"GPT-2 8M params, {row['threads']} threads" and row["device"] == "cpu"
        assert ("x over 1 thread" in row) == (row["threads"] == 2)
        for key in ("time_ms", "ms per Mparam", "gbps", "from memory ns", "stream bound ns"):
            assert isinstance(row[key], float), key
        assert row["in L2 ns"] is None or row["in L2 ns"] > 0  # None: other load hid the slope
    assert len(results["targets"]) == 2 * 2  # a verdict per same-precision comparison and thread count


def test_summary_renders_the_offload_tables(results: dict) -> None:
    table = summary.render(results, "offload", 1)
    assert len(table) == 2 + 6
    assert table[3].startswith("| FusedAdamW, fp32 | ") and "x torch fused" in table[3]
    assert "other precision: " in table[4]
    bound = summary.render(results, "offload-bound")
    assert len(bound) == 2 + 4 * 2 and all(line.count(" ns") in (2, 3) for line in bound[2:])  # n/a in L2


def test_offload_loop_gpt2_small_holds_124m_params() -> None:
    model = bench_offload_loop.GPT2()
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_offload_loop_llama_7b_holds_6_7b_params() -> None:
    model = bench_offload_loop.Llama(device="meta")
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616


def test_offload_loop_rows_on_tiny_models() -> None:
    """The GPU loop's logic, on the CPU (offload to the same device is plain copies): every case
    has its rows, the offloaded optimizers report host bytes and their host work, the timings are
    consistent, and the verdicts find what they need."""
    rows = []
    for case in bench_offload_loop.cases(["gpt2", "llama-7b"], "cpu", dry_run=True):
        saved: list[int] = []  # the rows handed over after each one (written to the JSON)
        measured = bench_offload_loop.measure(
            case, "cpu", steps=2, done=lambda rows, saved=saved: saved.append(len(rows))
        )
        assert [row["impl"] for row in measured] == ["forward + backward", *case.makers]
        assert saved == list(range(1, len(measured) + 1))
        baseline, *others = measured
        for row in others:
            assert row["fits"] and row["time_ms"] > 0 and row["forward_ms"] > 0 and row["backward_ms"] > 0
            assert row["fwd_bwd_ms"] == pytest.approx(baseline["time_ms"])
            assert row["exposed_ms"] == pytest.approx(row["time_ms"] - row["fwd_bwd_ms"])
            offloaded = row["impl"].startswith("fusedamp offloaded")
            assert (row["host_bytes_per_param"] is not None) == offloaded, row
            assert (row["hooks_ms"] is not None) == offloaded
            assert (row["cpu_step_ms"] is not None) == offloaded
            if offloaded and "remainder" in case.name:
                assert row["host_bytes_per_param"] < 8.1  # remainder + int8 moments
        rows += measured
    assert {row["case"] for row in rows} == {
        "GPT-2 124M, fp32 params, bf16 autocast", "GPT-2 124M, bf16 params, remainder + int8",
        "Llama 7B, bf16 params, remainder + int8",
    }
    table = summary.render({"rows": rows}, "offload-loop")
    assert len(table) == 2 + len(rows) and all(line.count("|") == 13 for line in table)
    targets = bench_offload_loop.verdicts(rows)
    assert len(targets) == 2 + 3 + 2  # GPT-2 against the GPU (torchao: GPU only), backward x 3, Llama 7B
