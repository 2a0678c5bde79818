"""Episodes → training windows: the render stage's library entry points (MASS_SPEC §7).

`render_episode` turns one episode's proxy log into `TrainingWindow`s plus per-thread statistics; `render_dataset`
does it for the selected episodes and aggregates (`iter_episode_renders` + `dataset_stats` do the same one episode at
a time, for callers that store windows as they come). Problems that `strict` mode refuses — a thread that cannot be
rendered, a block too large for any window, no thread carrying the teacher prompt — are collected as one-line
messages in `EpisodeRender.errors`; with `strict=True` the first of them is raised as `RenderError` instead. Malformed
logs (bad JSON, records without requests) always raise. Nothing here reads or writes storage.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, Unpack

from mass_ops.render.errors import RenderError
from mass_ops.render.masks import ChatRenderer, Segment, vllm_messages
from mass_ops.render.proxy_log import ProxyLogSource, exchanges
from mass_ops.render.substitution import agent_role, find_teacher_prompt, substitute
from mass_ops.render.threads import Conversation, conversations
from mass_ops.render.windows import assemble, make_windows

DEFAULT_WINDOW = 32768
DEFAULT_OVERLAP = 8192
_TASK_IN_CONDITION = re.compile(r"^t(\d+)_")


@dataclass(frozen=True)
class EpisodeSource:
    """Everything rendering needs about one selected episode; `log_records` is any `ProxyLogSource`
    (gz/plain bytes, a path, or an iterable of records or JSONL lines)."""

    episode: str
    task: int
    condition: str
    seed: int
    success: bool
    log_records: ProxyLogSource
    teacher_prompt: str | None = None
    bare_prompt: str | None = None
    weight: float = 1.0


@dataclass(frozen=True)
class TrainingWindow:
    """One training example: token ids, labels (−100 = not trained) and where it came from."""

    input_ids: list[int]
    labels: list[int]
    n_tokens: int
    n_loss_tokens: int
    blocks: tuple[int, int]
    ctx_blocks: tuple[int, ...]
    loss_blocks: tuple[int, ...]
    header_tokens: int
    segment: int
    episode: str
    condition: str
    seed: int
    thread: str
    task: int
    is_main: bool
    role: str
    match_mode: str | None
    window: int
    n_windows: int
    success: bool
    weight: float

    def as_record(self) -> dict[str, Any]:
        """The JSON-ready row (one line of the windows JSONL)."""
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "n_tokens": self.n_tokens,
            "n_loss_tokens": self.n_loss_tokens,
            "blocks": list(self.blocks),
            "ctx_blocks": list(self.ctx_blocks),
            "loss_blocks": list(self.loss_blocks),
            "header_tokens": self.header_tokens,
            "segment": self.segment,
            "episode": self.episode,
            "condition": self.condition,
            "seed": self.seed,
            "thread": self.thread,
            "task": self.task,
            "is_main": self.is_main,
            "role": self.role,
            "match_mode": self.match_mode,
            "window": self.window,
            "n_windows": self.n_windows,
            "success": self.success,
            "weight": self.weight,
        }


@dataclass
class EpisodeRender:
    """Result of rendering one episode: windows, statistics (JSON-ready; they repeat `errors`) and the one-line
    problems strict mode refuses."""

    windows: list[TrainingWindow]
    stats: dict[str, Any]
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RenderOptions:
    """The knobs of rendering (MASS_SPEC §7); the paper's render stage uses window 49152, overlap 8192, strict and
    require_success. `substitute=False` keeps the teacher prompt in the main thread (it is still detected);
    `sent_forms` maps md5(prompt text) → the text qwen-code actually sent."""

    window: int = DEFAULT_WINDOW
    overlap: int = DEFAULT_OVERLAP
    strict: bool = False
    require_success: bool = False
    max_header_frac: float = 0.9
    keep_truncated_final: bool = False
    substitute: bool = True
    sent_forms: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise RenderError(f"window must be positive (got {self.window})")
        if not 0 <= self.overlap < self.window:
            raise RenderError(f"overlap must be in [0, window) (got {self.overlap} for window {self.window})")
        if not 0 < self.max_header_frac <= 1:
            raise RenderError(f"max_header_frac must be in (0, 1] (got {self.max_header_frac})")

    def as_args(self) -> dict[str, Any]:
        """JSON-ready record of the options for the stats document (the sent-form index by size)."""
        return {
            "window": self.window,
            "overlap": self.overlap,
            "strict": self.strict,
            "require_success": self.require_success,
            "max_header_frac": self.max_header_frac,
            "keep_truncated_final": self.keep_truncated_final,
            "substitute": self.substitute,
            "sent_forms": len(self.sent_forms or {}),
        }


class RenderKnobs(TypedDict, total=False):
    """`RenderOptions`' fields as the keyword arguments of `render_episode` and `render_dataset` (the defaults are
    `RenderOptions`' own)."""

    window: int
    overlap: int
    strict: bool
    require_success: bool
    max_header_frac: float
    keep_truncated_final: bool
    substitute: bool
    sent_forms: Mapping[str, str] | None


