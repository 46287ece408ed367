# Sourced by gpu_cost.sh and gpu_check.sh from the repository root: sets PY (the interpreter:
# $PYTHON, else .venv/bin/python, else python) and CUDA_VISIBLE_DEVICES ($GPU, default 0), and
# stops unless torch sees a CUDA device.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
export CUDA_VISIBLE_DEVICES="${GPU:-${CUDA_VISIBLE_DEVICES:-0}}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible")' || exit 1
