"""vLLM's own code checks the production contract: the bodies we send, the serve flags we pass, the FP8 export.

The project's side (bodies, argv, export, preflight) is built here in .venv with the real project code; the vLLM side
runs once per session in `.venv-vllm` (vLLM 0.33.0's CPU wheel, created by scripts/vllm_contract_env.sh, which
scripts/test.sh runs) on tests/contract/vllm_checks.py, fed one JSON document. A missing environment fails the
tests with the command that creates it: CI runs scripts/test.sh, so a skip would only hide a broken contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mass_ops.compute import kubernetes as specs
from mass_ops.config import load_config
from mass_ops.critical_path import server_priority
from mass_ops.export import export_fp8
from mass_ops.export.fp8 import BLOCK, auto_quantizable, fp8_quantization_config
from mass_ops.export.safetensors_io import TensorEntry
from mass_ops.export.tensor_parallel import split_problems
from mass_ops.llm.calls import in_loop_sampling
from mass_ops.llm.request import _wire_body, chat_request
from mass_ops.llm.settings import LLMEndpoint
from mass_ops.runtime.proxy import CHAT_ROUTE, COMPLETIONS_ROUTE, RESPONSES_ROUTE, LoggingProxy, prepare_generation
from mass_ops.runtime.qwen_install import default_runtime_dir, ensure_qwen_code
from mass_ops.runtime.settings import AGENT_TOKEN_ENV, qwen_settings
from tests.compute.test_kubernetes_specs import GPU_VALUES, chart_settings_dir, cluster_config
from tests.deploy.chart_render import REPO_ROOT
from tests.policy_server import PolicyServer, PolicyServerConfig
from tests.support.export import qwen3_model, save_checkpoint

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
CHECKER = Path(__file__).with_name("vllm_checks.py")
SERVE_SH = REPO_ROOT / "docker" / "inference" / "serve.sh"
CHECK_TIMEOUT_S = 300
AGENT_TIMEOUT_S = 240
AGENT_PRIORITY = 13  # a rollout's place on the paper's critical path
TP_SIZES = (1, 2, 4, 8)
# Decoder shapes of the released models (config.json): Qwen3-4B, and Qwen3.6-27B's hybrid layers (gated attention
# with 256-wide heads, Gated DeltaNet linear attention).
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-4b": {"hidden": 2560, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 9728},
    "qwen3.6-27b": {
        "hidden": 5120,
        "heads": 24,
        "kv_heads": 4,
        "head_dim": 256,
        "intermediate": 17408,
        "attn_output_gate": True,
        "linear": {"key_heads": 16, "value_heads": 48, "key_dim": 128, "value_dim": 128},
    },
    # The export tests' tiny checkpoint: its 384-wide MLP splits into partial blocks on 2 ranks.
    "tiny": {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 384},
}


# --- the project's side -------------------------------------------------------------------------------------------


def vllm_endpoint(config) -> LLMEndpoint:
    return LLMEndpoint(base_url="http://vllm.test:8001/v1", model=config.models.served_name, backend="vllm")


def in_loop_bodies(preset: str) -> dict[str, dict[str, Any]]:
    """Judge, optimizer and evaluation chat bodies as `LLMClient` sends them to a vLLM server (extra_body merged),
    under the preset's own scheduling and under priority scheduling (where the stages add `priority`)."""
    config = load_config(preset, [])
    by_priority = load_config(preset, ["inference.server.scheduling_policy=priority"])
    endpoint = vllm_endpoint(config)
    schema = {"title": "verdict", "type": "object", "properties": {"winner": {"type": "string"}}}
    ranking, search = server_priority(by_priority, "ranking"), server_priority(by_priority, "search", 3)
    cases = {
        "judge": (in_loop_sampling(config, 7), "json_object", None),
        "judge-priority": (in_loop_sampling(by_priority, 7, priority=ranking), "json_object", None),
        "optimizer": (in_loop_sampling(config, 11, priority=server_priority(config, "search", 3)), "json_object", None),
        "optimizer-priority": (in_loop_sampling(by_priority, 11, priority=search), "json_object", None),
        "optimizer-schema": (in_loop_sampling(by_priority, 11, priority=search), "json_schema", schema),
        "self-judge-text": (in_loop_sampling(config, 13), None, None),
    }
    return {
        name: _wire_body(chat_request(endpoint, "You are a judge.", "Which is better?", sampling, mode, shape))
        for name, (sampling, mode, shape) in cases.items()
    }


