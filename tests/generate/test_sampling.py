"""Top-k and top-p together: the draw is restricted by both (top-k first, then top-p on what is left)."""

from __future__ import annotations

import math

import torch

from lmforge.generate.sampling import sample_next, sampling_logits


def test_top_k_applies_when_top_p_is_set_too() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = lambda **kw: torch.isfinite(sampling_logits(logits, 1.0, **kw))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_k=2, top_p=0.999) == [0, 1]  # top-p alone at 0.999 keeps all five
    assert kept(top_p=0.999) == [0, 1, 2, 3, 4]
    assert kept(top_k=3, top_p=None) == [0, 1, 2]
    # top-p on the top-k tokens' renormalised probabilities: of {0, 1}, token 0 holds e/(e+1) = 0.73 >= 0.7
    assert kept(top_k=2, top_p=0.7) == [0]
    assert kept(top_k=3, top_p=0.7) == [0, 1]  # 0.67 of {0, 1, 2} before token 1
    out = sampling_logits(logits, 0.5, top_k=2, top_p=0.999)[0]
    assert out[:2].tolist() == [8.0, 6.0] and all(math.isinf(v) for v in out[2:].tolist())
    g = torch.Generator().manual_seed(0)
    flat = -torch.arange(50.0)[None] / 100  # nearly uniform: top-p 0.999 alone keeps all 50
    draws = {int(sample_next(flat, 1.0, top_k=3, top_p=0.999, generator=g)[0]) for _ in range(200)}
    assert draws <= {0, 1, 2} and len(draws) > 1
