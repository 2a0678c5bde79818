"""qwen-code settings.json generation (MASS_SPEC §4): provider entry, key by name, limits, sampling, telemetry."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from mass_ops.config import load_config
from mass_ops.runtime.settings import SettingsError, qwen_settings, write_settings

CLIENT = "http://127.0.0.1:45678/v1"


def test_paper_preset_settings_match_the_reference() -> None:
    config = load_config("paper")
    settings = qwen_settings(config, client_base_url=CLIENT, seed=450051)

    assert settings["$version"] == 4
    [provider] = settings["modelProviders"]["openai"]
    assert provider["id"] == settings["model"]["name"] == "Qwen/Qwen3.6-27B-FP8"
    assert provider["envKey"] == "MASS_EPISODE_TOKEN"  # the NAME of the token's variable, never the key's
    assert provider["baseUrl"] == CLIENT
    generation = provider["generationConfig"]
    assert generation["timeout"] == 1800000 and generation["maxRetries"] == 0
    assert generation["contextWindowSize"] == 262144
    assert generation["extra_body"] == {"chat_template_kwargs": {"enable_thinking": True}}
    assert generation["samplingParams"] == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 32768,
        "seed": 450051,
    }
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["tools"]["shell"]["defaultTimeoutMs"] == 600000
    assert settings["telemetry"] == {"enabled": False}
    assert settings["privacy"]["usageStatisticsEnabled"] is False


def test_config_knobs_reach_the_settings() -> None:
    config = load_config(
        "demo",
        [
            "runtime.http_response_timeout_ms=12345",
            "runtime.shell_timeout_ms=6789",
            "inference.sampling.enable_thinking=false",
            "inference.sampling.temperature=0.1",
            "inference.episode_max_output_tokens=300",
        ],
    )
    settings = qwen_settings(config, client_base_url=CLIENT, seed=3)
    generation = settings["modelProviders"]["openai"][0]["generationConfig"]
    assert generation["timeout"] == 12345
    assert settings["tools"]["shell"]["defaultTimeoutMs"] == 6789
    assert generation["extra_body"]["chat_template_kwargs"]["enable_thinking"] is False
    assert generation["samplingParams"]["temperature"] == 0.1
    assert generation["samplingParams"]["max_tokens"] == 300
    assert generation["samplingParams"]["seed"] == 3
    assert settings["modelProviders"]["openai"][0]["envKey"] == "MASS_EPISODE_TOKEN"


def test_other_openai_compatible_servers_get_no_vllm_extensions() -> None:
    config = load_config("demo")  # backend openai-compatible: `transformers serve`
    sampling = qwen_settings(config, client_base_url=CLIENT, seed=4)["modelProviders"]["openai"][0]
    params = sampling["generationConfig"]["samplingParams"]
    assert set(params) == {"temperature", "top_p", "presence_penalty", "max_tokens", "seed"}
    vllm = qwen_settings(load_config("demo", ["inference.backend=vllm"]), client_base_url=CLIENT, seed=4)
    assert {"top_k", "repetition_penalty"} <= set(
        vllm["modelProviders"]["openai"][0]["generationConfig"]["samplingParams"]
    )


def test_openrouter_gets_reasoning_effort_and_max_tokens_only() -> None:
    config = load_config(
        "paper",
        [
            "inference.backend=openrouter",
            "inference.endpoint=https://openrouter.ai/api/v1",
            "inference.api_key_env=OPENROUTER_API_KEY",
            "inference.reasoning_effort=high",
            "inference.context_window_tokens=131072",
            "inference.episode_max_output_tokens=8192",
            "inference.max_output_tokens=8192",
            "models.served_name=openai/gpt-oss-120b:nitro",
        ],
    )
    generation = qwen_settings(config, client_base_url=CLIENT, seed=9)["modelProviders"]["openai"][0]
    assert generation["id"] == "openai/gpt-oss-120b:nitro"  # requests keep the full id
    assert generation["envKey"] == "MASS_EPISODE_TOKEN"  # the proxy holds OPENROUTER_API_KEY
    assert generation["generationConfig"]["extra_body"] == {"reasoning": {"effort": "high"}}
    assert generation["generationConfig"]["samplingParams"] == {"max_tokens": 8192}


def test_settings_never_hold_a_key_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "sk-should-never-appear-1234")
    text = json.dumps(qwen_settings(load_config("paper"), client_base_url=CLIENT, seed=1))
    assert "sk-should-never-appear" not in text
    # The agent reads its credential from the per-episode token variable; the key's variable is not even named.
    assert '"envKey": "MASS_EPISODE_TOKEN"' in text and "VLLM_API_KEY" not in text


def test_bad_client_endpoint_is_refused() -> None:
    with pytest.raises(SettingsError, match="must be an http"):
        qwen_settings(load_config("demo"), client_base_url="127.0.0.1:9/v1", seed=1)


def test_write_settings_is_atomic_and_private(tmp_path: Path) -> None:
    target = tmp_path / "home" / ".qwen" / "settings.json"
    settings = qwen_settings(load_config("demo"), client_base_url=CLIENT, seed=5)
    write_settings(target, settings)
    assert json.loads(target.read_text()) == settings
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["settings.json"]  # no temp file left behind
