"""The copy data mixture: each source writes what it says, the share of tokens replaced is the configured fraction,
the segments are seeded by the block's place (exact resume of the loader and of training), bad settings are one
line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.data import BlockLoader, CopyMixture, TokenDataset
from lmforge.tokenizer import Tokenizer
from lmforge.train import load_run_config, train

V = 1000
BASE = 5000  # the blocks' own ids: above every id the mixture writes, so what it wrote is visible


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])


def blocks(rows: int, n: int) -> np.ndarray:
    return (BASE + np.arange(rows * n, dtype=np.int64)).reshape(rows, n)  # every id distinct


def test_repeats_copy_an_earlier_span_of_the_block_after_a_gap():
    mix = CopyMixture(0.3, ["repeat"], (8, 12), vocab_size=V)
    b = blocks(50, 129)
    orig = b.copy()
    replaced = mix.apply(b, seed=0, epoch=0, first=0)
    changed = b != orig
    assert replaced == changed.sum() > 0
    for row, was, ch in zip(b, orig, changed):
        pos = np.flatnonzero(ch)
        for run in np.split(pos, np.flatnonzero(np.diff(pos) > 1) + 1):  # each copy: one run of changed positions
            if not len(run):
                continue
            src = int(np.flatnonzero(was == row[run[0]])[0])  # the copied ids come from earlier in the block
            L = len(run)  # (adjacent copies could merge; the spans used here never touch: gap >= 0, span first)
            assert 8 <= L <= 12 and run[0] - src - L <= L  # its span, then a gap of 0..L, then the copy
            assert np.array_equal(row[run], was[src:src + L]) and np.array_equal(row[src:src + L], was[src:src + L])


def test_random_ids_appear_twice_and_skip_special_ids():
    mix = CopyMixture(0.1, ["random"], (6, 10), vocab_size=20, special_ids=[7])  # 9.7 tokens: one segment at most
    b = blocks(40, 97)
    replaced = mix.apply(b, seed=1, epoch=0, first=0)
    written = b < BASE
    assert replaced == written.sum() > 0 and not (b == 7).any()
    for row in b:
        pos = np.flatnonzero(row < BASE)
        if not len(pos):
            continue
        L = len(pos) // 2
        first, second = pos[:L], pos[L:]
        assert 6 <= L <= 10 and len(pos) == 2 * L and 0 <= second[0] - first[-1] - 1 <= L  # ids, a gap of 0..L, ids
        assert np.all(np.diff(first) == 1) and np.all(np.diff(second) == 1)
        assert np.array_equal(row[first], row[second])


def test_names_are_sentences_that_mention_a_name_twice(byte_tok):
    mix = CopyMixture(0.3, ["names"], vocab_size=byte_tok.vocab_size, tokenizer=byte_tok)
    b = np.full((4, 257), ord("x"), dtype=np.int64)
    assert mix.apply(b, seed=0, epoch=0, first=0) > 0
    text = byte_tok.decode(b[0].tolist())
    sentence = next(s for s in text.split("\n") if s.strip("x"))
    words = [w.strip(".,;:!?") for w in sentence.split()]
    names = {w for w in words if w[:1].isupper() and words.count(w) >= 2 and w not in ("Q", "A")}
    assert names, sentence


@pytest.mark.parametrize("fraction, sources", [(0.12, ["repeat", "names", "random"]), (0.12, ["repeat"]),
                                               (0.3, ["random"]), (0.05, ["names"])])
def test_the_share_replaced_is_the_fraction(fraction, sources, byte_tok):
    mix = CopyMixture(fraction, sources, vocab_size=byte_tok.vocab_size, tokenizer=byte_tok)
    b = blocks(400, 257)
    share = mix.apply(b, seed=3, epoch=2, first=100) / b.size
    assert share == pytest.approx(fraction, rel=0.12)
    assert CopyMixture(0.0, vocab_size=V, tokenizer=byte_tok).apply(blocks(3, 257), 0, 0, 0) == 0


def test_segments_are_seeded_by_the_blocks_place(byte_tok):
    mix = CopyMixture(0.2, vocab_size=byte_tok.vocab_size, tokenizer=byte_tok)
    a, b, c = blocks(4, 257), blocks(4, 257), blocks(4, 257)
    mix.apply(a, 0, 0, 10)
    mix.apply(b, 0, 0, 10)
    mix.apply(c[1:], 0, 0, 11)  # the same blocks at the same places, in a batch cut elsewhere
    assert np.array_equal(a, b) and np.array_equal(a[1:], c[1:])
    for other in ((1, 0, 10), (0, 1, 10), (0, 0, 14)):  # another seed, epoch or place: other segments
        d = blocks(4, 257)
        mix.apply(d, *other)
        assert not np.array_equal(a, d)


@pytest.mark.parametrize("kw, match", [
    (dict(fraction=0.6), r"data\.copy_fraction must be in \[0, 0\.5\]"),
    (dict(sources=["repeat", "poems"]), r"data\.copy_sources must be distinct names among repeat, names, random"),
    (dict(sources=[]), "data.copy_sources"), (dict(sources=["repeat", "repeat"]), "data.copy_sources"),
    (dict(span=(1, 4)), r"data\.copy_span must be \[lo, hi\] tokens with 2 <= lo <= hi"),
    (dict(span=(9, 4)), "data.copy_span"),
    (dict(tokenizer=None), "'names' encodes its sentences with the run's tokenizer"),
])
def test_bad_settings_are_one_line(kw, match, byte_tok):
    args = dict(fraction=0.1, sources=("repeat", "names", "random"), span=(16, 64), tokenizer=byte_tok) | kw
    with pytest.raises(ValueError, match=match):
        CopyMixture(args["fraction"], args["sources"], args["span"], vocab_size=V, tokenizer=args["tokenizer"])


def _shards(tiny_run):
    return tiny_run.parent / "shards"


def test_the_loader_resumes_its_mixture_exactly_and_measures_its_share(tiny_run, byte_tok):
    ds = TokenDataset(_shards(tiny_run))
    tok = Tokenizer.load(tiny_run / "tokenizer.json")

    def loader(fraction=0.15):
        mix = CopyMixture(fraction, span=(4, 8), vocab_size=tok.vocab_size, special_ids=[tok.eot_id], tokenizer=tok)
        return BlockLoader(ds, 4, 32, seed=2, mixture=mix)

    ref, plain = loader(), BlockLoader(ds, 4, 32, seed=2)
    want = [ref.next_batch() for _ in range(9)]
    assert any(not torch.equal(x, plain.next_batch()[0]) for x, _ in want)  # the mixture wrote into the blocks
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in want)  # targets are the written inputs shifted
    a = loader()
    for _ in range(4):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = loader()
    b.load_state_dict(state)
    assert b.step_metrics() == a.step_metrics()
    for wx, wy in want[4:]:
        x, y = b.next_batch()
        assert torch.equal(x, wx) and torch.equal(y, wy)
    assert b.step_metrics() == ref.step_metrics() and 0.09 < ref.step_metrics()["copy_data_share"] < 0.21
    assert plain.step_metrics() == {}
    with pytest.raises(ValueError, match="saved with the copy data mixture .* resume with the same data.copy_"):
        loader(0.2).load_state_dict(state)
    with pytest.raises(ValueError, match="copy data mixture None"):
        loader().load_state_dict(plain.state_dict())


def test_training_with_the_mixture_resumes_exactly_and_logs_the_share(tiny_run, tmp_path):
    def cfg(steps: int, **data):
        return load_run_config(base={
            "model": {"vocab_size": 320, "context_length": 32, "d_model": 32, "n_layers": 2, "n_heads": 2},
            "optimizer": {"lr": 3e-3, "warmup_steps": 1, "decay_steps": 40},  # one schedule, any max_steps
            "training": {"max_steps": steps, "batch_size": 4, "device": "cpu", "eval_every": 100, "log_every": 1,
                         "checkpoint_every": 3, "num_threads": 1},
            "data": {"dir": str(_shards(tiny_run)), "copy_fraction": 0.15, "copy_span": [4, 8]} | data})

    def events(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    train(cfg(6), tmp_path / "full", progress=False)
    train(cfg(3), tmp_path / "split", progress=False)
    train(cfg(6), tmp_path / "split", progress=False)
    full, split = events(tmp_path / "full"), events(tmp_path / "split")
    losses = lambda ev: [(e["step"], e["loss"], e["copy_data_share"]) for e in ev if "loss" in e]  # noqa: E731
    assert losses(split) == losses(full) and len(losses(full)) == 6  # bit for bit, the share too
    assert all(0.05 < s < 0.25 for _, _, s in losses(full))
    train(cfg(6, copy_fraction=0.0), tmp_path / "plain", progress=False)
    assert [e["loss"] for e in events(tmp_path / "plain") if "loss" in e] != [x for _, x, _ in losses(full)]
    with pytest.raises(ValueError, match=r"incompatible config \(data\.copy_fraction: 0\.15 -> 0\.3\)"):
        train(cfg(8, copy_fraction=0.3), tmp_path / "split", progress=False)
    with pytest.raises(ValueError, match=r"data\.copy_fraction mixes copy data into pretraining blocks"):
        cfg(6, kind="conversations")