def task_from_condition(condition: str) -> int | None:
    """The task id of a `t<q>_…` condition name, or None."""
    found = _TASK_IN_CONDITION.match(condition)
    return int(found.group(1)) if found else None


def render_episode(source: EpisodeSource, tokenizer: Any, **options: Unpack[RenderKnobs]) -> EpisodeRender:
    """Render one episode's proxy log into training windows (MASS_SPEC §7); options as in `RenderOptions`.

    `require_success` skips an unsuccessful episode (no windows; the stats say why). With `strict`, the first
    problem (thread error, skipped block, no main thread) is raised as `RenderError`.
    """
    return _render_episode(source, ChatRenderer(tokenizer), RenderOptions(**options))


def _render_episode(source: EpisodeSource, renderer: ChatRenderer, options: RenderOptions) -> EpisodeRender:
    stats: dict[str, Any] = {
        "episode": source.episode,
        "task": source.task,
        "condition": source.condition,
        "seed": source.seed,
        "success": source.success,
        "weight": source.weight,
        "used": True,
        "skip_reason": None,
    }
    if options.require_success and not source.success:
        stats.update(
            used=False, skip_reason="not successful", n_windows=0, loss_tokens=0, total_tokens=0, threads=[], errors=[]
        )
        return EpisodeRender(windows=[], stats=stats)
    if source.teacher_prompt is not None and source.bare_prompt is None and options.substitute:
        raise RenderError(f"episode {source.episode}: a teacher prompt was given without the bare prompt to put in")

    where = f"episode {source.episode}"
    threads = conversations(
        exchanges(source.log_records, where=where), keep_truncated_final=options.keep_truncated_final
    )
    thread_stats = [_thread_info(conversation) for conversation in threads]
    prepared = [
        _prepare_thread(source, c, options, info, renderer.part_separator)
        for c, info in zip(threads, thread_stats, strict=True)
    ]
    pending = [(c, info, m) for c, info, m in zip(threads, thread_stats, prepared, strict=True) if m is not None]
    try:
        # All conversations of the episode are tokenised together: one batch keeps every tokenizer thread busy.
        rendered = renderer.render_many([(m, c.tools, _where(source, c)) for c, _, m in pending])
    finally:
        renderer.clear_cache()  # blocks recur within an episode only
    windows: list[TrainingWindow] = []
    for (conversation, info, _), segments in zip(pending, rendered, strict=True):
        if isinstance(segments, RenderError):
            _record_error(info, segments, _where(source, conversation))
            continue
        windows.extend(_thread_windows(source, conversation, segments, options, info))

    problems: list[str] = []
    for info in thread_stats:
        if info["error"]:
            problems.append(info["error"])
        for skipped in info["skipped"]:
            problems.append(
                f"{where} thread {info['thread']}: segment {skipped['segment']} block {skipped['block']} "
                f"({skipped['n_tokens']} tokens) does not fit any window"
            )
    if not any(info["is_main"] for info in thread_stats):
        problems.append(f"{where}: no thread carries the teacher prompt (no main thread matched)")
    if options.strict and problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RenderError(problems[0] + more)
    stats.update(
        n_windows=len(windows),
        loss_tokens=sum(w.n_loss_tokens for w in windows),
        total_tokens=sum(w.n_tokens for w in windows),
        threads=thread_stats,
        errors=problems,
    )
    return EpisodeRender(windows=windows, stats=stats, errors=problems)


