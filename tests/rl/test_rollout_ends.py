"""Where a rollout ends, with a tiny random model (no stop id can be sampled) and a scripted engine: at the
context's last position (the reply fills ``context_length + 1`` ids, and every sampled id is trained), and at each
of the chat's stop ids — ``<|assistant_end|>``, end of text, ``<|user_start|>`` — and no other."""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import pytest
import torch

from lmforge.chat import ChatFormat, add_chat_tokens
from lmforge.data.conversations import IGNORE_INDEX
from lmforge.generate.engine import Engine
from lmforge.model import ModelConfig, TransformerLM
from lmforge.rl import rollout_batches, sample_replies
from lmforge.tokenizer import EOT, Tokenizer

CTX = 16


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [])))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_reply_fills_the_context_and_every_sampled_id_is_trained(fmt, use_kernel) -> None:
    """Bytes only (``vocab_limit`` 256: no special token, so no stop): each reply ends on the context, holding
    ``CTX + 1 - len(prompt)`` ids (the last one sampled from the context's last position, never fed); its batch
    row is the context's ``CTX`` positions and trains each of them."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=fmt.tokenizer.vocab_size, context_length=CTX, d_model=16,
                                      n_layers=1, n_heads=2)).eval()
    prompts = [[1, 2, 3, 4, 5], [7] * (CTX - 1)]
    groups = sample_replies(Engine(model, use_kernel=use_kernel), prompts, [[1, 2], [3, 4]], temperature=1.0,
                            top_k=None, top_p=None, max_new_tokens=100, fmt=fmt, vocab_limit=256, tools=False)
    rollouts = [r for g in groups for r in g]
    for p, g in zip(prompts, groups):
        for r in g:
            assert (r.finish, r.stop, len(r.ids), all(r.sampled)) == ("context", None, CTX + 1 - len(p), True)
    (x, y, w), = rollout_batches(rollouts, [[1.0] * len(r.ids) for r in rollouts], 4, CTX, pad_id=0)
    assert x.shape == (4, CTX)
    for b, r in enumerate(rollouts):
        assert y[b].tolist() == [IGNORE_INDEX] * (len(r.prompt) - 1) + r.ids
        assert (w[b] != 0).sum() == r.sampled_count


class _Scripted:
    """An engine whose row ``i`` (the prompt's one prefilled row and its copies, in order) emits ``scripts[i]`` in
    order (the logits of every other id at -1e4; the copies take the first row's first token), keeping
    rows as :class:`~lmforge.generate.engine.Engine` does when one is released (the last moves into its place)."""

    def __init__(self, scripts: list[list[int]], vocab: int) -> None:
        self.context_length, self.device, self.scripts, self.vocab = 64, torch.device("cpu"), scripts, vocab
        self.rows: list[tuple[int, int]] = []  # (script, position) per live engine row

    def _logits(self) -> torch.Tensor:
        out = torch.full((len(self.rows), self.vocab), -1e4)
        for b, (i, k) in enumerate(self.rows):
            out[b, self.scripts[i][k]] = 0.0
        return out

    def open_slots(self, n_slots: int, capacity: int) -> None:
        self.rows, self.cache, self.prompt = [], types.SimpleNamespace(capacity=capacity), 0

    def admit(self, prompt: list[int]) -> tuple[int, torch.Tensor]:
        self.prompt = len(prompt)
        row = self.fork(-1)
        return row, self._logits()[row]

    def fork(self, row: int) -> int:  # row i of the copies emits script i
        self.rows.append((len(self.rows), 0))
        return len(self.rows) - 1

    @property
    def lengths(self) -> list[int]:
        return [self.prompt + k for _, k in self.rows]

    def step(self, feed: torch.Tensor) -> torch.Tensor:
        assert len(feed) == len(self.rows)
        self.rows = [(i, k + 1) for i, k in self.rows]
        return self._logits()

    def release(self, row: int) -> int | None:
        last = len(self.rows) - 1
        self.rows[row] = self.rows[last]
        self.rows.pop()
        return last if row != last else None

    @contextlib.contextmanager
    def serial_torch(self) -> Iterator[None]:
        yield


def test_a_reply_stops_at_each_of_the_chats_stop_ids_and_no_other(fmt) -> None:
    sp = fmt.tokenizer.special_tokens
    a, b = ord("a"), ord("b")
    scripts = [[a, b, sp["<|user_start|>"], a], [a, sp[EOT], a], [a, sp["<|assistant_end|>"], a],
               [a, sp["<|assistant_start|>"], sp["<|python_start|>"], sp["<|assistant_end|>"]]]
    groups = sample_replies(_Scripted(scripts, fmt.tokenizer.vocab_size), [[1, 2]], [[0, 1, 2, 3]],
                            temperature=1.0, top_k=None, top_p=None, max_new_tokens=10, fmt=fmt,
                            vocab_limit=fmt.tokenizer.vocab_size, tools=False)
    got = [(r.ids, r.stop, r.finish) for r in groups[0]]
    assert got == [([a, b], sp["<|user_start|>"], "stop"), ([a], sp[EOT], "stop"),
                   ([a], sp["<|assistant_end|>"], "stop"),
                   ([a, sp["<|assistant_start|>"], sp["<|python_start|>"]], sp["<|assistant_end|>"], "stop")]
