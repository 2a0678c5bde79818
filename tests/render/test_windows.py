"""`make_windows` on synthetic block sizes: the packing rules of MASS_SPEC §7, without a tokenizer."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from mass_ops.render import IGNORE_INDEX, RenderError, make_windows
from mass_ops.render.masks import Block
from mass_ops.render.windows import assemble


@dataclass(frozen=True)
class Sized:
    n_tokens: int
    n_loss_tokens: int = 0


def blocks(*spec: int | tuple[int, int]) -> list[Sized]:
    """Sizes; a (size, loss) pair marks a loss-bearing block."""
    return [Sized(*item) if isinstance(item, tuple) else Sized(item) for item in spec]


def test_everything_fits_in_one_window_ending_after_the_last_trained_block():
    layout = make_windows(blocks(10, 10, (5, 4), 20, (5, 4), 30), window=100, overlap=10)
    (only,) = layout.windows
    assert layout.header_tokens == 20
    assert (only.start, only.end, only.ctx_blocks, only.loss_blocks) == (2, 5, (), (2, 4))
    assert only.n_tokens == 50 and only.n_loss_tokens == 8
    assert layout.skipped == []


def test_next_window_starts_after_the_last_trained_block_with_preceding_context():
    # header 20, budget 40: [A 15][T 10][A 15][T 10][A 15]
    layout = make_windows(blocks(10, 10, (15, 10), 10, (15, 10), 10, (15, 10)), window=60, overlap=12)
    first, second = layout.windows
    assert (first.start, first.end, first.loss_blocks) == (2, 5, (2, 4))
    # Context = the tool block just before block 6 (10 ≤ overlap 12); the assistant before it would exceed overlap.
    assert (second.ctx_blocks, second.start, second.end, second.loss_blocks) == ((5,), 6, 7, (6,))
    assert second.n_tokens == 20 + 10 + 15


def test_query_block_is_put_in_front_of_the_context():
    # Segment 1 of a conversation: blocks 2–4 are the previous segment, block 5 is this segment's user message.
    sizes = blocks(10, 10, 8, 8, 8, 6, (30, 20), 4, (30, 20))
    layout = make_windows(sizes, window=80, overlap=10, query_block=5)
    first, second = layout.windows
    assert first.ctx_blocks == (5,) and first.start == 6
    # Block 8's window: the tool block 7 fits within overlap; the query goes in front of it.
    assert (second.ctx_blocks, second.start) == ((5, 7), 8)


def test_query_block_in_front_drops_nothing_so_context_may_exceed_overlap():
    # header 20, budget 40; query block 3 (6 tokens). Block 7's preceding blocks 5 and 6 fill the overlap (8); the
    # query goes in front of them and both stay: 14 context tokens, the overlap plus the query block's size.
    sizes = blocks(10, 10, 5, 6, (20, 15), 4, 4, (20, 15))
    first, second = make_windows(sizes, window=60, overlap=8, query_block=3).windows
    assert (first.ctx_blocks, first.start, first.end) == ((3,), 4, 5)
    assert (second.ctx_blocks, second.start, second.end) == ((3, 5, 6), 7, 8)
    assert second.n_tokens == 20 + 6 + 4 + 4 + 20


def test_query_block_already_in_the_context_is_not_repeated():
    layout = make_windows(blocks(10, 10, 5, 5, (10, 9)), window=100, overlap=50, query_block=3)
    assert layout.windows[0].ctx_blocks == (2, 3)


def test_context_falls_back_to_the_query_block_then_to_nothing():
    # Budget 80. Block 6 (72) cannot follow the 10-token context [query, block 5], but fits after the query alone.
    layout = make_windows(blocks(10, 10, 5, 5, 5, 5, (72, 60)), window=100, overlap=10, query_block=3)
    assert layout.windows[0].ctx_blocks == (3,)
    # Here even the query does not fit beside block 6 (75 + 10 > 80): no context at all.
    layout = make_windows(blocks(10, 10, 5, 10, 5, 5, (75, 60)), window=100, overlap=10, query_block=3)
    assert layout.windows[0].ctx_blocks == ()


def test_oversize_trained_block_is_skipped_and_later_blocks_still_train():
    layout = make_windows(blocks(10, 10, (90, 80), 5, (10, 9)), window=100, overlap=20)
    assert layout.skipped == [2]
    (only,) = layout.windows
    assert (only.ctx_blocks, only.start, only.loss_blocks) == ((3,), 4, (4,))


def test_header_above_the_allowed_share_of_the_window_is_an_error():
    make_windows(blocks(45, 45, (5, 5)), window=100, overlap=0)  # exactly 0.9 × window is allowed
    with pytest.raises(RenderError, match="header"):
        make_windows(blocks(45, 46, (5, 5)), window=100, overlap=0)
    with pytest.raises(RenderError, match="header"):
        make_windows(blocks(30, 31, (5, 5)), window=100, overlap=0, max_header_frac=0.6)


def test_segment_without_trained_blocks_has_no_window():
    assert make_windows(blocks(10, 10, 30, 30), window=100, overlap=10).windows == []


@pytest.mark.parametrize("seed", range(40))
def test_random_segments_train_every_block_exactly_once_within_the_window(seed: int):
    rng = random.Random(seed)
    window = rng.choice([64, 128, 512])
    overlap = rng.randrange(0, window // 2)
    n = rng.randrange(3, 40)
    spec = [rng.randrange(1, window // 4), rng.randrange(1, window // 4)]
    query = rng.choice([None, *range(2, n)])
    sizes = blocks(*spec)
    for index in range(2, n):
        size = rng.choice([rng.randrange(1, window // 3), rng.randrange(1, window + 40)])
        loss = rng.random() < 0.5 and (query is None or index > query)
        sizes.append(Sized(size, max(1, size - 3) if loss else 0))
    layout = make_windows(sizes, window, overlap, query_block=query)

    trained = [i for i, block in enumerate(sizes) if block.n_loss_tokens]
    covered = [i for plan in layout.windows for i in plan.loss_blocks]
    assert sorted(covered + layout.skipped) == trained
    assert len(set(covered)) == len(covered)
    budget = window - layout.header_tokens
    assert all(sizes[i].n_tokens > budget for i in layout.skipped)
    previous_end = 2
    for plan in layout.windows:
        assert plan.n_tokens <= window
        assert plan.n_tokens == layout.header_tokens + sum(sizes[i].n_tokens for i in plan.ctx_blocks) + sum(
            sizes[i].n_tokens for i in range(plan.start, plan.end)
        )
        assert previous_end <= plan.start < plan.end and sizes[plan.start].n_loss_tokens
        assert sizes[plan.end - 1].n_loss_tokens  # ends right after a trained block
        assert all(i < plan.start for i in plan.ctx_blocks)
        if query is not None and query < plan.start and plan.ctx_blocks:
            assert query in plan.ctx_blocks  # a non-empty context always holds the segment's query
        previous_end = plan.end


def test_assemble_masks_header_and_context_and_keeps_body_labels():
    made = [
        Block("system", 0, [1, 2], None),
        Block("user", 1, [3], None),
        Block("assistant", 2, [4, 5, 6], (1, 3)),
        Block("tool", 3, [7, 8], None),
        Block("assistant", 4, [9, 10, 11], (1, 3)),
    ]
    layout = make_windows(made, window=11, overlap=5)
    ids, labels = assemble(made, layout.windows[-1])
    assert ids[:3] == [1, 2, 3] and labels[:3] == [IGNORE_INDEX] * 3
    assert len(layout.windows) == 1
    assert ids == list(range(1, 12))
    assert labels == [IGNORE_INDEX] * 4 + [5, 6] + [IGNORE_INDEX] * 3 + [10, 11]


# ---------------------------------------------------------------------------------------------------------------------
# An independent, literal re-implementation of MASS_SPEC §7 "Windowing", compared layout by layout.


def spec_windows(
    sizes: list[int], trained: list[bool], window: int, overlap: int, query: int | None, max_header_frac: float = 0.9
) -> tuple[list[tuple[tuple[int, ...], int, int]], list[int]]:
    """(context, start, end) per window and the skipped blocks, following the spec's sentences one by one."""
    header = sizes[0] + sizes[1]
    assert header <= max_header_frac * window
    room = window - header  # what a body may use beside the header
    has_query = query is not None and query >= 2
    plans: list[tuple[tuple[int, ...], int, int]] = []
    skipped: list[int] = []
    i = 2
    while i < len(sizes):
        if not trained[i]:
            i += 1
            continue
        # "context = as many immediately preceding blocks as fit within overlap tokens"
        context: list[int] = []
        k = i - 1
        while k >= 2 and sum(sizes[c] for c in context) + sizes[k] <= overlap:
            context.insert(0, k)
            k -= 1
        # "if the segment's own query block precedes i and is not already in that context, it is put in FRONT of
        # it and nothing is dropped"
        if has_query and query < i and query not in context:
            context = [query, *context]
        # "if block i doesn't fit the remaining budget, fall back to [query block] (when query + block fit in
        # window − header) or []"
        if sizes[i] > room - sum(sizes[c] for c in context):
            context = [query] if has_query and query < i and sizes[query] + sizes[i] <= room else []
        # "a single block larger than window − header is skipped (recorded)"
        if sizes[i] > room:
            skipped.append(i)
            i += 1
            continue
        # "greedily append contiguous blocks while they fit; the window ends after the last loss-bearing block that
        # fit; the next window starts there"
        used = header + sum(sizes[c] for c in context)
        end = j = i
        while j < len(sizes) and used + sizes[j] <= window:
            used += sizes[j]
            if trained[j]:
                end = j + 1
            j += 1
        plans.append((tuple(context), i, end))
        i = end
    return plans, skipped