def _where(source: EpisodeSource, conversation: Conversation) -> str:
    return f"episode {source.episode} thread {conversation.thread_id}"


def _record_error(info: dict[str, Any], exc: RenderError, where: str) -> None:
    message = str(exc)
    info["error"] = message if message.startswith(where) else f"{where}: {message}"


def _thread_info(conversation: Conversation) -> dict[str, Any]:
    return {
        "thread": conversation.thread_id,
        "role": None,
        "is_main": False,
        "match_mode": None,
        "n_requests": conversation.n_requests,
        "n_messages": len(conversation.messages),
        "n_segments": 0,
        "n_tokens": 0,
        "n_windows": 0,
        "loss_tokens": 0,
        "final_truncated": conversation.final_truncated,
        "empty_reasoning_turns": 0,
        "skipped": [],
        "error": None,
    }


def _prepare_thread(
    source: EpisodeSource,
    conversation: Conversation,
    options: RenderOptions,
    info: dict[str, Any],
    part_separator: str,
) -> list[dict[str, Any]] | None:
    """vLLM-normalised messages (list content joined with `part_separator`, as the template renders it) with the
    teacher prompt substituted in the main thread; None after a thread error (recorded in `info`). Sets the thread's
    role, main flag and match mode."""
    where = _where(source, conversation)
    try:
        messages = vllm_messages(conversation.messages, where=where, part_separator=part_separator)
        system = messages[0]["content"] if messages and messages[0].get("role") == "system" else ""
        first_user = next((i for i, message in enumerate(messages) if message.get("role") == "user"), None)
        info["role"] = agent_role(system, is_main=False)
        match = None
        if source.teacher_prompt and first_user is not None:
            match = find_teacher_prompt(
                messages[first_user]["content"],
                source.teacher_prompt,
                source.bare_prompt or "",
                sent_forms=options.sent_forms,
                where=where,
            )
    except RenderError as exc:
        _record_error(info, exc, where)
        return None
    if match is not None and first_user is not None:
        info.update(is_main=True, match_mode=match.mode, role=agent_role(system, is_main=True))
        if options.substitute:
            replaced = substitute(messages[first_user]["content"], match)
            messages[first_user] = {**messages[first_user], "content": replaced}
    return messages


def _thread_windows(
    source: EpisodeSource,
    conversation: Conversation,
    segments: list[Segment],
    options: RenderOptions,
    info: dict[str, Any],
) -> list[TrainingWindow]:
    """Plan and assemble the windows of one rendered conversation; a window-planning error voids the thread."""
    try:
        layouts = [
            make_windows(
                segment.blocks,
                options.window,
                options.overlap,
                options.max_header_frac,
                query_block=segment.query_block,
            )
            for segment in segments
        ]
    except RenderError as exc:
        _record_error(info, exc, _where(source, conversation))
        return []
    info["n_segments"] = len(segments)
    info["n_tokens"] = segments[-1].n_tokens if segments else 0
    task = source.task if source.task is not None else task_from_condition(source.condition)
    windows: list[TrainingWindow] = []
    for segment, layout in zip(segments, layouts, strict=True):
        info["empty_reasoning_turns"] += sum(1 for block in segment.blocks if block.empty_reasoning)
        info["skipped"].extend(
            {"segment": segment.index, "block": index, "n_tokens": segment.blocks[index].n_tokens}
            for index in layout.skipped
        )
        for plan in layout.windows:
            input_ids, labels = assemble(segment.blocks, plan)
            windows.append(
                TrainingWindow(
                    input_ids=input_ids,
                    labels=labels,
                    n_tokens=plan.n_tokens,
                    n_loss_tokens=plan.n_loss_tokens,
                    blocks=(plan.start, plan.end),
                    ctx_blocks=plan.ctx_blocks,
                    loss_blocks=plan.loss_blocks,
                    header_tokens=layout.header_tokens,
                    segment=segment.index,
                    episode=source.episode,
                    condition=source.condition,
                    seed=source.seed,
                    thread=conversation.thread_id,
                    task=task,
                    is_main=info["is_main"],
                    role=info["role"],
                    match_mode=info["match_mode"],
                    window=len(windows),
                    n_windows=0,  # set below, once the thread's count is known
                    success=source.success,
                    weight=source.weight,
                )
            )
    count = len(windows)
    info["n_windows"] = count
    info["loss_tokens"] = sum(w.n_loss_tokens for w in windows)
    return [replace(w, n_windows=count) for w in windows]


