"""Rendered conversations on disk and their masked loader: the SFT side of stage 2.

A conversation directory (written by :func:`write_conversations`, read by :class:`ConversationDataset`) holds
``manifest.json``, ``tokenizer.json`` and per split three NumPy ``.npy`` files (``allow_pickle=False``)::

    {split}_ids.npy      int32  (N,)    the token ids of every conversation, one after another
    {split}_mask.npy     uint8  (N,)    1 where the id is a training target (see lmforge.chat.format)
    {split}_offsets.npy  int64  (n+1,)  conversation k is ids[offsets[k]:offsets[k+1]]

The manifest records the tokenizer's fingerprint, each split's counts and the sha256 of the source files it
was rendered from, so a resumed run can refuse changed data.

**Packing.** :class:`ConversationLoader` packs *whole* conversations into rows of ``context_length + 1``
tokens: each epoch takes the conversations in a seeded order and fills a row greedily until the next one does
not fit, then pads the rest of the row (input id ``pad_id``, target ignored). A conversation is never split
across rows, so every trained token sees its whole conversation; conversations in one row are separated by the
end-of-text token the chat format starts each one with (the base model saw documents separated the same way).
Targets whose mask is 0, and padding, become :data:`IGNORE_INDEX`. The loader's position is a few integers
(``state_dict``), global over data-parallel ranks like :class:`~lmforge.data.BlockLoader`: batch ``s`` takes
rows ``[s·G, (s+1)·G)`` (``G = batch_size * world_size``) of the global sequence of rows and rank ``r`` gets the
``r``-th slice. That sequence is every epoch's rows in turn: epochs pack into different numbers of rows (their
orders differ), so a batch that reaches an epoch's end takes the next epoch's first rows, and every batch is full
on every rank, at every epoch (none is dropped, none is short).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from lmforge.common import atomic_open, atomic_write_text
from lmforge.data.loader import BlockLoader

__all__ = ["IGNORE_INDEX", "ConversationDataset", "ConversationLoader", "MixedLoader", "conversation_val_batches",
           "write_conversations", "pack_rows", "epoch_order", "check_packs"]

IGNORE_INDEX = -100
"""Target id that counts for nothing in the loss (a masked or padded position)."""

FORMAT = "lmforge-conversations"
MANIFEST = "manifest.json"
STATE_VERSION = 1


def write_conversations(out_dir: str | os.PathLike, splits: dict[str, tuple[Sequence[tuple[list[int], list[int]]],
                                                                       dict[str, Any]]],
                        tokenizer_fingerprint: str, pad_id: int) -> dict[str, Any]:
    """Write each split's ``(ids, mask)`` pairs into ``out_dir`` and a manifest recording, per split, its counts
    and the given info (sources, skipped), the tokenizer's fingerprint and the padding input id.

    ``splits``: ``{name: (rendered, info)}``. Every file is written atomically, the manifest last and whole, so
    processes writing the same content at once (ranks under ``torchrun``) never expose a partial manifest.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"format": FORMAT, "version": 1, "tokenizer": {"fingerprint": tokenizer_fingerprint},
                                "pad_id": int(pad_id), "splits": {}}
    for split, (rendered, info) in splits.items():
        lengths = np.array([len(ids) for ids, _ in rendered], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.fromiter((i for r, _ in rendered for i in r), dtype=np.int32, count=int(offsets[-1]))
        mask = np.fromiter((m for _, ms in rendered for m in ms), dtype=np.uint8, count=int(offsets[-1]))
        for name, arr in (("ids", ids), ("mask", mask), ("offsets", offsets)):
            with atomic_open(out / f"{split}_{name}.npy", "wb") as f:
                np.save(f, arr, allow_pickle=False)
        manifest["splits"][split] = {"conversations": len(rendered), "tokens": int(offsets[-1]),
                                     "trained_tokens": int(mask.sum()),
                                     "max_token_id": int(ids.max()) if len(ids) else -1, **info}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a conversation directory (``ValueError`` if there is none)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{directory} is not a conversation directory (no valid {MANIFEST}); it is written by "
                         "`lmforge sft` into the run directory")
    return manifest


