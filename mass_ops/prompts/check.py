"""`mass-ops prompts check`: every model-facing message kind rendered with a config's templates, as SHA-256 and size.

Without a cycle, each message template renders its built-in examples (the samples in `specs.TEMPLATES`). With a
cycle, every recorded message is rendered again from the template and variables it was made of (kept beside each
LLM call and teacher prompt, `prompts.capture`), so a user who wrote the reference's wording into `prompts.dir` can
compare the hashes with a reference run's, and sees which recorded messages their templates would change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.errors import InputError
from mass_ops.layout import llm_call_prompt_key, teacher_prompt_inputs_key, teacher_prompt_key
from mass_ops.prompts.library import PromptSet
from mass_ops.prompts.specs import TEMPLATES

# The templates that are whole messages, and which messages they are; the others are macro libraries they import.
MESSAGE_TEMPLATES: dict[str, str] = {
    "judge_system.j2": "judge system message (search, arbitration, ranking, evaluation)",
    "judge_user.j2": "judge user message (search, arbitration, ranking, evaluation)",
    "optimizer_system.j2": "optimizer system message",
    "optimizer_user.j2": "optimizer user message",
    "teacher_prompt.j2": "teacher prompt (collection episodes)",
}
MACRO_LIBRARIES = frozenset(name for name in TEMPLATES if name not in MESSAGE_TEMPLATES)


@dataclass(frozen=True)
class CheckedMessage:
    """One message rendered with the checked templates. `recorded_sha256`: what was recorded (cycle mode)."""

    source: str
    template: str | None
    sha256: str | None
    chars: int | None
    recorded_sha256: str | None = None

    @property
    def verdict(self) -> str:
        if self.sha256 is None:
            return "no recorded inputs: cannot render"
        if self.recorded_sha256 is None:
            return "built-in example"
        return "same as recorded" if self.sha256 == self.recorded_sha256 else "differs from recorded"

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "template": self.template,
            "sha256": self.sha256,
            "chars": self.chars,
            "recorded_sha256": self.recorded_sha256,
            "verdict": self.verdict,
        }


def _rendered(source: str, prompts: PromptSet, template: str, variables: dict[str, Any]) -> CheckedMessage:
    text = prompts.render(template, **variables)
    return CheckedMessage(source, template, hashlib.sha256(text.encode("utf-8")).hexdigest(), len(text))


def example_messages(prompts: PromptSet) -> list[CheckedMessage]:
    """Every message template rendered with each of its built-in examples."""
    out = []
    for template in MESSAGE_TEMPLATES:
        samples = TEMPLATES[template].samples
        for index, sample in enumerate(samples, 1):
            source = f"{template} example {index}/{len(samples)}"
            out.append(_rendered(source, prompts, template, dict(sample)))
    return out


def recorded_messages(prompts: PromptSet, config: CycleConfig, cycle_name: str) -> list[CheckedMessage]:
    """Every message of cycle `cycle_name` (in the config's stores) rendered again from its recorded inputs."""
    # Imported here: the stores are only needed for a recorded cycle, and the prompt library stays light.
    from mass_ops.store.artifact_backends import open_artifact_store
    from mass_ops.store.repository import MetadataRepository

    repo = MetadataRepository.from_url(config.storage.metadata_url)
    artifacts = open_artifact_store(config.storage.artifact_url)
    cycle = repo.get_cycle(cycle_name)
    if cycle is None:
        raise InputError(f"prompts check: no cycle {cycle_name!r} in {config.storage.metadata_url}")
    out: list[CheckedMessage] = []
    for call in repo.llm_calls(cycle.id):
        key = llm_call_prompt_key(cycle_name, call.unit_key)
        if not artifacts.exists(key):
            continue
        document = artifacts.get_json(key)
        inputs = document.get("message_inputs") if isinstance(document, dict) else None
        for entry in inputs if isinstance(inputs, list) else []:
            out.append(_again(prompts, f"{call.unit_key} {entry.get('place')}", entry, entry.get("sha256")))
    for row in repo.retained_workflows(cycle.id):
        task = int(row.task_id) if str(row.task_id).isdigit() else None
        if task is None or not artifacts.exists(teacher_prompt_key(cycle_name, task)):
            continue
        sent = hashlib.sha256(artifacts.get_bytes(teacher_prompt_key(cycle_name, task))).hexdigest()
        inputs_key = teacher_prompt_inputs_key(cycle_name, task)
        entry = artifacts.get_json(inputs_key) if artifacts.exists(inputs_key) else {}
        out.append(_again(prompts, f"task{task} teacher prompt", entry, sent))
    return out


def _again(prompts: PromptSet, source: str, entry: Any, recorded: Any) -> CheckedMessage:
    recorded_sha = recorded if isinstance(recorded, str) else None
    template = entry.get("template") if isinstance(entry, dict) else None
    variables = entry.get("variables") if isinstance(entry, dict) else None
    if not isinstance(template, str) or template not in TEMPLATES or not isinstance(variables, dict):
        return CheckedMessage(source, None, None, None, recorded_sha)
    message = _rendered(source, prompts, template, variables)
    return CheckedMessage(source, template, message.sha256, message.chars, recorded_sha)


def report_lines(messages: list[CheckedMessage]) -> Iterator[str]:
    """Two lines a message, each under 80 columns but for the label: what and how long, then the whole SHA-256."""
    for message in messages:
        size = "-" if message.chars is None else f"{message.chars:,} chars"
        label = message.source if message.recorded_sha256 is None else f"{message.source} via {message.template or '?'}"
        yield f"{label}: {size}, {message.verdict}"
        yield f"  sha256 {message.sha256 or '-'}"
