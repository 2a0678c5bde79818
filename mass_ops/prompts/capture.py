"""What each recorded message was rendered from: the template and its variables, kept beside the message.

`PromptSet.render` notes every rendering of the current thread (the last few only); whoever records a message (the
call ledger, the teacher-prompt freeze) asks `inputs_of(text)` for the rendering that produced exactly that text and
stores it with the record. `mass-ops prompts check --cycle` renders those inputs again with other templates, so a
user can compare their wording's messages with a run's without calling a model.

Variables are raw data (strings, numbers, lists, mappings); a rendering whose variables are not JSON is not kept.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

# A message is recorded right after it is rendered, in the same thread; a few entries cover a judge call's system
# and user messages with room for the parts rendered in between.
RECENT = 8

_local = threading.local()


def _recent() -> deque[tuple[str, str, Mapping[str, Any]]]:
    recent: deque[tuple[str, str, Mapping[str, Any]]] | None = getattr(_local, "recent", None)
    if recent is None:
        recent = _local.recent = deque(maxlen=RECENT)
    return recent


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def note_render(template: str, variables: Mapping[str, Any], text: str) -> None:
    """Remember that `template` with `variables` rendered `text` (in this thread)."""
    _recent().append((_digest(text), template, variables))


def inputs_of(text: str) -> dict[str, Any] | None:
    """{template, variables} of this thread's latest rendering that produced exactly `text`; None if there is none
    or its variables are not JSON."""
    digest = _digest(text)
    for seen, template, variables in reversed(_recent()):
        if seen != digest:
            continue
        try:
            document = json.loads(json.dumps(dict(variables), allow_nan=False))
        except (TypeError, ValueError):
            return None
        return {"template": template, "variables": document}
    return None


def message_inputs(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recorded inputs of every text of an LLM request (chat `messages`, or Responses `instructions`/`input`):
    one entry per text with its place (`messages[i]`, `instructions`, `input`) and its SHA-256, inputs or not."""
    texts: list[tuple[str, str]] = []
    messages = request.get("messages")
    if isinstance(messages, list):
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                texts.append((f"messages[{index}]", content))
    for field in ("instructions", "input"):
        if isinstance(request.get(field), str):
            texts.append((field, request[field]))
    entries = []
    for place, text in texts:
        entry: dict[str, Any] = {"place": place, "sha256": _digest(text), "chars": len(text)}
        found = inputs_of(text)
        if found is not None:
            entry.update(found)
        entries.append(entry)
    return entries
