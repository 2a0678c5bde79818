"""Workflow-as-text: parsing, rendering, agents, diffs and guardrails (MASS_SPEC §3.1, §3.3)."""

from __future__ import annotations

import json

import pytest

from mass_ops.tasks import load_catalogue
from mass_ops.workflow import (
    END_MARKER,
    START_MARKER,
    WorkflowError,
    WorkflowPrompt,
    bare_task_text,
    check_design_size,
    design_diff,
    find_numeric_caps,
    normalize_generated_design,
    parse_agents,
    parse_prompt,
    read_prompt_file,
)

CATALOGUE = load_catalogue()
TASK_IDS = CATALOGUE.ids


def _design(agents: list[dict[str, object]]) -> str:
    return START_MARKER + "\n" + json.dumps(agents, indent=2)


def _agent(agent_id: str, role: str = "specialist", instruction: str = "do the work") -> dict[str, object]:
    return {"agent_id": agent_id, "role": role, "instruction": instruction}


TEAM = [_agent("agent_orchestrator", "coordinator"), _agent("agent_coder"), _agent("agent_tester")]
PROMPT = "Solve X.\\nThen report.\n\n" + _design(TEAM) + "\n\n" + END_MARKER + ": use uv run.\n"


def test_parse_splits_at_markers_and_round_trips() -> None:
    prompt = parse_prompt(PROMPT, source="p.txt")
    assert prompt.before_design == "Solve X.\\nThen report.\n\n"
    assert prompt.design_block == _design(TEAM)
    assert prompt.after_design == END_MARKER + ": use uv run.\n"
    assert prompt.text == PROMPT
    assert prompt.task_text == "Solve X.\nThen report."


def test_parse_uses_first_start_and_last_end_marker() -> None:
    text = f"task {START_MARKER} A {END_MARKER} middle {START_MARKER} B {END_MARKER} tail"
    prompt = parse_prompt(text)
    assert prompt.before_design == "task "
    assert prompt.design_block == f"{START_MARKER} A {END_MARKER} middle {START_MARKER} B"
    assert prompt.after_design == f"{END_MARKER} tail"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (f"task only {END_MARKER}", "start marker"),
        (f"task {START_MARKER} []", "end marker"),
        (f"{END_MARKER} before {START_MARKER} []", "does not follow"),
    ],
)
def test_parse_errors_name_the_source(text: str, problem: str) -> None:
    with pytest.raises(WorkflowError, match=problem) as info:
        parse_prompt(text, source="tasks/initial/query7_ourTeam.txt")
    assert str(info.value).startswith("tasks/initial/query7_ourTeam.txt:")


def test_render_replaces_only_the_design_block() -> None:
    prompt = parse_prompt(PROMPT)
    new_design = _design([_agent("agent_orchestrator"), _agent("agent_solo_reviewer")])
    rendered = prompt.render("\n  " + new_design + "\n\n\n")
    assert rendered == prompt.before_design + new_design + "\n\n" + prompt.after_design
    again = parse_prompt(rendered)
    assert again.design_block == new_design
    assert (again.before_design, again.after_design) == (prompt.before_design, prompt.after_design)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_every_shipped_prompt_round_trips(task_id: int) -> None:
    task = CATALOGUE.task(task_id)
    prompt = parse_prompt(task.initial_prompt, source=task.workflow_name)
    assert prompt.render(prompt.design_block) == task.initial_prompt
    assert prompt.task_text == bare_task_text(task.bare_prompt)
    assert "\\n" not in prompt.task_text
    assert "Deliverables:" in prompt.task_text
    assert prompt.after_design.startswith(END_MARKER)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_every_shipped_design_has_valid_agents(task_id: int) -> None:
    task = CATALOGUE.task(task_id)
    agents = parse_agents(parse_prompt(task.initial_prompt).design_block)
    assert 3 <= len(agents) <= 5
    assert sum(agent.is_orchestrator for agent in agents) == 1
    assert len({agent.agent_id for agent in agents}) == len(agents)
    # Instructions are role-specific, not copies of one text.
    assert len({agent.instruction for agent in agents}) == len(agents)


