"""Speculative decoding with prompt-lookup drafts: a row's next tokens guessed from its context, checked in one pass.

A reply that quotes its input (a rewrite, an extraction, code edited in place) repeats runs of tokens the context
already holds. :class:`NgramDrafter` finds the last ``n`` tokens of a row (``n`` = 3, then 2) earlier in its context
(prompt and reply) and proposes the ``k`` tokens that followed them there: no second model. The engine then feeds the
row's next token and the ``k`` drafts in one pass (:meth:`~lmforge.generate.engine.Engine.verify`), which gives the
logits after each of them; the row takes tokens from those logits one by one exactly as plain decoding would, and
keeps going while the token it took is the next draft. The first mismatch ends the pass: the cache's columns of the
drafts after it are taken back (:meth:`~lmforge.generate.engine.Engine.rollback`).

Why the output is the one plain decoding gives: the logits after the j-th fed token are those a plain step would
compute there (the same context; on the CPU kernels the same bits), and the row draws each token from them with its
own sampler, constraint and tool state in the same order, one draw per token taken. With a draft that is a point
mass on ``d``, this is the rejection sampling of Leviathan et al. and Chen et al. (accept ``d`` with probability
``p(d)``, otherwise draw from ``p`` with ``d`` removed, renormalised): :func:`rejection_sample` is that rule written
out, the reference; drawing ``t ~ p`` and accepting when ``t == d`` gives the same distribution (a test holds the two
equal by chi-square), and with a seed it gives the very tokens plain decoding gives, so seeded replies do not
change either.

When drafts do not pay, :class:`DraftPolicy` stops them: the draft length halves after a miss and doubles after a
pass that kept every draft, and two passes in a row that keep none pause the row's drafting (for 16 tokens, doubling
to 256), so free text decodes by plain steps.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["DraftPolicy", "NgramDrafter", "SpecStats", "rejection_sample"]

NGRAMS = (3, 2)
"""The lengths of the context suffix looked up, longest first."""


class NgramDrafter:
    """Prompt-lookup drafts over one row's tokens: an index from each n-gram to where its latest earlier occurrence
    was followed, updated as tokens are appended (O(1) a token)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        for t in tokens:
            self.append(int(t))

    def append(self, t: int) -> None:
        """Token ``t`` joins the context: each n-gram ending just before it is now followed by it."""
        i = len(self.tokens)
        for n, index in self._next.items():
            if i >= n:
                index[tuple(self.tokens[i - n: i])] = i
        self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last n-gram (longest
        ``n`` first); ``[]`` when none occurred."""
        toks = self.tokens
        for n in NGRAMS:
            if len(toks) > n:
                at = self._next[n].get(tuple(toks[-n:]))
                if at is not None:
                    return toks[at: at + k]
        return []


def reference_propose(tokens: Sequence[int], k: int) -> list[int]:
    """:meth:`NgramDrafter.propose` by a plain scan (the spec its index is tested against)."""
    for n in NGRAMS:
        if len(tokens) > n:
            suffix = list(tokens[-n:])
            for start in range(len(tokens) - n - 1, -1, -1):
                if list(tokens[start: start + n]) == suffix:
                    return list(tokens[start + n: start + n + k])
    return []


def rejection_sample(probs: torch.Tensor, draft: int, gen: torch.Generator | None = None) -> int:
    """Speculative sampling's rule for a point-mass draft written out (module docstring): the reference, whose
    output is distributed as ``probs``."""
    u = float(torch.rand((), generator=gen))
    p = float(probs[draft])
    if u < p:
        return draft
    rest = probs.clone()
    rest[draft] = 0.0
    return int(torch.multinomial(rest / rest.sum(), 1, generator=gen)[0])


class SpecStats:
    """Passes that verified drafts, drafts proposed, drafts kept (tokens decoded beyond one per pass)."""

    def __init__(self) -> None:
        self.passes = self.drafted = self.accepted = 0

    def as_dict(self) -> dict[str, int]:
        return {"spec_passes": self.passes, "spec_drafted": self.drafted, "spec_accepted": self.accepted}


class DraftPolicy:
    """How many drafts a row proposes next, and whether it drafts at all (module docstring)."""

    K_MAX = 8
    PAUSE_MIN, PAUSE_MAX = 16, 256

    def __init__(self) -> None:
        self.k = 4
        self.misses = 0  # passes in a row that kept no draft
        self.pause = self.PAUSE_MIN
        self.resume_at = 0  # the row's token count from which it drafts again

    def draft_length(self, n_tokens: int) -> int:
        """Drafts to propose at the row's ``n_tokens``-th token (0: decode plainly)."""
        return 0 if n_tokens < self.resume_at else self.k

    def record(self, n_tokens: int, drafted: int, accepted: int) -> None:
        """A pass proposed ``drafted`` and kept ``accepted`` of them; the row is at ``n_tokens`` tokens."""
        if accepted == drafted:
            self.k = min(self.K_MAX, 2 * self.k)
        else:
            self.k = max(1, accepted + 1 if accepted else self.k // 2)
        if accepted:
            self.misses, self.pause = 0, self.PAUSE_MIN
            return
        self.misses += 1
        if self.misses >= 2:
            self.resume_at = n_tokens + self.pause
            self.pause = min(self.PAUSE_MAX, 2 * self.pause)
            self.misses = 0
