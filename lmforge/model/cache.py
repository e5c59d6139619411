"""The KV cache: keys and values of the tokens each row has already seen, and the one context-length check.

One cache serves every inference path: ``TransformerLM.forward(idx, cache=cache)`` appends the new tokens'
keys and values and attends over each row's own prefix, and the generation engine's C++ decode step reads and
writes the same tensors. Rows are independent: row ``b`` holds its tokens in columns ``0 .. lengths[b]-1``, so
prompts of different lengths are right-padded and RoPE positions are cache columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache", "check_context"]


def check_context(n_tokens: int, context_length: int, what: str = "the input",
                  limit: str = "the model's context length") -> None:
    """``ValueError`` when ``n_tokens`` do not fit in ``context_length`` (the one message for every path)."""
    if n_tokens > context_length:
        raise ValueError(f"{what} has {n_tokens} tokens but {limit} is {context_length}; shorten it to the last "
                         f"{context_length} tokens, or train a model with a longer context")


class KVCache:
    """Preallocated keys and values ``k, v (n_layers, B, n_kv_heads, capacity, head_dim)`` and ``lengths (B,)``.

    ``lengths[b]`` counts the tokens row ``b`` holds. The model writes new tokens at each row's columns
    ``lengths[b] ..`` (:meth:`begin` plans a pass, :meth:`write` stores each layer's keys and values, :meth:`mask`
    says what each query sees), and :meth:`advance` moves the lengths on.
    A row can be emptied (:meth:`reset`) and refilled alone through a view of it (:meth:`rows`), which shares
    the storage: that is how a row slides past the context or a finished request frees its slot.

    ``token_ids (B, capacity)`` int64: the token id in each cached column, written by models whose next token
    reads the previous one (``model.smear``: :meth:`write_ids`, read back by :meth:`last_ids`). Stored per
    column, not per row, so right-padded prompts need nothing more than their lengths set (the last real token
    is column ``lengths[b] - 1``). A row's whole state is therefore its columns ``0 .. lengths[b]-1`` of ``k``,
    ``v`` and ``token_ids`` and ``lengths[b]``: whoever copies a row copies all four (:meth:`copy_row`).

    ``static = True`` (a view's setting, for decode steps captured as CUDA graphs) plans every pass with fixed
    shapes and no host sync: new tokens go to each row's own columns and every query attends over all ``capacity``
    columns under a mask. The caller keeps room in every row (the engine slides full rows first): nothing checks.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        for name, v in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim), ("capacity", capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVCache {name} must be a positive integer, got {v!r}")
        shape = (n_layers, batch_size, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype or torch.float32)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.k.device)
        self.token_ids = torch.zeros(batch_size, capacity, dtype=torch.long, device=self.k.device)
        self.capacity = capacity
        self.static = False
        self._plan: tuple[int, int | None, Tensor, int] | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, capacity: int | None = None,
                  dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "KVCache":
        """A cache shaped for ``model`` (defaults: its context length, parameter device and dtype)."""
        cfg = model.cfg
        capacity = cfg.context_length if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity <= cfg.context_length:
            raise ValueError(f"cache capacity must be in [1, context_length={cfg.context_length}], got {capacity!r}")
        p = model.lm_head.weight
        return cls(cfg.n_layers, batch_size, cfg.n_kv_heads, cfg.head_dim, capacity,
                   device=device or p.device, dtype=dtype or p.dtype)

    @classmethod
    def _view(cls, k: Tensor, v: Tensor, lengths: Tensor, token_ids: Tensor) -> "KVCache":
        view = cls.__new__(cls)
        view.k, view.v, view.lengths, view.capacity, view.static, view._plan = k, v, lengths, k.shape[3], False, None
        view.token_ids = token_ids
        return view

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def rows(self, rows: slice | int) -> "KVCache":
        """A cache over rows ``rows`` that shares this one's storage (writes and lengths are seen by both)."""
        sl = slice(rows, rows + 1) if isinstance(rows, int) else rows
        return KVCache._view(self.k[:, sl], self.v[:, sl], self.lengths[sl], self.token_ids[sl])

    def copy_row(self, src: int, dst: int) -> None:
        """Make row ``dst`` hold what row ``src`` holds (its keys, values, token ids and length): a fork of a
        row, e.g. several samples of one prefilled prompt."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.lengths[dst] = n

    def reset(self) -> None:
        """Forget every row's tokens (the storage is kept; stale columns are never attended to)."""
        self.lengths.zero_()

    def begin(self, T: int) -> Tensor:
        """Plan a forward pass of ``T`` new tokens per row; returns their RoPE positions (= cache columns).

        ``(T,)`` when every row starts at the same column, else ``(B, T)`` (always, when :attr:`static`). The
        model calls this once per forward, then :meth:`write` per layer, :meth:`mask`, and :meth:`advance` at the
        end.
        """
        if self.static:  # fixed shapes, no host sync: each row's own columns, attention over the whole capacity
            cols = self.lengths[:, None] + torch.arange(T, device=self.k.device)  # (B, T)
            self._plan = (T, None, cols, self.capacity)
            return cols
        lo, hi = (int(x) for x in torch.aminmax(self.lengths))  # one host sync per forward
        check_context(hi + T, self.capacity, f"a cached row ({hi} cached + {T} new tokens)", "the KV cache's capacity")
        steps = torch.arange(T, device=self.k.device)
        start = lo if lo == hi else None
        cols = steps + lo if start is not None else self.lengths[:, None] + steps  # (T,) or (B, T)
        self._plan = (T, start, cols, hi + T)
        return cols

    def _planned(self, T: int) -> tuple[int | None, Tensor, int]:
        plan = getattr(self, "_plan", None)
        if plan is None or plan[0] != T:
            raise RuntimeError("KVCache.begin(T) must be called before write/mask for the same T")
        return plan[1:]

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v (B, KV, T, D)`` of the new tokens of ``layer``; return the keys and values to attend to,
        ``(B, KV, S, D)`` with ``S`` = the longest row's length after this write."""
        B, _, T, _ = k.shape
        if B != self.batch_size:
            raise ValueError(f"a batch of {B} rows does not fit a KV cache of {self.batch_size} rows; build the cache "
                             "with KVCache.for_model(model, batch_size)")
        start, cols, end = self._planned(T)
        kc, vc = self.k[layer], self.v[layer]  # (B, KV, capacity, D)
        if start is not None:
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v
        else:
            rows = torch.arange(B, device=k.device)[:, None].expand(B, T)  # (B, T)
            kc[rows, :, cols] = k.transpose(1, 2)  # advanced indices first: (B, T, KV, D)
            vc[rows, :, cols] = v.transpose(1, 2)
        ks, vs = kc[:, :, :end], vc[:, :, :end]
        if ks.dtype != k.dtype:  # e.g. a float32 cache under bf16 autocast
            ks, vs = ks.to(k.dtype), vs.to(k.dtype)
        return ks, vs

    def write_ids(self, idx: Tensor) -> None:
        """Store the ids ``idx (B, T)`` of the new tokens in their columns of :attr:`token_ids` (after :meth:`begin`)."""
        start, cols, end = self._planned(idx.shape[1])
        if start is not None:
            self.token_ids[:, start:end] = idx
        else:
            self.token_ids.scatter_(1, cols, idx)

    def last_ids(self) -> tuple[Tensor, Tensor]:
        """``(ids (B,), held (B,) bool)``: each row's last cached token id (column ``lengths[b] - 1``) and whether
        the row holds a token at all (``ids`` is then 0). No host sync: CUDA graphs may read it."""
        held = self.lengths > 0
        col = (self.lengths - 1).clamp(min=0)[:, None]  # (B, 1)
        return self.token_ids.gather(1, col).squeeze(1) * held, held

    def mask(self, T: int) -> Tensor | None:
        """Which cached columns each of the next ``T`` queries attends to (``True`` = attend).

        ``None`` when plain causal attention is exact (every row empty) or full attention is (one query per
        row, every row the same length); else ``(T, S)`` (every row the same length) or ``(B, 1, T, S)``.
        Query ``t`` of row ``b`` sits in column ``lengths[b] + t`` and sees columns ``0 ..`` that one.
        """
        start, cols, end = self._planned(T)
        if start is not None and (start == 0 or T == 1):
            return None
        keys = torch.arange(end, device=self.k.device)
        if start is not None:
            return keys[None, :] <= cols[:, None]  # (T, S)
        return (keys[None, None, :] <= cols[:, :, None])[:, None]  # (B, 1, T, S)

    def advance(self, T: int) -> None:
        """Count ``T`` more tokens in every row (the model calls this once all layers have written them)."""
        self._plan = None
        self.lengths += T
