#!/usr/bin/env bash
# The GPU check in one command (see tools/gpu_check.py): on a CUDA machine, from a fresh copy of the repository,
# install lmforge offline, run the GPU tests and measure every CUDA path in about 8 minutes.
#   tools/gpu_check.sh --prepare    # first, on a machine with PyPI access: wheels + a corpus into .gpu-check/
#   tools/gpu_check.sh              # on the GPU machine (python3 = the image's Python with torch + CUDA)
#   tools/gpu_check.sh --dry-run    # anywhere: the same stages on the CPU at tiny shapes
# PYTHON picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -u tools/gpu_check.py "$@"
