"""`MessagesClient` (Anthropic's Messages API) on a plain `LLMEndpoint`: the key it needs, the usage it records.
Its requests, retries and records as a report judge are pinned in tests/evaluation/test_external_clients.py."""

from __future__ import annotations

import pytest

from mass_ops.llm import LLMConfigError, LLMEndpoint, MessagesClient
from mass_ops.llm.messages import messages_usage
from tests.evaluation.fakes import AnthropicStandIn, verdict_text

KEY_ENV = "MASS_TEST_MESSAGES_KEY"


def _client(stand_in: AnthropicStandIn) -> MessagesClient:
    endpoint = LLMEndpoint(base_url="http://a.test", model="claude-m", api_key_env=KEY_ENV, backend="anthropic")
    return MessagesClient(endpoint, effort="max", http_client=stand_in.client())


def test_a_hosted_endpoint_needs_a_real_key_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    stand_in = AnthropicStandIn(lambda body: verdict_text("A"))
    client = _client(stand_in)
    with pytest.raises(LLMConfigError, match=f"{KEY_ENV} is empty or unset"):
        client.chat("s", "u", purpose="external_judge")
    assert stand_in.bodies == []
    monkeypatch.setenv(KEY_ENV, "sk-ant-test")
    result = client.chat("s", "u", purpose="external_judge", json_mode="json_object")
    client.close()
    assert result.parsed_json == {"winner": "A", "rationale": "Workspace A has the more complete deliverables."}
    assert stand_in.bodies[0]["output_config"] == {"effort": "max"} and repr(client).startswith("MessagesClient(")


def test_cache_reads_and_writes_count_as_prompt_tokens() -> None:
    usage = {"input_tokens": 10, "cache_read_input_tokens": 5, "cache_creation_input_tokens": None, "output_tokens": 7}
    assert messages_usage(usage) == {**usage, "prompt_tokens": 15, "completion_tokens": 7, "total_tokens": 22}
