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


def test_query_block_is_forced_into_context_dropping_older_blocks():
    # Segment 1 of a conversation: blocks 2–4 are the previous segment, block 5 is this segment's user message.
    sizes = blocks(10, 10, 8, 8, 8, 6, (30, 20), 4, (30, 20))
    layout = make_windows(sizes, window=80, overlap=10, query_block=5)
    first, second = layout.windows
    assert first.ctx_blocks == (5,) and first.start == 6
    # Block 8's window: the tool block 7 fits within overlap alongside the forced query, nothing older does.
    assert (second.ctx_blocks, second.start) == ((5, 7), 8)


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
