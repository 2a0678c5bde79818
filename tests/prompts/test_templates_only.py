"""Every model-facing message is exactly its templates' output: no sentence, label, marker or separator comes from
Python. Each template is swapped for one that prints only its variables (as JSON, each after a marker); the public
builders then must return text made of those pieces and nothing else (#26 item 5)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mass_ops.judge.prompts import judge_system_prompt, judge_user_prompt
from mass_ops.prompts import PromptSet
from mass_ops.prompts.library import load_prompts
from mass_ops.prompts.specs import TEMPLATES
from mass_ops.search.prompt import (
    delta_checklist,
    failure_notice,
    optimizer_system_prompt,
    optimizer_user_prompt,
    scoreboard_line,
)
from mass_ops.stages.collect import teacher_prompt
from mass_ops.tasks.catalogue import TaskCatalogue, TaskSplits
from tests.prompts.cases import LONG_RATIONALE, _bundle, _optimizer_cases

MARK = "«SWAP»"


def _swap_source(name: str) -> str:
    """A template that prints its name and each of its variables after MARK, and macros that print their arguments
    likewise."""
    spec = TEMPLATES[name]
    body = f"{MARK}{json.dumps(name)}" + "".join(f"{MARK}{{{{ {v} | tojson }}}}" for v in sorted(spec.variables))
    macros = "".join(
        f"{{% macro {macro}() %}}{MARK}{{{{ varargs | tojson }}}}{MARK}{{{{ kwargs | tojson }}}}{{% endmacro %}}"
        for macro in spec.macros
    )
    return macros + body


@pytest.fixture(scope="module")
def swapped(tmp_path_factory: pytest.TempPathFactory) -> PromptSet:
    folder = tmp_path_factory.mktemp("swapped")
    for name in TEMPLATES:
        (folder / name).write_text(_swap_source(name), encoding="utf-8")
    return load_prompts(folder)


def only_variables(text: str | None) -> list[object]:
    """The JSON values a swapped rendering is made of; fails on anything between or around them."""
    assert text, "the builder returned no text"
    head, *pieces = text.split(MARK)
    if head:
        pytest.fail(f"text before the first template output: {head[:80]!r}")
    values = []
    for piece in pieces:
        try:
            values.append(json.loads(piece))
        except ValueError:
            pytest.fail(f"text that no template printed: {piece[:120]!r}")
    return values


def test_the_swap_detects_text_added_in_python(swapped: PromptSet) -> None:
    with pytest.raises(pytest.fail.Exception, match="no template printed"):
        only_variables(optimizer_system_prompt(prompts=swapped) + "\n\nextra words")
    with pytest.raises(pytest.fail.Exception, match="before the first"):
        only_variables("# Heading\n" + judge_system_prompt(51, prompts=swapped))


@pytest.mark.parametrize("task_id", [1, 202, 324, 9999])
def test_the_judge_system_message(swapped: PromptSet, task_id: int) -> None:
    assert task_id in only_variables(judge_system_prompt(task_id, prompts=swapped))


def test_the_judge_user_message_carries_both_bundles_as_raw_data(swapped: PromptSet) -> None:
    a = _bundle(51, "s3://bucket/a.tar.gz", "a", "report A")
    b = _bundle(51, "s3://bucket/b.tar.gz", "b", "report B")
    values = only_variables(judge_user_prompt("Do the study.", "candidate-a", "candidate-b", a, b, prompts=swapped))
    assert "candidate-a" in values and "candidate-b" in values
    assert json.loads(json.dumps(a.variables())) in values and json.loads(json.dumps(b.variables())) in values


@pytest.mark.parametrize("case", sorted(_optimizer_cases()))
def test_the_optimizer_messages(swapped: PromptSet, case: str) -> None:
    assert only_variables(optimizer_system_prompt(prompts=swapped)) == ["optimizer_system.j2"]
    inputs = _optimizer_cases()[case]
    values = only_variables(optimizer_user_prompt(inputs, prompts=swapped))
    assert values[0] == "optimizer_user.j2"
    # The task text arrives as data, cut as the reference cuts it (stripped); no Python-made text around it.
    assert inputs.task_text.strip() in values


def test_the_optimizer_parts_called_from_python(swapped: PromptSet) -> None:
    notice = only_variables(failure_notice({"exit_code": 137, "trace_has_success_result": True}, prompts=swapped))
    board = only_variables(scoreboard_line([(0, "B"), (1, "A"), (2, "tie")], 0, prompts=swapped))
    checklist = only_variables(delta_checklist([LONG_RATIONALE, "Plot missing."], prompts=swapped))
    # Each part is one swapped macro call: its positional and keyword arguments, nothing else.
    assert len(notice) == len(board) == len(checklist) == 2
    assert all(isinstance(part[0], list) and isinstance(part[1], dict) for part in (notice, board, checklist))


def test_the_teacher_prompt(swapped: PromptSet) -> None:
    catalogue = TaskCatalogue(tasks={}, splits=TaskSplits((), (), (), {}, {}), teacher_directive="Use agents.\n")
    ctx = SimpleNamespace(prompts=swapped, catalogue=catalogue)
    values = only_variables(teacher_prompt(ctx, "retained prompt\n\n"))  # type: ignore[arg-type]
    assert values == ["teacher_prompt.j2", "retained prompt", "Use agents.\n"]


def test_every_template_is_swapped(tmp_path: Path, swapped: PromptSet) -> None:
    assert swapped.overridden == sorted(TEMPLATES)
