"""Generation past the context length: the sliding window (cached) == full recompute over the same window."""

from __future__ import annotations

import pytest
import torch

from conftest import torch_threads
from lmforge.generate import Engine, Generator
from lmforge.model import ModelConfig, TransformerLM

VOCAB, CTX = 400, 48


def tiny_model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, context_length=CTX, d_model=32, n_layers=2, n_heads=4, d_ff=64, **kw)
    return TransformerLM(ModelConfig(**cfg)).eval()


def naive_window(model, prompt: list[int], n: int, drop: int) -> list[int]:
    """Greedy reference written out here: full forward over the window at every step; a window longer than
    the context drops its oldest ``drop`` tokens (the documented policy)."""
    window, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            t = int(model(torch.tensor([window]))[0, -1].argmax())
            out.append(t)
            window.append(t)
            if len(window) > CTX:
                window = window[drop:]
    return out


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}])
def test_sliding_window_greedy_equals_naive_recompute(kw):
    model = tiny_model(seed=2, **kw)
    gen = Generator(model)
    prompts = [list(range(1, 41)), [5, 6, 7], list(range(100, 148))]  # 40, 3 and 48 (full) tokens
    cached = gen.generate_ids(prompts, 110, temperature=0, stop_ids=[])
    assert all(len(r) == 110 for r in cached)
    with torch_threads(1):  # the references: 110 full forwards of tiny tensors each
        assert cached == gen.generate_ids(prompts, 110, temperature=0, stop_ids=[], naive=True)
        assert cached == [naive_window(model, p, 110, CTX // 4) for p in prompts]
    assert cached == [gen.generate_ids(p, 110, temperature=0, stop_ids=[]) for p in prompts]  # rows independent
    assert len(set(cached[0][60:])) > 3  # past the first slides the model still produces varied tokens


@pytest.mark.parametrize("drop", [1, 5, 47, 48])
def test_window_drop_sizes(drop):
    model = tiny_model(seed=4)
    gen = Generator(model, window_drop=drop)
    prompts = [list(range(1, 30)), list(range(60, 100))]
    cached = gen.generate_ids(prompts, 70, temperature=0, stop_ids=[])
    with torch_threads(1):
        assert cached == [naive_window(model, p, 70, drop) for p in prompts]
    gen.refresh()
    assert gen.engine.window_drop == drop


def test_slides_are_amortized(monkeypatch):
    """Each slide re-prefills CTX - drop tokens, once per ``drop`` generated tokens."""
    gen = Generator(tiny_model())
    calls = []
    prefill, refill = Engine.prefill, Engine._refill

    def counting_prefill(self, rows, capacity):
        calls.append((len(rows), max(map(len, rows))))
        return prefill(self, rows, capacity)

    def counting_refill(self, rows, kept):
        calls.append(tuple(kept.shape))
        return refill(self, rows, kept)

    monkeypatch.setattr(Engine, "prefill", counting_prefill)
    monkeypatch.setattr(Engine, "_refill", counting_refill)
    gen.generate_ids([list(range(1, 41))] * 2, 200, temperature=0, stop_ids=[])
    drop = CTX // 4
    # prompt prefill, then a slide when the cache first fills (after 8 new tokens) and every `drop` tokens after
    assert calls[0] == (2, 40)
    assert calls[1:] == [(2, CTX - drop)] * len(calls[1:])
    # 199 tokens are fed (the last one is only sampled); slides at feeds 9, 9 + drop, 9 + 2 drop, ...
    assert len(calls) - 1 == (199 - 9) // drop + 1


def test_ragged_rows_step_logits_match_full_forward():
    """Rows of different lengths (right-padded prefill, per-row cache columns) against the model on each row."""
    model = tiny_model(n_kv_heads=2)
    dec = Engine(model)
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (30, 12, 25)]
    starts = [9, 3, 14]
    with torch.inference_mode():
        got = [dec.prefill([s[:k].tolist() for s, k in zip(seqs, starts)], 40)]
        for i in range(8):
            got.append(dec.step(torch.stack([s[k + i] for s, k in zip(seqs, starts)])))
        for b, (s, k) in enumerate(zip(seqs, starts)):
            want = model(s[None, : k + 8])[0, k - 1 :]  # (9, V)
            torch.testing.assert_close(torch.stack([g[b] for g in got]), want, rtol=1e-4, atol=1e-4)


def test_bad_window_drop():
    with pytest.raises(ValueError, match="window_drop"):
        Generator(tiny_model(), window_drop=0)
    with pytest.raises(ValueError, match="window_drop"):
        Generator(tiny_model(), window_drop=CTX + 1)
