#!/usr/bin/env bash
# The one script for a GPU machine, sized so that a run and a shorter rerun fit in about 15 minutes
# of it: the stages share GPU_CHECK_BUDGET_S (default 480 s). The build carried from a CPU host
# (prepare_device_build.sh; its header says how to run this with it) is installed when its Python, torch,
# archs and sources match, else the extension is built for 8.0;9.0a; the peers carried beside it
# (<build>/site: bitsandbytes, torchao) go on PYTHONPATH. Then the CUDA tests (optimizer/AMP tests
# first, on 4 pytest-xdist workers where the image has xdist, then the GEMM tests, each under its
# own timeout with Python's faulthandler dumping stacks after 60 s, so a hung mbarrier cannot eat
# the budget, and pytest-timeout's per-test limit where the image has it), compute-sanitizer's
# memcheck and initcheck over a small subset, the benchmarks, then the demo under a time budget.
# A stage out of time gets SIGINT (pytest writes its JUnit XML and summary) and SIGKILL 20 s
# later. The CPU-only tests are not rerun here. GPU_CHECK_DRY_RUN=1 runs every stage's Python
# entry point as below but never compiles nor runs the sanitizer, and the demo only briefly
# (tests/test_gpu_check.py, on CPU, where the tests skip); GPU_CHECK_BENCHMARKS limits the
# benchmarks to some modules (python -m benchmarks --only) and GPU_CHECK_BENCHMARK_S sets their
# stage's cap (default 150 s; each module may take all of it but 50 s: bench_optim needs about
# 240 s on an H200, its torchao peer most of it, so it gets a call of its own:
# GPU_CHECK_STAGES=benchmarks GPU_CHECK_BENCHMARKS=optim GPU_CHECK_BENCHMARK_S=300);
# GPU_CHECK_STAGES limits the run to some stages (e.g. "cuda_tests,benchmarks", for a rerun); the
# two tuning sweeps run only when named there, each alone, about 3 minutes each: "sweep" (the
# multi-tensor launcher's, writes sweep.json) and "gemm_sweep" (the GEMM's, writes gemm_sweep.json);
# GPU_CHECK_TESTS the CUDA tests to some files (default: all of tests/, e.g. "tests/test_offload.py
# tests/test_offload_overlap.py"; CONTRIBUTING.md has the call for the offloaded training benchmark).
# Everything lands in $OUT, at most 8 files, to copy back from the GPU machine: summary.json
# (environment + per-stage status, always written, also when a stage fails), build.log,
# tests.log (tests and sanitizer), cuda_tests.xml, gemm_tests.xml, benchmarks.log (benchmarks and
# demo), demo.json and the benchmarks' <platform>.json (e.g. cuda-h200.json: commit it as
# benchmarks/results/<platform>.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
# The archs of the carried build, whatever the image sets: the H200 image exports
# TORCH_CUDA_ARCH_LIST=9.0a, which refused the carried 8.0;9.0a build and cost a whole build there.
export TORCH_CUDA_ARCH_LIST="${GPU_CHECK_ARCHS:-8.0;9.0a}" FUSEDAMP_CUDA=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" PYTHONUNBUFFERED=1
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
STAGES_WANTED="${GPU_CHECK_STAGES:-}"
read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests}"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
CARRIED="${GPU_CHECK_CARRIED_BUILD:-.device_build}"
START=$(date +%s)
STAGES=$(mktemp)

# One line per stage: name, status (passed / carried / failed / timeout / skipped / unsupported /
# dry_run), rc, seconds.
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STAGES"; }

