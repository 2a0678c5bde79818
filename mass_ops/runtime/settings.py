"""qwen-code's `settings.json` for one episode, generated from the cycle config (MASS_SPEC §4).

The file lives in the episode's own QWEN_HOME and is published with its artifacts. It never holds a secret: the
provider's `envKey` names `AGENT_TOKEN_ENV`, the episode's random proxy token, and the logging proxy adds the real
key upstream. Sampling per backend: vLLM gets the reference's sampling params, the episode seed and
`enable_thinking`; OpenRouter `reasoning.effort` and `max_tokens` only; another OpenAI-compatible server the vLLM set
minus `top_k` and `repetition_penalty` (a strict server refuses them). The settings shape: docs/runtime.md
(`mass_ops.runtime.settings`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.errors import InputError

SETTINGS_FILE = "settings.json"
# The variable the agent reads its credential from: the per-episode proxy token, never the inference key.
AGENT_TOKEN_ENV = "MASS_EPISODE_TOKEN"
SETTINGS_SCHEMA_VERSION = 4
VLLM_SAMPLING_EXTENSIONS = ("top_k", "repetition_penalty")


class SettingsError(InputError):
    """The settings cannot be generated (bad client endpoint) or written."""


def qwen_settings(config: CycleConfig, *, client_base_url: str, seed: int) -> dict[str, Any]:
    """Settings for one episode whose agent reaches the model at `client_base_url` (the logging proxy, with `/v1`)."""
    if not client_base_url.startswith(("http://", "https://")):
        raise SettingsError(f"settings: client endpoint {client_base_url!r} must be an http(s) URL")
    inference, runtime = config.inference, config.runtime
    if inference.backend == "openrouter":
        extra_body: dict[str, Any] = {"reasoning": {"effort": inference.reasoning_effort}}
        sampling: dict[str, Any] = {"max_tokens": inference.episode_max_output_tokens}
    else:
        s = inference.sampling
        extra_body = {"chat_template_kwargs": {"enable_thinking": s.enable_thinking}}
        sampling = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "presence_penalty": s.presence_penalty,
            "repetition_penalty": s.repetition_penalty,
            "max_tokens": inference.episode_max_output_tokens,
            "seed": seed,
        }
        if inference.backend != "vllm":
            for extension in VLLM_SAMPLING_EXTENSIONS:
                del sampling[extension]
    provider = {
        "id": config.models.served_name,
        "envKey": AGENT_TOKEN_ENV,  # the token's variable (a NAME): the key itself stays with the proxy
        "baseUrl": client_base_url,
        "generationConfig": {
            "timeout": runtime.http_response_timeout_ms,
            # Transport retries inside the agent would hide infrastructure failures from the runner, which retries
            # whole episodes as new attempts instead (qwen-code still has its own backoff loop on 5xx; see outcome).
            "maxRetries": 0,
            "contextWindowSize": inference.context_window_tokens,
            "extra_body": extra_body,
            "samplingParams": sampling,
        },
    }
    return {
        "$version": SETTINGS_SCHEMA_VERSION,
        "modelProviders": {"openai": [provider]},
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": config.models.served_name},
        "tools": {
            "shell": {"defaultTimeoutMs": runtime.shell_timeout_ms},
            # Desktop automation downloads a native driver from the internet on first use: an episode sandbox has
            # no display and no egress beyond the model server, so the tools could only fail.
            "computerUse": {"enabled": False},
        },
        "telemetry": {"enabled": False},
        # Operational switches that do not change what the model sees: no usage statistics or update checks
        # (egress), and no `systemd-inhibit` helper process that would outlive the agent.
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"enableAutoUpdate": False, "preventSystemSleep": False},
    }


def write_settings(path: Path, settings: dict[str, Any]) -> Path:
    """Write `settings` to `path` atomically (temp file beside it, then rename), readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path
