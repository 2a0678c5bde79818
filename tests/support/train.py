"""Window records and files of the training tests (MASS_SPEC §7 fields the trainer reads)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def window_record(input_ids: list[int], labels: list[int], *, task: int, role: str, episode: str) -> dict[str, Any]:
    """A MASS_SPEC §7 window record with the fields the trainer reads."""
    return {
        "input_ids": list(input_ids),
        "labels": list(labels),
        "task": task,
        "role": role,
        "is_main": role == "orchestrator",
        "episode": episode,
        "condition": f"t{task}_L0",
        "n_tokens": len(input_ids),
        "n_loss_tokens": sum(label != -100 for label in labels),
    }


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write `rows` as JSON lines to `path`."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