def agent_chat_body(config) -> dict[str, Any]:
    """A qwen-code request mid-episode: its settings' sampling, streamed, with tools and a tool-call turn."""
    settings = qwen_settings(config, client_base_url="http://127.0.0.1:9/v1", seed=450051)
    [provider] = settings["modelProviders"]["openai"]
    generation = provider["generationConfig"]
    tool = {
        "type": "function",
        "function": {
            "name": "run_shell_command",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'},
    }
    return {
        "model": provider["id"],
        "messages": [
            {"role": "system", "content": "You are Qwen Code, an interactive CLI agent."},
            {"role": "user", "content": "Fix the failing test."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "tests\nsrc\n"},
        ],
        "tools": [tool],
        "tool_choice": "auto",
        "stream": True,
        **generation["samplingParams"],
        **generation["extra_body"],
    }


def proxied(route: str, body: dict[str, Any], priority: int) -> dict[str, Any]:
    """The body as the episode proxy forwards it: budget cap added where missing, `priority` stamped."""
    forwarded = prepare_generation(route, json.dumps(body).encode(), default_max_tokens=4096, priority=priority)
    return json.loads(forwarded.body)


def qwen_code_available() -> bool:
    """Whether real qwen-code can run here (installed, or installable with npm), as the qwen-code smoke test asks."""
    return shutil.which("npm") is not None or (default_runtime_dir() / "qwen").exists()


def real_qwen_code_requests(tmp_path: Path, config) -> list[dict[str, Any]]:
    """The chat bodies real qwen-code sends in one episode on the project's settings.json, as they reach the server
    through the episode proxy (which stamps `priority`): what a priority-scheduling vLLM receives from an agent."""
    install = ensure_qwen_code()
    workspace, qwen_home = tmp_path / "workspace", tmp_path / "qwen_home"
    workspace.mkdir()
    qwen_home.mkdir()
    token = "contract-test-token"
    served = config.models.served_name

    async def episode() -> list[dict[str, Any]]:
        async with (
            PolicyServer(PolicyServerConfig(models=(served,))) as server,
            LoggingProxy(
                server.base_url, tmp_path / "requests.jsonl", agent_token=token, request_priority=AGENT_PRIORITY
            ) as proxy,
        ):
            settings = qwen_settings(config, client_base_url=f"{proxy.url}/v1", seed=450051)
            (qwen_home / "settings.json").write_text(json.dumps(settings))
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(tmp_path),
                "QWEN_HOME": str(qwen_home),
                AGENT_TOKEN_ENV: token,
                "QWEN_TELEMETRY_ENABLED": "false",
                "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
                "NO_PROXY": "127.0.0.1,localhost",
            }
            process = await asyncio.create_subprocess_exec(
                *install.argv("--model", served, "--approval-mode", "yolo", "--output-format", "stream-json"),
                cwd=workspace,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            prompt = b"Produce research_report.md and results/metrics.json for the task.\n"
            _, stderr = await asyncio.wait_for(process.communicate(prompt), timeout=AGENT_TIMEOUT_S)
            assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
            return list(server.requests)

    return asyncio.run(episode())


def request_cases() -> list[dict[str, Any]]:
    cases = []
    for preset in ("paper", "cycle2"):
        config = load_config(preset, [])
        for name, body in in_loop_bodies(preset).items():
            cases.append({"name": f"{preset}/{name}", "route": "chat", "body": body})
        agent = agent_chat_body(config)
        cases.append(
            {"name": f"{preset}/agent-chat", "route": "chat", "body": proxied(CHAT_ROUTE, agent, AGENT_PRIORITY)}
        )
    model = load_config("paper", []).models.served_name
    completion = {"model": model, "prompt": "def add(a, b):", "max_tokens": 64, "stream": True}
    cases.append(
        {"name": "agent-completions", "route": "completions", "body": proxied(COMPLETIONS_ROUTE, completion, 5)}
    )
    responses = {"model": model, "input": "Summarise the repository.", "stream": False}
    cases.append({"name": "agent-responses", "route": "responses", "body": proxied(RESPONSES_ROUTE, responses, 5)})
    return cases


SERVE_VARIANTS = {
    "paper": ("paper", []),
    "paper-priority": ("paper", ["inference.server.scheduling_policy=priority"]),
    "paper-tp4": ("paper", ["inference.server.gpus=4", "inference.server.scheduling_policy=priority"]),
    "paper-tp2-of-4": ("paper", ["inference.server.gpus=4", "inference.tensor_parallel_size=2"]),
    "cycle2": ("cycle2", []),
    "cycle2-priority": ("cycle2", ["inference.server.scheduling_policy=priority"]),
}


def serve_argvs(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """For each variant: the deployment's MASS_SERVE_* env, and the argv serve.sh execs `vllm` with for it."""
    chart_dir = chart_settings_dir(tmp_path, GPU_VALUES)
    settings = specs.load_workload_settings(chart_dir)
    recorder = tmp_path / "bin" / "vllm"
    recorder.parent.mkdir()
    # A stand-in `vllm` on PATH that records its argv instead of serving.
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    recorder.chmod(0o755)
    out = {}
    for name, (preset, overrides) in SERVE_VARIANTS.items():
        config = cluster_config(chart_dir, preset, *overrides)
        deployment = specs.inference_deployment(config, settings, specs.current_serving_target(config), scope="c")
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"].startswith("MASS_SERVE_")}
        run = subprocess.run(
            ["bash", str(SERVE_SH)],
            env={"PATH": f"{recorder.parent}:{os.environ['PATH']}", **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        argv = json.loads(run.stdout)
        assert argv[0] == "serve", argv
        out[name] = {"env": env, "argv": argv[1:], "config": config}
    return out


def tp_shapes(model: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The [out, in] shapes of one decoder layer's weights that the FP8 export quantizes (checkpoint names)."""
    hidden, heads, kv, dim = model["hidden"], model["heads"], model["kv_heads"], model["head_dim"]
    q_rows = heads * dim * (2 if model.get("attn_output_gate") else 1)
    shapes = {
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv * dim, hidden),
        "self_attn.v_proj": (kv * dim, hidden),
        "self_attn.o_proj": (hidden, heads * dim),
        "mlp.gate_proj": (model["intermediate"], hidden),
        "mlp.up_proj": (model["intermediate"], hidden),
        "mlp.down_proj": (hidden, model["intermediate"]),
    }
    if gdn := model.get("linear"):
        keys, values = gdn["key_heads"] * gdn["key_dim"], gdn["value_heads"] * gdn["value_dim"]
        shapes |= {
            "linear_attn.in_proj_qkv": (2 * keys + values, hidden),
            "linear_attn.in_proj_z": (values, hidden),
            "linear_attn.in_proj_b": (gdn["value_heads"], hidden),
            "linear_attn.in_proj_a": (gdn["value_heads"], hidden),
            "linear_attn.out_proj": (hidden, values),
        }
    named = {f"model.layers.0.{module}.weight": shape for module, shape in shapes.items()}
    entries = {name: TensorEntry(name, "BF16", shape, 0, 0) for name, shape in named.items()}
    return {name: shape for name, shape in named.items() if auto_quantizable(entries[name], BLOCK)}


# --- one vLLM run for the session ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def contract(tmp_path_factory) -> dict[str, Any]:
    """Everything the project sends or writes, and vLLM's verdict on each (one subprocess)."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/vllm_contract_env.sh (scripts/test.sh does)", False)
    work = tmp_path_factory.mktemp("fp8")
    export_dir = work / "out"
    export_fp8(save_checkpoint(qwen3_model(), work / "bf16", torch.bfloat16), export_dir)
    exported = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    requests = request_cases()
    if qwen_code_available():
        agent = real_qwen_code_requests(tmp_path_factory.mktemp("qwen"), load_config("paper", []))
        requests += [{"name": f"qwen-code/{i}", "route": "chat", "body": body} for i, body in enumerate(agent)]
    serve = serve_argvs(tmp_path_factory.mktemp("serve"))
    tp_cases = [
        {"name": f"{model}/tp{tp}", "tp": tp, "model": MODELS[model], "quantization_config": exported}
        for model in MODELS
        for tp in TP_SIZES
    ]
    document = {
        "requests": requests,
        "serve_argv": [{"name": name, "argv": item["argv"]} for name, item in serve.items()],
        "quantization_configs": [
            {"name": "export", "config": exported},
            {"name": "default", "config": fp8_quantization_config(["lm_head", "model.embed_tokens"])},
        ],
        "tensor_parallel": tp_cases,
    }
    run = subprocess.run(
        [str(VLLM_PYTHON), str(CHECKER)],
        input=json.dumps(document),
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
        cwd=REPO_ROOT,
    )
    if run.returncode != 0:
        pytest.fail(f"vllm_checks.py exited {run.returncode}: {run.stderr.strip().splitlines()[-1:]}", False)
    verdicts = json.loads(run.stdout)
    assert verdicts["versions"]["vllm"] == "0.33.0"
    return {"sent": document, "serve": serve, "exported": exported, "vllm": verdicts}


def by_name(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in results}


def refused(results: list[dict[str, Any]]) -> dict[str, str]:
    return {r["name"]: r["error"] for r in results if not r["ok"]}


# --- (a) request bodies -------------------------------------------------------------------------------------------


def test_every_request_body_we_send_validates_against_vllm_s_request_models(contract):
    results = contract["vllm"]["requests"]
    assert len(results) == len(contract["sent"]["requests"]) >= 14
    assert refused(results) == {}
    assert {r["name"]: r["ignored"] for r in results if r["ignored"]} == {}, "fields vLLM drops without a word"


def test_priority_reaches_vllm_as_the_proxy_and_the_stages_set_it(contract):
    results = by_name(contract["vllm"]["requests"])
    by_priority = load_config("paper", ["inference.server.scheduling_policy=priority"])
    assert results["paper/agent-chat"]["priority"] == AGENT_PRIORITY
    assert results["agent-completions"]["priority"] == 5 and results["agent-responses"]["priority"] == 5
    assert results["paper/optimizer-priority"]["priority"] == server_priority(by_priority, "search", 3) == 3
    assert results["paper/judge-priority"]["priority"] == server_priority(by_priority, "ranking") > 3
    # Under first-come-first-served the stages send no priority at all: vLLM reads its default.
    assert results["paper/judge"]["priority"] == results["paper/optimizer"]["priority"] == 0
    sent = {case["name"]: case["body"] for case in contract["sent"]["requests"]}
    assert "priority" not in sent["paper/judge"] and "priority" not in sent["paper/optimizer"]


def test_real_qwen_code_requests_stamped_by_the_proxy_validate_with_their_priority(contract):
    if not qwen_code_available():
        pytest.skip("npm is not installed and no qwen-code runtime is cached (as the qwen-code smoke test)")
    agent = {r["name"]: r for r in contract["vllm"]["requests"] if r["name"].startswith("qwen-code/")}
    sent = {r["name"]: r["body"] for r in contract["sent"]["requests"] if r["name"] in agent}
    assert len(agent) >= 4, "an episode makes several requests (orchestrator and subagents)"
    assert all(body.get("tools") and body.get("stream") is True for body in sent.values())
    assert {name: r["priority"] for name, r in agent.items()} == dict.fromkeys(agent, AGENT_PRIORITY)
    assert all(r["ok"] and not r["ignored"] for r in agent.values())


# --- (b) serve arguments ------------------------------------------------------------------------------------------


def test_serve_sh_arguments_from_the_deployment_parse_with_vllm_s_own_parser(contract):
    results = by_name(contract["vllm"]["serve_argv"])
    assert refused(contract["vllm"]["serve_argv"]) == {}
    for name, item in contract["serve"].items():
        parsed, config = results[name]["parsed"], item["config"]
        assert parsed["model"] == item["env"]["MASS_SERVE_MODEL"], name
        assert parsed["served_model_name"] == [item["env"]["MASS_SERVE_NAME"]], name
        assert parsed["scheduling_policy"] == config.inference.server.scheduling_policy, name
        expected_tp = int(item["env"].get("MASS_SERVE_TENSOR_PARALLEL_SIZE", "1"))
        assert parsed["tensor_parallel_size"] == expected_tp, name
    assert results["paper-tp4"]["parsed"]["tensor_parallel_size"] == 4
    assert results["paper-tp4"]["parsed"]["scheduling_policy"] == "priority"
    assert results["paper-tp2-of-4"]["parsed"]["tensor_parallel_size"] == 2


# --- (c) FP8 export -----------------------------------------------------------------------------------------------


def test_the_fp8_export_s_quantization_config_is_read_by_vllm_as_written(contract):
    results = by_name(contract["vllm"]["quantization_configs"])
    assert refused(contract["vllm"]["quantization_configs"]) == {}
    read = results["export"]["read"]
    assert read["weight_block_size"] == list(BLOCK) and read["activation_scheme"] == "dynamic"
    assert read["checkpoint_is_fp8_serialized"] is True
    assert read["ignored_layers"] == contract["exported"]["modules_to_not_convert"]


def test_the_tensor_parallel_preflight_agrees_with_vllm_s_weight_creation(contract):
    """Per model and size, the preflight refuses exactly when vLLM's block-FP8 layers refuse to be created.

    Per layer the preflight is the stricter of the two: vLLM 0.33 lets a merged column-parallel layer (qkv_proj,
    gate_up_proj) hold partial blocks, and refuses only on a row-parallel input split; the preflight also refuses a
    column split of partial blocks. Whenever vLLM refuses, the preflight has refused too.
    """
    results = by_name(contract["vllm"]["tensor_parallel"])
    verdicts = {}
    for model, shape in MODELS.items():
        for tp in TP_SIZES:
            ours = split_problems(tp_shapes(shape), tp, kv_heads=shape["kv_heads"])
            theirs = results[f"{model}/tp{tp}"]
            verdicts[f"{model}/tp{tp}"] = (not ours, theirs["ok"])
            assert (not ours) == theirs["ok"], (model, tp, [p.describe() for p in ours], theirs["error"])
    # The facts behind the agreement, so that a change on either side shows here.
    assert all(verdicts[f"qwen3.6-27b/tp{tp}"] == (True, True) for tp in TP_SIZES)
    assert [verdicts[f"qwen3-4b/tp{tp}"][1] for tp in TP_SIZES] == [True, True, True, False]  # 9728 / 8 = 1216
    assert [verdicts[f"tiny/tp{tp}"][1] for tp in TP_SIZES] == [True, False, False, False]
    assert "down_proj" in results["qwen3-4b/tp8"]["error"]
