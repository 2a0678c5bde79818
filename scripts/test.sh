#!/usr/bin/env bash
# The README's test command: sets up what it needs, then runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/vllm_contract_env.sh  # vLLM's CPU wheel for tests/contract (its own .venv-vllm)
# Node, qwen-code and the tokenizer install into the checkout (kept between runs, ignored by git).
export MASS_RUNTIME_DIR="${MASS_RUNTIME_DIR:-$PWD/.runtime}"
# Postgres must answer on 127.0.0.1:5432 (the machine's own server); start it if it was stopped.
if ! .venv/bin/python -c "import psycopg2; psycopg2.connect(host='127.0.0.1', user='postgres', dbname='postgres').close()" 2>/dev/null; then
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  fi
fi
# Type check before the tests (pyproject's [tool.mypy]: strict, on mass_ops/): a type error fails the command.
.venv/bin/mypy
# Two pytest workers by default (MASS_TEST_WORKERS; 0 runs in this one process): the whole-cycle tests spend much of
# their time waiting on servers and schedulers, and the other worker uses that core. A test module stays on one
# worker (--dist loadfile), so its module fixtures are built once; every worker has its own Airflow home, databases,
# scratch folders and ports (tests/conftest.py, tests/fixtures/). Modules are handed out in collection order, which
# tests/conftest.py sorts costliest first (the `slow(seconds=N)` marks): no whole cycle is left to start last.
echo "test.sh: setup and type check took ${SECONDS} s" >&2
workers="${MASS_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest "${parallel[@]}" "$@"
