"""A prefix cache across requests: the keys and values of token prefixes kept after a request, reused by the next.

Every chat client re-sends the whole conversation each turn, and many clients share one system prompt. The
:class:`PrefixCache` keeps the KV of token prefixes in blocks of ``block`` tokens, each keyed by its parent block and
its own tokens (a radix tree of blocks: tokens are compared exactly, never through a hash). A new prompt walks the tree
from its first token; the longest chain of whole cached blocks is copied into its cache row, and only the rest of the
prompt is prefilled. At least one prompt token is always left to prefill (its logits start the reply).

Tenancy: blocks are shared by every request with the same ``salt`` (``None``: one shared, unsalted space). A salt
is folded into the first block's key (as its parent: the SHA-256 digest of the salt's UTF-8 bytes, 32 bytes however
long the salt), so a chain stored under one salt cannot be reached from another salt or from none: a request under a
different salt reuses nothing (it reports 0 cached tokens and prefills the whole prompt, so neither its counts nor
its time to first token say what others sent). Salts share the byte budget: one salt's traffic can evict another's
blocks, which shows how much others send (their own hits drop), never what.

Blocks are read-only once stored (a row gets copies), and evicted least recently used under a byte budget: a lookup
touches its chain leaf first, so a parent is always more recent than its children and eviction takes leaves first.

Why the replies do not change: row ``b``'s column ``i`` holds the keys and values of token ``i`` given tokens
``0 .. i`` (RoPE positions are columns), which is what the stored block holds for the same tokens; on the CPU
kernels' path a prompt's tokens get the bits single steps would (:mod:`~lmforge.generate.engine`), wherever it starts.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["DEFAULT_BLOCK", "MAX_SALT_CHARS", "PrefixCache", "PrefixStats", "admit_cached", "check_salt", "keep_row",
           "positional_fields"]

DEFAULT_BLOCK = 16
"""Tokens per cached block: a prefix is reused up to the last whole block it shares."""

MAX_SALT_CHARS = 4096
"""The longest cache salt, in characters (room for a client's salt and a tenant's identity folded into it)."""

_Parent = int | bytes
"""A block key's parent: the id of the block before it, or for a first block its salt's root (0: no salt)."""


def check_salt(salt: str | None) -> None:
    """``ValueError`` unless ``salt`` is None or a string of 1 to :data:`MAX_SALT_CHARS` characters."""
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_SALT_CHARS):
        got = f"{len(salt)} characters" if isinstance(salt, str) else f"a {type(salt).__name__}"
        raise ValueError(f"cache_salt must be a string of 1 to {MAX_SALT_CHARS} characters or None (got {got})")


def _root(salt: str | None) -> _Parent:
    """The parent of a first block under ``salt``: 0 without one, else the SHA-256 digest of its UTF-8 bytes (lone
    surrogates passed through); block ids are ints, so a digest is never mistaken for one."""
    check_salt(salt)
    return 0 if salt is None else hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()


def positional_fields(cache: Any) -> list[str] | None:
    """The names of ``cache``'s tensors that hold one entry per column of each row (``(L, B, H, capacity, D)`` or
    ``(B, capacity)``), or None when it holds other tensors as well (then a prefix cannot be cut out of a row)."""
    B, S = cache.batch_size, cache.capacity
    tensors = {name: t for name, t in vars(cache).items() if isinstance(t, torch.Tensor) and name != "lengths"}
    positional = all((t.dim() == 5 and t.shape[1] == B and t.shape[3] == S) or t.shape == (B, S)
                     for t in tensors.values())
    return sorted(tensors) if tensors and positional else None


def _columns(t: torch.Tensor, row: int, start: int, end: int) -> torch.Tensor:
    """Columns ``start .. end-1`` of row ``row`` of a positional tensor (a view)."""
    return t[row, start:end] if t.dim() == 2 else t[:, row, :, start:end]


@dataclass
class PrefixStats:
    """Counts since the cache was made: lookups (``queries``) and those that reused a block (``hits``); the prompt
    tokens looked up and those reused; blocks evicted; bytes held now."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    bytes: int = 0


