"""Names and artifact keys of every record of a cycle, in one place.

Artifact keys are relative to the configured artifact store (`s3://bucket/prefix` or a folder), so the same layout
serves both profiles, e.g. `cycles/<cycle>/episodes/<episode>/workspace.tar.gz`. Condition names follow the
reference release (MASS_SPEC §1) so that rendered datasets and compatibility exports match it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from mass_ops.errors import InputError

EpisodeKind = Literal["reference", "search", "collection", "rollout", "benchmark"]

# Files an episode publishes; the episode row stores their URIs under these names.
EPISODE_FILES = {
    "workspace": "workspace.tar.gz",
    "api_log": "api_requests.jsonl.gz",
    "stream": "stream.jsonl",
    "stderr": "stderr.log",
    "status": "status.json",
    "prompt": "prompt.txt",
    "settings": "settings.json",
}
# Kind of the `evaluations` row of a pairwise evaluation (L(k+1) against L(k)).
PAIRWISE_KIND = "pairwise"
# The prompt an episode pod's publisher container writes into the shared hand-off folder for its sandbox.
HANDOFF_PROMPT_FILE = "prompt.txt"


# A benchmark task's name as the adapters build it (`<benchmark>_<instance>`): what a command line, a label (after
# `compute.kubernetes.label_value`), a hand-off document and an artifact key can all carry.
BENCHMARK_TASK_NAME = re.compile(r"[a-z0-9]+_[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def bare_condition(task_id: int) -> str:
    """Condition of a bare-task episode (RHI reference, evaluation rollout)."""
    return f"t{task_id}_bare"


def version_condition(task_id: int, version: int) -> str:
    """Condition of an RHI episode of workflow version k."""
    return f"t{task_id}_v{version}"


def teacher_condition(task_id: int, generation: int) -> str:
    """Condition of a teacher-collection episode of generation g."""
    return f"t{task_id}_L{generation}"


def episode_name(condition: str, seed: int) -> str:
    """Human-readable episode name used by the reference release: `{condition}_s{seed}`."""
    return f"{condition}_s{seed}"


@dataclass(frozen=True)
class EpisodeUnit:
    """The deterministic identity of one episode attempt (ARCHITECTURE: units of work)."""

    cycle: str
    task_id: int
    kind: EpisodeKind
    seed: int
    version: int | None = None
    candidate: int | None = None
    attempt: int = 1
    generation: str | None = None

    @property
    def slug(self) -> str:
        """Stable, path-safe identity without the attempt: the same unit across retries.

        The executing generation is part of the identity when given: rollouts of L(k) and L(k+1) share seeds for the
        paired comparison and must not share artifacts. Never change this format: stored keys must match on resume.
        """
        parts = [self.kind, f"t{self.task_id}"]
        if self.version is not None:
            parts.append(f"v{self.version}")
        if self.candidate is not None:
            parts.append(f"c{self.candidate}")
        parts.append(f"s{self.seed}")
        if self.generation is not None:
            parts.append(f"g{self.generation}")
        return "-".join(parts)

    @property
    def key(self) -> str:
        """Unique key of this attempt within the metadata store."""
        return f"{self.cycle}/{self.slug}/a{self.attempt}"

    def identity(self) -> dict[str, Any]:
        """The fields that identify the unit across its attempts (the filter of `episode_attempts`)."""
        return {
            "task_id": self.task_id,
            "kind": self.kind,
            "seed": self.seed,
            "version": self.version,
            "candidate": self.candidate,
            "generation": self.generation,
        }

    def artifact_prefix(self) -> str:
        """Artifact folder of this attempt."""
        return f"{cycle_prefix(self.cycle)}/episodes/{self.slug}/a{self.attempt}"

    def artifact_key(self, name: str) -> str:
        """Key of one of the episode's files (see EPISODE_FILES)."""
        return f"{self.artifact_prefix()}/{EPISODE_FILES[name]}"


def cycle_prefix(cycle: str) -> str:
    """Root of a cycle's artifacts."""
    return f"cycles/{cycle}"


def llm_call_prefix(cycle: str, call_key: str) -> str:
    """Folder holding one LLM call's prompt and result (call keys use '/' to group by task and ledger)."""
    return f"{cycle_prefix(cycle)}/calls/{call_key}"


def llm_call_prompt_key(cycle: str, call_key: str) -> str:
    """One LLM call's request document (what was sent, and what each message was rendered from)."""
    return f"{llm_call_prefix(cycle, call_key)}/prompt.json"


def workflow_version_key(cycle: str, task_id: int, version: int) -> str:
    """Full prompt of RHI version k of task q."""
    return f"{cycle_prefix(cycle)}/search/task{task_id}/versions/v{version}.txt"


def teacher_prompt_key(cycle: str, task_id: int) -> str:
    """Teacher prompt of task q (retained version + teacher directive)."""
    return f"{cycle_prefix(cycle)}/collection/task{task_id}/teacher_prompt.txt"


def teacher_prompt_inputs_key(cycle: str, task_id: int) -> str:
    """The template and variables the teacher prompt of task q was rendered from."""
    return f"{cycle_prefix(cycle)}/collection/task{task_id}/teacher_prompt_inputs.json"


def episode_prompt_key(cycle: str, prompt_sha256: str) -> str:
    """A prompt handed to an episode pod, content-addressed by its SHA-256 (the same prompt is stored once)."""
    if len(prompt_sha256) != 64 or any(c not in "0123456789abcdef" for c in prompt_sha256):
        raise ValueError(f"episode prompt: {prompt_sha256!r} is not a lowercase hex SHA-256")
    return f"{cycle_prefix(cycle)}/prompts/{prompt_sha256}.txt"


def dataset_key(cycle: str, split: str, shard: int) -> str:
    """One JSONL shard of the rendered windows of a split."""
    return f"{cycle_prefix(cycle)}/datasets/{split}/windows-{shard:05d}.jsonl.gz"


def dataset_stats_key(cycle: str, split: str) -> str:
    """Render statistics of a split."""
    return f"{cycle_prefix(cycle)}/datasets/{split}/stats.json"


def training_prefix(cycle: str) -> str:
    """Training outputs of a cycle (logs, checkpoints)."""
    return f"{cycle_prefix(cycle)}/training"


def model_prefix(location: str) -> str:
    """Artifact folder of a model given its configured location (relative keys are used as they are)."""
    return location.rstrip("/")


def report_prefix(cycle: str) -> str:
    """Report of a cycle (Markdown, HTML, figures)."""
    return f"{cycle_prefix(cycle)}/report"


_GENERATION_IN_KEY = re.compile(r"L(\d+)(?=-(?:bf16|fp8)$)")


def next_generation_key(key: str, generation: int) -> str:
    """`models/L1-bf16` → `models/L2-bf16`: the model key of the generation after `generation`; InputError when the
    key does not name generation `generation` as `…L<g>-bf16` or `…L<g>-fp8`."""
    match = _GENERATION_IN_KEY.search(key)
    if match is None or int(match.group(1)) != generation:
        raise InputError(
            f"cannot derive the next cycle's model key from {key!r} (expected …L{generation}-bf16 or …-fp8); set the "
            "next cycle's models explicitly"
        )
    return key[: match.start(1)] + str(generation + 1) + key[match.end(1) :]
