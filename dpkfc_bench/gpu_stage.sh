#!/usr/bin/env bash
# Stage, on this machine, what a bare GPU machine lacks, in git-ignored folders that a device
# run carries along (neither is ever committed):
#   .whl/       wheels (CPython 3.12, manylinux x86-64) of the dependencies the GPU image does
#               not have and the benchmarks import: Opacus, MONAI, nibabel, dp-accounting
#               (+ dm-tree), at the versions installed here (the DICOM readers SimpleITK and
#               pydicom stay behind: SimpleITK's wheel alone would fill the 64 MiB a run carries);
#   .gpu_data/  copies of the data folders the GPU benchmarks read (default: msd_hippocampus),
#               taken from the bundled shared/data folder.
# dpkfc_bench/gpu_env.sh (sourced by every gpu_*.sh script) installs .whl into /tmp/site and
# points DPKFC_MED_DATA at .gpu_data when they are there.
#
#   bash dpkfc_bench/gpu_stage.sh [DATA_SUBFOLDER ...]
#
# Environment: PYTHON (the interpreter whose installed versions are pinned, default
# .venv/bin/python), DATA_ROOT (default: the shared/data folder beside the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
DATA_ROOT="${DATA_ROOT:-../shared/data}"
pins=$("$PY" - <<'PY'
from importlib.metadata import version
names = ["opacus", "monai", "nibabel", "dp-accounting", "dm-tree"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl $pins
mkdir -p .gpu_data
for sub in "${@:-msd_hippocampus}"; do
    [ -d "$DATA_ROOT/$sub" ] || { echo "gpu_stage.sh: no folder $DATA_ROOT/$sub (set DATA_ROOT)" >&2; exit 1; }
    rm -rf ".gpu_data/$sub" && cp -r "$DATA_ROOT/$sub" ".gpu_data/$sub"
done
du -sh .whl .gpu_data
ls .whl
