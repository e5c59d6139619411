"""Feeding token shards to training: ``get_batch`` (CS336), ``BlockLoader`` (exact resume), ``val_batches``.

``BlockLoader`` cuts each shard of a split into blocks of ``context_length + 1`` tokens (inputs and
shifted targets come from the same block, as in TinyLlama / Steel-LLM) and walks a seeded
permutation of all blocks, epoch after epoch. The permutation is computed, not stored (a keyed
Feistel network, see :func:`permute`), so the loader's memory does not grow with the corpus. Its whole position is a few integers and shard
names, so ``state_dict()`` is small JSON and a restored loader continues with exactly the batches
an uninterrupted one would have produced.

Appending data mid-run (Steel-LLM's scheme): shards added to the directory between restarts are
found by ``load_state_dict``; their blocks are merged into the *not yet seen* part of the current
epoch and that part is reshuffled (seeded), so nothing already seen in this epoch repeats. The
merge is recorded in the state, so later restarts replay it exactly.

Data parallelism: an optimizer step takes ``global_batch_size`` consecutive blocks of the epoch order
(default ``batch_size * world_size``: one micro-batch per rank). Its ``k``-th micro-batch call takes the
``k``-th run of ``batch_size * world_size`` of them and rank ``r`` gets the ``r``-th slice, so ranks are
disjoint and together cover the epoch (minus a remainder smaller than one global batch). Which blocks a
step sees depends only on the step and the global batch, never on the world size or the micro-batch
split; a new epoch starts only at a step boundary. The state is the same on every rank and is global
(epoch, blocks consumed), so a run saved at one world size resumes at another with the same samples.

Example::

    ds = TokenDataset("data/shakespeare", "train")
    loader = BlockLoader(ds, batch_size=16, context_length=256, seed=0)
    x, y = loader.next_batch()                               # (16, 256) int64 each, y = x shifted by one
    state = loader.state_dict()                              # small JSON: save it with the checkpoint
    again = BlockLoader(TokenDataset("data/shakespeare", "train"), 16, 256, seed=0)
    again.load_state_dict(state)                             # the next batches are the same, bit for bit
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from lmforge.data.mixture import CopyMixture
from lmforge.data.shards import TokenDataset
from lmforge.corpus.splits import mix64

if TYPE_CHECKING:
    import torch  # here: data prepare/inspect never need torch (~1 s to import)

logger = logging.getLogger("lmforge")

STATE_VERSION = 1


def get_batch(tokens: np.ndarray, batch_size: int, context_length: int, device: Any = "cpu",
              generator: "torch.Generator | None" = None) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Random training windows from a 1-D token array (e.g. a ``np.memmap``), CS336 semantics.

    For uniformly drawn starts ``i`` in ``[0, len(tokens) - context_length - 1]``: ``x = tokens[i:i+T]``,
    ``y = tokens[i+1:i+T+1]``, both int64 ``(B, T)`` on ``device``. Only the selected windows are
    read. On CUDA the batch is pinned and copied asynchronously.
    """
    import torch  # here: data prepare/inspect never need torch (~1 s to import)

    for name, v in (("batch_size", batch_size), ("context_length", context_length)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    n = len(tokens)
    if n < context_length + 1:
        raise ValueError(f"the token array has {n} tokens, fewer than context_length + 1 = {context_length + 1}; "
                         "use more data or a shorter context")
    starts = torch.randint(n - context_length, (batch_size,), generator=generator).numpy()
    idx = starts[:, None] + np.arange(context_length + 1)  # (B, T+1)
    block = torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))  # (B, T+1)
    x, y = block[:, :-1].contiguous(), block[:, 1:].contiguous()  # (B, T), (B, T)
    dev = torch.device(device)
    if dev.type == "cuda":
        return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
    return x.to(dev), y.to(dev)


