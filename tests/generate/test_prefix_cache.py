"""The prefix cache across requests: the same replies with it on and off, less prefill with it, its budget held.

The oracle is the scheduler without the cache (itself held to the Generator in test_scheduler.py).
"""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import Engine
from lmforge.generate.prefix_cache import PrefixCache, positional_fields
from lmforge.generate.scheduler import Request, Scheduler
from lmforge.model import KVCache, ModelConfig, TransformerLM
from tests.conftest import torch_threads
from tests.generate.test_scheduler import Collect, byte_tokenizer, drain

CTX = 96


def model(seed: int = 0, context: int = CTX) -> TransformerLM:
    """A seeded untrained 2-layer model over the byte tokenizer's 257 ids (260 with padding)."""
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=260, context_length=context, d_model=32, n_layers=2, n_heads=4,
                                     d_ff=64)).eval()


SYSTEM = list(b"You are a helpful assistant. Answer briefly. ")  # 45 tokens: two blocks of 16 and change


def replies(m, prompts, cache: PrefixCache | None, kernel: bool, temperature: float = 0.0, **kw):
    """Each prompt alone through a scheduler (one after the other, so later ones can hit); texts and the load."""
    s = Scheduler(Engine(m, use_kernel=kernel), byte_tokenizer(), max_batch=3, prefix_cache=cache,
                  speculative=False, **kw)
    out = []
    with torch_threads(1):  # the PyTorch path's small ops: threads only contend on a shared machine
        for k, p in enumerate(prompts):
            c = Collect()
            s.submit(Request(p, 12, c, temperature=temperature, seed=k))
            drain(s)
            out.append((c.text, c.last.finish_reason))
    return out, s.load()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_replies_are_the_same_with_the_cache_on_and_off(kernel, temperature):
    """Prompts sharing a system prompt, and a conversation's next turn starting with the previous reply: the
    replies (greedy and seeded) do not change, and the cache served whole blocks of them."""
    m = model()
    prompts = [SYSTEM + list(b"Q: hi"), SYSTEM + list(b"Q: bye"), SYSTEM + list(b"Q: hi")]
    off, _ = replies(m, prompts, None, kernel, temperature)
    first = SYSTEM + list(b"Q: hi")
    turn2 = first + list(off[0][0].encode()) + list(b" Q: more")  # the next turn re-sends the history
    off2, _ = replies(m, prompts + [turn2], None, kernel, temperature)
    on, load = replies(m, prompts + [turn2], PrefixCache(1 << 20, block=8), kernel, temperature)
    assert on == off2 and off2[:3] == off
    assert load["prefix_queries"] == 4 and load["prefix_hits"] == 3
    # blocks of 8: the second prompt reuses the system prompt's 40 tokens, the third (the first again) 48 of its
    # 50, the next turn the first prompt and the reply kept when its row left (50 + 11 fed tokens: 56)
    assert load["prefix_hit_tokens"] == 40 + 48 + 56
    assert 0 < load["prefix_bytes"] <= 1 << 20


def test_a_restored_prefix_gives_the_same_logits_bits_on_the_kernel_path():
    """Engine.admit(prompt, start) after the prefix's keys and values were copied in: bit-identical logits and
    cache to prefilling the whole prompt (the kernel's prompt numbers do not depend on where the prompt starts)."""
    m = model()
    prompt = list(range(40, 77))
    a, b = Engine(m, use_kernel=True), Engine(m, use_kernel=True)
    for e in (a, b):
        e.open_slots(2)
    _, whole = a.admit(prompt)
    pc = PrefixCache(1 << 20, block=16)
    fields = positional_fields(a.cache)
    with torch.inference_mode():
        pc.store(prompt, a.cache, 0, fields)
        start = pc.restore(pc.lookup(prompt), b.cache, 0, fields)
    assert start == 32
    _, part = b.admit(prompt, start)
    assert torch.equal(whole, part)
    n = len(prompt)
    assert torch.equal(a.cache.k[:, 0, :, :n], b.cache.k[:, 0, :, :n])


def test_lookup_leaves_a_token_and_counts():
    pc = PrefixCache(1 << 20, block=4)
    c = KVCache(1, 1, 1, 2, 32)
    toks = list(range(12))
    pc.store(toks, c, 0, ["k", "v"])
    assert len(pc) == 3
    assert len(pc.lookup(toks)) == 2  # 12 tokens: 11 may come from the cache, so two whole blocks
    assert len(pc.lookup(toks + [99])) == 3
    assert pc.lookup([1] + toks) == []  # a prefix must start at the first token
    assert (pc.stats.queries, pc.stats.hits, pc.stats.hit_tokens) == (3, 2, 20)


def test_eviction_keeps_the_budget_and_takes_leaves_first():
    """Thrash: many distinct prefixes never hold more than the budget; the blocks kept are whole chains from the
    root (a parent outlives its children), so every kept block stays reachable."""
    c = KVCache(2, 1, 2, 4, 64)
    per_block = 2 * 2 * 2 * 4 * 4 * 4  # k and v: layers x heads x block x dim x 4 bytes
    pc = PrefixCache(10 * per_block, block=4)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        toks = torch.randint(0, 50, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
        pc.store(toks, c, 0, ["k", "v"])
        assert pc.stats.bytes <= pc.budget and len(pc) <= 10
    assert pc.stats.evicted_blocks > 0
    ids = {b.id for b in pc._blocks.values()}
    assert all(parent == 0 or parent in ids for parent, _ in pc._blocks)
    assert PrefixCache(0).store(list(range(64)), c, 0, ["k", "v"]) == 0  # 0 = off


def test_per_row_state_that_is_not_positional_turns_the_cache_off():
    c = KVCache(1, 3, 1, 2, 8)
    assert positional_fields(c) is not None and "k" in positional_fields(c)
    c.extra = torch.zeros(3, 5)  # one value per row, not per column
    assert positional_fields(c) is None
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)


def test_long_shared_prefixes_and_a_thrashing_stream_of_prompts():
    """Hostile: a system prompt filling most of the context, then many distinct ones through a small budget; every
    reply equals its cache-off twin and the cache stays under its budget."""
    m = model(1)
    long = [(7 * i) % 250 for i in range(CTX - 16)]
    prompts = [long + [i] for i in range(3)] + [[(i * 13 + j) % 250 for j in range(30)] for i in range(8)]
    off, _ = replies(m, prompts, None, True)
    budget = 6 * 2 * 2 * 4 * 8 * 8 * 4  # six blocks of 8 tokens
    on, load = replies(m, prompts, PrefixCache(budget, block=8), True)
    assert on == off
    assert load["prefix_bytes"] <= budget and load["prefix_hits"] >= 2
