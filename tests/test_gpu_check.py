"""tools/gpu_check.sh on CPU, so that the script for a lent GPU cannot rot unseen: its dry run
(every stage's Python entry point as the script calls it, from a copy of the checkout with no
PYTHONPATH, as on the device; the tests and the sanitizer subset skip without a GPU), and the
matching that decides whether it installs the build carried from a CPU host."""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import device_build

ROOT = Path(__file__).resolve().parents[1]
ARCHS = "8.0;9.0a"


def fake_checkout(root: Path) -> None:
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "op.cu").write_text("// a kernel\n")
    (root / "setup.py").write_text("# setup\n")
    (root / "fusedamp").mkdir()


def fake_build(folder: Path) -> None:
    folder.mkdir()
    (folder / "_C.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (folder / "_build_meta.py").write_text("TORCH_VERSION = '2.11.0+cu130'\n")


def test_carried_build_is_used_only_when_python_torch_archs_and_sources_match(tmp_path: Path) -> None:
    root, folder = tmp_path / "checkout", tmp_path / "carried"
    fake_checkout(root)
    assert "no carried build" in device_build.mismatch(str(folder), ARCHS, str(root))
    fake_build(folder)
    manifest = device_build.write_manifest(str(folder), ARCHS, str(root))
    assert manifest["torch"] == torch.__version__
    assert device_build.mismatch(str(folder), ARCHS, str(root)) is None
    assert "cuda_archs '8.0;9.0a'" in device_build.mismatch(str(folder), "9.0a", str(root))
    for key, value in [("python", "2.7"), ("torch", "2.11.0+cu130")]:
        (folder / device_build.MANIFEST).write_text(json.dumps({**manifest, key: value}))
        assert f"is for {key} {value!r}" in device_build.mismatch(str(folder), ARCHS, str(root))
    (folder / device_build.MANIFEST).write_text(json.dumps(manifest))
    (root / "csrc" / "op.cu").write_text("// the kernel, changed\n")
    assert "is for sources" in device_build.install(str(folder), ARCHS, str(root))
    assert not list((root / "fusedamp").iterdir())
    (root / "csrc" / "op.cu").write_text("// a kernel\n")
    assert device_build.install(str(folder), ARCHS, str(root)) is None
    assert sorted(p.name for p in (root / "fusedamp").iterdir()) == [
        "_C.cpython-312-x86_64-linux-gnu.so",
        "_build_meta.py",
    ]
    # The library compressed, as prepare_device_build.sh carries it: installed decompressed.
    library = folder / "_C.cpython-312-x86_64-linux-gnu.so"
    (folder / (library.name + ".xz")).write_bytes(lzma.compress(b"\x7fELF compressed"))
    library.unlink()
    assert device_build.install(str(folder), ARCHS, str(root)) is None
    assert (root / "fusedamp" / library.name).read_bytes() == b"\x7fELF compressed"


def test_source_digest_covers_every_file_the_build_compiles() -> None:
    digest = device_build.source_digest(str(ROOT))
    assert digest == device_build.source_digest(str(ROOT)) and len(digest) == 64
    assert (ROOT / "csrc" / "cuda" / "amp.cu").exists() and (ROOT / "fusedamp" / "_cuda_archs.py").exists()


needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")


def dry_run(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess, Path, dict[str, str]]:
    """gpu_check.sh in its dry run from a copy of this checkout with its build carried, the
    GPU_CHECK_* `settings` added: the result, the $OUT folder and its logs by name."""
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "results", "*.egg-info")
    for name in ("benchmarks", "csrc", "fusedamp", "tests", "tools"):
        shutil.copytree(ROOT / name, checkout / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, checkout / name)
    # This checkout's build, carried: gpu_check.sh must install it into fusedamp/ to import it.
    carried = checkout / ".device_build"
    carried.mkdir()
    for library in (checkout / "fusedamp").glob("_C.*.so"):
        library.rename(carried / library.name)
    shutil.copy2(checkout / "fusedamp" / "_build_meta.py", carried / "_build_meta.py")
    device_build.write_manifest(str(carried), ARCHS, str(checkout))

    out = tmp_path / "out"
    env = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TORCH_CUDA_ARCH_LIST")
    }
    env.update(OUT=str(out), PYTHON=sys.executable, GPU_CHECK_DRY_RUN="1", CUDA_VISIBLE_DEVICES="")
    env.update(settings)
    result = subprocess.run(
        ["bash", str(checkout / "tools" / "gpu_check.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, out, {path.name: path.read_text() for path in out.glob("*.log")}


@needs_bash
def test_gpu_check_dry_run_runs_every_stage_entry_point(tmp_path: Path) -> None:
    result, out, logs = dry_run(tmp_path, GPU_CHECK_BENCHMARKS="gemm", GPU_CHECK_BENCHMARK_S="120")
    assert result.returncode == 0, result.stdout + result.stderr + "".join(logs.values())
    summary = json.loads((out / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == [
        "build",
        "cuda_tests",
        "gemm_tests",
        "sanitizer_memcheck",
        "sanitizer_initcheck",
        "benchmarks",
        "demo",
    ]
    assert stages["build"]["status"] == "carried" and summary["ok"]
    assert summary["env"]["build_info"]["torch_running"] == torch.__version__
    for name in ("cuda_tests", "gemm_tests"):
        tests = stages[name]["tests"]
        assert (
            stages[name]["status"] == "passed" and tests["tests"] > 0 and tests["skipped"] == tests["tests"]
        )
    assert all(stages[name]["status"] == "passed"
               for name in ("sanitizer_memcheck", "sanitizer_initcheck", "benchmarks", "demo"))
    assert logs["tests.log"].count("sanitizer_subset: skipped, needs a CUDA GPU") == 2
    assert "bench_gemm" in logs["benchmarks.log"]
    assert "== benchmarks (at most 120 s)" in logs["benchmarks.log"]
    assert json.loads((out / "demo.json").read_text())
    # The benchmarks' results file, named for the platform, and no chart; at most 8 files, what
    # the device tool brings back.
    results = [path.name for path in out.glob("*.json") if path.name not in ("summary.json", "demo.json")]
    assert results == [json.loads(next(out.glob("cpu-*.json")).read_text())["platform"] + ".json"]
    assert len(list(out.iterdir())) <= 8
    assert not list(out.glob("*.png"))
    assert not any("ModuleNotFoundError" in text or "ImportError" in text for text in logs.values())


@needs_bash
def test_gpu_check_runs_the_gemm_sweep_only_when_asked(tmp_path: Path) -> None:
    result, out, logs = dry_run(tmp_path, GPU_CHECK_STAGES="gemm_sweep", GPU_CHECK_SWEEP_ARGS="--dtypes bf16")
    log = logs["benchmarks.log"]
    assert result.returncode == 0, result.stdout + result.stderr + log
    stages = json.loads((out / "summary.json").read_text())["stages"]
    assert list(stages) == ["build", "gemm_sweep"] and stages["gemm_sweep"]["status"] == "passed"
    assert "== gemm_sweep (at most 300 s)" in log
    # Squares, MLP up/down and the K sweep; bf16 only; two epilogues; torch, mma.sync and wgmma
    # (each schedule forced, and chosen per shape); both timings.
    assert "would time square 1024 (M=1024 N=1024 K=1024) for bf16 x none,bias_gelu" in log
    assert "would time mlp down t=16384 (M=16384 N=4096 K=16384)" in log
    assert "would time k sweep 4096x4096 k=16384" in log
    assert "dry run, 340 timings planned" in log


@needs_bash
def test_gpu_check_sweep_stage_runs_alone_and_writes_its_json(tmp_path: Path) -> None:
    result, out, logs = dry_run(tmp_path, GPU_CHECK_STAGES="sweep")
    assert result.returncode == 0, result.stdout + result.stderr + "".join(logs.values())
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["stages"]) == ["build", "sweep"] and summary["ok"]
    sweep = json.loads((out / "sweep.json").read_text())
    # Every mode under every variant: 2 kernel parameter budgets x 4 chunk sizes, for the 2 steps
    # with int8 moments x 2 coded layouts, and for the 2 grad ops x 3 unroll depths.
    modes = {row["mode"] for row in sweep["rows"]}
    assert len(modes) == 9 and len(sweep["rows"]) == 5 * 8 + 2 * 8 * 2 + 2 * 8 * 3
    assert {(row["param_bytes"], row["chunk_size"]) for row in sweep["rows"]} == {
        (budget, 2**k) for budget in (4096, 32764) for k in range(14, 18)
    }
    assert {row["grad_unroll"] for row in sweep["rows"]} == {None, 2, 4, 8}
    assert {row["mode"] for row in sweep["rows"] if row["coded_runs"] == 2} == {
        "adamw fp32, int8 moments", "adamw bf16 + remainder, int8 moments"
    }
    assert all(row["share_of_stream"] > 0 and row["bytes"] > 0 for row in sweep["rows"])
    assert sweep["stream_gb_per_s"] > 0
    assert len(list(out.iterdir())) <= 8


# What marks a test file as running CUDA code: tensors put on a GPU, or a skip without one.
USES_CUDA = re.compile(r'needs_cuda|not torch\.cuda\.is_available\(\)|device="cuda"|\.cuda\(\)|\("cuda"')


def test_gpu_check_selects_every_cuda_test_file() -> None:
    # gpu_check.sh runs `pytest -m cuda` (tests/conftest.py marks the tests skipped without a GPU
    # or taking a "cuda" device): a CUDA test that escapes the marker would never run on a GPU.
    uses_cuda = {
        path.name
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != Path(__file__).name and USES_CUDA.search(path.read_text())
    }
    assert {"test_cuda_ops.py", "test_gemm_cuda.py", "test_optim_codecs.py"} <= uses_cuda
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert "-m cuda" in script and "tests/test_gemm_cuda.py" in script
    collect = ["--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", *collect], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    node_ids = [line for line in collected.stdout.splitlines() if "::" in line]
    selected = {node_id.split("::")[0].removeprefix("tests/") for node_id in node_ids}
    assert uses_cuda <= selected, f"CUDA tests gpu_check.sh would not run: {sorted(uses_cuda - selected)}"
