#!/usr/bin/env bash
# GPU validation of one node (see scripts/gpu_check.py): serve an exported FP8 tiny Qwen3 with vLLM, then time
# ZeRO-3 LoRA steps on a random Qwen3 of a few billion parameters; prints tokens/s and MFU. Parts that need CUDA
# (or vLLM) are skipped with a line saying why. Run from a clone after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export MASS_RUNTIME_DIR="${MASS_RUNTIME_DIR:-$PWD/.runtime}"
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"
