"""Which thread is the orchestrator, and the teacher → bare prompt substitution (MASS_SPEC §7).

Teacher episodes run the task prompt plus the retained workflow plus the teacher directive. The student must learn
to behave like that team from the bare task alone, so in the main (orchestrator) thread the teacher text is replaced,
once, by the bare prompt. The teacher prompt is looked for in the thread's first user message in these forms, first
hit wins: exact; the form qwen-code actually sent (optional md5 → text index); stripped; qwen-code's @-path rewrite
("precision@k" → "precision @k", "recall@k" → "recall @k", then stripped — qwen-code reads "@k" as a file reference).
Two or more occurrences of a form are ambiguous and an error. The bare prompt is normalised the same way as the match
in the sent and @-path forms; for the stripped form it goes in unstripped, as the reference does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from mass_ops.render.errors import RenderError

AT_PATH_REWRITES = (("precision@k", "precision @k"), ("recall@k", "recall @k"))
ORCHESTRATOR_SYSTEM_PREFIX = "You are Qwen Code"
WORKER_SYSTEM_PREFIX = "You are a general-purpose subagent"

ORCHESTRATOR = "orchestrator"
WORKER = "worker"
AUXILIARY = "auxiliary"


@dataclass(frozen=True)
class PromptMatch:
    """The form under which the teacher prompt was found and the bare text that replaces it."""

    mode: str
    teacher_form: str
    bare_form: str


def prompt_digest(text: str) -> str:
    """Key of a prompt in a sent-form index: md5 hex of its UTF-8 text."""
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def at_path_rewrite(text: str) -> str:
    """qwen-code's rewrite of "@k" metric names, then strip."""
    for before, after in AT_PATH_REWRITES:
        text = text.replace(before, after)
    return text.strip()


def prompt_forms(teacher: str, bare: str, sent_forms: Mapping[str, str] | None = None) -> list[PromptMatch]:
    """Candidate (mode, teacher form, bare form) triples in matching order; empty or repeated forms dropped."""
    candidates = [PromptMatch("exact", teacher, bare)]
    if sent_forms:
        sent_teacher = sent_forms.get(prompt_digest(teacher))
        if sent_teacher is not None:
            candidates.append(PromptMatch("sent", sent_teacher, sent_forms.get(prompt_digest(bare), bare)))
    # The reference inserts the bare prompt as given (unstripped) when the stripped teacher form matched.
    candidates.append(PromptMatch("stripped", teacher.strip(), bare))
    candidates.append(PromptMatch("at_path", at_path_rewrite(teacher), at_path_rewrite(bare)))
    seen: set[str] = set()
    forms = []
    for candidate in candidates:
        if candidate.teacher_form and candidate.teacher_form not in seen:
            seen.add(candidate.teacher_form)
            forms.append(candidate)
    return forms


def find_teacher_prompt(
    text: str, teacher: str, bare: str, *, sent_forms: Mapping[str, str] | None = None, where: str = "thread"
) -> PromptMatch | None:
    """The first form of `teacher` occurring exactly once in `text`, or None when no form occurs.

    Raises `RenderError` when the first form that occurs at all occurs two or more times.
    """
    for form in prompt_forms(teacher, bare, sent_forms):
        count = text.count(form.teacher_form)
        if count == 1:
            return form
        if count > 1:
            raise RenderError(
                f"{where}: teacher prompt occurs {count} times ({form.mode} form) in the first user message; "
                "the substitution would be ambiguous"
            )
    return None


def substitute(text: str, match: PromptMatch) -> str:
    """Replace the single occurrence of the matched teacher form by the bare form."""
    return text.replace(match.teacher_form, match.bare_form, 1)


def agent_role(system_text: str, *, is_main: bool) -> str:
    """orchestrator (main thread, or a qwen-code core system prompt), worker (general-purpose subagent), or
    auxiliary (anything else: compression, titles, checks)."""
    head = system_text.lstrip()
    if is_main or head.startswith(ORCHESTRATOR_SYSTEM_PREFIX):
        return ORCHESTRATOR
    if head.startswith(WORKER_SYSTEM_PREFIX):
        return WORKER
    return AUXILIARY
