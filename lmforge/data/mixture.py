"""Synthetic copy data mixed into pretraining blocks on the fly (``data.copy_fraction``, ``data.copy_sources``).

A model learns to copy from its context (an induction head) early when its training text repeats itself; ordinary
text seldom does within one block. :class:`CopyMixture` overwrites a share of each training block with segments
whose second half repeats their first, from three sources:

* ``repeat``: a span of the block's own text (``L`` tokens, ``data.copy_span``) repeated after a gap of ``0..L``
  tokens: ``[span][gap][span again]``; the second copy is what it replaces (``L`` tokens).
* ``names``: a template sentence in which a made-up full name appears, then again (and a question answered with
  it), e.g. ``"Q: What is your name? A: My name is Tormund Kasby. Q: Say it again. A: Tormund Kasby."``; replaces
  its length. The sentences are pieces of text encoded once with the run's tokenizer and joined as ids.
* ``random``: ``L`` random ids (any id of the tokenizer but its special tokens), a gap of ``0..L`` tokens of the
  block, the same ids again; replaces ``2L`` tokens.

Each block draws segments (sources in equal shares) until the tokens they replace reach ``copy_fraction`` of the
block (the last one kept with the probability that makes the expected share exact), and lays them out in order at
random places, so no segment overwrites another: the repeats stay repeats. The expected share is
``copy_fraction`` while the segments fit; a block holds at most a third of ``repeat`` copies (each needs its span
and gap), so large fractions fall short, which the loader's measured share (``copy_data_share`` in the metrics)
shows.

Everything is drawn from a generator seeded by ``(seed, epoch, position of the block in the epoch)``: the same block
at the same place of the same run gets the same segments whatever the world size, the micro-batching or a resume
(:class:`~lmforge.data.loader.BlockLoader` applies it and saves nothing more than its own position).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["CopyMixture", "COPY_SOURCES", "copy_mixture", "check_copy_settings"]

COPY_SOURCES = ("repeat", "names", "random")
"""The synthetic sources ``data.copy_sources`` may name."""

_SALT = 0x0C0B1E5  # keeps the mixture's generator apart from any other seeded by the same (seed, epoch, position)
_POOL_SEED = 20250601  # the made-up names: one fixed pool for every run
_POOL_SIZE = 1024

# made-up names from syllables (distinct from lmforge.evals.probes' name probe, so that probe measures copying)
_HEADS = ("Ber", "Cal", "Dor", "Eld", "Fen", "Gar", "Hol", "Ivo", "Kas", "Lin", "Mor", "Nel", "Osk", "Par", "Rud",
          "Sel", "Tor", "Val", "Wil", "Zor")
_MIDS = ("a", "e", "i", "o", "u", "ab", "en", "il", "or", "um")
_TAILS = ("bert", "da", "dric", "lina", "mund", "ra", "ric", "sa", "tine", "win")
_SURNAME_TAILS = ("by", "croft", "field", "gate", "ham", "ley", "more", "ridge", "ton", "worth")
_TEMPLATES = (
    "\n{name} came to the gate, and the porter let {name} in.\n",
    "\nMy name is {name}. Yes, {name}; you will not forget it.\n",
    "\nQ: What is your name? A: My name is {name}. Q: Say it again. A: {name}.\n",
    "\nSend for {name}! {name} is the one we need.\n",
    "\nIt was {name} who spoke first, and {name} who spoke last.\n",
    "\nUser: I am {name}. What is my name?\nAssistant: Your name is {name}.\n",
    "\nDear {name}, this letter is for you alone. Yours, a friend of {name}.\n",
    "\n{name}. That is the name: {name}.\n",
)


def _names(n: int) -> list[str]:
    rng = np.random.default_rng(_POOL_SEED)

    def pick(options: Sequence[str]) -> str:
        return options[int(rng.integers(len(options)))]

    return [f"{pick(_HEADS)}{pick(_MIDS)}{pick(_TAILS)} {pick(_HEADS)}{pick(_MIDS)}{pick(_SURNAME_TAILS)}"
            for _ in range(n)]


def check_copy_settings(fraction: float, sources: Sequence[str], span: Sequence[int]) -> None:
    """``ValueError`` naming the ``data.copy_*`` setting that is out of range."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 0.5:
        raise ValueError(f"data.copy_fraction must be in [0, 0.5] (a share of each block's tokens), got {fraction!r}")
    if not sources or len(set(sources)) != len(sources) or any(s not in COPY_SOURCES for s in sources):
        raise ValueError(f"data.copy_sources must be distinct names among {', '.join(COPY_SOURCES)}, got "
                         f"{list(sources)!r}")
    if len(span) != 2 or not 2 <= span[0] <= span[1]:
        raise ValueError(f"data.copy_span must be [lo, hi] tokens with 2 <= lo <= hi, got {list(span)!r}")


