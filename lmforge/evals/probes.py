"""Probes of what a language model does with its context: in-context copying, on random ids and on natural text.

A model that copies from its context (an induction head: a head that finds the previous occurrence of the current
token and predicts what followed it) predicts the second occurrence of a sequence far better than the first. Each
probe gives the mean cross-entropy (nats per token) on a first and on a second occurrence, deterministically (fixed
ids, seeds and passages); reports show the second as a percentage of the first.

* :func:`copy_probe`: random token ids given twice. In order, a copier scores near 0% of its first-occurrence loss;
  with ``shuffled=True`` the second occurrence holds the same ids in another order, where a copier predicts the id
  that followed last time, now wrong, and scores near or above 100%. A model that only knows *which* ids the context
  holds (a bag of recent tokens, no order) scores about the same on both, roughly half its first-occurrence loss
  (``tests/evals/test_probes.py`` has both as oracles): the shuffled control is what tells copying from a bag of
  tokens.
* :func:`natural_probe`: passages of held-out text (:func:`val_passages`: the validation split) given twice.
* :func:`name_probe`: a made-up full name introduced and mentioned again in a sentence; the loss on the name's
  tokens at its first mention and at its second.

:func:`context_probes` runs the three for a model and its data (the speedrun's eval stage, which
``benchmarks/bench_recipe.py`` reuses). ``model(ids)`` maps ids ``(rows, positions)`` to logits
``(rows, positions, vocab)``: a :class:`~lmforge.model.TransformerLM` (run on its parameters' device) or any
callable (run on the CPU).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["copy_probe", "natural_probe", "name_probe", "val_passages", "used_ids", "context_probes", "PROBE_FIELDS",
           "PROBES_VERSION"]

PROBE_FIELDS = ("copy_first", "copy_second", "copy_shuffled", "natural_first", "natural_second", "name_first",
                "name_second")
"""The keys of :func:`context_probes`' record (nats per token; the name pair is None when no sentence fits)."""
PROBES_VERSION = 2
"""Bumped whenever a probe measures something else (the speedrun keys its eval stage on it)."""

# The name probe's own made-up names and sentences: none of them is what lmforge.data.mixture trains on, so the
# probe measures copying, not recall of a training sentence.
_NAME_HEADS = ("Ala", "Bre", "Cor", "Dun", "Esk", "Fal", "Gwy", "Hal", "Iso", "Jor", "Kel", "Lor", "Mab", "Nim",
               "Orv", "Pel", "Quil", "Ros", "Syl", "Tam", "Ulf", "Vey", "Wen", "Yso", "Zan")
_NAME_MIDS = ("an", "bri", "da", "el", "fi", "ga", "ith", "lo", "mar", "nor", "ri", "sa", "ven", "wy")
_NAME_TAILS = ("a", "as", "en", "ia", "ic", "on", "or", "us", "wyn", "eth")
_SURNAME_TAILS = ("dane", "holt", "mere", "stow", "vale", "wick", "thorn", "brook")
_NAME_SENTENCES = (
    "I am {name}. Remember me: {name}.",
    "Who is there? It is {name}. Let {name} in.",
    "Enter {name}. Make way for {name}!",
    "This is from {name}; so writes {name}.",
)


def _device(model: Any) -> torch.device:
    params = getattr(model, "parameters", None)
    return next((p.device for p in params()), torch.device("cpu")) if callable(params) else torch.device("cpu")


@torch.no_grad()
def _token_losses(model: Any, ids: Tensor) -> Tensor:
    """``ids (R, P)`` -> ``(R, P - 1)``: the cross-entropy of id ``t + 1`` from the logits at position ``t``."""
    logits = model(ids[:, :-1].to(_device(model))).float().cpu()  # (R, P - 1, V)
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


def _occurrences(model: Any, first: Tensor, second: Tensor) -> tuple[float, float]:
    """Mean loss on ``first (R, L)`` and on ``second (R, L)`` given one after the other in each row, each without
    its own first id (nothing before it announces it)."""
    L = first.shape[1]
    loss = _token_losses(model, torch.cat([first, second], 1))  # (R, 2L - 1); column t predicts id t + 1
    return loss[:, :L - 1].mean().item(), loss[:, L:].mean().item()


