"""A long conversation's second turn prefills only its new message (the first turn's prompt and reply come from the
prefix cache) and replies as it would with the cache off: what ``lmforge chat``'s time to first token rests on."""

from __future__ import annotations

import pytest
import torch

from lmforge.chat import add_chat_tokens
from lmforge.chat.session import ChatSession
from lmforge.generate import Generator
from lmforge.generate.prefix_cache import PrefixCache
from lmforge.model import ModelConfig, TransformerLM
from tests.conftest import make_corpus_text


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_the_second_turn_of_a_long_conversation_prefills_only_its_message(tiny_tokenizer, temperature):
    tok = add_chat_tokens(tiny_tokenizer)
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=tok.vocab_size, context_length=2048, d_model=32, n_layers=2,
                                      n_heads=4, d_ff=64)).eval()
    words = make_corpus_text().split()
    long = " ".join(words[:980])

    def talk(reuse: bool) -> list:
        gen = Generator(model, tok)
        gen.prefix_cache = PrefixCache(64 << 20) if reuse else None
        chat = ChatSession(gen, max_new_tokens=24, temperature=temperature, seed=3)
        chat.stop_ids = []  # every reply runs its 24 tokens
        out = []
        for msg in (long, "and the second question?"):
            stream = chat.send(msg)
            out.append(("".join(stream), stream.reply.ids, stream.reply.prefilled, len(stream.prompt)))
        return out

    on, off = talk(True), talk(False)
    assert [x[:2] for x in on] == [x[:2] for x in off]  # the same replies
    (_, _, first, n1), (_, _, second, n2) = on
    assert n1 >= 1900 and first == n1 and [x[2] for x in off] == [n1, n2]
    # turn 2 reuses at least turn 1's prompt up to its last whole block of 16 (its reply's ids, re-rendered from
    # text, may tokenize otherwise than sampled)
    assert n2 - second >= n1 - 15 and second <= n2 - n1 + 15 and second * 20 < n2, (n1, n2, second)
