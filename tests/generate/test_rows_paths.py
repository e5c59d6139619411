"""One reply on every path: the same prompt ids and sampling give the same tokens through ``lmforge generate``
(Generator.generate_ids, drafting), a chat turn (Generator.turn, again from the prefix cache), an RL rollout (K rows
forked from one prefill), the server's scheduler (several requests in one batch) and, greedy, the evals' generative
task; each path decodes through the row step (lmforge.generate.rows)."""

from __future__ import annotations

import pytest
import torch

from lmforge.chat import ChatFormat, add_chat_tokens
from lmforge.evals.generative import EXTRA_NEW_TOKENS, exact_match, reply_text
from lmforge.evals.tasks import ChatItem
from lmforge.generate import Generator
from lmforge.generate.engine import Engine
from lmforge.generate.prefix_cache import PrefixCache
from lmforge.generate.scheduler import Job, Scheduler
from lmforge.model import ModelConfig, TransformerLM
from lmforge.rl import sample_replies

N = 16
USER = "abc abc abc abc abc abc"  # a reply that repeats it drafts
CASES = [(0.0, None, None, 0), (1.0, None, None, 5), (0.8, 20, 0.9, 11)]
"""(temperature, top_k, top_p, seed): greedy, plain sampling, top-k with top-p."""


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    tok = add_chat_tokens(tiny_tokenizer)
    fmt = ChatFormat(tok)
    torch.manual_seed(5)
    model = TransformerLM(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
                                      n_heads=4, d_ff=64)).eval()
    with torch.no_grad():
        model.lm_head.weight[fmt.assistant_end_id] *= 1.5  # a reply ends by itself
    return model, tok, fmt, fmt.render_for_completion([{"role": "user", "content": USER}])


def test_every_path_gives_the_same_reply(setup):
    model, tok, fmt, prompt = setup
    stops = fmt.stop_ids
    gen = Generator(model, tok)
    gen.prefix_cache = PrefixCache(1 << 20, block=4)
    want, prefilled = [], []
    for t, k, p, seed in CASES:
        sampling = dict(temperature=t, top_k=k, top_p=p)
        ids = gen.generate_ids(prompt, N, seed=seed, stop_ids=stops, **sampling)  # drafts (one prompt)
        want.append(ids)
        for _ in range(2):  # each turn but the very first takes the prompt's whole blocks from the prefix cache
            turn = gen.turn(prompt, N, rng=gen.rng(seed), stop_ids=stops, **sampling)
            text = "".join(piece for _, piece, _ in turn)
            assert turn.ids == ids and text == tok.decode(ids)
            prefilled.append(turn.prefilled)
        other = gen.generate_ids(prompt, N, seed=seed + 1, stop_ids=stops, **sampling)
        (rows,) = sample_replies(gen.engine, [prompt], [[seed, seed + 1, seed, seed + 1]], max_new_tokens=N,
                                 fmt=fmt, vocab_limit=tok.vocab_size, tools=False, **sampling)
        assert [r.ids for r in rows] == [ids, other, ids, other]
        assert all(r.sampled_count == len(r.ids) + (r.stop is not None) for r in rows)
    assert prefilled == [len(prompt)] + [len(prompt) % 4 or 4] * 5
    st = gen.rows.spec_stats  # drafts were verified: some kept, some rolled back
    assert st.drafted > st.accepted > 0
    assert len({tuple(w) for w in want}) == 3 and len(want[1]) < N  # the cases differ; one stops

    # the server: the three requests decoded together, each with its own seed
    sched, got = Scheduler(Engine(model), tok, max_batch=4), {}
    for i, (t, k, p, seed) in enumerate(CASES):
        got[i] = []
        sched.submit(Job(prompt, N, got[i].append, temperature=t, top_k=k, top_p=p, seed=seed, stop_ids=stops))
    while sched.run_once():
        pass
    for i, ids in enumerate(want):
        assert "".join(u.text for u in got[i]) == tok.decode(ids) and got[i][-1].completion_tokens == len(ids)
        assert got[i][-1].finish_reason == ("stop" if len(ids) < N else "length")

    # the evals' generative task: greedy, its own stop ids, a budget of the answer's tokens + 16
    answer = "cat " * (N - EXTRA_NEW_TOKENS + 8)
    budget = len(tok.encode(answer.strip(), special="plain")) + EXTRA_NEW_TOKENS
    evals = exact_match(gen, [ChatItem(({"role": "user", "content": USER},), answer)] * 2)
    ids = gen.generate_ids(prompt, budget, temperature=0.0, stop_ids=[fmt.assistant_end_id, tok.eot_id])
    assert fmt.ids["<|python_start|>"] not in ids  # no calculator call: the generator's reply is the chat's
    assert evals["replies"] == [reply_text(fmt, ids)] * 2 and evals["ended"] == [len(ids) < budget] * 2


def _lockstep(model: TransformerLM, prompts: list[list[int]], n: int, seed: int, stop: int, **sampling) -> list:
    """The reference for several prompts: every row steps and draws at every step, all from one ``(B, V)`` sample of
    one seeded generator, over the model's full forward; a row's reply is its tokens before its first stop id."""
    from lmforge.generate.sampling import sample_next

    gen = torch.Generator().manual_seed(seed)
    seqs, out, done = [list(p) for p in prompts], [[] for _ in prompts], [False] * len(prompts)
    for _ in range(n):
        with torch.no_grad():
            logits = torch.cat([model(torch.tensor([s]))[:, -1] for s in seqs])
        for b, t in enumerate(sample_next(logits, generator=gen, **sampling).tolist()):
            seqs[b].append(t)
            done[b] = done[b] or t == stop
            if not done[b]:
                out[b].append(t)
        if all(done):
            break
    return out


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)])
def test_several_prompts_draw_in_lockstep(setup, sampling):
    """A row that ended keeps drawing, so each seed gives the replies of the lockstep loop (a row ending changes
    nothing for the others); cached, kernel and naive paths alike."""
    model, tok, _, prompt = setup
    prompts = [prompt, prompt[:5], tok.encode("abc abc")]
    gen = Generator(model, tok)
    free = gen.generate_ids(prompts, N, seed=3, stop_ids=[], **sampling)
    stop = free[0][2]  # the first row ends early on its third token
    want = _lockstep(model, prompts, N, 3, stop, **sampling)
    assert want[0] == free[0][:2] and any(len(w) > 3 for w in want[1:])
    for naive in (False, True):
        assert gen.generate_ids(prompts, N, seed=3, stop_ids=[stop], naive=naive, **sampling) == want
