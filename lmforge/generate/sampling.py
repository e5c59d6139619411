"""Sampling the next token from logits: greedy, temperature, top-k, top-p (nucleus), reproducible by seed.

This module owns the sampling parameters' rules: which values are valid (:func:`check_sampling`,
:func:`check_seed`), the generator a seed gives (:func:`seeded`), which temperatures are greedy (:func:`is_greedy`),
and how a token is drawn (:func:`sample_next`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["MIN_TEMPERATURE", "SEED_MAX", "SEED_MIN", "check_sampling", "check_seed", "draw", "is_greedy",
           "sample_next", "sampling_logits", "seeded"]

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing float32 logits by a smaller one overflows to inf (1e-40 gives
inf/NaN probabilities), and long before that the distribution is one-hot anyway (vLLM uses the same floor)."""

SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
"""The seeds accepted: a signed 64-bit integer, the OpenAI API's range (``torch.Generator`` takes these)."""


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` means greedy decoding (argmax): 0, or below :data:`MIN_TEMPERATURE`."""
    return temperature < MIN_TEMPERATURE


def check_seed(seed: int | None) -> None:
    """``ValueError`` unless ``seed`` is None or an integer in ``[SEED_MIN, SEED_MAX]`` (a signed 64-bit integer)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] (got {seed!r:.40}); any number in that "
                         "range works, the same seed repeats the same sample")


def seeded(seed: int | None, device: Any = "cpu") -> torch.Generator:
    """A random generator on ``device`` seeded with ``seed`` (checked: :func:`check_seed`), or from fresh entropy."""
    check_seed(seed)
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Validate sampling parameters (``ValueError`` saying which one is wrong and what is allowed)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (got {temperature!r}); use 0 for greedy decoding, "
                         "around 1 for plain sampling")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None (got {top_k!r})")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (got {top_p}); 1 keeps every token, small values keep few")


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> torch.Tensor:
    """The logits ``(B, V)`` of the distribution :func:`sample_next` draws from at a non-greedy ``temperature``:
    divided by the temperature, then tokens outside the ``top_k`` largest and outside the smallest set whose
    probabilities add up to at least ``top_p`` set to ``-inf`` (the most likely token always stays)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) smallest kept logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
        drop = mass_before >= top_p
        drop[:, 0] = False  # the most likely token stays, even for a top_p that rounds to 0 in float32 (1e-50)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token of each row of ``logits`` ``(B, V)``; returns ``(B,)`` int64.

    A temperature below :data:`MIN_TEMPERATURE` (0 included) is greedy (argmax; ties go to the lowest id).
    Otherwise one token is drawn with ``generator`` from :func:`sampling_logits`'s distribution.
    """
    if is_greedy(temperature):
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
            # numpy's argmax: the same ids (the first maximum; a NaN counts as the maximum), faster on a step's rows
            return torch.from_numpy(logits.numpy().argmax(-1))
        return logits.argmax(dim=-1)
    return draw(sampling_logits(logits, temperature, top_k, top_p), generator)


def draw(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``(B, V)``, drawn with ``generator`` from their softmax as they are (a
    distribution :func:`sampling_logits` has already tempered and cut); returns ``(B,)`` int64."""
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