class _Block:
    __slots__ = ("key", "id", "tensors", "nbytes")

    def __init__(self, key: tuple[_Parent, tuple[int, ...]], id_: int, tensors: list[torch.Tensor]) -> None:
        self.key, self.id, self.tensors = key, id_, tensors
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """KV blocks of token prefixes under ``budget_bytes``, shared by the requests of one salt (:func:`check_salt`;
    None is the shared space; module docstring). Thread-safe."""

    def __init__(self, budget_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget must be a non-negative number of bytes (got {budget_bytes!r})")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"the prefix cache's block must be a positive number of tokens (got {block!r})")
        self.budget, self.block = budget_bytes, block
        self._blocks: collections.OrderedDict[tuple[_Parent, tuple[int, ...]], _Block] = collections.OrderedDict()
        self._next_id = 1  # 0 is the unsalted root (the empty prefix); a salt's root is its digest
        self._lock = threading.Lock()
        self.stats = PrefixStats()

    def _chain(self, tokens: Sequence[int], limit: int, root: _Parent) -> list[_Block]:
        """The cached blocks ``tokens[:limit]`` starts with under ``root`` (whole blocks only), root first."""
        chain: list[_Block] = []
        parent = root
        for start in range(0, limit - self.block + 1, self.block):
            found = self._blocks.get((parent, tuple(tokens[start: start + self.block])))
            if found is None:
                break
            chain.append(found)
            parent = found.id
        return chain

    def lookup(self, prompt: Sequence[int], salt: str | None = None) -> list[_Block]:
        """The longest chain of cached blocks ``prompt`` starts with under ``salt``, leaving at least its last token
        out; counted in :attr:`stats` and touched (most recently used)."""
        root = _root(salt)
        with self._lock:
            chain = self._chain(prompt, len(prompt) - 1, root)
            for b in reversed(chain):  # the leaf first: a parent always ends more recent than its children
                self._blocks.move_to_end(b.key)
            s = self.stats
            s.queries += 1
            s.query_tokens += len(prompt)
            s.hits += bool(chain)
            s.hit_tokens += len(chain) * self.block
            return chain

    def restore(self, chain: Sequence[_Block], cache: Any, row: int, fields: Sequence[str]) -> int:
        """Copy ``chain``'s blocks (a :meth:`lookup`'s, so of its salt) into columns ``0 ..`` of ``cache`` row ``row``
        (its ``fields``); returns the columns written. The caller sets the row's length and tokens."""
        for i, b in enumerate(chain):
            for name, t in zip(fields, b.tensors):
                _columns(getattr(cache, name), row, i * self.block, (i + 1) * self.block).copy_(t)
        return len(chain) * self.block

    def store(self, tokens: Sequence[int], cache: Any, row: int, fields: Sequence[str], salt: str | None = None) -> int:
        """Keep the whole blocks of ``tokens`` (what ``cache`` row ``row`` holds in columns ``0 .. len(tokens)-1``)
        not already kept under ``salt``, evicting the least recently used beyond the budget; returns blocks added.
        A failure part way (a copy out of memory) leaves the blocks added before it, within the budget."""
        root = _root(salt)
        with self._lock:  # a budget of 0 keeps nothing: no block fits in it
            chain = self._chain(tokens, len(tokens), root)
            parent = chain[-1].id if chain else root
            added: list[_Block] = []
            try:
                for start in range(len(chain) * self.block, len(tokens) - self.block + 1, self.block):
                    key = (parent, tuple(int(t) for t in tokens[start: start + self.block]))
                    kept = [_columns(getattr(cache, f), row, start, start + self.block).clone() for f in fields]
                    block = _Block(key, self._next_id, kept)
                    if block.nbytes > self.budget:
                        break
                    self._next_id += 1
                    self._blocks[key] = block
                    self.stats.bytes += block.nbytes
                    added.append(block)
                    parent = block.id
            finally:
                for b in reversed(chain + added):  # the leaf first, as in lookup
                    self._blocks.move_to_end(b.key)
                while self.stats.bytes > self.budget:  # evict the least recently used
                    _, b = self._blocks.popitem(last=False)
                    self.stats.bytes -= b.nbytes
                    self.stats.evicted_blocks += 1
            return len(added)

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        """Forget every block (a new model's weights make them stale)."""
        with self._lock:
            self._blocks.clear()
            self.stats.bytes = 0


def admit_cached(engine: Any, cache: PrefixCache | None, prompt: Sequence[int],
                 salt: str | None = None) -> tuple[int, torch.Tensor, int]:
    """``engine.admit(prompt)`` from the longest prefix ``cache`` holds under ``salt`` (then its blocks kept under
    ``salt``): ``(row, logits, cached)``, ``cached`` the prompt tokens taken from the cache instead of prefilled.
    Without a cache, or with a KV cache that cannot be cut (:func:`positional_fields`), a plain admit (``cached`` 0).
    All or nothing: when any part fails, the row it took is freed before the error propagates."""
    fields = positional_fields(engine.cache) if cache is not None and cache.budget else None
    if fields is None:
        return (*engine.admit(prompt), 0)
    # inference tensors; PyTorch on one thread (Engine.serial_torch says why)
    with torch.inference_mode(), engine.serial_torch():
        start = cache.restore(cache.lookup(prompt, salt), engine.cache, engine.active, fields)
        row, logits = engine.admit(prompt, start)
        try:
            cache.store(prompt, engine.cache, row, fields, salt)
        except BaseException:
            engine.release(row)  # the last live row: nothing moves
            raise
    return row, logits, start


def keep_row(engine: Any, cache: PrefixCache | None, row: int, salt: str | None = None) -> None:
    """Keep live ``row``'s tokens (prompt and reply, what its cache holds) in ``cache`` under ``salt`` (its
    request's) before it is freed."""
    fields = positional_fields(engine.cache) if cache is not None and cache.budget else None
    if fields is not None:
        with torch.inference_mode(), engine.serial_torch():
            cache.store(engine.tokens[row, : engine.lengths[row]].tolist(), engine.cache, row, fields, salt)