def test_read_prompt_file_takes_the_query_id_from_the_name(tmp_path) -> None:
    path = tmp_path / "query42_ourTeam-v3.txt"
    path.write_text(PROMPT, encoding="utf-8")
    query_id, prompt = read_prompt_file(path)
    assert query_id == 42
    assert prompt.text == PROMPT
    bad = tmp_path / "task42.txt"
    bad.write_text(PROMPT, encoding="utf-8")
    with pytest.raises(WorkflowError, match=r"task42\.txt"):
        read_prompt_file(bad)


def test_bare_task_text_cuts_before_the_suffix() -> None:
    bare = "Line one\\nLine two\\n\\nDeliverables:\\n1. x\n\nUse uv for all Python workflows: and logs.txt\n"
    assert bare_task_text(bare) == "Line one\nLine two\n\nDeliverables:\n1. x"
    assert bare_task_text("  no suffix here\\n ") == "no suffix here"


def test_parse_agents_accepts_extra_keys_and_strips_ids() -> None:
    team = [dict(_agent(" agent_orchestrator "), output_to_orchestrator="schema"), _agent("agent_analyst")]
    agents = parse_agents(_design(team))
    assert [agent.agent_id for agent in agents] == ["agent_orchestrator", "agent_analyst"]
    assert agents[0].is_orchestrator and not agents[1].is_orchestrator


def test_orchestrator_may_be_named_by_role() -> None:
    agents = parse_agents(_design([_agent("agent_lead", "Orchestrator and lead"), _agent("agent_coder")]))
    assert [agent.is_orchestrator for agent in agents] == [True, False]


