"""Main-thread detection, the teacher → bare substitution forms, and agent roles."""

from __future__ import annotations

import pytest

from mass_ops.render import RenderError
from mass_ops.render.substitution import (
    agent_role,
    at_path_rewrite,
    find_teacher_prompt,
    prompt_digest,
    substitute,
)

TEACHER = "  Evaluate precision@k and recall@k.\n\nCreate an agent team ...\n\nDirective.\n"
BARE = "  Evaluate precision@k and recall@k.\n\nUse uv.\n"
REMINDER = "<system-reminder>\nctx\n</system-reminder>\n"


def test_exact_form_wins_and_replaces_verbatim():
    text = REMINDER + TEACHER
    match = find_teacher_prompt(text, TEACHER, BARE)
    assert match is not None and match.mode == "exact"
    assert substitute(text, match) == REMINDER + BARE


def test_stripped_form_substitutes_the_bare_prompt_unstripped():
    text = REMINDER + TEACHER.strip()
    match = find_teacher_prompt(text, TEACHER, BARE)
    assert match is not None and match.mode == "stripped"
    assert BARE.strip() != BARE  # the test tells the two apart
    assert substitute(text, match) == REMINDER + BARE


def test_at_path_rewrite_matches_what_qwen_code_sent():
    sent = at_path_rewrite(TEACHER)
    assert "precision @k" in sent and "recall @k" in sent and sent == sent.strip()
    match = find_teacher_prompt(REMINDER + sent, TEACHER, BARE)
    assert match is not None and match.mode == "at_path"
    assert substitute(REMINDER + sent, match) == REMINDER + "Evaluate precision @k and recall @k.\n\nUse uv."


def test_sent_form_index_is_consulted_before_stripping():
    sent_teacher = "Evaluate P@k and R@k (sent form).\n\nCreate an agent team ..."
    sent_bare = "Evaluate P@k and R@k (sent form)."
    index = {prompt_digest(TEACHER): sent_teacher, prompt_digest(BARE): sent_bare}
    match = find_teacher_prompt(REMINDER + sent_teacher, TEACHER, BARE, sent_forms=index)
    assert match is not None and match.mode == "sent"
    assert substitute(REMINDER + sent_teacher + "\ntail", match) == REMINDER + sent_bare + "\ntail"
    # Without a sent form for the bare prompt, the bare prompt goes in as given.
    only_teacher = {prompt_digest(TEACHER): sent_teacher}
    match = find_teacher_prompt(REMINDER + sent_teacher, TEACHER, BARE, sent_forms=only_teacher)
    assert match is not None and match.bare_form == BARE


def test_absent_prompt_is_not_a_main_thread():
    assert find_teacher_prompt(REMINDER + "Write hello.txt", TEACHER, BARE) is None


def test_two_occurrences_are_an_error_naming_the_thread():
    text = TEACHER.strip() + "\n" + TEACHER.strip()
    with pytest.raises(RenderError, match=r"episode e1 thread abc\.0: teacher prompt occurs 2 times \(stripped form\)"):
        find_teacher_prompt(text, TEACHER, BARE, where="episode e1 thread abc.0")


def test_a_single_exact_occurrence_is_not_ambiguous_because_of_a_looser_form():
    # The stripped form occurs twice, but the exact form, tried first, occurs once.
    text = TEACHER + "\n" + TEACHER.strip()
    match = find_teacher_prompt(text, TEACHER, BARE)
    assert match is not None and match.mode == "exact"


@pytest.mark.parametrize(
    ("system", "is_main", "role"),
    [
        ("You are Qwen Code, a non-interactive CLI agent developed by Alibaba Group", False, "orchestrator"),
        ("\nYou are Qwen Code, an interactive CLI agent", False, "orchestrator"),
        ("You are a general-purpose subagent working for a parent agent.", False, "worker"),
        ("You are a general-purpose subagent working for a parent agent.", True, "orchestrator"),
        ("Generate a short title for the conversation.", False, "auxiliary"),
        ("", False, "auxiliary"),
    ],
)
def test_roles_follow_the_system_prompt(system: str, is_main: bool, role: str):
    assert agent_role(system, is_main=is_main) == role
