"""The prefix cache across requests: the same replies with it on and off, less prefill with it, its budget held.

The oracle is the scheduler without the cache (itself held to the Generator in test_scheduler.py).
"""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import Engine
from lmforge.generate.prefix_cache import MAX_SALT_CHARS, PrefixCache, positional_fields
from lmforge.generate.scheduler import Job, Scheduler
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
            s.submit(Job(p, 12, c, temperature=temperature, seed=k))
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


# ------------------------------------------------------------------------------------------------------------------
# Tenancy: a salt per request (cache_salt) keeps its blocks from every other salt
def pin_prompt(pin: bytes, tail: bytes = b" Q: my balance?") -> list[int]:
    """A support bot's system prompt holding a customer's PIN (bytes 26..29: the fourth block of 8), then a question."""
    return list(b"Customer Alice Smith, PIN " + pin + b". Be kind." + tail)


def salted_turns(m, turns, cache: PrefixCache | None = None) -> list[tuple[list[int], int]]:
    """``(prompt, salt)`` turns one after another through one scheduler: each reply's token ids and cached tokens
    (each prompt sampled with its own seed, wherever it comes in the sequence)."""
    s = Scheduler(Engine(m), byte_tokenizer(), max_batch=2, prefix_cache=cache, speculative=False)
    out = []
    with torch_threads(1):
        for prompt, salt in turns:
            c = Collect()
            s.submit(Job(prompt, 6, c, temperature=0.8, seed=sum(prompt), logprobs=0, cache_salt=salt))
            drain(s)
            assert c.last.finish_reason == "length", c.last
            out.append(([lp.token for u in c.updates for lp in u.logprobs], c.last.cached_tokens))
    return out


def test_the_pin_probe_learns_nothing_across_salts():
    """A victim's prompt holds a PIN under salt A. An attacker guessing PINs under salt B, or under no salt, gets
    the very counts (and replies) it gets from a server that never saw the victim: the right guess shows nothing.
    Under the victim's own salt the cache is shared (the right guess reuses the PIN's block), which is the point."""
    m = model()
    victim = (pin_prompt(b"4821"), "tenant-A")
    guesses = [pin_prompt(pin, b" Q: hi") for pin in (b"1111", b"4820", b"4821", b"9999")]
    for salt in ("tenant-B", None):
        probe = [(g, salt) for g in guesses]
        seen = salted_turns(m, [victim] + probe, PrefixCache(1 << 20, block=8))[1:]
        assert seen == salted_turns(m, probe, PrefixCache(1 << 20, block=8))
        assert seen[0][1] == 0 and seen[2][1] == seen[1][1]  # no hit at first; 4821 reuses what 4820 did
    same = salted_turns(m, [victim] + [(g, "tenant-A") for g in guesses], PrefixCache(1 << 20, block=8))[1:]
    cached = [c for _, c in same]
    assert cached == [24, 24, 40, 24]  # the blocks before the PIN; the right guess its block and the next too
    assert [t for t, _ in same] == [t for t, _ in salted_turns(m, [(g, None) for g in guesses])]  # cache off


def test_a_row_leaving_keeps_its_tokens_under_its_salt():
    """keep_row under a salt: the next turn (prompt, reply, a new question) under the same salt reuses the reply's
    blocks too; under another salt or none it reuses nothing, and every reply equals the cache-off one."""
    m = model()
    first = pin_prompt(b"4821")
    (reply, _), = salted_turns(m, [(first, "A")])
    turn2 = first + reply + list(b" Q: more")
    for salt, want in (("A", 8 * ((len(first) + 5) // 8)), ("B", 0), (None, 0)):
        got = salted_turns(m, [(first, "A"), (turn2, salt)], PrefixCache(1 << 20, block=8))
        assert got[1][1] == want, (salt, got)
        assert [r for r, _ in got] == [r for r, _ in salted_turns(m, [(first, "A"), (turn2, salt)])]  # cache off
    c = KVCache(1, 1, 1, 2, 32)
    pc = PrefixCache(1 << 20, block=4)
    toks = list(range(12))
    assert pc.store(toks, c, 0, ["k", "v"], "A") == 3 and pc.store(toks, c, 0, ["k", "v"]) == 3  # two spaces
    assert pc.store(toks, c, 0, ["k", "v"], "A") == 0 and len(pc.lookup(toks + [1], "A")) == 3
    assert pc.lookup(toks + [1], "B") == [] and len(pc.lookup(toks + [1])) == 3
    long = "x" * MAX_SALT_CHARS  # any salt costs one 32-byte digest in its first block's key
    pc.store(toks, c, 0, ["k", "v"], long)
    assert {len(p) for p, _ in pc._blocks if isinstance(p, bytes)} == {32} and len(pc.lookup(toks, long)) == 2


def test_salts_are_checked_and_share_the_budget_with_unchanged_accounting():
    """A salt is None or a non-empty bounded string (one ValueError). Eviction does not care about salts: a stream
    under one salt counts exactly as unsalted, and under many salts the budget holds, bytes are the blocks' own and
    every kept block is reachable from its salt's root."""
    c = KVCache(2, 1, 2, 4, 64)
    per_block = 2 * 2 * 2 * 4 * 4 * 4
    for bad in ("", "x" * (MAX_SALT_CHARS + 1), b"A", 7):
        with pytest.raises(ValueError, match="cache_salt must be a string of 1 to"):
            PrefixCache(1 << 20).lookup([1, 2], bad)
    g = torch.Generator().manual_seed(1)
    heads = [torch.randint(0, 50, (12,), generator=g).tolist() for _ in range(3)]  # shared prefixes: hits
    stream = [heads[k % 3] + torch.randint(0, 50, (int(torch.randint(0, 24, (1,), generator=g)),),
                                           generator=g).tolist() for k in range(120)]
    stats = {}
    for how in ("none", "one", "many"):
        pc = PrefixCache(10 * per_block, block=4)
        for k, toks in enumerate(stream):
            salt = {"none": None, "one": "s", "many": f"s{k % 5}"}[how]
            pc.lookup(toks, salt)
            pc.store(toks, c, 0, ["k", "v"], salt)
            assert pc.stats.bytes <= pc.budget and pc.stats.bytes == sum(b.nbytes for b in pc._blocks.values())
        ids = {b.id for b in pc._blocks.values()}
        assert all(isinstance(parent, bytes) or parent == 0 or parent in ids for parent, _ in pc._blocks)
        stats[how] = pc.stats
    assert stats["one"] == stats["none"] and stats["none"].hits > 0 and stats["none"].evicted_blocks > 0
    assert stats["many"].hits < stats["none"].hits and stats["many"].evicted_blocks > 0