@pytest.mark.parametrize(
    ("design", "problem"),
    [
        ("Some other header\n[]", "does not start with the start marker"),
        (START_MARKER, "no agent array"),
        (START_MARKER + "\n[{'agent_id': 'a'}]", "not valid JSON"),
        (START_MARKER + '\n{"agent_id": "agent_orchestrator"}', "must be a JSON array"),
        (START_MARKER + "\n[]", "agent array is empty"),
        (START_MARKER + '\n["agent_orchestrator"]', "agent #0 must be a JSON object"),
        (START_MARKER + "\n" + json.dumps(TEAM) + "\nAlso do more.", "not valid JSON"),
        (_design([_agent("agent_orchestrator"), _agent("")]), "agent #1: 'agent_id' must be a non-empty string"),
        (_design([_agent("agent_orchestrator"), _agent("agent_x", role="  ")]), "'role' must be a non-empty"),
        (_design([_agent("agent_orchestrator"), {"agent_id": "agent_x", "role": "r"}]), "'instruction' must be"),
        (_design([_agent("agent_orchestrator"), _agent("agent_x", instruction=["a"])]), "'instruction' must be"),
        (_design([_agent("agent_orchestrator"), _agent("agent_x"), _agent("agent_x")]), "duplicate agent_id"),
        (_design([_agent("agent_coder"), _agent("agent_tester")]), "found 0"),
        (_design([_agent("agent_orchestrator"), _agent("agent_sub", "sub-orchestrator")]), "found 2"),
        (START_MARKER + "\n" + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_parse_agents_rejects_malformed_designs(design: str, problem: str) -> None:
    with pytest.raises(WorkflowError, match=problem) as info:
        parse_agents(design, source="design_v3")
    assert str(info.value).startswith("design_v3:")


def test_design_diff_shows_changed_lines_with_one_context_line() -> None:
    old = "\n".join(["header", "a", "b", "c", "d", "e"])
    new = "\n".join(["header", "a", "b", "C", "d", "e"])
    diff = design_diff(old, new, old_label="v1", new_label="v2")
    lines = diff.splitlines()
    assert lines[:2] == ["--- v1", "+++ v2"]
    assert lines[2].startswith("@@")
    assert lines[3:] == [" b", "-c", "+C", " d"]
    wider = design_diff(old, new, context=3).splitlines()
    assert " a" in wider and " e" in wider


def test_design_diff_of_equal_designs() -> None:
    assert design_diff("same\ntext", "same\ntext") == "(designs are identical)"


def test_normalize_requires_the_start_marker() -> None:
    template = parse_prompt(PROMPT)
    with pytest.raises(WorkflowError, match="does not start with the start marker"):
        normalize_generated_design("Here is the improved design:\n" + _design(TEAM), template)


def test_normalize_trims_an_echoed_suffix() -> None:
    template = parse_prompt(PROMPT)
    design = _design(TEAM)
    generated = "\n\n  " + design + "\n\n" + template.after_design + "\n"
    assert normalize_generated_design(generated, template) == design


def test_normalize_cuts_a_trailing_end_marker_but_keeps_an_early_one() -> None:
    template = parse_prompt(PROMPT)
    design = _design(TEAM)
    # The echo differs from the template's suffix, so only the end-marker rule applies.
    late = design + "\n\n" + END_MARKER + " (paraphrased suffix)"
    assert normalize_generated_design(late, template) == design
    early_team = [_agent("agent_orchestrator", instruction=END_MARKER + " when you run code")] + [
        _agent(f"agent_worker_{i}", instruction="write the analysis code and its unit tests " * 4) for i in range(4)
    ]
    early = _design(early_team)
    assert early.find(END_MARKER) < 0.7 * len(early)
    assert normalize_generated_design(early, template) == early


def test_normalize_cuts_only_at_the_first_end_marker_as_the_reference_does() -> None:
    template = parse_prompt(PROMPT)
    design = _design(TEAM)
    # First marker early (an instruction mentioning uv), a paraphrased suffix echo at the end: the reference looks
    # at the FIRST marker only, finds it too early and cuts nothing.
    early_then_late = design.replace("do the work", END_MARKER + " to run code", 1) + "\n\n" + END_MARKER + " (echo)"
    assert early_then_late.find(END_MARKER) < 0.7 * len(early_then_late) <= early_then_late.rfind(END_MARKER)
    assert normalize_generated_design(early_then_late, template) == early_then_late
    # Two late markers: the cut is at the first.
    late_twice = design + "\n" + END_MARKER + " once.\n" + END_MARKER + " twice."
    assert normalize_generated_design(late_twice, template) == design


def test_normalize_compares_the_marker_with_int_of_seventy_percent() -> None:
    template = parse_prompt(PROMPT)
    head = START_MARKER + " x"
    # A proposal of length n whose first marker sits at int(0.7 n) < 0.7 n: the reference's int() makes it a cut.
    n = next(n for n in range(200, 300) if int(0.7 * n) < 0.7 * n)
    position = int(0.7 * n)
    kept = head + "y" * (position - len(head))
    generated = kept + END_MARKER + "z" * (n - position - len(END_MARKER))
    assert len(generated) == n and generated.find(END_MARKER) == position < 0.7 * n
    assert normalize_generated_design(generated, template) == kept


def test_normalize_keeps_a_clean_design_unchanged() -> None:
    task = CATALOGUE.task(51)
    template = task.initial_workflow
    assert normalize_generated_design(template.design_block, template) == template.design_block


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Spawn at most 3 subagents for modelling.", ["at most 3 subagents"]),
        ("Use a maximum of 2 re-delegation rounds.", ["maximum of 2 re-delegation rounds"]),
        ("Each worker is limited to 45 minutes.", ["limited to 45 minutes"]),
        (
            "Maximum 4 recall iterations, at most 10 tool calls.",
            ["Maximum 4 recall iterations", "at most 10 tool calls"],
        ),
        ("Allow at most 2\nhops between agents.", ["at most 2 hops between agents"]),
        ("Keep it limited to 1 round.", ["limited to 1 round"]),
    ],
)
def test_find_numeric_caps_reports_caps(text: str, expected: list[str]) -> None:
    assert find_numeric_caps(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Touch at most 3 files per agent.",
        "Recall a subagent until its acceptance checks pass.",
        "Report the maximum drawdown over 12 months.",
        "Use 5 seeds and at most 2 GB of memory.",
    ],
)
def test_find_numeric_caps_ignores_other_numbers(text: str) -> None:
    assert find_numeric_caps(text) == []


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_shipped_designs_carry_no_numeric_caps(task_id: int) -> None:
    assert find_numeric_caps(CATALOGUE.task(task_id).initial_workflow.design_block) == []


def test_check_design_size() -> None:
    check_design_size("x" * 100, 100)
    with pytest.raises(WorkflowError, match="101 characters, more than the limit of 100"):
        check_design_size("x" * 101, 100)
    with pytest.raises(WorkflowError, match="must be positive"):
        check_design_size("x", 0)


def test_workflow_prompt_is_immutable() -> None:
    prompt = WorkflowPrompt("a", "b", "c")
    with pytest.raises(AttributeError):
        prompt.design_block = "other"  # type: ignore[misc]
