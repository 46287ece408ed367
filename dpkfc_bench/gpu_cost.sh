#!/usr/bin/env bash
# Full cost benchmark (python -m dpkfc_bench cost, full sizes: batch 256 / 64 / 8, default dp-kfc
# preconditioner, 5 rounds x 6 timed steps per method, 2 timed refreshes) on one GPU.
#
#   bash dpkfc_bench/gpu_cost.sh [extra python -m dpkfc_bench cost options]
#
# Writes dpkfc_bench/results/cost_cuda.{json,md}. Budgeted to finish in under 8 minutes: a hard
# timeout of 7 min 50 s interrupts it otherwise, and the models measured so far are already
# saved (the study writes its JSON/Markdown after every model). Environment: PYTHON (interpreter,
# default .venv/bin/python or python), GPU (device index, default 0), THREADS (CPU threads, 2),
# BUDGET_S (the timeout in seconds, default 470).
set -euo pipefail
cd "$(dirname "$0")/.."
. dpkfc_bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv || true
exec timeout --signal=INT --kill-after=10 "${BUDGET_S:-470}" \
    "$PY" -m dpkfc_bench cost --device cuda --threads "${THREADS:-2}" --steps 6 --refresh-reps 2 "$@"