write_summary() {
  "$PYTHON" - "$STAGES" "$OUT" "$START" <<'EOF' || printf '{"error": "summary.json could not be built"}\n' > "$OUT/summary.json"
import json, os, platform, subprocess, sys, time
import xml.etree.ElementTree as ElementTree

stages_file, out, start = sys.argv[1], sys.argv[2], float(sys.argv[3])

def command(*args):
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None

env = {
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "gpu": command("nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                   "--format=csv,noheader"),
    "nvcc": (command("nvcc", "--version") or "").splitlines()[-1:],
    "python": platform.python_version(),
    "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
}
try:
    import torch
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
except Exception as error:  # the summary must be written whatever is broken
    env["torch_error"] = repr(error)
try:
    import fusedamp
    env["build_info"] = fusedamp.build_info()
except Exception as error:
    env["fusedamp_error"] = repr(error)

stages = {}
for line in open(stages_file).read().splitlines():
    name, status, rc, seconds = line.split("\t")
    stages[name] = {"status": status, "rc": int(rc), "seconds": int(seconds)}
    report = os.path.join(out, f"{name}.xml")
    if os.path.exists(report):
        try:
            root = ElementTree.parse(report).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            stages[name]["tests"] = {key: int(suite.get(key, 0))
                                     for key in ("tests", "failures", "errors", "skipped")}
        except (ElementTree.ParseError, AttributeError, ValueError) as error:
            stages[name]["tests"] = repr(error)
summary = {"env": env, "stages": stages, "total_seconds": int(time.time() - start),
           "ok": all(s["status"] in ("passed", "carried", "unsupported", "dry_run")
                     for s in stages.values())}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
print(json.dumps(summary["stages"], indent=1))
EOF
  rm -f "$STAGES"
}
trap write_summary EXIT

# Runs a stage under `timeout`: at most $2 seconds, and never past the budget (else it is skipped,
# which fails the check like a failing stage). SIGINT first: pytest then stops, writes its XML
# and the list of what failed; SIGKILL 20 s later (Python dies on SIGTERM as on SIGKILL).
stage() {
  local name=$1 cap=$2 log=$3
  shift 3
  if [[ -n "$STAGES_WANTED" && ",$STAGES_WANTED," != *",$name,"* ]]; then
    return 0
  fi
  local left=$(( BUDGET_S - ($(date +%s) - START) - 10 ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 20 )); then
    echo "gpu_check: $name skipped, the budget is spent" | tee -a "$log"
    record "$name" skipped 0 0
    return 1
  fi
  echo "== $name (at most ${limit} s)" >> "$log"
  local begin=$(date +%s) rc=0
  timeout --signal=INT --kill-after=20 "$limit" "$@" >> "$log" 2>&1 || rc=$?
  local status=passed
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc != 0 )); then status=failed; fi
  record "$name" "$status" "$rc" $(( $(date +%s) - begin ))
  echo "gpu_check: $name $status (rc $rc) in $(( $(date +%s) - begin )) s"
  tail -n 15 "$log"
  return "$rc"
}

# Every entry point runs as a module from the checkout's root (python -m puts it on sys.path),
# where the build lands: a script path would put tools/ there instead, and no fusedamp.
PYTEST=("$PYTHON" -u -m pytest -v --durations=25 -m cuda -o faulthandler_timeout=60
        --continue-on-collection-errors -p no:cacheprovider)
if "$PYTHON" -c "import pytest_timeout" 2> /dev/null; then PYTEST+=(--timeout=120); fi
WORKERS=()
if "$PYTHON" -c "import xdist" 2> /dev/null; then WORKERS=(-n 4 --dist loadfile); fi

# The carried build, when it matches and imports (a host with a newer glibc could make one that
# does not); else the build below replaces what was installed.
begin=$(date +%s)
if carried=$("$PYTHON" -u -m tools.device_build install --folder "$CARRIED" \
    --archs "$TORCH_CUDA_ARCH_LIST" 2>&1) &&
    carried+=$'\n'$("$PYTHON" -c "import fusedamp; print('gpu_check: the carried build imports')" 2>&1); then
  echo "$carried" | tee -a "$OUT/build.log"
  record build carried 0 $(( $(date +%s) - begin ))
else
  echo "gpu_check: not using the carried build: $carried" | tee -a "$OUT/build.log"
  if (( DRY_RUN )); then
    record build dry_run 0 0
  elif ! stage build 300 "$OUT/build.log" "$PYTHON" setup.py build_ext --inplace; then
    echo "gpu_check: build failed, nothing else runs (see build.log)"
    exit 1
  fi
fi

# The benchmarks' peers, carried as an unpacked site folder (the device has no package index).
if [[ -d "$CARRIED/site" ]]; then
  export PYTHONPATH="$(cd "$CARRIED/site" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi

