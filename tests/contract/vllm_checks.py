"""Runs vLLM's own code on what the project sends and passes it; run with `.venv-vllm/bin/python` (vLLM's CPU wheel).

Reads one JSON document on stdin and prints one JSON document on stdout. Imports only vLLM (and what it brings) and
the standard library, so it runs in vLLM's environment, not the project's. Input keys, each optional:

  requests:   [{name, route: chat|completions|responses, body}]   -> vLLM's request model validates `body`
                                                                   (and names the fields it would ignore)
  serve_argv: [{name, argv}]                                       -> `vllm serve`'s parser (argv after `serve`)
  quantization_configs: [{name, config}]                           -> `Fp8Config.from_config`
  tensor_parallel: [{name, tp, quantization_config,
                    model: {hidden, heads, kv_heads, head_dim, intermediate, attn_output_gate,
                    linear: {key_heads, value_heads, key_dim, value_dim} | null}}]
                                                                   -> vLLM's block-FP8 linear layers are created

Output: the same keys, each a list of {name, ok, error} (`error` a one-line reason when not ok), plus `versions`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import types
from typing import Any

# vLLM picks its platform from the hardware; this machine has no GPU, so name vLLM's own CPU platform.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:2000]


def check_requests(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate each body with the request model of its route, as vLLM's server does before serving it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    models = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest}
    results = []
    for item in items:
        try:
            parsed = models[item["route"]].model_validate(item["body"])
            # vLLM's models accept unknown fields and drop them (logged at debug level only): a field we send that
            # vLLM ignores is a setting that silently does nothing, so it is reported.
            read = {"priority": getattr(parsed, "priority", None), "ignored": sorted(parsed.model_extra or {})}
            results.append({"name": item["name"], "ok": True, "error": None, **read})
        except Exception as exc:  # every refusal is a finding to report, not a crash
            results.append({"name": item["name"], "ok": False, "error": _one_line(exc)})
    return results


def check_serve_argv(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parse each argv (what follows `vllm serve`) with vLLM's own server argument parser."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    results = []
    for item in items:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = parser.parse_args(item["argv"])
            parsed = {
                "model": args.model_tag,
                "scheduling_policy": args.scheduling_policy,
                "tensor_parallel_size": args.tensor_parallel_size,
                "served_model_name": args.served_model_name,
            }
            results.append({"name": item["name"], "ok": True, "error": None, "parsed": parsed})
        except SystemExit:
            lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
            results.append({"name": item["name"], "ok": False, "error": lines[-1] if lines else "parser exited"})
        except Exception as exc:
            results.append({"name": item["name"], "ok": False, "error": _one_line(exc)})
    return results


def check_quantization_configs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Read each `quantization_config` with vLLM's FP8 config, as its model loader does."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    results = []
    for item in items:
        try:
            config = Fp8Config.from_config(item["config"])
            read = {
                "weight_block_size": config.weight_block_size,
                "activation_scheme": config.activation_scheme,
                "checkpoint_is_fp8_serialized": config.is_checkpoint_fp8_serialized,
                "ignored_layers": list(config.ignored_layers or []),
            }
            results.append({"name": item["name"], "ok": True, "error": None, "read": read})
        except Exception as exc:
            results.append({"name": item["name"], "ok": False, "error": _one_line(exc)})
    return results


def _decoder_layers(model: dict[str, Any], quant_config: Any) -> list[tuple[str, Any]]:
    """(prefix, constructor) of one decoder layer's linears as vLLM's Qwen3 / Qwen3.5 models build them."""
    from vllm.model_executor.layers import linear

    hidden, heads, kv_heads, head_dim = model["hidden"], model["heads"], model["kv_heads"], model["head_dim"]
    q_heads = heads * (2 if model.get("attn_output_gate") else 1)  # Qwen3.5's gated attention doubles q_proj
    common: dict[str, Any] = {"bias": False, "quant_config": quant_config}
    layers = [
        ("self_attn.qkv_proj", lambda: linear.QKVParallelLinear(hidden, head_dim, q_heads, kv_heads, **common)),
        ("self_attn.o_proj", lambda: linear.RowParallelLinear(heads * head_dim, hidden, **common)),
        ("mlp.gate_up_proj", lambda: linear.MergedColumnParallelLinear(hidden, [model["intermediate"]] * 2, **common)),
        ("mlp.down_proj", lambda: linear.RowParallelLinear(model["intermediate"], hidden, **common)),
    ]
    gdn = model.get("linear")
    if gdn:
        keys, values = gdn["key_heads"] * gdn["key_dim"], gdn["value_heads"] * gdn["value_dim"]
        layers += [
            (
                "linear_attn.in_proj_qkv",
                lambda: linear.MergedColumnParallelLinear(hidden, [keys, keys, values], **common),
            ),
            ("linear_attn.in_proj_z", lambda: linear.ColumnParallelLinear(hidden, values, **common)),
            ("linear_attn.out_proj", lambda: linear.RowParallelLinear(values, hidden, **common)),
        ]
    return layers


def check_tensor_parallel(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create one decoder layer's block-FP8 linears on `tp` ranks with vLLM's own layers and FP8 method.

    vLLM checks at weight creation (`validate_fp8_block_shape`) that every rank's slice is whole blocks. The
    weights go to the meta device (no memory), the tensor-parallel group is a stand-in answering its size and rank
    0, and the GPU kernel choice after the check is skipped (this CPU has no FP8 matmul kernel).
    """
    import torch
    import vllm.distributed.parallel_state as parallel_state
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.config import VllmConfig, set_current_vllm_config

    fp8.init_fp8_linear_kernel = lambda **_: None
    config = VllmConfig()
    # Fp8LinearMethod reads the activation dtype from the model config; a served model would be bf16.
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.bfloat16))
    results = []
    for item in items:
        try:
            quant_config = fp8.Fp8Config.from_config(item["quantization_config"])
        except Exception as exc:
            results.append({"name": item["name"], "ok": False, "error": f"quantization_config: {_one_line(exc)}"})
            continue
        parallel_state._TP = types.SimpleNamespace(world_size=item["tp"], rank_in_group=0)
        refused = []
        with set_current_vllm_config(config), torch.device("meta"):
            for prefix, make in _decoder_layers(item["model"], quant_config):
                try:
                    make()
                except (ValueError, AssertionError) as exc:
                    refused.append(f"{prefix}: {_one_line(exc)}")
        results.append({"name": item["name"], "ok": not refused, "error": "; ".join(refused) or None})
    parallel_state._TP = None
    return results


CHECKS = {
    "requests": check_requests,
    "serve_argv": check_serve_argv,
    "quantization_configs": check_quantization_configs,
    "tensor_parallel": check_tensor_parallel,
}


def main() -> int:
    document = json.loads(sys.stdin.read())
    import vllm

    out: dict[str, Any] = {"versions": {"vllm": vllm.__version__}}
    # vLLM logs to stdout in places; keep stdout for the one JSON answer.
    with contextlib.redirect_stdout(sys.stderr):
        for key, check in CHECKS.items():
            if key in document:
                out[key] = check(document[key])
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
