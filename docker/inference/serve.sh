#!/usr/bin/env bash
# Entry point of the inference image: starts vLLM's OpenAI-compatible server with the cycle's serving flags
# (MASS_SPEC §2). Every parameter comes from the environment so one pod template serves every cycle:
#
#   MASS_SERVE_MODEL                 model directory (required), e.g. /models/L1-fp8
#   MASS_SERVE_NAME                  served model name (required), e.g. Qwen/Qwen3.6-27B-FP8
#   MASS_SERVE_HOST                  0.0.0.0
#   MASS_SERVE_PORT                  8001
#   MASS_SERVE_MAX_MODEL_LEN         262144
#   MASS_SERVE_TOOL_CALL_PARSER      qwen3_coder
#   MASS_SERVE_REASONING_PARSER      qwen3
#   MASS_SERVE_MAX_NUM_SEQS          4
#   MASS_SERVE_GPU_MEMORY_UTILIZATION 0.90
#   MASS_SERVE_SCHEDULING_POLICY     fcfs (or priority: requests are served by their `priority` field, lower first)
#   MASS_SERVE_TENSOR_PARALLEL_SIZE  unset (vLLM's default, one GPU); set for multi-GPU serving
#
# Extra arguments are passed through to `vllm serve`.
#
# The API key: when VLLM_API_KEY is set (from a Secret), vLLM reads it from the environment and requires it as the
# bearer token. It is deliberately never put on the command line, where every process could read it from
# /proc/<pid>/cmdline, and never printed. The names avoid vLLM's own VLLM_PORT/VLLM_HOST_IP, which mean something
# else to vLLM (and which a Kubernetes Service named `vllm` would inject).
set -euo pipefail

fail() {
  echo "mass-serve: $*" >&2
  exit 64
}

require_match() {
  # require_match NAME VALUE REGEX WHAT: one clear line naming the variable when its value has the wrong shape.
  [[ $2 =~ $3 ]] || fail "$1=$2 is not $4"
}

model=${MASS_SERVE_MODEL:-}
name=${MASS_SERVE_NAME:-}
host=${MASS_SERVE_HOST:-0.0.0.0}
port=${MASS_SERVE_PORT:-8001}
max_model_len=${MASS_SERVE_MAX_MODEL_LEN:-262144}
tool_call_parser=${MASS_SERVE_TOOL_CALL_PARSER:-qwen3_coder}
reasoning_parser=${MASS_SERVE_REASONING_PARSER:-qwen3}
max_num_seqs=${MASS_SERVE_MAX_NUM_SEQS:-4}
gpu_memory_utilization=${MASS_SERVE_GPU_MEMORY_UTILIZATION:-0.90}
scheduling_policy=${MASS_SERVE_SCHEDULING_POLICY:-fcfs}
tensor_parallel_size=${MASS_SERVE_TENSOR_PARALLEL_SIZE:-}

[[ -n $model ]] || fail "MASS_SERVE_MODEL must name the model directory to serve"
[[ -n $name ]] || fail "MASS_SERVE_NAME must give the served model name"
require_match MASS_SERVE_PORT "$port" '^[0-9]{1,5}$' "a TCP port number"
((port >= 1 && port <= 65535)) || fail "MASS_SERVE_PORT=$port is not a TCP port number (1-65535)"
require_match MASS_SERVE_MAX_MODEL_LEN "$max_model_len" '^[1-9][0-9]*$' "a positive integer"
require_match MASS_SERVE_MAX_NUM_SEQS "$max_num_seqs" '^[1-9][0-9]*$' "a positive integer"
require_match MASS_SERVE_GPU_MEMORY_UTILIZATION "$gpu_memory_utilization" '^(0(\.[0-9]+)?|1(\.0+)?)$' \
  "a fraction in (0, 1]"
require_match MASS_SERVE_SCHEDULING_POLICY "$scheduling_policy" '^(fcfs|priority)$' "fcfs or priority"
if [[ -n $tensor_parallel_size ]]; then
  require_match MASS_SERVE_TENSOR_PARALLEL_SIZE "$tensor_parallel_size" '^[1-9][0-9]*$' "a positive integer"
fi
for arg in "$@"; do
  case $arg in
    --api-key | --api-key=*) fail "pass the API key through VLLM_API_KEY, never as --api-key on the command line" ;;
  esac
done
if [[ -n ${VLLM_API_KEY:-} && ${VLLM_API_KEY} =~ [[:space:]] ]]; then
  fail "VLLM_API_KEY contains whitespace"
fi

args=(
  serve "$model"
  --served-model-name "$name"
  --host "$host"
  --port "$port"
  --max-model-len "$max_model_len"
  --enable-auto-tool-choice
  --tool-call-parser "$tool_call_parser"
  --reasoning-parser "$reasoning_parser"
  --max-num-seqs "$max_num_seqs"
  --gpu-memory-utilization "$gpu_memory_utilization"
  --scheduling-policy "$scheduling_policy"
)
if [[ -n $tensor_parallel_size ]]; then
  args+=(--tensor-parallel-size "$tensor_parallel_size")
fi

auth=off
[[ -n ${VLLM_API_KEY:-} ]] && auth=on
# The argv holds no secret, so it is safe to log; the key's presence is reported as on/off only.
echo "mass-serve: vllm ${args[*]} $* (api key: $auth)" >&2
exec vllm "${args[@]}" "$@"
