# Sourced by the gpu_*.sh scripts from the repository root: sets PY (the interpreter: $PYTHON,
# else .venv/bin/python, else python3), installs the wheels staged in .whl/ by gpu_stage.sh
# into /tmp/site when the interpreter lacks Opacus (a bare GPU machine), points
# DPKFC_MED_DATA at .gpu_data/ when it is there, sets CUDA_VISIBLE_DEVICES ($GPU, default 0),
# and stops unless torch sees a CUDA device.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c 'import opacus' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -d .gpu_data ]; then
    export DPKFC_MED_DATA="$PWD/.gpu_data${DPKFC_MED_DATA:+:$DPKFC_MED_DATA}"
fi
export CUDA_VISIBLE_DEVICES="${GPU:-${CUDA_VISIBLE_DEVICES:-0}}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible")' || exit 1
