"""Perplexity and bits per byte of a model on documents or on a shard directory.

Documents: each is encoded as ``EOT + text`` (the way ``prepare`` lays documents out) and cut into windows of
``context_length`` targets; each window is scored on its own (non-overlapping windows: a token at the start
of a window sees no earlier text, so a long document scores a little worse than with a sliding window).
Shards: blocks of ``context_length + 1`` tokens in file order, as the training loop's validation batches.
Bits per byte = total nats / ln 2 / UTF-8 bytes of the text scored.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from lmforge.data import TokenDataset
from lmforge.data.shards import load_manifest
from lmforge.tokenizer import Tokenizer

__all__ = ["perplexity_of_texts", "perplexity_of_shards", "shard_split"]


def _summary(nats: float, tokens: int, text_bytes: float, docs: int) -> dict[str, Any]:
    loss = nats / max(tokens, 1)
    return {"n": docs, "tokens": tokens, "loss": loss, "ppl": math.exp(min(loss, 700.0)),
            "bpb": nats / math.log(2) / text_bytes if text_bytes > 0 else None}


@torch.inference_mode()
def _score_windows(model: Any, windows: list[np.ndarray], batch_size: int) -> float:
    """Sum of the loss (nats) over windows (each ``inputs + 1`` tokens), batched by equal length."""
    device = model.lm_head.weight.device
    by_len: dict[int, list[np.ndarray]] = defaultdict(list)
    for w in windows:
        by_len[len(w)].append(w)
    total = 0.0
    was_training = model.training
    model.eval()
    try:
        for group in by_len.values():
            for i in range(0, len(group), batch_size):
                t = torch.from_numpy(np.stack(group[i: i + batch_size]).astype(np.int64)).to(device)  # (B, T+1)
                total += float(model(t[:, :-1], targets=t[:, 1:], reduction="sum"))
    finally:
        model.train(was_training)
    return total


def perplexity_of_texts(model: Any, tokenizer: Tokenizer, texts: Sequence[str], batch_size: int = 16) -> dict[str, Any]:
    """``{"n", "tokens", "loss", "ppl", "bpb"}`` of ``model`` on the documents ``texts``."""
    ctx = model.cfg.context_length
    prefix = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    windows: list[np.ndarray] = []
    tokens = 0
    text_bytes = 0
    for text in texts:
        ids = np.asarray(prefix + tokenizer.encode(text, special="plain"), dtype=np.int64)
        text_bytes += len(text.encode("utf-8"))
        tokens += len(ids) - 1
        windows += [ids[s: s + ctx + 1] for s in range(0, len(ids) - 1, ctx)]
    nats = _score_windows(model, windows, batch_size)
    return _summary(nats, tokens, text_bytes, len(texts))


def shard_split(directory: str | Path) -> str:
    """The split of a shard directory to score: ``val`` if it has one, else its only split."""
    splits = [k for k, v in load_manifest(Path(directory))["splits"].items() if v.get("tokens")]
    if "val" in splits:
        return "val"
    if len(splits) == 1:
        return splits[0]
    raise ValueError(f"{directory} has splits {sorted(splits)} and none is 'val'; prepare a val split "
                     "(data prepare --val-fraction or --split val)")


def perplexity_of_shards(model: Any, tokenizer: Tokenizer, directory: str | Path, limit: int | None = None,
                         batch_size: int = 16) -> dict[str, Any]:
    """Loss, perplexity and bits per byte on a shard directory's ``val`` split (or its only one), at most
    ``limit`` blocks of ``context_length + 1`` tokens. ``ValueError`` if the shards were made with another
    tokenizer."""
    split = shard_split(directory)
    ds = TokenDataset(directory, split)
    ds.check_tokenizer(tokenizer)
    block = model.cfg.context_length + 1
    windows: list[np.ndarray] = []
    for shard in ds.shards:
        for s in range(0, len(shard) - block + 1, block):
            if limit is not None and len(windows) >= limit:
                break
            windows.append(np.asarray(shard[s: s + block]))
    if not windows:
        raise ValueError(f"split {split!r} of {directory} has {ds.num_tokens:,} tokens, fewer than one block of "
                         f"{block}; use more data")
    nats = _score_windows(model, windows, batch_size)
    tokens = len(windows) * (block - 1)
    out = _summary(nats, tokens, tokens * ds.bytes_per_token, len(windows))
    out["split"] = split
    return out