def copy_probe(model: Any, vocab_size: int, rows: int = 8, length: int = 60, seed: int = 0, *,
               pool: Sequence[int] | Tensor | None = None, shuffled: bool = False) -> tuple[float, float]:
    """Mean cross-entropy (nats) of ``model`` on the first and on the second occurrence of ``rows`` random
    sequences of ``length`` distinct token ids, each given twice in a row (the ids seeded by ``seed``).

    ``pool``: the ids to draw from, e.g. :func:`used_ids` of the training split (every id the model has learned);
    ``None``: the upper nine tenths of ``range(vocab_size)``. ``shuffled``: the second occurrence holds the same ids
    in a seeded random order (the first occurrence, and so its loss, is the same as in order). Without in-context
    copying the two losses are equal; a perfect copier scores 0 on the second in order.

    ``2 * length - 1`` positions must fit the model's context. Example: an untrained model scores about
    ``ln(vocab_size)`` on both.
    """
    ids = torch.arange(vocab_size // 10, vocab_size) if pool is None else torch.as_tensor(pool, dtype=torch.long)
    if length < 2 or rows < 1 or len(ids) < length:
        raise ValueError(f"copy_probe needs length >= 2, rows >= 1 and at least length distinct ids to draw from, got "
                         f"length {length}, {rows} rows, {len(ids)} ids")
    g = torch.Generator().manual_seed(seed)
    seq = torch.stack([ids[torch.randperm(len(ids), generator=g)[:length]] for _ in range(rows)])  # (rows, length)
    second = seq
    if shuffled:
        order = torch.stack([torch.randperm(length, generator=g) for _ in range(rows)])
        same = (order == torch.arange(length)).all(1)
        order[same] = order[same].roll(1, dims=1)  # never the identity (length 2's one draw of two)
        second = seq.gather(1, order)
    return _occurrences(model, seq, second)


def natural_probe(model: Any, passages: Tensor) -> tuple[float, float]:
    """Mean cross-entropy (nats) of ``model`` on the first and on the second occurrence of each passage of
    ``passages (rows, length)`` (held-out text, :func:`val_passages`), given twice in a row."""
    if passages.dim() != 2 or passages.shape[1] < 2 or passages.shape[0] < 1:
        raise ValueError(f"natural_probe needs passages of shape (rows >= 1, length >= 2), got {tuple(passages.shape)}")
    return _occurrences(model, passages, passages)


def val_passages(dataset: Any, rows: int, length: int, exclude: Sequence[int] = ()) -> Tensor:
    """``(rows', length)`` token ids: ``rows`` windows of a :class:`~lmforge.data.TokenDataset` split spread evenly
    over it, each inside one shard and holding none of ``exclude`` (e.g. the end-of-text id: one passage, not two
    documents); a window that holds one moves on by ``length`` tokens (a few tries). ``rows' <= rows`` (fewer only
    when the split is short); ``ValueError`` when none fits."""
    bad = np.asarray(list(exclude), dtype=np.int64)
    sizes = np.array([len(s) for s in dataset.shards], dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    out: list[np.ndarray] = []
    for r in range(rows):
        start = r * max(0, total - length) // rows
        for _ in range(8):
            i = int(np.searchsorted(ends, start, side="right"))
            if i >= len(sizes):
                break
            local = start - int(ends[i] - sizes[i])
            if local + length > sizes[i]:  # crosses into the next shard: start there
                start = int(ends[i])
                continue
            w = np.asarray(dataset.shards[i][local:local + length], dtype=np.int64)
            if not np.isin(w, bad).any():
                out.append(w)
                break
            start += length
    if not out:
        raise ValueError(f"split {getattr(dataset, 'split', '?')!r} holds no passage of {length} tokens without an "
                         "end-of-text token; use a shorter probe length or more validation text")
    return torch.from_numpy(np.stack(out))


def used_ids(dataset: Any, exclude: Sequence[int] = (), max_tokens: int = 1 << 26) -> Tensor:
    """The ids that occur in (the first ``max_tokens`` tokens of) a :class:`~lmforge.data.TokenDataset` split, less
    ``exclude`` (special tokens), ascending: the vocabulary the model was trained on, for :func:`copy_probe`'s
    ``pool``."""
    seen = np.zeros(0, dtype=np.int64)
    left = max_tokens
    for s in dataset.shards:
        part = np.asarray(s[:left], dtype=np.int64)
        counts = np.bincount(part)
        if len(counts) > len(seen):
            seen = np.pad(seen, (0, len(counts) - len(seen)))
        seen[:len(counts)] += counts
        left -= len(part)
        if left <= 0:
            break
    ids = np.flatnonzero(seen)
    return torch.from_numpy(ids[~np.isin(ids, np.asarray(list(exclude), dtype=np.int64))])


def _made_up_name(g: torch.Generator) -> str:
    def pick(options: Sequence[str]) -> str:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    first = pick(_NAME_HEADS) + pick(_NAME_MIDS) + pick(_NAME_TAILS)
    return f"{first} {pick(_NAME_HEADS)}{pick(_NAME_MIDS)}{pick(_SURNAME_TAILS)}"


def name_probe(model: Any, tokenizer: Any, rows: int = 16, seed: int = 0,
               max_tokens: int | None = None) -> tuple[float, float] | None:
    """Mean cross-entropy (nats) of ``model`` on a made-up full name's tokens at its first and at its second mention
    in a sentence (``rows`` sentences: seeded names, four templates in turn, e.g. "Who is there? It is Corelwyn
    Tamsamere. Let Corelwyn Tamsamere in.").

    The pieces between the mentions and the name (with its leading space) are encoded apart and joined, so the
    name's tokens are the same at both mentions. Sentences longer than ``max_tokens`` (the model's context) are
    left out; None when none fits.
    """
    g = torch.Generator().manual_seed(seed)
    seqs: list[list[int]] = []
    spans: list[tuple[int, int, int]] = []  # (start of the first mention, start of the second, name length)
    for r in range(rows):
        name = tokenizer.encode(" " + _made_up_name(g))
        before, between, after = _NAME_SENTENCES[r % len(_NAME_SENTENCES)].split("{name}")
        head, mid, tail = tokenizer.encode(before), tokenizer.encode(between), tokenizer.encode(after)
        seq = head + name + mid + name + tail
        if max_tokens is not None and len(seq) > max_tokens:
            continue
        seqs.append(seq)
        spans.append((len(head), len(head) + len(name) + len(mid), len(name)))
    if not seqs:
        return None
    width = max(map(len, seqs))
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in seqs])  # right-padded: later ids change no loss
    loss = _token_losses(model, ids)  # column t predicts id t + 1
    first = torch.cat([loss[b, a - 1:a - 1 + n] for b, (a, _, n) in enumerate(spans)])
    second = torch.cat([loss[b, c - 1:c - 1 + n] for b, (_, c, n) in enumerate(spans)])
    return first.mean().item(), second.mean().item()


