#!/usr/bin/env bash
# UNETR on MSD Task04 hippocampus at epsilon 8 on one GPU: the segmentation benchmark's one
# tuning protocol (python -m dpkfc_bench segmentation: learning rates x clip norms on seed 0, widened
# at an edge, then seeds 1-3 on their test cases) for non-private training, DP-SGD and DP-KFC,
# on configs/hippocampus_unetr_3d_eps8.yaml.
#
#   bash dpkfc_bench/gpu_stage.sh                 # here: wheels + data for a bare GPU machine
#   bash dpkfc_bench/gpu_unetr.sh [extra segmentation study options]   # on the GPU
#
# Writes dpkfc_bench/results/segmentation_hippocampus_unetr.{json,md,png} after every finished
# run, so a run cut short by the budget keeps what it finished and the next call resumes it
# (copy the JSON back, commit it, and run the script again on a later device). BUDGET_S (default
# 540 s) bounds the whole call; WORKERS (default 6) runs share the GPU; RUNS_DIR holds the runs.
# Environment otherwise as for gpu_cost.sh (PYTHON, GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
. dpkfc_bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
exec timeout --signal=INT --kill-after=20 "${BUDGET_S:-540}" \
    "$PY" -m dpkfc_bench segmentation --config configs/hippocampus_unetr_3d_eps8.yaml \
    --epsilons 8 --device cuda --workers "${WORKERS:-6}" \
    --runs-dir "${RUNS_DIR:-/tmp/dpkfc_bench_runs/segmentation_unetr}" \
    --out dpkfc_bench/results/segmentation_hippocampus_unetr.json "$@"
