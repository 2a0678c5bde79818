"""Scripted policies: what the stand-in model answers, decided from the request alone (stateless, deterministic).

`classify_request` recognises who is asking from the system prompt; `ResearchTeamPolicy` answers each kind the way
a cooperative model would, with tool names and argument schemas exactly as qwen-code 0.21.10 declares them
(`write_file{file_path, content}`, `run_shell_command{command, description}`, `agent{description, prompt,
subagent_type, run_in_background}`), verified against the `tools` array of a real qwen-code request.

The next step of a scripted agent is chosen from the number of tool results already in the conversation, so the
policy needs no server-side session state and works with real qwen-code, retries and concurrent episodes alike.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

WORKFLOW_START_MARKER = "Create an agent team with following agent candidates to solve this problem:"
SUBAGENT_TARGET_TAG = "TARGET_FILE:"

_CWD_PATTERN = re.compile(r"I'm currently working in the directory: (\S+)")
_VERSION_PATTERN = re.compile(r"# Current multi agent design \(v(\d+)\)")
_JUDGE_PERSONA = re.compile(r"senior (?:[\w-]+ )*researcher|senior research reviewer", re.IGNORECASE)


class RequestKind(StrEnum):
    """Who sent a chat-completion request, as told by its system prompt."""

    ORCHESTRATOR = "orchestrator"  # qwen-code's main agent ("You are Qwen Code, …")
    SUBAGENT = "subagent"  # a subagent launched through qwen-code's `agent` tool
    OPTIMIZER = "optimizer"  # the RHI optimizer ("principal prompt engineer …")
    JUDGE = "judge"  # pairwise judge / self-judge ("senior … researcher", "senior research reviewer")
    AUXILIARY = "auxiliary"  # qwen-code housekeeping (memory extraction, titles, …) and anything else


def message_text(message: dict[str, Any]) -> str:
    """Plain text of a message whose content is a string or a list of `{type: text, text}` parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def system_prompt(body: dict[str, Any]) -> str:
    return "\n".join(message_text(m) for m in body.get("messages") or [] if m.get("role") in ("system", "developer"))


def classify_request(body: dict[str, Any]) -> RequestKind:
    """Kind of a chat-completion request body, from its system prompt."""
    system = system_prompt(body)
    head = system.lstrip()[:400]
    if head.startswith("You are Qwen Code"):
        return RequestKind.ORCHESTRATOR
    if "principal prompt engineer" in head:
        return RequestKind.OPTIMIZER
    if _JUDGE_PERSONA.search(head):
        return RequestKind.JUDGE
    if "subagent" in head and "memory" not in head:
        return RequestKind.SUBAGENT
    return RequestKind.AUXILIARY


