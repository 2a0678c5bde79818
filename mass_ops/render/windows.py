"""Packing one segment's blocks into training windows (MASS_SPEC §7, `make_windows`).

Every window starts with the masked header (system block and first user block); at each loss-bearing block a window
opens with as much preceding context as fits within `overlap` (the segment's query block put in front), then takes
contiguous blocks while they fit. Contract: every loss-bearing block is trained in exactly one window or reported as
skipped (larger than window − header), no window exceeds `window`, and a header over `max_header_frac × window` is
an error for the thread. The exact algorithm, and where it follows the reference's code over its comment:
docs/render.md (`mass_ops.render.windows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mass_ops.render.errors import RenderError
from mass_ops.render.masks import IGNORE_INDEX, Block

HEADER_BLOCKS = 2


class SizedBlock(Protocol):
    """What windowing needs to know about a block."""

    @property
    def n_tokens(self) -> int: ...

    @property
    def n_loss_tokens(self) -> int: ...


@dataclass(frozen=True)
class WindowPlan:
    """One window: header blocks, then `ctx_blocks` (masked), then body blocks [start, end) of which `loss_blocks`
    are trained."""

    ctx_blocks: tuple[int, ...]
    start: int
    end: int
    loss_blocks: tuple[int, ...]
    n_tokens: int
    n_loss_tokens: int


@dataclass(frozen=True)
class WindowLayout:
    """All windows of one segment, the header size, and loss-bearing blocks too large for any window."""

    header_tokens: int
    windows: list[WindowPlan]
    skipped: list[int]


def make_windows(
    blocks: Sequence[SizedBlock],
    window: int,
    overlap: int,
    max_header_frac: float = 0.9,
    *,
    query_block: int | None = None,
) -> WindowLayout:
    """Plan the windows of one segment (see module docstring); `query_block` is the segment's user block index."""
    if window <= 0 or overlap < 0:
        raise RenderError(f"window must be positive and overlap non-negative (got window={window}, overlap={overlap})")
    if len(blocks) < HEADER_BLOCKS:
        raise RenderError(f"a segment needs a system and a user block (got {len(blocks)} blocks)")
    sizes = [block.n_tokens for block in blocks]
    trained = [block.n_loss_tokens > 0 for block in blocks]
    header = sizes[0] + sizes[1]
    if header > max_header_frac * window:
        raise RenderError(
            f"header (system + first user) is {header} tokens, above {max_header_frac:g} × window ({window})"
        )
    budget = window - header
    query = query_block if query_block is not None and query_block >= HEADER_BLOCKS else None

    windows: list[WindowPlan] = []
    skipped: list[int] = []
    i = HEADER_BLOCKS
    while i < len(blocks):
        if not trained[i]:
            i += 1
            continue
        if sizes[i] > budget:
            skipped.append(i)
            i += 1
            continue
        context = _context(sizes, i, overlap, query)
        context_tokens = sum(sizes[j] for j in context)
        if sizes[i] > budget - context_tokens:
            fits_with_query = query is not None and query < i and sizes[query] + sizes[i] <= budget
            context = [query] if fits_with_query else []  # type: ignore[list-item]
            context_tokens = sum(sizes[j] for j in context)
        used = header + context_tokens
        end = i
        j = i
        while j < len(blocks) and used + sizes[j] <= window:
            used += sizes[j]
            j += 1
            if trained[j - 1]:
                end = j
        body = range(i, end)
        loss_blocks = tuple(k for k in body if trained[k])
        windows.append(
            WindowPlan(
                ctx_blocks=tuple(context),
                start=i,
                end=end,
                loss_blocks=loss_blocks,
                n_tokens=header + context_tokens + sum(sizes[k] for k in body),
                n_loss_tokens=sum(blocks[k].n_loss_tokens for k in loss_blocks),
            )
        )
        i = end
    return WindowLayout(header_tokens=header, windows=windows, skipped=skipped)


def _context(sizes: list[int], i: int, overlap: int, query: int | None) -> list[int]:
    """Blocks immediately before i within `overlap` tokens, preceded by the query block when it precedes i and is
    not among them already (never dropping any of them: see the module docstring)."""
    context: list[int] = []
    total = 0
    j = i - 1
    while j >= HEADER_BLOCKS and total + sizes[j] <= overlap:
        context.insert(0, j)
        total += sizes[j]
        j -= 1
    if query is None or query >= i or query in context:
        return context
    return [query, *context]


def assemble(blocks: Sequence[Block], plan: WindowPlan) -> tuple[list[int], list[int]]:
    """input_ids and labels of a planned window: header and context masked, body blocks with their own labels."""
    input_ids: list[int] = []
    labels: list[int] = []
    for index in (*range(HEADER_BLOCKS), *plan.ctx_blocks):
        input_ids.extend(blocks[index].input_ids)
        labels.extend([IGNORE_INDEX] * blocks[index].n_tokens)
    for index in range(plan.start, plan.end):
        input_ids.extend(blocks[index].input_ids)
        labels.extend(blocks[index].labels())
    return input_ids, labels
