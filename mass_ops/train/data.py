"""Loading window datasets (MASS_SPEC §7 records) for training and validation.

Token ids are kept as int32 numpy arrays (a paper-sized set holds ~10⁸ ids; Python lists would need ~30× the memory).
Windows with nothing to learn after the first position (all labels[1:] == −100) are dropped at load, as the
reference does, and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mass_ops.errors import InputError
from mass_ops.train.sampler import WindowTag

IGNORE_INDEX = -100
ROLES = frozenset({"orchestrator", "worker", "auxiliary"})


class WindowDataError(InputError):
    """A window file that cannot be trained on; the message names file, line and field."""


@dataclass(frozen=True)
class TrainingWindow:
    """One window: token ids, labels (−100 = masked) and the tags the sampler and validation breakdowns use."""

    index: int
    line: int
    input_ids: np.ndarray
    labels: np.ndarray
    task: int
    role: str
    episode: str
    is_main: bool

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_loss_tokens(self) -> int:
        """Supervised next-token targets (labels after the first position)."""
        return int(np.count_nonzero(self.labels[1:] != IGNORE_INDEX))

    def tag(self) -> WindowTag:
        return WindowTag(
            index=self.index, task=self.task, role=self.role, episode=self.episode, n_loss_tokens=self.n_loss_tokens
        )


@dataclass(frozen=True)
class WindowSet:
    path: str
    windows: list[TrainingWindow]
    dropped_unsupervised: int

    def __len__(self) -> int:
        return len(self.windows)

    def tags(self) -> list[WindowTag]:
        return [w.tag() for w in self.windows]

    @property
    def loss_tokens(self) -> int:
        return sum(w.n_loss_tokens for w in self.windows)


def _int_array(value: object, where: str, name: str) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise WindowDataError(f"{where}: '{name}' must be a non-empty list of token ids")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        raise WindowDataError(f"{where}: '{name}' must be a flat list of integers") from None
    # dtype kind, not a per-element check: fast on 49k-token windows, and rejects floats, bools, strings, nesting.
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise WindowDataError(f"{where}: '{name}' must be a flat list of integers")
    return array


def parse_window(record: object, *, where: str, index: int, line: int, vocab_size: int | None) -> TrainingWindow:
    """Validate one JSON record into a `TrainingWindow` (without the unsupervised-window filter)."""
    if not isinstance(record, dict):
        raise WindowDataError(f"{where}: a window must be a JSON object")
    missing = [k for k in ("input_ids", "labels", "task", "role", "episode") if k not in record]
    if missing:
        raise WindowDataError(f"{where}: missing fields {missing}")
    input_ids = _int_array(record["input_ids"], where, "input_ids")
    labels = _int_array(record["labels"], where, "labels")
    if input_ids.shape != labels.shape:
        raise WindowDataError(
            f"{where}: input_ids ({input_ids.shape[0]}) and labels ({labels.shape[0]}) differ in length"
        )
    if input_ids.min() < 0 or (vocab_size is not None and input_ids.max() >= vocab_size):
        raise WindowDataError(f"{where}: input_ids outside the vocabulary [0, {vocab_size})")
    supervised = labels[labels != IGNORE_INDEX]
    if supervised.size and (supervised.min() < 0 or (vocab_size is not None and supervised.max() >= vocab_size)):
        raise WindowDataError(f"{where}: labels must be −100 or token ids in [0, {vocab_size})")
    task = record["task"]
    if isinstance(task, bool) or not isinstance(task, int):
        raise WindowDataError(f"{where}: 'task' must be an integer task id (got {task!r})")
    role = record["role"]
    if role not in ROLES:
        raise WindowDataError(f"{where}: 'role' must be one of {sorted(ROLES)} (got {role!r})")
    episode = record["episode"]
    if not isinstance(episode, str) or not episode:
        raise WindowDataError(f"{where}: 'episode' must be a non-empty string")
    return TrainingWindow(
        index=index,
        line=line,
        input_ids=input_ids.astype(np.int32),
        labels=labels.astype(np.int32),
        task=task,
        role=role,
        episode=episode,
        is_main=bool(record.get("is_main", role == "orchestrator")),
    )


def load_windows(path: str | Path, *, vocab_size: int | None = None) -> WindowSet:
    """Read a window JSONL file. Raises `WindowDataError` naming file:line on the first bad record; empty files and
    files whose every window is unsupervised are errors too."""
    path = Path(path)
    if not path.is_file():
        raise WindowDataError(f"{path}: window file not found")
    windows: list[TrainingWindow] = []
    dropped = 0
    with path.open("r", encoding="utf-8") as handle:
        for line_no, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise WindowDataError(f"{where}: not valid JSON ({exc.msg})") from None
            window = parse_window(record, where=where, index=len(windows), line=line_no, vocab_size=vocab_size)
            if window.n_loss_tokens == 0:
                dropped += 1
                continue
            windows.append(window)
    if not windows:
        raise WindowDataError(f"{path}: no window with supervised tokens ({dropped} dropped as label-free)")
    return WindowSet(path=str(path), windows=windows, dropped_unsupervised=dropped)
