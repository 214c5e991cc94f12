#!/usr/bin/env bash
# Builds fusedamp (CPU kernels) against the oldest torch it declares (setup.py's MIN_TORCH, also in
# pyproject.toml and the docs; tests/test_build.py keeps them equal) and runs the test files that
# hold on it. Not part of CI: PyPI's Linux torch wheels of that age are CUDA builds that pull a few
# GB of nvidia packages. Run it when raising torch's minimum or touching a torch API that is new.
#
#   bash tools/check_oldest_torch.sh        # OLDEST_TORCH=2.5.1 OLDEST_VENV=/tmp/fusedamp-oldest-torch
#
# On torch 2.5.1 the rest of the suite fails for reasons of that torch, not of fusedamp's kernels:
# torch.compile and opcheck's AOT dispatch refuse custom ops whose mutated list arguments alias
# (test_compile, test_op_table, the compile tests of test_autocast and test_grad_scaler), there is
# no torch.optim.Muon to compare FusedMuon with (test_muon), fully_shard is not yet public in
# torch.distributed.fsdp (test_distributed*, test_fsdp_offload, two offload tests), autograd
# refuses a grad of another dtype than its param (test_optim_state, test_optim_codecs,
# test_step_plan, test_offload), optimizers take no named params (test_dropin), and some of
# torch's error messages read differently (test_autocast, test_grad_scaler).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${OLDEST_TORCH:-2.5.1}"
VENV="${OLDEST_VENV:-/tmp/fusedamp-oldest-torch}"
SOURCES="$VENV/src"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH" ninja setuptools wheel pytest numpy expecttest hypothesis
# A copy of the tracked files: the build writes fusedamp/_C*.so in place, and this checkout keeps its own.
rm -rf "$SOURCES" && mkdir -p "$SOURCES"
git ls-files -z | xargs -0 cp --parents -t "$SOURCES"
cd "$SOURCES"
FUSEDAMP_CUDA=0 "$VENV/bin/python" setup.py --quiet build_ext --inplace
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_amp_ops.py tests/test_bad_inputs.py tests/test_bench_offload.py tests/test_build.py \
  tests/test_checkpoint.py tests/test_clients.py tests/test_codec.py tests/test_conversions.py \
  tests/test_data.py tests/test_demo.py tests/test_diagnostics.py tests/test_docs.py \
  tests/test_dropin_edges.py tests/test_gemm.py tests/test_gemm_kernel_choice.py tests/test_gemm_tiles.py \
  tests/test_long_run_accuracy.py tests/test_multi_tensor_plan.py tests/test_optim.py \
  tests/test_optim_accuracy.py tests/test_optim_amp.py tests/test_param_edits.py tests/test_properties.py
