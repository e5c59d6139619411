"""Generator.turn with a prefix cache (what ``lmforge chat`` runs): each turn prefills only what the previous turn
did not leave in the cache, and the replies do not change."""

from __future__ import annotations

import pytest

from lmforge.generate import Generator
from lmforge.generate.prefix_cache import PrefixCache
from tests.generate.test_prefix_cache import SYSTEM, model
from tests.generate.test_scheduler import byte_tokenizer


def conversation(gen: Generator, temperature: float) -> list[list[int]]:
    prompt, replies = SYSTEM + list(b"Q: hi"), []
    for k, more in enumerate((b" Q: and?", b" Q: ok")):
        turn = gen.turn(prompt, 10, temperature=temperature, rng=gen.rng(k))
        for _ in turn:
            pass
        replies.append(turn.ids)
        prompt = prompt + turn.ids + list(more)
    turn = gen.turn(prompt, 10, temperature=temperature, rng=gen.rng(9))
    replies.append([t for t, _, _ in turn])
    return replies


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_turns_are_the_same_with_the_cache_and_prefill_less(temperature):
    m = model()
    plain = Generator(m, byte_tokenizer())
    cached = Generator(m, byte_tokenizer())
    cached.prefix_cache = PrefixCache(1 << 20, block=8)
    assert conversation(cached, temperature) == conversation(plain, temperature)
    st = cached.prefix_cache.stats
    # blocks of 8; turn 2 (68 tokens) reuses turn 1's prompt and the 9 reply tokens it fed (59: 56), turn 3 (84)
    # reuses turn 2's 68 + 9 (77: 72); without the replies kept it would be 48 + 64
    assert st.queries == 3 and st.hits == 2 and st.hit_tokens == 56 + 72
    cached.refresh()  # new weights: the kept keys and values are stale
    assert len(cached.prefix_cache) == 0 and cached.prefix_cache.stats.bytes == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_a_turn_drafts_and_prefills_only_the_new_tokens_with_the_same_replies(temperature):
    """The chat's turns run through the row step: with drafting and the prefix cache (blocks of 1) the second turn
    prefills only the tokens the first did not feed (its new message and the first reply's last token), drafts are
    verified and kept on a repetitive greedy conversation, and the tokens are those of a turn with both off."""
    m = model(context=256)

    def talk(gen: Generator) -> tuple[list[list[int]], list[int]]:
        prompt, replies, prefilled = SYSTEM + list(b"Q: say abcabcabc abcabcabc"), [], []
        for k in range(3):
            turn = gen.turn(prompt, 12, temperature=temperature, rng=gen.rng(k))
            replies.append([t for t, _, _ in turn])
            prefilled.append(turn.prefilled)
            assert turn.finish_reason == "length"  # no stop ids: every turn feeds all but its last token
            prompt = prompt + turn.ids + list(b" Q: again abcabcabc")
        return replies, prefilled

    plain = Generator(m, byte_tokenizer())
    plain.speculative = False
    fast = Generator(m, byte_tokenizer())
    fast.prefix_cache = PrefixCache(1 << 22, block=1)
    want, full = talk(plain)
    got, prefilled = talk(fast)
    assert got == want
    new = len(b" Q: again abcabcabc") + 1
    assert prefilled == [full[0], new, new] and full[2] > 5 * new
    st = fast.rows.spec_stats
    assert plain.rows.spec_stats.passes == 0 and (st.accepted > 0 or temperature > 0)  # the untrained model's
    # samples rarely repeat an n-gram: the greedy conversation is the one that drafts


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_generate_drafts_through_a_sliding_context_with_the_same_tokens(temperature):
    """``Generator.generate_ids`` on one prompt (what ``lmforge generate`` streams) runs through the row step: 100
    tokens in a 64-token context slide, and with drafts on or off the tokens are the same."""
    m = model(context=64)
    prompt = list(b"abcabcabc abcabcabc abc")
    on, off = Generator(m, byte_tokenizer()), Generator(m, byte_tokenizer())
    off.speculative = False
    got = on.generate_ids(prompt, 100, temperature=temperature, seed=3, stop_ids=[])
    assert got == off.generate_ids(prompt, 100, temperature=temperature, seed=3, stop_ids=[]) and len(got) == 100
    assert off.rows.spec_stats.passes == 0
    assert on.rows.spec_stats.accepted > 0 or temperature > 0  # (test_generate_window holds it to the naive path)