def pack_rows(lengths: Sequence[int] | np.ndarray, context_length: int, order: np.ndarray) -> list[np.ndarray]:
    """Conversation indices per row: those of ``order`` packed greedily, whole, into rows of at most
    ``context_length + 1`` tokens (a conversation that does not fit starts the next row)."""
    block = context_length + 1
    out, row, used = [], [], 0
    for k in order.tolist():
        n = int(lengths[k])
        if used + n > block and row:
            out.append(np.asarray(row, dtype=np.int64))
            row, used = [], 0
        row.append(k)
        used += n
    if row:
        out.append(np.asarray(row, dtype=np.int64))
    return out


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded order of ``n`` conversations in ``epoch`` (the loader's shuffle)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def check_packs(lengths: Sequence[int], context_length: int, seed: int, rows_per_step: int, split: str) -> None:
    """``ValueError`` unless the conversations pack into at least one global batch of ``rows_per_step`` rows."""
    rows = len(pack_rows(lengths, context_length, epoch_order(len(lengths), seed, 0)))
    if rows < rows_per_step:
        raise ValueError(f"split {split!r} packs into {rows} rows of {context_length + 1} tokens, fewer than one "
                         f"global batch ({rows_per_step} rows: batch size x ranks); add conversations or lower "
                         "training.batch_size")


class ConversationDataset:
    """One split of a conversation directory, memory-mapped: ``ids``, ``mask``, ``offsets`` (see the module)."""

    def __init__(self, directory: str | os.PathLike, split: str) -> None:
        self.dir, self.split = Path(directory), split
        self.manifest = read_manifest(directory)
        if split not in self.manifest["splits"]:
            raise ValueError(f"{directory} has no conversations for split {split!r} "
                             f"(it has {', '.join(sorted(self.manifest['splits'])) or 'none'})")
        self.info = self.manifest["splits"][split]
        load = lambda name: np.load(self.dir / f"{split}_{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        self.ids, self.mask, self.offsets = load("ids"), load("mask"), load("offsets")
        if len(self.offsets) != self.info["conversations"] + 1 or len(self.ids) != self.info["tokens"] \
                or len(self.mask) != len(self.ids):
            raise ValueError(f"the conversation files of split {split!r} in {directory} do not match its manifest "
                             "(were they changed by hand?); run `lmforge sft` again with --force")
        self.lengths = np.diff(np.asarray(self.offsets))
        self.max_token_id = int(self.info["max_token_id"])
        self.pad_id = int(self.manifest["pad_id"])
        self.bytes_per_token = 0.0  # bits per byte is not reported for conversations

    def __len__(self) -> int:
        return len(self.lengths)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """``ValueError`` unless ``tokenizer`` is the one the conversations were rendered with."""
        if tokenizer.fingerprint() != self.manifest["tokenizer"]["fingerprint"]:
            raise ValueError(f"the conversations in {self.dir} were rendered with another tokenizer than "
                             f"{tokenizer!r}; render them again (lmforge sft ... --force)")

    def rows(self, context_length: int, order: np.ndarray) -> list[np.ndarray]:
        """Greedy packing of the conversations in ``order`` into rows of at most ``context_length + 1`` tokens."""
        return pack_rows(self.lengths, context_length, order)

    def fill(self, rows: Sequence[np.ndarray], context_length: int) -> tuple["Any", "Any"]:
        """``(x, y)`` int64 tensors ``(len(rows), context_length)`` of packed rows; ignored targets are -100."""
        import torch  # here: rendering and inspection never need torch

        block = context_length + 1
        ids = np.full((len(rows), block), self.pad_id, dtype=np.int64)  # (B, T+1)
        mask = np.zeros((len(rows), block), dtype=bool)
        for b, row in enumerate(rows):
            pos = 0
            for k in row.tolist():
                lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
                assert hi - lo + pos <= block, "a packed row overflows"
                ids[b, pos:pos + hi - lo] = self.ids[lo:hi]
                mask[b, pos:pos + hi - lo] = self.mask[lo:hi]
                pos += hi - lo
        targets = np.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(ids[:, :-1].copy()), torch.from_numpy(targets)


class ConversationLoader:
    """Packed, shuffled rows of a :class:`ConversationDataset` with exact, JSON-serialisable resume."""

    def __init__(self, dataset: ConversationDataset, batch_size: int, context_length: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or context_length < 1 or seed < 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad loader settings: batch_size={batch_size}, context_length={context_length}, "
                             f"seed={seed}, rank={rank}, world_size={world_size}")
        self.dataset, self.batch_size, self.context_length = dataset, int(batch_size), int(context_length)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        if epoch == 0:
            check_packs(self.dataset.lengths, self.context_length, self.seed, self.batch_size * self.world_size,
                        self.dataset.split)
        order = epoch_order(len(self.dataset), self.seed, epoch)
        self.epoch, self.consumed, self._rows = epoch, 0, self.dataset.rows(self.context_length, order)

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in the current epoch's rows."""
        return len(self._rows) // (self.batch_size * self.world_size)

    def _take(self, n: int) -> list[np.ndarray]:
        """The next ``n`` rows of the global sequence, into the next epoch where this one ends."""
        out: list[np.ndarray] = []
        while len(out) < n:
            if self.consumed >= len(self._rows):
                self._start_epoch(self.epoch + 1)
            k = min(n - len(out), len(self._rows) - self.consumed)
            out.extend(self._rows[self.consumed:self.consumed + k])
            self.consumed += k
        return out

    def next_batch(self) -> tuple["Any", "Any"]:
        """This rank's next ``(x, y)`` (int64 CPU tensors ``(B, T)``, ``B = batch_size``; ignored targets are -100)."""
        rows = self._take(self.batch_size * self.world_size)  # the global batch; this rank's slice is filled
        lo = self.rank * self.batch_size
        return self.dataset.fill(rows[lo:lo + self.batch_size], self.context_length)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (JSON-serialisable)."""
        return {"version": STATE_VERSION, "kind": "conversations", "seed": self.seed, "epoch": self.epoch,
                "consumed": self.consumed, "batch_size": self.batch_size, "context_length": self.context_length,
                "world_size": self.world_size, "conversations": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (the same global sequence of rows)."""
        if state.get("version") != STATE_VERSION or state.get("kind") != "conversations":
            raise ValueError("the checkpoint's loader state is not a conversation loader's; resume with the same "
                             "data settings")
        for key in ("seed", "batch_size", "context_length", "conversations"):
            mine = len(self.dataset) if key == "conversations" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"the loader state was saved with {key}={state[key]!r} but this loader has "
                                 f"{mine!r}; resume with the same data and settings")
        self._start_epoch(int(state["epoch"]))
        self.consumed = int(state["consumed"])


class MixedLoader:
    """Each batch: ``conversations.batch_size`` packed conversation rows, then ``tokens.batch_size`` pretraining
    blocks (all targets trained). Both positions are saved, so the mix resumes exactly."""

    def __init__(self, conversations: ConversationLoader, tokens: BlockLoader) -> None:
        self.conversations, self.tokens = conversations, tokens

    def next_batch(self) -> tuple["Any", "Any"]:
        import torch

        (xc, yc), (xt, yt) = self.conversations.next_batch(), self.tokens.next_batch()[:2]
        return torch.cat([xc, xt]), torch.cat([yc, yt])  # (Bc + Bt, T) each

    def step_metrics(self) -> dict[str, float]:
        """The pretraining blocks' figures (``copy_data_share`` with a copy mixture)."""
        return self.tokens.step_metrics()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixed", "conversations": self.conversations.state_dict(), "tokens": self.tokens.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "mixed":
            raise ValueError("the checkpoint's loader state has no pretraining mix; resume with the same sft.pretrain_mix")
        self.conversations.load_state_dict(state["conversations"])
        self.tokens.load_state_dict(state["tokens"])


def conversation_val_batches(dataset: ConversationDataset, batch_size: int, context_length: int,
                             max_batches: int) -> list[tuple["Any", "Any"]]:
    """A fixed list of validation batches: the split packed in file order, at most ``max_batches`` of them
    (the last one may be smaller)."""
    rows = dataset.rows(context_length, np.arange(len(dataset)))[:max_batches * batch_size]
    return [dataset.fill(rows[i:i + batch_size], context_length) for i in range(0, len(rows), batch_size)]
