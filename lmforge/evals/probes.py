"""Probes of what a language model does with its context, measured on synthetic token ids.

:func:`copy_probe` measures **in-context copying**: a model with an induction head (a head that finds the previous
occurrence of the current token and predicts what followed it) predicts the second occurrence of a random
sequence far better than the first; a model without one scores both the same. The speedrun's report and
``benchmarks/bench_recipe.py`` show it beside bits per byte.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["copy_probe"]


@torch.no_grad()
def copy_probe(model: Any, vocab_size: int, rows: int = 8, length: int = 60, seed: int = 0) -> tuple[float, float]:
    """Mean cross-entropy (nats) of ``model`` on the first and on the second occurrence of ``rows`` random
    sequences of ``length`` token ids (drawn from the upper nine tenths of the vocabulary, seeded), each given
    twice in a row. Without in-context copying the two are equal; a perfect copier scores 0 on the second.

    ``model(ids)`` must return logits ``(rows, positions, vocab)``; ``2 * length - 1`` positions must fit its
    context. Example: an untrained model scores about ``ln(vocab_size)`` on both.
    """
    if length < 2 or rows < 1 or vocab_size < 10:
        raise ValueError(f"copy_probe needs length >= 2, rows >= 1 and vocab_size >= 10, got {length}, {rows}, "
                         f"{vocab_size}")
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(vocab_size // 10, vocab_size, (rows, length), generator=g)
    seq = torch.cat([seq, seq], 1)  # (rows, 2 length)
    device = next((p.device for p in model.parameters()), torch.device("cpu")) if hasattr(model, "parameters") \
        else torch.device("cpu")
    logits = model(seq[:, :-1].to(device)).float().cpu()  # (rows, 2 length - 1, V)
    loss = F.cross_entropy(logits.transpose(1, 2), seq[:, 1:], reduction="none")  # (rows, 2 length - 1)
    # target t+1 is in the first occurrence for t < length - 1, in the second from t = length on (t = length - 1
    # predicts the second occurrence's first id, which nothing before it announces)
    return loss[:, :length - 1].mean().item(), loss[:, length:].mean().item()
