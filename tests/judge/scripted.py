"""Test helpers for judge-output failures: a cycle with its `judge` section overridden, and a judge that answers
some requests with text that is not JSON (a stand-in for a model that writes prose instead of a verdict)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mass_ops.config import validate_config
from tests.inner_loop_fakes import FakeExecutor, InnerLoopEnv, OpenCycle, fast_client, open_test_cycle
from tests.policy_server import ChatRequest, PolicyReply, RequestKind

NOT_A_VERDICT = "Both workspaces are fine; I would rather not pick one."


def open_judged_cycle(inner_loop: InnerLoopEnv, judge: dict[str, Any], **overrides: Any) -> OpenCycle:
    """`inner_loop.open(**overrides)` with the config's `judge` section updated by `judge` (the shared config
    builder only updates the `search` section)."""
    data = inner_loop.config(**overrides).model_dump(mode="json")
    data["judge"].update(judge)
    config = validate_config(data)
    ctx = open_test_cycle(config)
    client = fast_client(config)
    inner_loop.clients.append(client)
    return OpenCycle(config, ctx, FakeExecutor(ctx), client)


def break_judge(inner_loop: InnerLoopEnv, broken: Callable[[ChatRequest], bool]) -> Callable[[], None]:
    """Make the policy answer judge requests for which `broken(request)` holds with prose instead of JSON; returns
    the function that fixes the judge again."""
    policy = inner_loop.policy
    original = policy.respond

    def respond(request: ChatRequest) -> PolicyReply:
        if request.kind is RequestKind.JUDGE and broken(request):
            return PolicyReply(content=NOT_A_VERDICT)
        return original(request)

    policy.respond = respond  # type: ignore[method-assign]

    def fix() -> None:
        policy.respond = original  # type: ignore[method-assign]

    return fix
