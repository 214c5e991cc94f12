#!/usr/bin/env bash
# The one script for a lent GPU: build for sm_90a, run the whole test suite (CUDA tests
# included), run every benchmark; logs and JSON go under $OUT. Meant to finish in < 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" FUSEDAMP_CUDA=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -n 2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

start=$(date +%s)
if ! "$PYTHON" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -n 40 "$OUT/build.log"
  echo "gpu_check: build failed (full log in build.log)"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"

"$PYTHON" -m pytest tests -q --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT/tests.log"

bench_rc=0
for bench in benchmarks/bench_*.py; do
  name=$(basename "$bench" .py)
  timeout 150 "$PYTHON" -m "benchmarks.$name" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || bench_rc=1
  tail -n 25 "$OUT/$name.log"
done
echo "gpu_check: tests rc=$tests_rc, benchmarks rc=$bench_rc, total $(( $(date +%s) - start )) s"
exit $(( tests_rc || bench_rc ))