def iter_episode_renders(
    episodes: Sequence[EpisodeSource], tokenizer: Any, options: RenderOptions | None = None
) -> Iterator[EpisodeRender]:
    """Render episodes one by one, so a caller can store each episode's windows before the next is rendered.

    Episode ids must be unique (checked before anything is rendered).
    """
    options = options or RenderOptions()
    seen: set[str] = set()
    for source in episodes:
        if source.episode in seen:
            raise RenderError(f"episode {source.episode} is listed twice")
        seen.add(source.episode)
    renderer = ChatRenderer(tokenizer)
    for source in episodes:
        yield _render_episode(source, renderer, options)


def dataset_stats(renders_stats: Sequence[Mapping[str, Any]], options: RenderOptions) -> dict[str, Any]:
    """The stats document {args, aggregate, episodes} from the `stats` of each `EpisodeRender`."""
    episodes = [dict(row) for row in renders_stats]
    used = [row for row in episodes if row["used"]]
    threads = [thread for row in used for thread in row["threads"]]
    return {
        "args": options.as_args(),
        "aggregate": {
            "episodes": len(used),
            "episodes_skipped": len(episodes) - len(used),
            "windows": sum(row["n_windows"] for row in used),
            "loss_tokens": sum(row["loss_tokens"] for row in used),
            "total_tokens": sum(row["total_tokens"] for row in used),
            "threads": len(threads),
            "thread_errors": sum(1 for thread in threads if thread["error"]),
            "skipped_blocks": sum(len(thread["skipped"]) for thread in threads),
            "empty_reasoning_turns": sum(thread["empty_reasoning_turns"] for thread in threads),
        },
        "episodes": episodes,
    }


def render_dataset(
    episodes: Sequence[EpisodeSource],
    tokenizer: Any,
    *,
    require_windows: bool = False,
    **knobs: Unpack[RenderKnobs],
) -> tuple[list[TrainingWindow], dict[str, Any]]:
    """Render every episode; return all windows and the stats document {args, aggregate, episodes}; options as in
    `RenderOptions`.

    `require_windows` applies `ensure_every_episode_has_windows` (the render stage's final check). For paper-sized
    datasets prefer `iter_episode_renders`, which does not hold every window in memory at once.
    """
    options = RenderOptions(**knobs)
    windows: list[TrainingWindow] = []
    rows: list[dict[str, Any]] = []
    for result in iter_episode_renders(episodes, tokenizer, options):
        windows.extend(result.windows)
        rows.append(result.stats)
    if require_windows:
        ensure_every_episode_has_windows([source.episode for source in episodes], (w.episode for w in windows))
    return windows, dataset_stats(rows, options)


def ensure_every_episode_has_windows(episodes: Iterable[str], produced: Iterable[str]) -> None:
    """Raise `RenderError` naming every selected episode absent from `produced` (the episode ids of the windows
    written, e.g. `w.episode for w in windows`): the render stage must fail when one yields no window."""
    have = set(produced)
    missing = [episode for episode in episodes if episode not in have]
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        raise RenderError(f"{len(missing)} selected episode(s) produced no training window: {shown}")
