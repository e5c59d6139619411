"""The context probes against oracles written here: a perfect copier scores ~0% of its first-occurrence loss in order
and above 100% shuffled; a context-unigram model (which ids the context holds, no order) scores about half in
order and the same shuffled; a model that ignores its context scores 100% on every probe."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmforge.evals.probes import (PROBE_FIELDS, context_probes, copy_probe, name_probe, natural_probe, used_ids,
                                  val_passages)
from lmforge.tokenizer import Tokenizer

V = 1000


def copier(ids: torch.Tensor, vocab: int = V, share: float = 0.9) -> torch.Tensor:
    """Log-probabilities ``(R, P, vocab)``: ``share`` on the id that followed the latest earlier occurrence of the
    current id (an induction head), the rest uniform; uniform where the current id has not occurred before."""
    R, P = ids.shape
    out = torch.full((R, P, vocab), 1.0 / vocab)
    for r in range(R):
        last: dict[int, int] = {}
        for t in range(P):
            j = last.get(int(ids[r, t]))
            if j is not None:
                out[r, t] *= 1 - share
                out[r, t, ids[r, j + 1]] += share
            last[int(ids[r, t])] = t
    return out.log()


def longest_match_copier(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Like :func:`copier`, but the earlier position chosen is the one whose preceding ids match the current ones
    longest (an ideal induction head on text, where single ids recur often)."""
    R, P = ids.shape
    out = torch.full((R, P, vocab), 1.0 / vocab)
    for r in range(R):
        row = ids[r].tolist()
        for t in range(P):
            best, best_len = None, 0
            for j in range(t):
                n = 0
                while n <= j and row[j - n] == row[t - n]:
                    n += 1
                if n > best_len:
                    best, best_len = j, n
            if best is not None:
                out[r, t] *= 0.1
                out[r, t, row[best + 1]] += 0.9
    return out.log()


def context_unigram(ids: torch.Tensor, vocab: int = V, eps: float = 0.5) -> torch.Tensor:
    """Log-probabilities of the ids seen so far in the row (counts, no order), mixed with ``eps`` of uniform."""
    counts = torch.nn.functional.one_hot(ids, vocab).float().cumsum(1)  # (R, P, vocab)
    seen = counts / counts.sum(-1, keepdim=True)
    return ((1 - eps) * seen + eps / vocab).log()


def uniform(ids: torch.Tensor, vocab: int = V) -> torch.Tensor:
    return torch.zeros(*ids.shape, vocab)


def _ratios(model) -> tuple[float, float, float]:
    first, second = copy_probe(model, V, rows=3, length=40, pool=torch.arange(V))
    first2, shuffled = copy_probe(model, V, rows=3, length=40, pool=torch.arange(V), shuffled=True)
    assert first2 == first  # the same first occurrences
    return first, second / first, shuffled / first


def test_a_copier_scores_near_zero_in_order_and_above_its_first_occurrence_shuffled():
    first, in_order, shuffled = _ratios(copier)
    assert first == pytest.approx(math.log(V))  # distinct ids: nothing to copy in the first occurrence
    assert in_order < 0.03 and shuffled > 1.2


def test_a_bag_of_recent_tokens_scores_the_same_in_order_and_shuffled():
    """The old probe (in order only) scored this order-blind model at ~60%, as if it half copied."""
    _, in_order, shuffled = _ratios(context_unigram)
    assert 0.5 < in_order < 0.7 and shuffled == pytest.approx(in_order, rel=1e-4)


def test_a_model_blind_to_its_context_scores_100_percent_everywhere():
    assert _ratios(uniform) == pytest.approx((math.log(V), 1.0, 1.0))