class CopyMixture:
    """The module docstring's mixture: ``fraction`` of each block's tokens replaced by segments of ``sources``.

    ``span (lo, hi)``: the length in tokens of a ``repeat`` or ``random`` segment's half (at most a third of the block).
    ``vocab_size`` and ``special_ids``: the tokenizer's, for ``random`` ids. ``tokenizer``: the run's (needed by
    ``names``: its sentences are encoded once here).
    """

    def __init__(self, fraction: float, sources: Sequence[str] = COPY_SOURCES, span: tuple[int, int] = (16, 64), *,
                 vocab_size: int, special_ids: Sequence[int] = (), tokenizer: Any = None) -> None:
        check_copy_settings(fraction, sources, span)
        lo, hi = span
        if "names" in sources and tokenizer is None:
            raise ValueError("data.copy_sources 'names' encodes its sentences with the run's tokenizer: pass it")
        self.fraction, self.sources, self.span = float(fraction), tuple(sources), (int(lo), int(hi))
        specials = np.asarray(sorted(set(int(i) for i in special_ids)), dtype=np.int64)
        ids = np.arange(vocab_size, dtype=np.int64)
        self._pool = ids[~np.isin(ids, specials)]
        self._names: list[list[int]] = []
        self._pieces: list[list[list[int]]] = []
        if "names" in sources:
            self._names = [tokenizer.encode(" " + n) for n in _names(_POOL_SIZE)]
            self._pieces = [[tokenizer.encode(p) for p in t.split("{name}")] for t in _TEMPLATES]

    def signature(self) -> dict[str, Any]:
        """What a resumed loader's mixture must equal (saved in the loader state)."""
        return {"fraction": self.fraction, "sources": list(self.sources), "span": list(self.span)}

    def apply(self, blocks: np.ndarray, seed: int, epoch: int, first: int) -> int:
        """Overwrite segments of ``blocks (B, T+1)`` (int64, in place), row ``b`` being the block at position
        ``first + b`` of ``epoch``; returns how many tokens were replaced."""
        return sum(self._row(row, np.random.default_rng([_SALT, seed, epoch, first + b]))
                   for b, row in enumerate(blocks))

    def _draw(self, rng: np.random.Generator, n: int) -> tuple[str, int, int, np.ndarray | None]:
        """One segment: ``(source, half length L or sentence length, gap, ids)``."""
        kind = self.sources[int(rng.integers(len(self.sources)))]
        if kind == "names":
            name = self._names[int(rng.integers(len(self._names)))]
            pieces = self._pieces[int(rng.integers(len(self._pieces)))]
            ids = list(pieces[0])
            for p in pieces[1:]:
                ids += name + p
            return kind, len(ids), 0, np.asarray(ids, dtype=np.int64)
        hi = min(self.span[1], n // 3)
        lo = min(self.span[0], hi)
        L = int(rng.integers(lo, hi + 1))
        gap = int(rng.integers(0, L + 1))
        ids = self._pool[rng.integers(len(self._pool), size=L)] if kind == "random" else None
        return kind, L, gap, ids

    @staticmethod
    def _sizes(seg: tuple[str, int, int, np.ndarray | None]) -> tuple[int, int]:
        """``(tokens the segment occupies, tokens it replaces)``."""
        kind, L, gap, _ = seg
        if kind == "names":
            return L, L
        return 2 * L + gap, (2 * L if kind == "random" else L)

    def _row(self, row: np.ndarray, rng: np.random.Generator) -> int:
        n = len(row)
        if n // 3 < 2:  # too short a block for a segment
            return 0
        budget, used, replaced = self.fraction * n, 0, 0
        segs = []
        while budget > 0:
            seg = self._draw(rng, n)
            size, repl = self._sizes(seg)
            if repl > budget:  # the last one: kept with probability budget / repl (the expected share is exact)
                keep = rng.random() < budget / repl
                budget = 0.0
                if not keep:
                    break
            else:
                budget -= repl
            if used + size > n:
                break
            segs.append(seg)
            used += size
            replaced += repl
        if not segs:
            return 0
        gaps = np.sort(rng.integers(0, n - used + 1, size=len(segs)))  # the block's own text before each segment
        start = 0
        for seg, before in zip(segs, np.diff(gaps, prepend=0)):
            start += int(before)
            kind, L, gap, ids = seg
            if kind == "names":
                row[start:start + L] = ids
            else:
                if kind == "random":
                    row[start:start + L] = ids
                row[start + L + gap:start + 2 * L + gap] = row[start:start + L]
            start += self._sizes(seg)[0]
        return replaced


def copy_mixture(data: Any, tokenizer: Any) -> CopyMixture | None:
    """The mixture a run's ``data`` config (``copy_fraction``, ``copy_sources``, ``copy_span``) asks for, with its
    ``tokenizer``; None when ``copy_fraction`` is 0."""
    if not getattr(data, "copy_fraction", 0):
        return None
    return CopyMixture(data.copy_fraction, data.copy_sources, tuple(data.copy_span), vocab_size=tokenizer.vocab_size,
                       special_ids=list(tokenizer.special_tokens.values()), tokenizer=tokenizer)
