"""Log-likelihood of continuations given contexts, batched through the model's one forward pass and KV cache.

A request is ``(context, continuation)``. Tokens follow lm-eval-harness's ``_encode_pair``: whitespace at the
end of the context moves to the start of the continuation, the continuation's tokens are those of
``context + continuation`` after the context's own tokens, and the model reads ``context + continuation[:-1]``.
lmforge puts the end-of-text token before every context (pretraining documents start right after it).

Scoring a batch: the batch's distinct contexts are prefilled once into a :class:`~lmforge.model.KVCache`
(right-padded rows); each request's row of the cache is copied into a second cache, one row per request, and
every continuation runs through it in one forward pass. A four-choice question thus reads its question once.
A request longer than the context keeps the last ``context_length + 1`` tokens (the oldest context tokens
go; counted in ``truncated``), as lm-eval does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from lmforge.model import KVCache
from lmforge.tokenizer import Tokenizer

__all__ = ["Scored", "encode_request", "score_requests"]


@dataclasses.dataclass(frozen=True)
class Scored:
    """A request's ``sum log p(continuation | context)`` (nats), whether greedy decoding reproduces the
    continuation, its token count and whether its context was truncated."""

    ll: float
    greedy: bool
    n_tokens: int
    truncated: bool


def encode_request(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-eval-harness splits them (see the module docstring)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation, special="plain")
    ctx = tokenizer.encode(context, special="plain")
    prefix = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    return prefix + ctx, whole[len(ctx):]


def _fit(ctx: list[int], cont: list[int], context_length: int) -> tuple[list[int], bool]:
    """The context cut from the left so that ``ctx + cont[:-1]`` fits; whether it was cut."""
    if not cont:
        raise ValueError("a continuation encodes to no tokens; every choice must add text to score")
    if len(cont) > context_length:
        raise ValueError(f"a continuation has {len(cont)} tokens but the model's context length is {context_length}; "
                         "it cannot be scored (shorten the choice)")
    over = len(ctx) + len(cont) - (context_length + 1)
    return (ctx[over:], True) if over > 0 else (ctx, False)


def _pad(rows: Sequence[Sequence[int]], device: Any) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out.to(device)


@torch.inference_mode()
def _score_batch(model: Any, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    device = model.lm_head.weight.device
    ctx_index: dict[tuple[int, ...], int] = {}
    for ctx, _ in pairs:
        ctx_index.setdefault(tuple(ctx), len(ctx_index))
    contexts = list(ctx_index)
    lens = torch.tensor([len(c) for c in contexts], device=device)  # (U,)
    # 1. each distinct context once: the next-token log-probs after its last token
    cache = KVCache.for_model(model, len(contexts), capacity=int(lens.max()))
    h = model.hidden(_pad(contexts, device), cache=cache)  # (U, Tc, D)
    last = h[torch.arange(len(contexts), device=device), lens - 1]  # (U, D)
    first_lp = torch.log_softmax(model.logits(last).float(), dim=-1)  # (U, V)
    cache.lengths.copy_(lens)  # the pads' columns are overwritten by the continuations
    rows = [ctx_index[tuple(c)] for c, _ in pairs]
    conts = [cont for _, cont in pairs]
    lls = [float(first_lp[u, c[0]]) for u, c in zip(rows, conts)]
    greedy = [int(first_lp[u].argmax()) == c[0] for u, c in zip(rows, conts)]
    longest = max(len(c) for c in conts)
    if longest > 1:
        # 2. every continuation after a copy of its context's cache row
        idx = torch.tensor(rows, device=device)
        big = KVCache.for_model(model, len(pairs), capacity=int(lens.max()) + longest - 1)
        width = cache.capacity
        big.k[:, :, :, :width] = cache.k[:, idx]
        big.v[:, :, :, :width] = cache.v[:, idx]
        big.token_ids[:, :width] = cache.token_ids[idx]  # the previous token a smearing model reads
        big.lengths.copy_(lens[idx])
        logits = model.logits(model.hidden(_pad([c[:-1] if len(c) > 1 else c[:1] for c in conts], device),
                                           cache=big))  # (R, Cmax-1, V)
        lp = torch.log_softmax(logits.float(), dim=-1)
        for r, c in enumerate(conts):
            if len(c) > 1:
                tgt = torch.as_tensor(c[1:], device=device)
                rest = lp[r, : len(c) - 1]  # (n-1, V)
                lls[r] += float(rest.gather(1, tgt[:, None]).sum())
                greedy[r] = greedy[r] and bool((rest.argmax(-1) == tgt).all())
    return list(zip(lls, greedy))


def _batches(encoded: list[Any], batch_size: int, context_length: int) -> list[list[Any]]:
    """Consecutive runs of at most ``batch_size`` requests whose longest context plus longest continuation
    fits the context (every row of the second cache has the same width)."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    c_max = x_max = 0
    for req in encoded:
        c, x = max(c_max, len(req[0])), max(x_max, len(req[1]))
        if cur and (len(cur) == batch_size or c + x - 1 > context_length):
            out.append(cur)
            cur, c, x = [], len(req[0]), len(req[1])
        cur.append(req)
        c_max, x_max = c, x
    if cur:
        out.append(cur)
    return out


def score_requests(model: Any, tokenizer: Tokenizer, requests: Sequence[tuple[str, str]],
                   batch_size: int = 16) -> list[Scored]:
    """Score each ``(context, continuation)`` with ``model`` (a ``TransformerLM``), ``batch_size`` requests per pass.

    Requests sharing a context should be adjacent (the choices of one item): they share its prefill.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    ctx_len = model.cfg.context_length
    encoded = []
    for context, continuation in requests:
        ctx, cont = encode_request(tokenizer, context, continuation)
        ctx, cut = _fit(ctx, cont, ctx_len)
        encoded.append((ctx, cont, cut))
    out: list[Scored] = []
    was_training = model.training
    model.eval()
    try:
        for chunk in _batches(encoded, batch_size, ctx_len):
            scores = _score_batch(model, [(c, x) for c, x, _ in chunk])
            out += [Scored(ll, g, len(x), cut) for (ll, g), (_, x, cut) in zip(scores, chunk)]
    finally:
        model.train(was_training)
    return out