def test_copy_probe_is_seeded_draws_distinct_ids_from_the_pool_and_checks_sizes():
    seen = []
    copy_probe(lambda ids: seen.append(ids) or uniform(ids), V, rows=2, length=30, seed=5, pool=range(100, 140))
    ids = torch.cat([seen[0], torch.zeros(2, 1, dtype=torch.long)], 1)[:, :60]  # the input lacks the last id
    assert all(len(set(r[:30].tolist())) == 30 and set(r[:30].tolist()) <= set(range(100, 140)) for r in ids)
    assert torch.equal(ids[:, 30:59], ids[:, :29])  # given twice
    assert copy_probe(context_unigram, V, rows=2, seed=3) == copy_probe(context_unigram, V, rows=2, seed=3)
    with pytest.raises(ValueError, match="length >= 2"):
        copy_probe(uniform, V, length=1)
    with pytest.raises(ValueError, match="at least length distinct ids"):
        copy_probe(uniform, V, length=30, pool=range(20))


def _dataset(*shards) -> SimpleNamespace:
    return SimpleNamespace(shards=[np.asarray(s, dtype=np.uint16) for s in shards], split="val")


def test_val_passages_spread_over_the_split_stay_in_one_shard_and_avoid_the_end_of_text_id():
    ds = _dataset(np.arange(100), np.r_[np.arange(200, 230), [999], np.arange(300, 380)])
    got = val_passages(ds, rows=4, length=20, exclude=[999])
    assert got.shape == (4, 20)
    for w in got.tolist():
        assert 999 not in w and all(b - a == 1 for a, b in zip(w, w[1:]))  # consecutive ids: one shard, in order
    assert got[0, 0] == 0 and len({w[0] for w in got.tolist()}) == 4
    with pytest.raises(ValueError, match="no passage of 20 tokens"):
        val_passages(_dataset([999] * 50), rows=2, length=20, exclude=[999])


def test_natural_probe_and_used_ids():
    passages = torch.stack([torch.randperm(V)[:25] for _ in range(2)])
    first, second = natural_probe(copier, passages)
    assert first == pytest.approx(math.log(V)) and second < 0.2
    ds = _dataset([5, 7, 7, 999], [3, 5])
    assert used_ids(ds, exclude=[999]).tolist() == [3, 5, 7]
    assert used_ids(ds, max_tokens=2).tolist() == [5, 7]


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])


def test_name_probe_scores_the_names_second_mention_against_its_first(byte_tokenizer):
    copy = lambda ids: longest_match_copier(ids, 257)  # noqa: E731
    first, second = name_probe(copy, byte_tokenizer, rows=4)
    assert second < 0.3 * first  # the second mention's letters follow the first's
    assert name_probe(lambda ids: uniform(ids, 257), byte_tokenizer, rows=4) == pytest.approx((math.log(257),) * 2)
    assert name_probe(copy, byte_tokenizer, rows=4, max_tokens=20) is None  # no sentence fits 20 tokens
    weights = torch.randn(257, generator=torch.Generator().manual_seed(0))
    fixed = lambda ids: weights.expand(*ids.shape, 257)  # noqa: E731  (no context: each id's own loss, anywhere)
    first, second = name_probe(fixed, byte_tokenizer, rows=4)
    assert first == pytest.approx(second, rel=1e-6)  # the same ids scored at both mentions, not their neighbours


def test_context_probes_record(byte_tokenizer):
    train = _dataset(np.arange(40, 120))
    val = _dataset(np.r_[np.arange(0, 200), [256], np.arange(0, 50)])
    rec = context_probes(lambda ids: copier(ids, 257), byte_tokenizer, train, val, context_length=200, rows=3,
                         length=30)
    assert set(rec) == set(PROBE_FIELDS)
    assert rec["copy_second"] < 0.05 * rec["copy_first"] < rec["copy_shuffled"]
    assert rec["natural_second"] < 0.05 * rec["natural_first"]
    assert rec["name_second"] < rec["name_first"]
    rec = context_probes(uniform, byte_tokenizer, train, None, context_length=200, rows=3, length=30)
    assert rec["natural_first"] is None and rec["copy_second"] == pytest.approx(rec["copy_first"])