status=0
# The GEMM sweep (benchmarks/bench_gemm.py --sweep: squares, MLP shapes and a K sweep, every kernel
# and wgmma schedule and epilogue, back-to-back and CUDA-graph timings, the per-tile fit; estimated
# at 2.5 to 5 minutes on an H200, not timed yet) runs only when GPU_CHECK_STAGES names it, first: it would take most of a
# full run's budget. GPU_CHECK_SWEEP_ARGS passes options (e.g. "--cases k --backends wgmma").
if [[ ",$STAGES_WANTED," == *",gemm_sweep,"* ]]; then
  read -r -a sweep <<< "--sweep ${GPU_CHECK_SWEEP_ARGS:-}"
  if (( DRY_RUN )); then sweep+=(--dry-run); fi
  stage gemm_sweep "${GPU_CHECK_SWEEP_S:-300}" "$OUT/benchmarks.log" "$PYTHON" -u -m benchmarks.bench_gemm \
    "${sweep[@]}" --json "$OUT/gemm_sweep.json" || status=1
fi
stage cuda_tests 240 "$OUT/tests.log" "${PYTEST[@]}" ${WORKERS[@]+"${WORKERS[@]}"} \
  --junitxml="$OUT/cuda_tests.xml" --ignore=tests/test_gemm_cuda.py "${TESTS[@]}" || status=1
stage gemm_tests 90 "$OUT/tests.log" "${PYTEST[@]}" --junitxml="$OUT/gemm_tests.xml" \
  tests/test_gemm_cuda.py || status=1

# memcheck without the caching allocator (every tensor its own allocation, so it sees bounds);
# initcheck too, as memory fresh from cudaMalloc is often zeroed and memcheck would not see a
# kernel reading what nothing wrote (check_and_norm_'s partials with only empty grads did).
SANITIZER=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" 2> /dev/null)
for tool in memcheck initcheck; do
  if (( DRY_RUN )); then
    sanitize=()
  elif [[ -n "$SANITIZER" ]]; then
    sanitize=("$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 20)
  else
    echo "gpu_check: no compute-sanitizer in this toolkit" >> "$OUT/tests.log"
    record "sanitizer_$tool" unsupported 0 0
    continue
  fi
  if ! stage "sanitizer_$tool" 45 "$OUT/tests.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      ${sanitize[@]+"${sanitize[@]}"} "$PYTHON" -u -m tools.sanitizer_subset; then
    if grep -q "Device not supported" "$OUT/tests.log"; then
      # Some sandboxes (gVisor) refuse the sanitizer: not a finding about fusedamp.
      sed -i '$ s/\tfailed\t/\tunsupported\t/' "$STAGES"
    else
      status=1
    fi
  fi
done

only=()
if [[ -n "${GPU_CHECK_BENCHMARKS:-}" ]]; then only=(--only "$GPU_CHECK_BENCHMARKS"); fi
BENCHMARK_S="${GPU_CHECK_BENCHMARK_S:-150}"
stage benchmarks "$BENCHMARK_S" "$OUT/benchmarks.log" "$PYTHON" -u -m benchmarks --timeout $(( BENCHMARK_S - 50 )) \
  ${only[@]+"${only[@]}"} --results-dir "$OUT" || status=1
# The demo's speedups over fp32 (fusedamp's and torch AMP's), on its synthetic data.
demo=(--time-budget 45)
if (( DRY_RUN )); then demo=(--modes fp32 --epochs 1 --batch-size 32 --train-size 64 --test-size 32); fi
stage demo 60 "$OUT/benchmarks.log" "$PYTHON" -u -m fusedamp.demo "${demo[@]}" --json "$OUT/demo.json" || status=1
# The launcher's tuning sweep (benchmarks/sweep_launch.py: chunk sizes, kernel parameter budgets,
# the grad ops' unroll depths and the coded kernels' layouts, kernel and wall times, into
# sweep.json): only when GPU_CHECK_STAGES names it, as it
# does not fit one call beside the stages above: GPU_CHECK_STAGES=sweep bash tools/gpu_check.sh
if [[ ",$STAGES_WANTED," == *",sweep,"* ]]; then
  stage sweep 200 "$OUT/benchmarks.log" "$PYTHON" -u -m benchmarks.sweep_launch --json "$OUT/sweep.json" || status=1
fi
echo "gpu_check: total $(( $(date +%s) - START )) s"
exit "$status"
