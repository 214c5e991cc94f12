"""benchmarks/bench_offload.py runs (on a GPT-2 of one block and a small vocabulary, one round,
without DeepSpeed) and writes the rows that the runner compares and benchmarks.summary renders;
bench_offload_loop.py's training loop runs on a tiny GPT-2 on the CPU."""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
        "--rounds", "1", "--threads", "1", "--no-deepspeed", "--json", str(out),
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
        assert row["case"] == "GPT-2 8M params, 1 threads" and row["device"] == "cpu"
        for key in ("time_ms", "ms per Mparam", "gbps", "from memory ns", "stream bound ns"):
            assert isinstance(row[key], float), key
        assert row["in L2 ns"] is None or row["in L2 ns"] > 0  # None: other load hid the slope
    assert len(results["targets"]) == 2  # a verdict per same-precision comparison


def test_summary_renders_the_offload_tables(results: dict) -> None:
    table = summary.render(results, "offload", 1)
    assert len(table) == 2 + 6
    assert table[3].startswith("| FusedAdamW, fp32 | ") and "x torch fused" in table[3]
    assert "other precision: " in table[4]
    bound = summary.render(results, "offload-bound")
    assert len(bound) == 2 + 4 and all(line.count(" ns") in (2, 3) for line in bound[2:])  # n/a in L2


def test_offload_loop_gpt2_small_holds_124m_params() -> None:
    model = bench_offload_loop.GPT2()
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_offload_loop_rows_on_a_tiny_gpt2() -> None:
    """The GPU loop's logic, on the CPU (offload to the same device is plain copies): every case
    has its rows, the offloaded optimizers report host bytes, the timings are consistent."""
    args = argparse.Namespace(device="cpu", batch=2, seq=16, steps=2)
    tiny = functools.partial(bench_offload_loop.GPT2, vocab=97, positions=16, width=64, layers=2)
    for case, (dtype, makers) in bench_offload_loop.cases("cpu").items():
        rows = bench_offload_loop.measure(case, dtype, makers, args, model=tiny)
        assert {row["impl"] for row in rows} == set(makers)
        for row in rows:
            assert row["time_ms"] > 0 and row["step_alone_ms"] > 0 and row["fwd_bwd_ms"] > 0
            assert row["exposed_ms"] == pytest.approx(row["time_ms"] - row["fwd_bwd_ms"])
            offloaded = row["impl"] == "fusedamp"
            assert (row["host_bytes_per_param"] is not None) == offloaded, row
            if offloaded and dtype == torch.bfloat16:
                assert row["host_bytes_per_param"] < 8.1  # remainder + int8 moments
