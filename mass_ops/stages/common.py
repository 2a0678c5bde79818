"""What every stage family shares: the episode executor of a cycle, the XCom-safe row, the post-training refusal
of remote backends, and the names of the training splits and run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import CycleContext
from mass_ops.errors import InputError
from mass_ops.runtime.episode import EpisodeExecutor

SPLITS = ("train", "val")
TRAINING_RUN_KEY = "sft"


class PostTrainingError(InputError):
    """A post-training stage cannot run or continue; the message names the stage, the record and why."""


def refuse_remote(config: CycleConfig, stage: str) -> None:
    """Render, train and export need the model's weights: refuse a remotely served model (MASS_SPEC §1)."""
    if config.is_remote_backend:
        raise PostTrainingError(
            f"{stage}: inference.backend is {config.inference.backend}: a remotely served model cannot be rendered, "
            "trained or exported (MASS_SPEC §1); run this stage with a local-backend config"
        )


@contextmanager
def episode_executor(ctx: CycleContext) -> Iterator[EpisodeExecutor]:
    """The cycle's episode executor: local qwen-code processes behind an EpisodePool. On a backend that runs episodes
    in pods (`ComputeBackend.episode_pod`), the pods ran them first and the pool finds them recorded (reused)."""
    from mass_ops.runtime.pool import EpisodePool

    with EpisodePool(ctx) as pool:
        yield pool


def jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """Keep XCom payloads plain: drop anything that is not JSON-native."""
    plain = (str, int, float, bool, type(None))

    def clean(value: Any) -> Any:
        if isinstance(value, plain):
            return value
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return str(value)

    return {str(k): clean(v) for k, v in row.items()}
