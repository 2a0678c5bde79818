"""Stand-in for the LLM *policy* in tests: a scripted OpenAI-compatible server (not a model, never shipped).

It answers qwen-code's orchestrator and subagents with a scripted plan (reasoning, text, fragmented tool calls,
a subagent launch, a final answer), the RHI optimizer with a valid design JSON, and pairwise judges with a verdict;
it can also inject faults (503, connection reset, cut or stalled streams, unlisted model, broken JSON) by rule.
Run it in-process (`PolicyServer`, optionally on an `EventLoopThread`) or as a subprocess:
`python -m tests.policy_server --port 0 --port-file F [--model NAME] [--latency S] [--capacity N] [--fault SPEC]`.
"""

from tests.policy_server.background import EventLoopThread
from tests.policy_server.faults import Fault, FaultRule, FaultSpecError
from tests.policy_server.policies import (
    WORKFLOW_START_MARKER,
    ChatRequest,
    Policy,
    PolicyReply,
    RequestKind,
    ResearchTeamPolicy,
    ToolCall,
    classify_request,
)
from tests.policy_server.server import PolicyServer, PolicyServerConfig, estimate_tokens

__all__ = [
    "WORKFLOW_START_MARKER",
    "ChatRequest",
    "EventLoopThread",
    "Fault",
    "FaultRule",
    "FaultSpecError",
    "Policy",
    "PolicyReply",
    "PolicyServer",
    "PolicyServerConfig",
    "RequestKind",
    "ResearchTeamPolicy",
    "ToolCall",
    "classify_request",
    "estimate_tokens",
]
