"""Speculative decoding with prompt-lookup drafts: the same tokens as plain decoding, in fewer passes.

The oracle is the scheduler with drafting off (itself held to the Generator in test_scheduler.py).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from lmforge.generate import Engine
from lmforge.generate.scheduler import Job, Scheduler
from lmforge.generate.speculative import DraftPolicy, NgramDrafter, reference_propose, rejection_sample
from tests.conftest import torch_threads
from tests.generate.test_prefix_cache import model as small_model
from tests.generate.test_scheduler import Collect, _grammars, byte_tokenizer, drain


def model(seed: int = 0):
    return small_model(seed, context=128)


def decode(m, prompts, spec: bool, kernel: bool = False, n: int = 32, **kw):
    """Each request alone (drafting runs at batch 1); the updates' texts, log-probs, finish reasons, and the load."""
    eng = Engine(m, use_kernel=kernel)
    s = Scheduler(eng, byte_tokenizer(), max_batch=2, speculative=spec)
    out = []
    with torch_threads(1):  # the PyTorch path's small ops: threads only contend on a shared machine
        for k, p in enumerate(prompts):
            c = Collect()
            s.submit(Job(p, n, c, seed=k, **kw))
            drain(s)
            out.append([(u.text, u.logprobs, u.finish_reason) for u in c.updates])
    return out, s.load()


PROMPTS = [list(b"the cat sat on the mat. the cat sat on the mat. the cat"),
           list(b"abcabcabcabcabcab"), list(b"1 2 3 4 1 2 3 4 1 2"), list(b"Hello there"),
           list(b"x = f(x); y = f(y); z = f(")] + [[(i * j) % 200 + 20 for j in range(24)] for i in range(1, 4)]


def joined(out):
    return ["".join(t for t, _, _ in updates) for updates in out]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_greedy_tokens_are_those_of_plain_decoding(kernel):
    m = model()
    off, _ = decode(m, PROMPTS, False, kernel, temperature=0)
    on, load = decode(m, PROMPTS, True, kernel, temperature=0)
    assert joined(on) == joined(off)
    assert load["spec_passes"] > 0 and load["spec_accepted"] > 0


def test_seeded_sampling_constraints_tools_and_logprobs_are_unchanged():
    """Seeded samples, log-probabilities, a regex constraint and a tool that forces tokens: every update equal, bit
    for bit (on the kernel path, whose verify pass gives a plain step's bits; the PyTorch path's one pass of k + 1
    tokens rounds its logits differently from single steps, so there only the tokens are held equal above)."""
    from lmforge.generate.constraints import RowConstraint, regex_grammar

    m = model(2)
    off, _ = decode(m, PROMPTS, False, True, temperature=0.1)
    on, load = decode(m, PROMPTS, True, True, temperature=0.1)
    assert on == off and load["spec_accepted"] > 0
    off, _ = decode(m, PROMPTS[:4], False, True, temperature=0, logprobs=3)
    on, load = decode(m, PROMPTS[:4], True, True, temperature=0, logprobs=3)
    assert on == off and load["spec_accepted"] > 0

    def tool(t: int):  # every "a" is followed by two forced tokens
        return list(b"ab") if t == ord("a") else None

    off, _ = decode(m, PROMPTS[1:3], False, True, temperature=0, tool=tool)
    on, load = decode(m, PROMPTS[1:3], True, True, temperature=0, tool=tool)
    assert on == off
    tok = byte_tokenizer()
    grammars = _grammars(tok)
    res = []
    for spec in (False, True):
        c = RowConstraint(grammars, regex_grammar("(ab|abc){1,12}"), close_id=tok.eot_id)
        res.append(decode(m, [list(b"abcabcab")], spec, True, temperature=0, constraint=c, stop_ids=[tok.eot_id]))
    assert res[0][0] == res[1][0]


def test_a_request_can_opt_out():
    m = model()
    _, load = decode(m, PROMPTS[:3], True, temperature=0, speculative=False)
    assert load["spec_passes"] == 0