_WINDOW = 4096  # epoch positions whose block ids are computed together
def _round_keys(*key: int) -> list[np.uint64]:
    """Four 64-bit round keys derived from integers (seed, epoch, layer)."""
    raw = "/".join(map(str, key)).encode()
    return [np.uint64(int.from_bytes(hashlib.blake2b(raw + bytes([r]), digest_size=8).digest(), "little"))
            for r in range(4)]


def permute(x: np.ndarray, n: int, keys: list[np.uint64]) -> np.ndarray:
    """``p(x)`` for a keyed pseudo-random permutation ``p`` of ``[0, n)``, computed, never stored.

    A 4-round balanced Feistel network on the smallest even number of bits that covers ``n`` is a
    bijection of ``[0, 2**bits)``; values that land outside ``[0, n)`` are sent through it again
    ("cycle walking"), which makes it a bijection of ``[0, n)``. O(1) memory for any corpus size.
    """
    x = np.asarray(x, dtype=np.uint64)
    if n <= 1:
        return np.zeros(x.shape, dtype=np.int64)
    half = ((n - 1).bit_length() + 1) // 2
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)

    def feistel(y: np.ndarray) -> np.ndarray:
        left, right = y >> shift, y & mask
        for k in keys:
            left, right = right, left ^ (mix64(right ^ k) & mask)
        return (left << shift) | right

    y = feistel(x)
    out = y >= np.uint64(n)
    while out.any():  # at most a few rounds: the Feistel domain is < 4n
        y[out] = feistel(y[out])
        out = y >= np.uint64(n)
    return y.astype(np.int64)


def _block_starts(dataset: TokenDataset, i: int, block: int, bos_aligned: bool) -> np.ndarray | int:
    """Start offsets of the blocks of shard ``i``; an int ``n`` stands for ``0, block, ..., (n-1)*block``."""
    n = len(dataset.shards[i])
    if not bos_aligned:
        return n // block
    docs = dataset.doc_starts(i)
    docs = docs[docs + block <= n]
    out = []
    j = 0
    while j < len(docs):  # greedy: a block at each document start that follows the previous block's end
        out.append(docs[j])
        j = int(np.searchsorted(docs, docs[j] + block, side="left"))
    return np.asarray(out, dtype=np.int64)


