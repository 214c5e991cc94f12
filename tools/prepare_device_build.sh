#!/usr/bin/env bash
# Builds fusedamp here (a CPU host with nvcc 13.0) for a GPU machine, so that gpu_check.sh spends
# the GPU machine's time on tests instead of a ~200 s build: a venv with the GPU machine's Python
# 3.12 and torch 2.11.0+cu130 (PyPI's 2.11.0 wheel is the cu130 build), TORCH_CUDA_ARCH_LIST=8.0;9.0a,
# every CPU kernel build (FUSEDAMP_CPU_ISAS=all: the GPU machine's CPU is not this one),
# debug info stripped and xz-compressed (a small folder to copy to the GPU machine), into
# .device_build/ (ignored by git) with a manifest of Python, torch, archs and a digest of the
# sources (tools/device_build.py).
#
#   bash tools/prepare_device_build.sh    # here; then, on the GPU machine, in a copy of this
#   bash tools/gpu_check.sh               # checkout with .device_build/ beside it (OUT=<folder>)
#
# gpu_check.sh installs the carried build only when the GPU machine's Python, torch and archs and the
# checkout's sources match the manifest, and builds there otherwise (the log says why). Rebuild here
# after any change under csrc/, setup.py or fusedamp/_cuda_archs.py. The benchmarks' peers that a GPU
# machine without a package index lacks (bitsandbytes, torchao) are unpacked beside the build, into
# site/, trimmed to what their optimizers load (bitsandbytes' CUDA 13.0 library; no torchao GEMM
# libraries), so that build and peers stay a few tens of MiB.
#
# The first run installs the venv and torch (later runs reuse them); a cold build is long on a
# 2-core machine, a warm one short (ninja recompiles only changed sources: build/device-src is
# kept). The stripped _C (every CPU ISA, two CUDA archs) is ~70 MiB, ~8 MiB compressed. Stage
# caps on the GPU machine (gpu_check.sh, GPU_CHECK_BUDGET_S=480 by default): carried build installed
# in ~10 s (else the build, up to 300 s, leaves little else), CUDA tests 240 s, GEMM tests 60 s,
# memcheck 45 s, initcheck 45 s, benchmarks 150 s, demo 60 s: a first run leaves time for a rerun of
# some stages (GPU_CHECK_STAGES) within about 15 minutes.
# Environment: DEVICE_VENV (default /work/venvs/device-py312), DEVICE_PYTHON (an interpreter of
# the GPU machine's Python version, default pyenv's 3.12), DEVICE_TORCH (2.11.0),
# DEVICE_BUILD (.device_build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV="${DEVICE_VENV:-/work/venvs/device-py312}"
TORCH="${DEVICE_TORCH:-2.11.0}"
FOLDER="${DEVICE_BUILD:-$ROOT/.device_build}"
ARCHS="8.0;9.0a"
STAGING="$ROOT/build/device-src"

if [[ ! -x "$VENV/bin/python" ]]; then
  PY="${DEVICE_PYTHON:-$(pyenv prefix 3.12 2> /dev/null)/bin/python3}"
  [[ -x "$PY" ]] || { echo "prepare_device_build: no Python 3.12 (set DEVICE_PYTHON)" >&2; exit 1; }
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH" ninja setuptools wheel

# The build writes fusedamp/_C*.so and fusedamp/_build_meta.py in place: build a copy of the
# sources, kept between runs so that ninja and ccache rebuild only what changed.
mkdir -p "$STAGING/fusedamp"
rm -rf "$STAGING/csrc"
cp -r csrc setup.py pyproject.toml "$STAGING/"
cp fusedamp/*.py "$STAGING/fusedamp/"
for package in fusedamp/*/; do
  mkdir -p "$STAGING/$package" && cp "$package"*.py "$STAGING/$package"
done
(cd "$STAGING" && FUSEDAMP_CUDA=1 FUSEDAMP_CPU_ISAS=all TORCH_CUDA_ARCH_LIST="$ARCHS" "$VENV/bin/python" setup.py --quiet build_ext --inplace)

rm -rf "$FOLDER"
mkdir -p "$FOLDER"
for library in "$STAGING"/fusedamp/_C.cpython-*.so; do
  strip --strip-debug -o "$FOLDER/$(basename "$library")" "$library"
  xz -T0 -6 "$FOLDER/$(basename "$library")"
done
cp "$STAGING/fusedamp/_build_meta.py" "$FOLDER/"
# The digest of the sources that were built (the staging copy), whatever changed here since.
"$VENV/bin/python" -m tools.device_build manifest --folder "$FOLDER" --archs "$ARCHS" --root "$STAGING"
"$VENV/bin/python" -m pip install --quiet --no-deps --no-compile --target "$FOLDER/site" \
  bitsandbytes==0.50.2 torchao==0.18.0
find "$FOLDER/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*cuda130*' ! -name '*_cpu*' -delete
rm -rf "$FOLDER/site/test" "$FOLDER/site"/torchao/_C*.so
du -sh "$FOLDER"/*