def test_the_drafter_index_matches_the_plain_scan():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        toks = torch.randint(0, 4 + trial % 5, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        d = NgramDrafter(toks)
        for k in (1, 3, 8):
            assert d.propose(k) == reference_propose(toks, k), (toks, k)
    d = NgramDrafter(list(b"the cat. the c"))
    assert bytes(d.propose(3)) == b"at."


def test_point_draft_rejection_sampling_keeps_the_distribution():
    """Chi-square over many draws on a tiny vocabulary: the reference rule (keep d with p(d), else draw from p
    without d) and the scheduler's rule (draw t ~ p, keep d when t == d) both give p."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    gen = torch.Generator().manual_seed(0)
    n = 2500
    for draft in (0, 3):
        counts = torch.zeros(5)
        for _ in range(n):
            counts[rejection_sample(p, draft, gen)] += 1
        assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
    # a broken rule (always keep the draft when u < 0.5) is caught by the same test
    counts = torch.zeros(5)
    for _ in range(n):
        counts[3 if float(torch.rand((), generator=gen)) < 0.5 else int(torch.multinomial(p, 1, generator=gen))] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue < 1e-6


def test_sampled_replies_over_many_seeds_are_unchanged_through_the_scheduler():
    """Temperature 1 over a three-token vocabulary (top-k 3), where drafts are often kept: over many seeds each
    reply equals plain decoding's (one draw per token taken, in the same order, from the same logits)."""
    m = model(3)
    outs = []
    for spec in (False, True):
        eng = Engine(m, use_kernel=True)
        s = Scheduler(eng, byte_tokenizer(), max_batch=1, speculative=spec)
        texts = []
        for seed in range(30):
            c = Collect()
            s.submit(Job(list(b"abababababababab"), 24, c, temperature=1.0, top_k=3, seed=seed))
            drain(s)
            texts.append(c.text)
        outs.append((texts, s.load()))
    assert outs[0][0] == outs[1][0]
    assert outs[1][1]["spec_accepted"] > 0 and outs[1][1]["spec_drafted"] > outs[1][1]["spec_accepted"]


def test_drafting_pauses_when_it_does_not_pay():
    p = DraftPolicy()
    assert p.draft_length(0) == 4
    p.record(10, 4, 0)
    p.record(11, 2, 0)  # two passes in a row that kept nothing: pause 16 tokens
    assert p.draft_length(12) == 0 and p.draft_length(27) > 0
    p.record(27, 1, 0)
    p.record(28, 1, 0)
    assert p.draft_length(28 + 31) == 0 and p.draft_length(28 + 32) > 0  # the pause doubled
    p.record(70, 1, 1)
    assert p.k == 2 and p.pause == DraftPolicy.PAUSE_MIN


def test_a_cancelled_row_mid_draft_leaves_the_next_replies_correct():
    """Cancel a request between passes while it drafts; the next requests' replies equal plain decoding's."""
    m = model()
    s = Scheduler(Engine(m, use_kernel=False), byte_tokenizer(), max_batch=2, speculative=True)
    c = Collect()
    r = Job(PROMPTS[1], 60, c, temperature=0)
    s.submit(r)
    torch.set_num_threads(1)  # restored after the test (conftest)
    for _ in range(40):
        s.run_once()
        if s.load()["spec_passes"]:
            break
    assert s.load()["spec_passes"] > 0 and not c.done.is_set()
    s.cancel(r)
    drain(s)
    on, _ = decode(m, PROMPTS[:5], True, temperature=0)
    after = []
    with torch_threads(1):
        for k, p in enumerate(PROMPTS[:5]):
            cc = Collect()
            s.submit(Job(p, 32, cc, seed=k, temperature=0))
            drain(s)
            after.append("".join(u.text for u in cc.updates))
    off, _ = decode(m, PROMPTS[:5], False, temperature=0)
    assert after == joined(off) == joined(on)
