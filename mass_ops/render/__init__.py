"""Proxy logs → conversations → training windows with assistant-only loss masks (MASS_SPEC §7).

Modules, in data-flow order: `proxy_log` (records → exchanges), `threads` (threads and conversations),
`substitution` (main thread, roles, teacher → bare prompt), `masks` (chat template → token blocks and labels),
`windows` (`make_windows`), `episodes` (`render_episode`, `render_dataset`). No storage code: callers pass records in
and store the windows and stats they get back.
"""

from mass_ops.render.episodes import (
    DEFAULT_OVERLAP,
    DEFAULT_WINDOW,
    EpisodeRender,
    EpisodeSource,
    RenderOptions,
    TrainingWindow,
    dataset_stats,
    ensure_every_episode_has_windows,
    iter_episode_renders,
    render_dataset,
    render_episode,
)
from mass_ops.render.errors import RenderError
from mass_ops.render.masks import IGNORE_INDEX, ChatRenderer
from mass_ops.render.proxy_log import iter_proxy_records
from mass_ops.render.windows import make_windows

__all__ = [
    "DEFAULT_OVERLAP",
    "DEFAULT_WINDOW",
    "IGNORE_INDEX",
    "ChatRenderer",
    "EpisodeRender",
    "EpisodeSource",
    "RenderError",
    "RenderOptions",
    "TrainingWindow",
    "dataset_stats",
    "ensure_every_episode_has_windows",
    "iter_episode_renders",
    "iter_proxy_records",
    "make_windows",
    "render_dataset",
    "render_episode",
]
