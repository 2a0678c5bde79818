"""The chunked cross-entropy never materialises the full [T, V] logits, in forward or in backward."""

from __future__ import annotations

import pytest


def test_no_tensor_holds_more_than_one_chunk_of_logits() -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from mass_ops.train.loss import chunked_next_token_loss

    tokens, vocab, chunk = 257, 1000, 32

    class LargestVocabTensor(TorchDispatchMode):
        """Records the most rows of any tensor with a vocabulary-sized last dimension that an op produces."""

        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab:
                    LargestVocabTensor.rows = max(LargestVocabTensor.rows, t.numel() // vocab)
            return out

    hidden = torch.randn(tokens, 16, requires_grad=True)
    weight = torch.randn(vocab, 16)
    labels = torch.randint(0, vocab, (tokens,))
    with LargestVocabTensor():
        total, count = chunked_next_token_loss(hidden, labels, weight, chunk=chunk)
        total.backward()
    assert count == tokens - 1 and hidden.grad is not None
    assert 0 < LargestVocabTensor.rows <= chunk  # logits and their gradients exist one chunk at a time
    with LargestVocabTensor():
        (hidden @ weight.T).sum()
    assert LargestVocabTensor.rows == tokens  # the probe does see a full projection


def test_chunk_must_be_positive() -> None:
    import torch

    from mass_ops.train.loss import chunked_next_token_loss

    with pytest.raises(ValueError, match="ce_chunk must be positive"):
        chunked_next_token_loss(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), torch.zeros(3, 2), chunk=0)
