#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's own wheel, without CUDA, for the contract tests (tests/contract), which run vLLM's
# request models, CLI parser and FP8 config on the CPU against what the project sends and passes. It is a separate
# environment because vLLM pins a transformers the project's .venv does not use. Idempotent: a second run only checks
# the stamp. pip's wheel cache (its own, kept on the machine) makes a rebuild quick.
#
# vLLM is installed with --no-deps and then only the packages its imported modules need. Its full requirement list
# pulls a CUDA torch, flashinfer, cutlass and more (many GB); here torch is the local CPU build at the pinned version,
# and a constraint file holds it there so no later install can swap it. xgrammar and llguidance go in with --no-deps
# too: vLLM's CLI checks they are present, and xgrammar's own dependencies would pull triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
# What the imports of vllm.entrypoints.openai.*.protocol, vllm.entrypoints.common.cli_args and the FP8 quantization
# layer need on the CPU (found by importing them one missing module at a time).
NEEDED=(
  numpy "transformers>=5.16.1,<5.21.0" "pydantic>=2.12" "fastapi>=0.133,<0.137" "openai>=2.25" pyyaml regex cachetools
  psutil msgspec pyzmq cloudpickle tqdm requests prometheus_client einops blake3 py-cpuinfo partial-json-parser
  pybase64 cbor2 setproctitle "aiohttp>=3.14.4" pillow uvloop
)
NO_DEPS=("vllm==$VLLM_VERSION" "xgrammar==0.2.8" "llguidance>=1.7,<1.8" "oss-harmony>=0.0.11" "apache-tvm-ffi==0.1.11")
stamp=$VENV/.mass-ops-vllm-installed
want=$(printf '%s\n' "$VLLM_VERSION" "$TORCH_VERSION" "${NEEDED[@]}" "${NO_DEPS[@]}" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
started=$(date +%s)
if [ ! -x $VENV/bin/python ]; then
  "$PY" -m venv $VENV
fi
VPY=$VENV/bin/python
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
# vLLM's declared requirements are knowingly left unmet, so pip's resolver reports each as a conflict: drop those
# lines (pip's exit status still decides), keep everything else it says.
pip_install() {
  $VPY -m pip install --quiet "$@" 2>&1 | { grep -v -e "dependency resolver does not" -e "^vllm .* requires " || true; }
  return "${PIPESTATUS[0]}"
}
pip_install --upgrade pip
pip_install -c "$constraints" "torch==$TORCH_VERSION"
pip_install --no-deps "${NO_DEPS[@]}"
pip_install -c "$constraints" "${NEEDED[@]}"
# A CUDA torch would mean the constraint leaked: refuse the environment rather than run on it.
$VPY -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 'vllm env: torch is a CUDA build')"
echo "$want" >"$stamp"
echo "vllm env: $VENV ready in $(($(date +%s) - started)) s, $(du -sh $VENV | cut -f1)" >&2
