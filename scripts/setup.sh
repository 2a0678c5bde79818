#!/usr/bin/env bash
# Creates .venv and installs mass-ops with every extra the tests and the demo need. Idempotent: a second run only
# checks. torch is installed first at the pinned version so that nothing else can pull a different build, and
# DeepSpeed is built against it without build isolation (its sdist imports torch at build time).
set -euo pipefail
cd "$(dirname "$0")/.."
# The local agent's sandbox is bubblewrap (mass_ops/compute/sandbox.py). Install it once where it is missing and we
# can (root with apt-get, as on a fresh CI machine); elsewhere the sandbox tests skip and say why.
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
    || echo "setup: could not install bubblewrap; local episodes with a real API key will be refused" >&2
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.mass-ops-installed
want=$(cat pyproject.toml $(ls plugins/pyproject.toml 2>/dev/null) | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
$VPY -m pip install --quiet --upgrade pip setuptools wheel
$VPY -m pip install --quiet "torch==2.13.0"
# DeepSpeed ships as an sdist that imports torch while building: build it against the torch above (no isolation, so
# pip cannot fetch another torch) and without compiled ops (CPU here; the trainer image builds what GPUs need).
DS_BUILD_OPS=0 $VPY -m pip install --quiet --no-build-isolation "deepspeed==0.19.8"
$VPY -m pip install --quiet -e ".[train,airflow,report,dev,benchmarks]"
if [ -f plugins/pyproject.toml ]; then
  $VPY -m pip install --quiet -e plugins/
fi
# DeepSpeed JIT-builds its CPU shared-memory collective the first time a trainer starts (about a minute on 2 cores):
# build it once here into torch's extension cache, with the venv's ninja as the trainer uses (stages/train.py).
PATH="$PWD/.venv/bin:$PATH" DS_ACCELERATOR=cpu $VPY -c "
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder('ShareMemCommBuilder')
if builder is not None and builder.is_compatible():
    builder.load()
" >/dev/null
echo "$want" > "$stamp"