@dataclass(frozen=True)
class ToolCall:
    """One function call the policy wants to make; the server serialises and fragments the arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class PolicyReply:
    """One assistant turn: optional reasoning, text and tool calls."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None  # None = "tool_calls" when there are calls, else "stop"

    @property
    def effective_finish_reason(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat-completion request as the policy sees it."""

    body: dict[str, Any]
    kind: RequestKind

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    @property
    def seed(self) -> int | None:
        seed = self.body.get("seed")
        return seed if isinstance(seed, int) else None

    @property
    def tool_results(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "tool")

    @property
    def wants_json(self) -> bool:
        return (self.body.get("response_format") or {}).get("type") in ("json_object", "json_schema")

    def user_text(self) -> str:
        return "\n".join(message_text(m) for m in self.messages if m.get("role") == "user")

    def working_directory(self) -> str | None:
        """The agent's cwd as qwen-code announces it in its environment context."""
        for message in self.messages:
            found = _CWD_PATTERN.search(message_text(message))
            if found:
                return found.group(1)
        return None


class Policy(Protocol):
    """Anything that turns a request into a reply."""

    def respond(self, request: ChatRequest) -> PolicyReply: ...


def stable_digest(*parts: object) -> int:
    """Deterministic 64-bit number from the parts (Python's hash() is salted per process)."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


JudgeMode = Literal["seeded", "A", "B", "tie"]


@dataclass
class ResearchTeamPolicy:
    """A cooperative research team: orchestrator plan, subagent worker, RHI optimizer and pairwise judge.

    judge_winner: "seeded" picks A/B/tie from (request seed, user prompt) — deterministic, varying across
    comparisons; "A"/"B"/"tie" force the verdict.
    """

    judge_winner: JudgeMode = "seeded"
    report_file: str = "research_report.md"
    metrics_file: str = "results/metrics.json"
    subagent_type: str = "general-purpose"
    extra_agents: list[str] = field(default_factory=lambda: ["data_engineer", "modeler", "critic", "reporter"])

    def respond(self, request: ChatRequest) -> PolicyReply:
        if request.kind is RequestKind.ORCHESTRATOR:
            return self._orchestrator(request)
        if request.kind is RequestKind.SUBAGENT:
            return self._subagent(request)
        if request.kind is RequestKind.OPTIMIZER:
            return self._optimizer(request)
        if request.kind is RequestKind.JUDGE:
            return self._judge(request)
        return PolicyReply(content="{}" if request.wants_json else "Nothing to record.")

    # --- qwen-code agents -------------------------------------------------------------------------------------

    def _orchestrator(self, request: ChatRequest) -> PolicyReply:
        cwd = request.working_directory() or "."
        seed = request.seed if request.seed is not None else 0
        step = request.tool_results
        if step == 0:
            report = (
                "# Research report\n\n## Method\nA two-agent team: the orchestrator plans and writes this report, a "
                "worker subagent computes the metrics.\n\n## Results\nSee results/metrics.json "
                f"(seed {seed}).\n\n## Limitations\nScripted stand-in run.\n"
            )
            return PolicyReply(
                reasoning="The task needs a report and metrics. I will write the report skeleton first, then "
                "prepare the results folder and delegate the metrics to a worker subagent.",
                content="I'll start by writing the research report skeleton.",
                tool_calls=(ToolCall("write_file", {"file_path": f"{cwd}/{self.report_file}", "content": report}),),
            )
        if step == 1:
            return PolicyReply(
                reasoning="Report written. Now create the results directory.",
                content="Creating the results directory.",
                tool_calls=(
                    ToolCall(
                        "run_shell_command",
                        {"command": "mkdir -p results && ls -1", "description": "Create results dir and list files"},
                    ),
                ),
            )
        if step == 2:
            target = f"{cwd}/{self.metrics_file}"
            return PolicyReply(
                reasoning="Delegate the metrics computation to a worker subagent and wait for its result.",
                content="Delegating the metrics to a worker subagent.",
                tool_calls=(
                    ToolCall(
                        "agent",
                        {
                            "description": "Compute evaluation metrics",
                            "prompt": (
                                "Compute the evaluation metrics and save them as JSON.\n"
                                f"{SUBAGENT_TARGET_TAG} {target}\n"
                                "Output to orchestrator: the path written and the headline metric."
                            ),
                            "subagent_type": self.subagent_type,
                            "run_in_background": False,
                        },
                    ),
                ),
            )
        return PolicyReply(
            reasoning="All deliverables exist; summarise.",
            content=f"Done. The report is in {self.report_file} and the metrics in {self.metrics_file}.",
        )

    def _subagent(self, request: ChatRequest) -> PolicyReply:
        text = request.user_text()
        found = re.search(re.escape(SUBAGENT_TARGET_TAG) + r"\s*(\S+)", text)
        target = found.group(1) if found else f"{request.working_directory() or '.'}/{self.metrics_file}"
        seed = request.seed if request.seed is not None else 0
        if request.tool_results == 0:
            score = round((stable_digest("score", seed) % 1000) / 1000, 3)
            metrics = json.dumps({"seed": seed, "score": score, "n_samples": 128}, indent=2) + "\n"
            return PolicyReply(
                reasoning="Write the metrics file the orchestrator asked for.",
                content="Writing the metrics file.",
                tool_calls=(ToolCall("write_file", {"file_path": target, "content": metrics}),),
            )
        return PolicyReply(content=f"Output to orchestrator: wrote {target}; headline metric `score` recorded.")

    # --- MASS calls -------------------------------------------------------------------------------------------

    def _optimizer(self, request: ChatRequest) -> PolicyReply:
        text = request.user_text()
        found = _VERSION_PATTERN.search(text)
        version = int(found.group(1)) if found else 0
        seed = request.seed if request.seed is not None else 0
        n_extra = 1 + stable_digest("agents", seed, version) % len(self.extra_agents)
        agents = [
            {
                "name": "orchestrator",
                "role": "plans, delegates, reconciles subagent outputs and writes research_report.md",
                "output_to_orchestrator": None,
            }
        ] + [
            {
                "name": name,
                "role": f"specialist for {name.replace('_', ' ')}",
                "output_to_orchestrator": "paths written, checks run, open issues",
            }
            for name in self.extra_agents[:n_extra]
        ]
        design = f"{WORKFLOW_START_MARKER}\n{json.dumps(agents, indent=2)}"
        answer = {
            "improved_multi_agent_design": design,
            "changes_from_previous": [f"v{version} -> v{version + 1}: team of {len(agents)} agents"],
            "why_it_should_improve": ["tighter Output-to-orchestrator contracts"],
            "evidence_used": ["research_report.md", "results/metrics.json"],
            "expected_impact": ["fewer missing deliverables"],
            "verification_checks": ["every deliverable listed in the task exists"],
        }
        return PolicyReply(
            reasoning=f"Improve design v{version}: add specialists and explicit recall loops.",
            content=json.dumps(answer),
        )

    def _judge(self, request: ChatRequest) -> PolicyReply:
        winner = (
            self.judge_winner
            if self.judge_winner != "seeded"
            else self.seeded_judge_winner(request.seed, request.user_text())
        )
        loser = {"A": "B", "B": "A"}.get(winner)
        rationale = (
            f"Workspace {winner} covers the deliverables more completely; workspace {loser} is missing "
            "research_report.md sections and its metrics lack uncertainty."
            if loser
            else "Both workspaces are comparable: similar deliverable coverage and rigor."
        )
        return PolicyReply(
            reasoning="Compare deliverable coverage, rigor and reproducibility of A and B.",
            content=json.dumps({"winner": winner, "rationale": rationale}),
        )

    @staticmethod
    def seeded_judge_winner(seed: int | None, user_text: str) -> Literal["A", "B", "tie"]:
        """The "seeded" verdict for a judge request: a pure function of its seed and its user prompt."""
        return ("A", "B", "tie")[stable_digest("judge", seed, user_text) % 3]
