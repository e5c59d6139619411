"""SFT's packed rows after the first epoch: epochs pack into different numbers of rows, and every batch of every
epoch is still full on every rank, resumes exactly, and is the same global rows at any world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.conversations import (ConversationDataset, ConversationLoader, epoch_order, pack_rows,
                                        write_conversations)

LENGTHS, T, SEED = (6, 4, 4, 6), 9, 4  # rows of 10 tokens: two short conversations share one, a long one is alone


@pytest.fixture
def ds(tmp_path: Path) -> ConversationDataset:
    """Conversation ``k`` holds ids ``100k + 1, 100k + 2, ...``, so a row says which conversations it packs."""
    rendered = [(list(range(100 * k + 1, 100 * k + 1 + n)), [1] * n) for k, n in enumerate(LENGTHS)]
    write_conversations(tmp_path, {"train": (rendered, {})}, "fingerprint", 0)
    return ConversationDataset(tmp_path, "train")


def _convs(x: torch.Tensor) -> list[list[int]]:
    """The conversations of each row of ``x``, in order."""
    return [[int(t) // 100 for t in row if int(t) % 100 == 1] for row in x]


def _stream(epochs: int) -> list[list[int]]:
    """The rows of epochs 0 .. epochs-1 one after another (what the loader must walk through)."""
    return [r.tolist() for e in range(epochs) for r in pack_rows(LENGTHS, T, epoch_order(len(LENGTHS), SEED, e))]


def test_the_epochs_pack_into_different_numbers_of_rows() -> None:
    assert [len(pack_rows(LENGTHS, T, epoch_order(4, SEED, e))) for e in range(6)] == [3, 3, 2, 2, 2, 2]


def test_every_batch_is_full_and_the_rows_are_every_epochs_in_turn(ds) -> None:
    """Batch 3 on one rank: 8 batches walk through 6 epochs' 14 rows and on, each (3, 9), none skipped (before,
    step 3 returned (2, 9) batches)."""
    loader = ConversationLoader(ds, 3, T, seed=SEED)
    rows = []
    for _ in range(8):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (3, T)
        rows += _convs(x)
    assert rows == _stream(12)[:24]


def test_three_ranks_of_one_row_are_the_single_rank_batch_and_resume_exactly(ds) -> None:
    """Batch 1 on 3 ranks: each rank gets one row every step (before, rank 2 got a (0, 9) batch at step 3 and the
    loss raised); the ranks' rows together are the batch-3 single-rank rows; a state saved in the middle of an epoch
    (a batch straddled the end of the last) resumes into the same rows."""
    ranks = [ConversationLoader(ds, 1, T, seed=SEED, rank=r, world_size=3) for r in range(3)]
    single = ConversationLoader(ds, 3, T, seed=SEED)
    for step in range(8):
        if step == 3:  # after 9 rows: epoch 3 has begun, one row into it
            state = json.loads(json.dumps(ranks[2].state_dict()))
            assert (state["epoch"], state["consumed"]) == (3, 1)
            resumed = ConversationLoader(ds, 1, T, seed=SEED, rank=2, world_size=3)
            resumed.load_state_dict(state)
            later = [resumed.next_batch()[0] for _ in range(5)]
        xs = [r.next_batch()[0] for r in ranks]
        assert all(x.shape == (1, T) for x in xs)
        assert torch.equal(torch.cat(xs), single.next_batch()[0])
        if step >= 3:
            assert torch.equal(xs[2], later[step - 3])


def test_a_loader_state_at_an_epochs_exact_end_continues_into_the_next(ds) -> None:
    a = ConversationLoader(ds, 2, T, seed=SEED)
    for _ in range(3):  # 6 rows: epochs 0 and 1 exactly
        a.next_batch()
    b = ConversationLoader(ds, 2, T, seed=SEED)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        xa, xb = a.next_batch()[0], b.next_batch()[0]
        assert torch.equal(xa, xb) and xa.shape == (2, T)
    assert _convs(xa) == _stream(8)[12:14]


def test_a_conversation_that_fills_the_row_exactly_shares_it(ds) -> None:
    """6 + 4 tokens fill a row of context + 1 = 10 exactly: one row, no padding, every target but the row's first
    id trained (a packing check of ``>=`` would start a new row and pad both)."""
    assert [r.tolist() for r in pack_rows(LENGTHS, T, np.array([0, 1, 2, 3]))] == [[0, 1], [2, 3]]
    assert [r.tolist() for r in pack_rows(LENGTHS, T - 1, np.array([0, 1, 2, 3]))] == [[0], [1, 2], [3]]
    x, y = ds.fill(pack_rows(LENGTHS, T, np.array([0, 1])), T)
    assert x[0].tolist() == [1, 2, 3, 4, 5, 6, 101, 102, 103] and y[0].tolist() == [2, 3, 4, 5, 6, 101, 102, 103, 104]
