"""A teacher episode built turn by turn, with what rendering must train for every thread.

The episode: the orchestrator (teacher prompt as qwen-code sent it, i.e. with its "@k" rewrite) delegates to two
general-purpose workers through the `agent` tool; worker A writes a file (non-ASCII code), worker B runs
long commands and its last reply hits the token limit; a title-generation call is an auxiliary thread; then the
orchestrator's history is rewritten (old tool output cleared: a prefix break, i.e. a new conversation of the same
thread), a reminder user message opens a second segment, and the final answer has empty reasoning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tests.render.proxy_logs import (
    ORCHESTRATOR_SYSTEM,
    ORCHESTRATOR_TOOLS,
    TITLE_SYSTEM,
    WORKER_SYSTEM,
    WORKER_TOOLS,
    Agent,
    Call,
    ProxyLog,
    Reply,
    tool_output,
)

TASK_TEXT = (
    "Build a retrieval benchmark for protein-interface prediction.\\nReport precision@k and recall@k for k in "
    "{1, 5, 10} on a held-out split, compare against a random baseline and discuss failure modes.\\n\\nDeliverables:"
    "\n- research_report.md\n- results/metrics.json\n- deliverables/plots/pr_curve.png"
)
SUFFIX = "Use uv for all Python workflows (uv run, uv add). Write plan, execution and reflection to logs.txt."
DESIGN = "Create an agent team with following agent candidates to solve this problem:\n" + json.dumps(
    [
        {"agent_id": "agent_orchestrator", "role": "lead", "instruction": "Coordinate; verify every report."},
        {"agent_id": "agent_data_engineer", "role": "data", "instruction": "Build loaders and splits."},
        {"agent_id": "agent_evaluator", "role": "eval", "instruction": "Compute precision@k / recall@k."},
    ],
    indent=2,
)
DIRECTIVE = (
    "Execution requirements for the agent team (mandatory):\n1. Run every non-orchestrator role as a real sub-agent "
    "via the agent tool (subagent_type general-purpose).\n2. Every agent call runs in the foreground."
)
BARE_PROMPT = f"{TASK_TEXT}\n\n{SUFFIX}\n"
TEACHER_PROMPT = f"{TASK_TEXT}\n\n{DESIGN}\n\n{SUFFIX} Document every spawned agent in logs.txt.\n\n{DIRECTIVE}\n"


def sent_form(prompt: str) -> str:
    """What qwen-code sends for a prompt file: "@k" metric names rewritten, surrounding whitespace stripped."""
    return prompt.replace("precision@k", "precision @k").replace("recall@k", "recall @k").strip()


@dataclass
class ThreadExpectation:
    """Replies a conversation must train, in order, and per reply whether it renders with a think block."""

    role: str
    is_main: bool
    trained: list[tuple[Reply, bool]] = field(default_factory=list)
    final_truncated: bool = False
    segments: int = 1


@dataclass
class TeacherEpisode:
    log: ProxyLog
    # Conversations in order of their first request; matched to rendered threads by that order.
    threads: list[ThreadExpectation]
    long_outputs: list[str]


def build_teacher_episode(*, output_lines: int = 220) -> TeacherEpisode:
    log = ProxyLog()
    orchestrator = Agent(log, ORCHESTRATOR_SYSTEM, sent_form(TEACHER_PROMPT), ORCHESTRATOR_TOOLS)
    delegate_a = Call("call_o1", "agent", {"subagent_type": "general-purpose", "prompt": "Build the data loader."})
    o1 = Reply(reasoning="The team needs data first; I delegate the loader.", calls=[delegate_a])
    orchestrator.turn(o1)

    worker_a = Agent(log, WORKER_SYSTEM, "Build the data loader in /work/ws/src/loader.py.", WORKER_TOOLS)
    code = (
        'import csv\n\n\ndef load(path):\n    """Rows → dicts (UTF-8: α β γ)."""\n'
        "    return list(csv.DictReader(open(path)))\n"
    )
    a1 = Reply(
        reasoning="Write the loader.",
        calls=[Call("call_a1", "write_file", {"file_path": "/work/ws/src/loader.py", "content": code})],
    )
    worker_a.turn(a1)
    worker_a.results(("call_a1", "Successfully created and wrote to new file: /work/ws/src/loader.py."))
    a2 = Reply(reasoning="The file exists; report back.", content="Report: wrote src/loader.py (load → list of rows).")
    worker_a.turn(a2, stream=False)

    orchestrator.results(("call_o1", a2.content or ""))
    delegate_b = Call("call_o2", "agent", {"subagent_type": "general-purpose", "prompt": "Run the evaluation."})
    o2 = Reply(reasoning="Loader verified. Next: evaluation.", content="Delegating evaluation.", calls=[delegate_b])
    orchestrator.turn(o2)

    worker_b = Agent(log, WORKER_SYSTEM, "Run the evaluation and report precision@k.", WORKER_TOOLS)
    run = {"command": "cd /work/ws && uv run python run_pipeline.py --eval"}
    b1 = Reply(reasoning="Run the pipeline first.", calls=[Call("call_b1", "run_shell_command", run)])
    worker_b.turn(b1)
    first_output = tool_output(1, output_lines)
    worker_b.results(("call_b1", first_output))
    rerun = {"command": "cd /work/ws && uv run python run_pipeline.py --eval --seed 2"}
    b2 = Reply(
        reasoning="Numbers look noisy; rerun with a second seed.", calls=[Call("call_b2", "run_shell_command", rerun)]
    )
    worker_b.turn(b2)
    second_output = tool_output(2, output_lines)
    worker_b.results(("call_b2", second_output))
    b3 = Reply(reasoning="Summarising a very long", content="The evaluation shows", finish_reason="length")
    worker_b.turn(b3)

    title = Agent(log, TITLE_SYSTEM, "Build a retrieval benchmark for protein-interface prediction.", None)
    t1 = Reply(content="Protein interface retrieval benchmark")
    title.turn(t1, stream=False)

    orchestrator.results(("call_o2", "Subagent stopped: the model hit its output limit."))
    # Context pressure: qwen-code clears an old tool output in place, so the next request no longer extends the last.
    orchestrator.messages[3]["content"] = [{"type": "text", "text": "[Old tool result content cleared]"}]
    orchestrator.user(
        "<system-reminder>\nThe evaluation worker stopped early. Decide how to finish.\n</system-reminder>"
    )
    o3 = Reply(reasoning="", content="Final summary: loader built; evaluation incomplete, see logs.txt.")
    orchestrator.turn(o3)

    return TeacherEpisode(
        log=log,
        threads=[
            ThreadExpectation("orchestrator", True, [(o1, True), (o2, True)]),
            ThreadExpectation("worker", False, [(a1, True), (a2, True)]),
            ThreadExpectation("worker", False, [(b1, True), (b2, True)], final_truncated=True),
            ThreadExpectation("auxiliary", False, [(t1, True)]),
            ThreadExpectation("orchestrator", True, [(o1, True), (o2, True), (o3, True)], segments=2),
        ],
        long_outputs=[first_output, second_output],
    )


def expected_label_text(reply: Reply, *, think: bool) -> str:
    """The trained text of one reply: after `<|im_start|>assistant\\n<think>\\n` (or `…assistant\\n` without a think
    block) through `<|im_end|>`; empty reasoning trains from `</think>`."""
    content = reply.content or ""
    text = ""
    if think:
        reasoning = (reply.reasoning or "").strip("\n")
        text = (reasoning + "\n</think>\n\n") if reasoning else "</think>\n\n"
        text += content.lstrip("\n")
    else:
        text = content
    for index, call in enumerate(reply.calls):
        if index > 0 or content:
            text += "\n"
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        text += f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>'
    return text + "<|im_end|>"
