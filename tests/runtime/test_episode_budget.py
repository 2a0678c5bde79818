"""An episode's budget: what a response's usage counts for, and what an unreported one is charged."""

from __future__ import annotations

import json

from mass_ops.runtime.episode_budget import EpisodeBudget, usage_tokens
from mass_ops.runtime.sse import assemble_sse


def test_responses_usage_is_read_from_its_events_and_its_fields() -> None:
    event = {"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 7}}}
    usage = assemble_sse(f"data: {json.dumps(event)}\n\n")["usage"]
    assert usage_tokens(usage) == (12, None)
    assert usage_tokens({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 9})[0] == 9


def test_a_request_whose_usage_is_unreported_is_charged_its_whole_need() -> None:
    budget = EpisodeBudget(episode_tokens=1000, default_max_tokens=10)
    for generated in (True, False):
        assert budget.admit(300) is None
        budget.settle(300, None, server_may_have_generated=generated)
    assert (budget.spent, budget.in_flight) == (300, 0), "charged when the server may have generated, else not"
