"""Workflow-as-text: the multi-agent design block inside a MASS task prompt.

A workflow prompt is ``task text + design block + suffix``. The design block starts with :data:`START_MARKER`,
followed by a JSON array of agents; the suffix starts with :data:`END_MARKER`. Workflow search only ever rewrites
the design block, so this module splits a prompt into its three parts, renders a prompt for a new design, diffs
designs, and applies the guardrails to a design proposed by the optimizer (MASS_SPEC §3.1, §3.3).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mass_ops.errors import InputError

START_MARKER = "Create an agent team with following agent candidates to solve this problem:"
END_MARKER = "Use uv for all Python workflows"

# Length of the suffix probe used to trim a proposed design that repeats the prompt's tail (MASS_SPEC §3.3).
_SUFFIX_PROBE_CHARS = 200
# The end marker only counts as a trailing echo when its first occurrence sits in the last 30% of the proposal;
# earlier, it is more likely part of an agent instruction that mentions uv (the reference truncates 0.7·len to an int).
_END_MARKER_MIN_FRACTION = 0.7

_QUERY_FILE_RE = re.compile(r"query(\d+)_ourTeam")


class WorkflowError(InputError):
    """A workflow prompt or design is malformed; the message names the source and the problem."""


def unescape_newlines(text: str) -> str:
    """Turn the literal two-character ``\\n`` escapes used in task prompts into real newlines."""
    return text.replace("\\n", "\n")


@dataclass(frozen=True)
class WorkflowPrompt:
    """A prompt split around its design block.

    ``before_design`` ends where the start marker begins, ``design_block`` is the stripped text from the start
    marker up to the last end marker, and ``after_design`` runs from the last end marker to the end of the text.
    """

    before_design: str
    design_block: str
    after_design: str

    def render(self, design: str) -> str:
        """The full prompt with ``design`` in place of the current design block."""
        return self.before_design + design.strip() + "\n\n" + self.after_design.lstrip()

    @property
    def text(self) -> str:
        """The prompt rendered with its own design block."""
        return self.render(self.design_block)

    @property
    def task_text(self) -> str:
        """Task text as judges and the optimizer see it: newline escapes decoded, surrounding space stripped."""
        return unescape_newlines(self.before_design.rstrip()).strip()


def parse_prompt(text: str, source: str = "<prompt>") -> WorkflowPrompt:
    """Split ``text`` at the FIRST start marker and the LAST end marker.

    Raises :class:`WorkflowError` naming ``source`` when a marker is missing or the end marker does not follow the
    start marker.
    """
    start = text.find(START_MARKER)
    if start < 0:
        raise WorkflowError(f"{source}: no design block (start marker {START_MARKER!r} not found)")
    end = text.rfind(END_MARKER)
    if end < 0:
        raise WorkflowError(f"{source}: no suffix (end marker {END_MARKER!r} not found)")
    if end <= start:
        raise WorkflowError(f"{source}: end marker at char {end} does not follow the start marker at char {start}")
    return WorkflowPrompt(
        before_design=text[:start],
        design_block=text[start:end].strip(),
        after_design=text[end:],
    )


def read_prompt_file(path: str | Path) -> tuple[int, WorkflowPrompt]:
    """Read a ``query<ID>_ourTeam`` prompt file; return the query id parsed from the file name and the prompt."""
    path = Path(path)
    match = _QUERY_FILE_RE.search(path.name)
    if match is None:
        raise WorkflowError(f"{path}: file name does not contain 'query<ID>_ourTeam'")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise WorkflowError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise WorkflowError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    return int(match.group(1)), parse_prompt(text, source=str(path))


def bare_task_text(bare_prompt: str) -> str:
    """Task text of a bare prompt for ranking and reporting: the text before the first end marker (the whole text
    when there is none), newline escapes decoded, stripped."""
    end = bare_prompt.find(END_MARKER)
    head = bare_prompt if end < 0 else bare_prompt[:end]
    return unescape_newlines(head).strip()


@dataclass(frozen=True)
class Agent:
    """One agent candidate of a design block."""

    agent_id: str
    role: str
    instruction: str

    @property
    def is_orchestrator(self) -> bool:
        return "orchestrator" in self.agent_id.lower() or "orchestrator" in self.role.lower()


def parse_agents(design_block: str, source: str = "<design>") -> list[Agent]:
    """Parse and check the JSON array of agents that follows the start marker.

    The text after the marker must be exactly one JSON array of objects, each with a unique non-empty string
    ``agent_id`` and non-empty string ``role`` and ``instruction`` (other keys are allowed and ignored); exactly one
    agent must be the orchestrator (``orchestrator`` in its id or role).
    """
    block = design_block.strip()
    if not block.startswith(START_MARKER):
        raise WorkflowError(f"{source}: design block does not start with the start marker {START_MARKER!r}")
    body = block[len(START_MARKER) :].strip()
    if not body:
        raise WorkflowError(f"{source}: design block has no agent array after the start marker")
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        raise WorkflowError(
            f"{source}: agent array is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except RecursionError:
        raise WorkflowError(f"{source}: agent array is nested too deeply to be a list of agents") from None
    if not isinstance(payload, list):
        raise WorkflowError(f"{source}: agents must be a JSON array, got {type(payload).__name__}")
    if not payload:
        raise WorkflowError(f"{source}: agent array is empty")

    agents: list[Agent] = []
    seen: set[str] = set()
    for index, item in enumerate(payload):
        where = f"{source}: agent #{index}"
        if not isinstance(item, dict):
            raise WorkflowError(f"{where} must be a JSON object, got {type(item).__name__}")
        fields: dict[str, str] = {}
        for key in ("agent_id", "role", "instruction"):
            value = item.get(key)
            if not isinstance(value, str) or not value.strip():
                raise WorkflowError(f"{where}: {key!r} must be a non-empty string")
            fields[key] = value
        agent_id = fields["agent_id"].strip()
        if agent_id in seen:
            raise WorkflowError(f"{where}: duplicate agent_id {agent_id!r}")
        seen.add(agent_id)
        agents.append(Agent(agent_id=agent_id, role=fields["role"].strip(), instruction=fields["instruction"]))

    orchestrators = [agent.agent_id for agent in agents if agent.is_orchestrator]
    if len(orchestrators) != 1:
        found = ", ".join(orchestrators) if orchestrators else "none"
        raise WorkflowError(f"{source}: exactly one orchestrator agent required, found {len(orchestrators)} ({found})")
    return agents


def design_diff(old: str, new: str, context: int = 1, *, old_label: str = "old", new_label: str = "new") -> str:
    """Unified diff of two design blocks with ``context`` lines; ``"(designs are identical)"`` when equal."""
    lines = difflib.unified_diff(
        old.splitlines(), new.splitlines(), fromfile=old_label, tofile=new_label, n=context, lineterm=""
    )
    text = "\n".join(lines)
    return text if text else "(designs are identical)"


def normalize_generated_design(generated: str, template: WorkflowPrompt) -> str:
    """Apply the structural guardrails to a design proposed by the optimizer and return the design block.

    The proposal must start with the start marker (after stripping). If it echoes the prompt's suffix, the echo is
    cut (as the reference's ``_normalize_generated_design_block``): at the first occurrence of the first 200
    characters of ``template.after_design`` (left-stripped), otherwise at the FIRST end marker when that lies at or
    after ``int(0.7 * len)`` of the text — an earlier first marker cuts nothing, even if a later one is near the end.
    """
    text = generated.strip()
    if not text.startswith(START_MARKER):
        preview = text[:60].replace("\n", " ")
        raise WorkflowError(f"generated design does not start with the start marker (begins with {preview!r})")
    suffix = template.after_design.lstrip()
    if suffix:
        echo = text.find(suffix[:_SUFFIX_PROBE_CHARS])
        if echo >= 0:
            return text[:echo].rstrip()
    marker = text.find(END_MARKER)
    if marker >= 0 and marker >= int(_END_MARKER_MIN_FRACTION * len(text)):
        text = text[:marker].rstrip()
    return text


_CAP_UNITS = r"sub-?agents?|agents?|recalls?|hops?|turns?|tool[\s-]+calls?|tools?|iterations?|rounds?|minutes?|hours?"
# "maximum N …", "at most N …", "limited to N …" with up to two qualifying words before the unit ("at most 3
# re-delegation rounds"); "per" may not appear in between, so "at most 3 files per agent" is not a cap on agents.
_NUMERIC_CAP_RE = re.compile(
    rf"\b(?:maximum(?:\s+of)?|at\s+most|limited\s+to)\s+\d+\s+(?:(?!per\b)[\w-]+\s+){{0,2}}(?:{_CAP_UNITS})\b",
    re.IGNORECASE,
)


def find_numeric_caps(design: str) -> list[str]:
    """Phrases in ``design`` that impose a fixed numeric cap on agents, recalls, hops, turns, tools, iterations,
    rounds or time (the optional ``forbid-fixed-agent-limits`` guardrail); empty when there are none."""
    found: list[str] = []
    for match in _NUMERIC_CAP_RE.finditer(design):
        phrase = " ".join(match.group(0).split())
        if phrase not in found:
            found.append(phrase)
    return found


def check_design_size(design: str, max_chars: int) -> None:
    """Raise :class:`WorkflowError` when ``design`` is longer than ``max_chars`` characters."""
    if max_chars <= 0:
        raise WorkflowError(f"max design size must be positive, got {max_chars}")
    if len(design) > max_chars:
        raise WorkflowError(f"design has {len(design)} characters, more than the limit of {max_chars}")