def random_segment(rng: random.Random) -> tuple[list[Sized], int, int, int | None]:
    """A segment shaped like rendered agent threads: header, earlier segments' blocks, the query, then assistant
    turns (trained) alternating with tool results, sizes from tiny to larger than the window."""
    window = rng.choice([256, 1024, 4096])
    overlap = rng.randrange(0, window // 2)
    header = [rng.randrange(1, window // 5), rng.randrange(1, window // 5)]
    sizes = blocks(*header)
    query = None
    if rng.random() < 0.7:
        for _ in range(rng.randrange(0, 8)):  # earlier segments, never trained here
            sizes.append(Sized(rng.randrange(1, window // 3)))
        query = len(sizes)
        sizes.append(Sized(rng.choice([rng.randrange(1, overlap + 2), rng.randrange(1, window // 2)])))
    for turn in range(rng.randrange(1, 30)):
        scale = rng.choice([window // 16, window // 4, window])
        size = rng.randrange(2, scale + 2)
        if turn % 2 == 0 or rng.random() < 0.2:
            sizes.append(Sized(size, max(1, size - 5)))
        else:
            sizes.append(Sized(size))
    return sizes, window, overlap, query


def test_layouts_equal_the_spec_on_thousands_of_random_segments():
    rng = random.Random(20260512)
    cases = 3000
    for case in range(cases):
        sizes, window, overlap, query = random_segment(rng)
        layout = make_windows(sizes, window, overlap, query_block=query)
        got = [(plan.ctx_blocks, plan.start, plan.end) for plan in layout.windows]
        expected = spec_windows(
            [b.n_tokens for b in sizes], [b.n_loss_tokens > 0 for b in sizes], window, overlap, query
        )
        assert (got, layout.skipped) == expected, f"case {case}: window {window}, overlap {overlap}, query {query}"
        trained = [i for i, b in enumerate(sizes) if b.n_loss_tokens]
        covered = sorted(i for plan in layout.windows for i in plan.loss_blocks)
        assert sorted(covered + layout.skipped) == trained  # every assistant block in exactly one window
        assert all(plan.n_tokens <= window for plan in layout.windows)
