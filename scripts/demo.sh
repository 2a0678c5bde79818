#!/usr/bin/env bash
# The README's main command: sets up what it needs, then runs one whole demo cycle on the embedded default
# (tiny random Qwen3 on CPU, SQLite, a local artifact folder under runs/demo/). Extra args go to `mass-ops demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Node, qwen-code and the tokenizer install into the checkout (kept between runs, ignored by git).
export MASS_RUNTIME_DIR="${MASS_RUNTIME_DIR:-$PWD/.runtime}"
exec .venv/bin/mass-ops demo "$@"
