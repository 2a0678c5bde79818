"""The search stage family's command form: RHI for the given tasks, one summary row per task (MASS_SPEC §1 search).

The algorithm (reference and version episodes, judging, arbitration, proposals) lives in `mass_ops.search.driver`;
this module only attaches the cycle and shapes the rows. `mass_ops.stages.search_step` runs one version step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import attach_cycle
from mass_ops.llm import LLMClient
from mass_ops.runtime.episode import EpisodeExecutor
from mass_ops.search.driver import search_tasks


def run_search(
    config: CycleConfig,
    tasks: Sequence[int] | None = None,
    *,
    executor: EpisodeExecutor,
    client: LLMClient | None = None,
) -> list[dict[str, Any]]:
    """The `search` command: RHI for the given tasks (default: the train candidates); one summary row per task."""
    ctx = attach_cycle(config)
    return [result.as_row() for result in search_tasks(ctx, executor, tasks, client=client)]