def context_probes(model: Any, tokenizer: Any, train: Any, val: Any | None, context_length: int, rows: int = 16,
                   length: int = 60, seed: int = 0) -> dict[str, float | None]:
    """The three probes of a model trained on the :class:`~lmforge.data.TokenDataset` split ``train`` (its ids are
    the copy probe's pool) and held out on ``val`` (the natural-text passages; ``None``: the natural pair is None),
    with sequences of ``min(length, context_length // 2)`` ids; keys :data:`PROBE_FIELDS`."""
    length = min(length, context_length // 2)
    specials = list(getattr(tokenizer, "special_tokens", {}).values())
    pool = used_ids(train, exclude=specials)
    first, second = copy_probe(model, tokenizer.vocab_size, rows, length, seed, pool=pool)
    _, shuffled = copy_probe(model, tokenizer.vocab_size, rows, length, seed, pool=pool, shuffled=True)
    out: dict[str, float | None] = {"copy_first": first, "copy_second": second, "copy_shuffled": shuffled,
                                    "natural_first": None, "natural_second": None}
    if val is not None:
        out["natural_first"], out["natural_second"] = natural_probe(model, val_passages(val, rows, length, specials))
    names = name_probe(model, tokenizer, rows, seed, max_tokens=context_length + 1)
    out["name_first"], out["name_second"] = names if names is not None else (None, None)
    return out
