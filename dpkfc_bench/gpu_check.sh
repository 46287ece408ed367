#!/usr/bin/env bash
# GPU check on one GPU, in under 8 minutes:
#   1. the tests that run on every device the machine has (bf16 autocast with float32
#      per-sample gradients, clipping-mode agreement, sensitivity <= C with units of 3
#      patients, the CUDA backend settings), plus the privacy engine's core tests;
#   2. the full cost benchmark in float32 (dpkfc_bench/gpu_cost.sh) -> results/cost_cuda.{json,md};
#   3. the small CNN and the UNet 3D with bfloat16 autocast -> results/cost_cuda_bf16.{json,md}.
#
#   bash dpkfc_bench/gpu_check.sh
#
# Each part has its own timeout (TESTS_S 100, COST_S 250, BF16_S 110 seconds), so the whole
# check ends within 8 minutes even when a part is cut short; the cost benchmark keeps the models
# it finished. Environment as for gpu_cost.sh (PYTHON, GPU, THREADS). On a machine without
# Opacus/MONAI, install them first (pip install -e .; or their wheels, offline).
set -uo pipefail
cd "$(dirname "$0")/.."
. dpkfc_bench/gpu_env.sh
status=0
echo "== 1. tests on CUDA and CPU"
timeout --signal=INT --kill-after=10 "${TESTS_S:-100}" "$PY" -m pytest -o addopts="" -q -p no:cacheprovider \
    tests/privacy/test_precision.py tests/privacy/test_privacy_core.py || status=1
echo "== 2. cost benchmark, float32"
BUDGET_S="${COST_S:-250}" PYTHON="$PY" bash dpkfc_bench/gpu_cost.sh || status=1
echo "== 3. cost benchmark, bfloat16 autocast"
BUDGET_S="${BF16_S:-110}" PYTHON="$PY" bash dpkfc_bench/gpu_cost.sh --precision bf16 \
    --models small_cnn,unet_3d --out dpkfc_bench/results/cost_cuda_bf16.json || status=1
exit $status