class BlockLoader:
    """Shuffled fixed-length blocks of a :class:`TokenDataset` with exact, JSON-serialisable resume.

    ``bos_aligned=True`` starts every block at a document start (nanochat style; the block may run
    into the following documents, and the rest of a document longer than a block is dropped); it
    keeps each shard's block starts in memory (8 bytes per block).
    ``positions=True`` makes ``next_batch`` also return position ids that restart at 0 at every
    document start inside a block, for document-aware RoPE positions.
    ``mixture``: synthetic copy segments written into every block (:class:`~lmforge.data.mixture.CopyMixture`,
    seeded by the block's place in the epoch, so resuming needs nothing more); the share of tokens it replaced in
    this rank's blocks since step 0 is in the state and in :meth:`step_metrics`.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, context_length: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, bos_aligned: bool = False, positions: bool = False,
                 global_batch_size: int | None = None, mixture: CopyMixture | None = None) -> None:
        if batch_size < 1 or context_length < 1:
            raise ValueError(f"batch_size and context_length must be >= 1 (got {batch_size}, {context_length})")
        gb = batch_size * world_size if global_batch_size is None else int(global_batch_size)
        if gb < 1 or gb % (batch_size * world_size):
            raise ValueError(f"global_batch_size={gb} must be a positive multiple of batch_size x world_size = "
                             f"{batch_size} x {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.dataset, self.batch_size, self.context_length = dataset, int(batch_size), int(context_length)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.bos_aligned, self.positions = bool(bos_aligned), bool(positions)
        self.global_batch_size = gb
        self.mixture = mixture
        self.mixed_tokens = self.mixture_tokens = 0  # replaced by the mixture / seen, in this rank's blocks
        self._block = self.context_length + 1
        self._starts = [_block_starts(dataset, i, self._block, self.bos_aligned) for i in range(len(dataset.shards))]
        counts = [s if isinstance(s, int) else len(s) for s in self._starts]
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._docs: dict[int, np.ndarray] = {}
        self._key_cache: dict[tuple[int, int, int], list[np.uint64]] = {}
        self._names = dataset.shard_names
        self._sha = {e["name"]: e["sha256"] for e in dataset.entries}
        self.epoch = 0
        self._start_epoch(0)

    # ---- the epoch order ------------------------------------------------------------------------
    # Layer 0 is a permutation of the blocks of the shards known when the epoch started (global ids
    # 0..base-1). Each merge k appends a layer (at, prev_len, first, count): positions before `at` keep
    # the previous order; the rest of the previous order plus the `count` new blocks (global ids
    # first..first+count-1) are permuted together. Nothing is materialised: O(merges) memory.
    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0
        self._epoch_shards = list(self._names)
        self._merges: list[dict[str, Any]] = []
        self._base = self._length = int(self._cum[-1])
        self._layers: list[tuple[int, int, int, int]] = []
        self._window: tuple[int, np.ndarray] | None = None
        if self._base < self.global_batch_size:
            raise ValueError(
                f"split {self.dataset.split!r} of {self.dataset.dir} has {self.dataset.num_tokens:,} tokens = "
                f"{self._base} blocks of context_length + 1 = {self._block} tokens, fewer than one global batch "
                f"({self.global_batch_size} sequences); use more data, a shorter context or a smaller batch")

    def _merge(self, names: list[str]) -> None:
        """Merge new shards into the unseen rest of this epoch and reshuffle that rest (seeded)."""
        idx = [self._names.index(n) for n in names]
        assert idx == list(range(idx[0], idx[0] + len(idx))), "merged shards must follow the known ones"
        first, count = int(self._cum[idx[0]]), int(self._cum[idx[-1] + 1] - self._cum[idx[0]])
        self._layers.append((self.consumed, self._length, first, count))
        self._length += count
        self._window = None
        self._merges.append({"at": self.consumed, "shards": list(names)})

    def _keys(self, layer: int) -> list[np.uint64]:
        key = (self.seed, self.epoch, layer)
        if key not in self._key_cache:
            self._key_cache = {key: _round_keys(*key), **{k: v for k, v in self._key_cache.items() if k[1] == key[1]}}
        return self._key_cache[key]

    def _ids(self, lo: int, n: int) -> np.ndarray:
        """Block ids at epoch positions ``lo..lo+n-1``, computed ``_WINDOW`` positions at a time (vectorised)."""
        w = self._window
        if w is None or not (w[0] <= lo and lo + n <= w[0] + len(w[1])):
            stop = min(self._length, lo + max(n, _WINDOW))
            w = self._window = (lo, self._order_at(np.arange(lo, stop, dtype=np.int64)))
        return w[1][lo - w[0]:lo - w[0] + n]

    def _order_at(self, p: np.ndarray, layer: int | None = None) -> np.ndarray:
        """Global block ids at epoch positions ``p``."""
        k = len(self._layers) if layer is None else layer
        if k == 0:
            return permute(p, self._base, self._keys(0))
        at, prev_len, first, count = self._layers[k - 1]
        out = np.empty(len(p), dtype=np.int64)
        seen = p < at
        out[seen] = self._order_at(p[seen], k - 1)
        rest = prev_len - at
        q = permute(p[~seen] - at, rest + count, self._keys(k))
        old = q < rest
        ids = np.empty(len(q), dtype=np.int64)
        ids[old] = self._order_at(at + q[old], k - 1)
        ids[~old] = first + q[~old] - rest
        out[~seen] = ids
        return out

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches in the current epoch (as known now)."""
        return self._length // self.global_batch_size

    # ---- batches ----------------------------------------------------------------------------------
    def _read(self, ids: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copy blocks ``ids`` into ``out`` (B, T+1), one gather per shard that only touches those pages.

        Returns each row's shard index and start offset.
        """
        shard = np.searchsorted(self._cum, ids, side="right") - 1  # (B,)
        local = ids - self._cum[shard]
        starts = np.empty(len(ids), dtype=np.int64)
        for i in np.unique(shard):
            rows = np.flatnonzero(shard == i)
            st = self._starts[i]
            starts[rows] = local[rows] * self._block if isinstance(st, int) else st[local[rows]]
            out[rows] = self.dataset.shards[i][starts[rows, None] + np.arange(self._block)]  # (rows, T+1) gather
        return shard, starts

    def _positions_for(self, i: int, start: int) -> np.ndarray:
        if i not in self._docs:
            self._docs[i] = self.dataset.doc_starts(i)
        docs = self._docs[i]
        t = np.arange(start, start + self.context_length)
        k = np.searchsorted(docs, t, side="right") - 1  # index of the last document start <= t
        last = np.where(k >= 0, docs[np.maximum(k, 0)], start)
        return t - np.maximum(last, start)

    def next_batch(self) -> tuple["torch.Tensor", ...]:
        """This rank's next ``(x, y)`` (int64 CPU tensors ``(B, T)``), plus positions if requested."""
        import torch  # here: data prepare/inspect never need torch (~1 s to import)

        gb = self.batch_size * self.world_size  # blocks of one micro-batch call over all ranks
        step_start = self.consumed % self.global_batch_size == 0
        if (step_start and self.consumed + self.global_batch_size > self._length) or self.consumed + gb > self._length:
            self._start_epoch(self.epoch + 1)  # only at a step boundary, unless resumed with another global batch
        lo = self.consumed + self.rank * self.batch_size
        ids = self._ids(lo, self.batch_size)
        buf = np.empty((self.batch_size, self._block), dtype=np.int64)  # (B, T+1)
        pos = np.empty((self.batch_size, self.context_length), dtype=np.int64) if self.positions else None
        shard, starts = self._read(ids, buf)
        if self.mixture is not None:
            self.mixed_tokens += self.mixture.apply(buf, self.seed, self.epoch, lo)
            self.mixture_tokens += buf.size
        if pos is not None:
            for b in range(self.batch_size):
                pos[b] = self._positions_for(int(shard[b]), int(starts[b]))
        self.consumed += gb
        block = torch.from_numpy(buf)
        x, y = block[:, :-1].contiguous(), block[:, 1:].contiguous()  # (B, T), (B, T)
        if pos is not None:
            return x, y, torch.from_numpy(pos)
        return x, y

    def __iter__(self) -> Iterator[tuple["torch.Tensor", ...]]:
        while True:
            yield self.next_batch()

    def step_metrics(self) -> dict[str, float]:
        """With a mixture: ``copy_data_share``, the share of tokens it replaced in this rank's blocks since step 0
        (the training loop logs it with each step)."""
        return {"copy_data_share": self.mixed_tokens / self.mixture_tokens} if self.mixture_tokens else {}

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (JSON-serialisable)."""
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "batch_size": self.batch_size, "context_length": self.context_length, "world_size": self.world_size,
                "global_batch_size": self.global_batch_size,
                "bos_aligned": self.bos_aligned, "split": self.dataset.split,
                "epoch_shards": list(self._epoch_shards), "merges": [dict(m) for m in self._merges],
                "shards": {n: self._sha[n] for n in self._names if n in self._known()},
                **({"mixture": self.mixture.signature(), "mixed_tokens": self.mixed_tokens,
                    "mixture_tokens": self.mixture_tokens} if self.mixture is not None else {})}

    def _known(self) -> list[str]:
        return self._epoch_shards + [n for m in self._merges for n in m["shards"]]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; shards added to the dataset since then join the unseen rest of the epoch."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not {STATE_VERSION}")
        for key in ("seed", "context_length", "bos_aligned", "split"):
            mine = getattr(self, key) if key != "split" else self.dataset.split
            if state[key] != mine:
                raise ValueError(f"the loader state was saved with {key}={state[key]!r} but this loader has {mine!r}; "
                                 "resume with the same data settings")
        # states written before global_batch_size was recorded: their global batch is not known (accumulation)
        saved_gb = state.get("global_batch_size", self.global_batch_size)
        if state["batch_size"] != self.batch_size and "global_batch_size" not in state:
            raise ValueError(f"the loader state was saved with batch_size={state['batch_size']!r} but this loader has "
                             f"{self.batch_size!r}; resume with the same data settings")
        if saved_gb != self.global_batch_size:  # the micro-batch and world size may change; the global batch not
            raise ValueError(
                f"the loader state was saved with a global batch of {saved_gb} sequences per step (batch_size="
                f"{state['batch_size']} x world_size={state['world_size']}"
                f"{' x accumulation' if saved_gb != state['batch_size'] * state['world_size'] else ''}) but this loader "
                f"takes {self.global_batch_size} (batch_size={self.batch_size} x world_size={self.world_size}); resume "
                f"with the same global batch, e.g. training.global_batch_size={saved_gb} at any world size")
        mine = self.mixture.signature() if self.mixture is not None else None
        if state.get("mixture") != mine:
            raise ValueError(f"the loader state was saved with the copy data mixture {state.get('mixture')!r} but this "
                             f"loader has {mine!r}; resume with the same data.copy_* settings")
        known = state["epoch_shards"] + [n for m in state["merges"] for n in m["shards"]]
        if self._names[:len(known)] != known:
            missing = [n for n in known if n not in self._names]
            raise ValueError(f"the shards of {self.dataset.dir} changed since the loader state was saved "
                             f"({'missing: ' + ', '.join(missing) if missing else 'reordered'}); restore them to resume")
        for n in known:
            if state["shards"].get(n, self._sha[n]) != self._sha[n]:
                raise ValueError(f"shard {n} was replaced since the loader state was saved (content hash differs)")
        new = self._names[len(known):]
        dup = [n for n in new if self._sha[n] in {state["shards"].get(k) for k in known}]
        if dup:
            raise ValueError(f"shards {dup} repeat the content of shards already in the run; remove them")
        self.epoch = int(state["epoch"])
        self.consumed = 0
        self._epoch_shards = list(state["epoch_shards"])
        self._merges, self._layers, self._window = [], [], None
        self._base = self._length = int(self._cum[len(self._epoch_shards)])  # they are a prefix of the shards
        for m in state["merges"]:  # replay earlier merges exactly
            self.consumed = int(m["at"])
            self._merge(m["shards"])
        self.consumed = int(state["consumed"])
        self.mixed_tokens, self.mixture_tokens = int(state.get("mixed_tokens", 0)), int(state.get("mixture_tokens", 0))
        if new:
            logger.info("loader: merging %d new shards (%s) into the rest of epoch %d", len(new), ", ".join(new),
                        self.epoch)
            self._merge(new)


def val_batches(dataset: TokenDataset, batch_size: int, context_length: int,
                max_batches: int) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
    """A fixed, deterministic list of validation batches: the split's first blocks, in order."""
    import torch  # here: data prepare/inspect never need torch (~1 s to import)

    block = context_length + 1
    n_blocks = [len(s) // block for s in dataset.shards]
    total = min(sum(n_blocks), max_batches * batch_size)
    if total < batch_size:
        raise ValueError(f"split {dataset.split!r} of {dataset.dir} has {dataset.num_tokens:,} tokens, not enough for one "
                         f"batch of {batch_size} x {block} tokens; use more validation data or smaller eval batches")
    buf = np.empty((total - total % batch_size, block), dtype=np.int64)  # (N, T+1)
    row = 0
    for s, n in zip(dataset.shards, n_blocks):
        take = min(n, len(buf) - row)
        buf[row:row + take] = np.asarray(s[:take * block]).reshape(take, block)
        row += take
        if row == len(buf):
            break
    t = torch.from_numpy(buf)
    return [(t[i:i + batch_size, :-1], t[i:i + batch_size, 1:]) for i in range(0, len(buf), batch_size)]
