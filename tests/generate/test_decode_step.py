"""The C++ decode step (``_core.DecodeModel.step``, what ``Engine.step`` runs on CPU) against the model's own
forward (``Engine(use_kernel=False)``): every weight dtype, batches of 1, 3 and 8 rows of different lengths,
grouped-query attention, each instruction set of the kernels; rows joining and leaving (continuous batching);
the argument checks of the binding."""

import numpy as np
import pytest
import torch
from conftest import tiny_lm

from lmforge._native import core
from lmforge.generate.engine import Engine
from lmforge.generate.packed import INT4, PackedLinear, kernel_available
from lmforge.model import TransformerLM

pytestmark = pytest.mark.skipif(not kernel_available(), reason="C++ extension not built")
VOCAB = 97


def _model(seed: int = 0, **kw) -> TransformerLM:
    return tiny_lm(seed, **({"vocab_size": VOCAB, "context_length": 40} | kw))


def _pair(model: TransformerLM, dtype: str) -> tuple[Engine, Engine]:
    """The kernel engine and the reference: the model's forward on the same (rounded) matrices (float32
    arithmetic; the int8-activation arithmetic: test_integer_step_follows_its_reference_model)."""
    fast = Engine(model, weight_dtype=dtype, window_drop=7, activations="float32")
    assert fast._kernel
    q = "layers.0.attn.q_proj.weight"
    # the rounded copy the reference runs holds the stored weights (not the kernel's own say-so: rounded here)
    torch.testing.assert_close(fast.model.get_parameter(q), PackedLinear(model.get_parameter(q), fast.weight_dtype).weight(),
                               rtol=0, atol=0)
    return fast, Engine(fast.model, window_drop=7, use_kernel=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_step_equals_the_forward(dtype, batch, kv_heads, isa):
    """Prompts of different lengths, then steps through a slide past the context: the same logits (float32:
    the same greedy tokens as well)."""
    model = _model(seed=batch + kv_heads, n_kv_heads=kv_heads)
    fast, ref = _pair(model, dtype)
    g = torch.Generator().manual_seed(batch)
    rows = [torch.randint(0, VOCAB, (1 + (5 * b) % 13,), generator=g).tolist() for b in range(batch)]
    rows[-1] = rows[-1] + [3] * (30 - len(rows[-1]))  # the longest row slides within the 20 steps
    with torch.inference_mode():
        a, b = fast.prefill(rows, 40), ref.prefill(rows, 40)
        for _ in range(20):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            if dtype == "float32":
                assert torch.equal(a.argmax(-1), b.argmax(-1))
            tok = b.argmax(-1)
            a, b = fast.step(tok), ref.step(tok)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fast.lengths == ref.lengths
    assert torch.equal(fast.tokens, ref.tokens)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_integer_step_follows_its_reference_model(dtype, isa):
    """activations="int8": the C++ step against the model's reference path whose projections compute the same
    integer arithmetic in PyTorch (``Q8Linear``). Each product agrees bit for bit (tests/generate/test_packed_q8.py);
    the float operations between products (norms, RoPE, attention, SwiGLU) differ by an ulp or so, and now and then
    that moves an activation across a rounding boundary: one code, about 1/127 of its block's largest value, which
    then runs through the rest of the model (measured: up to 2e-2 in a logit). So most (step, row) logit vectors
    must agree within 1e-5 relative to the logits' scale and all within 5e-2, while the float32 arithmetic on the
    same weights misses the first bound in most of them."""
    model = _model(seed=3, n_kv_heads=2)
    fast = Engine(model, weight_dtype=dtype, window_drop=7, activations="int8")
    ref = Engine(fast.model, window_drop=7, use_kernel=False)
    other = Engine(model, weight_dtype=dtype, window_drop=7, activations="float32")  # float32 arithmetic: a kernel computing the wrong thing
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (1 + (5 * b) % 13,), generator=g).tolist() for b in range(5)]
    rows[-1] = rows[-1] + [3] * (30 - len(rows[-1]))  # slides within the 20 steps
    close, wrong, n = 0, 0, 0
    with torch.inference_mode():
        a, b, c = fast.prefill(rows, 40), ref.prefill(rows, 40), other.prefill(rows, 40)
        for _ in range(20):
            tol = 1e-5 * b.abs().amax(-1)  # (B,)
            close += int(((a - b).abs().amax(-1) <= tol).sum())
            wrong += int(((c - b).abs().amax(-1) <= tol).sum())
            n += a.shape[0]
            assert (a - b).abs().max() < 5e-2
            tok = b.argmax(-1)
            a, b, c = fast.step(tok), ref.step(tok), other.step(tok)
    assert close >= 0.8 * n, (close, n)
    assert wrong < 0.2 * n, (wrong, n)
    assert fast.lengths == ref.lengths


def test_every_instruction_set_gives_the_products_the_same_bits():
    """The AVX-512 build of the float tiles sums in the AVX2 build's order (csrc/decode/tiles.inc), and the AVX-512
    VNNI build of the integer tiles makes the AVX2 build's exact block sums (csrc/decode/qtiles.inc): on every
    instruction set the CPU has, wider and narrower, the products give the same bits."""
    _core = core()
    caps = [lambda on: None, _core.linear_force_avx512, _core.linear_force_avx2]  # the widest set, then capped
    g = torch.Generator().manual_seed(0)
    seen = set()
    try:
        for dtype, act in [(torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.float16, "float32"),
                           (torch.int8, "float32"), (INT4, "float32"), (torch.int8, "int8"), (INT4, "int8")]:
            for n, k in [(1000, 64), (37, 19), (300, 333)]:
                lin = PackedLinear(torch.randn(n, k, generator=g), dtype, act)
                for rows in range(1, 18):
                    x = torch.randn(rows, k, generator=g)
                    outs = []
                    for switch in caps:
                        switch(True)
                        seen.add(_core.linear_isa())
                        outs.append(lin(x, 2))
                        switch(False)
                    assert all(torch.equal(o, outs[0]) for o in outs), (dtype, act, n, k, rows)
    finally:
        _core.linear_force_avx2(False)
        _core.linear_force_avx512(False)
    if len(seen) == 1:
        pytest.skip(f"this CPU has one vector instruction set for the kernels ({seen.pop()}): nothing to compare")


@pytest.mark.parametrize("dtype, activations", [(torch.float32, "float32"), (torch.bfloat16, "float32"),
                                                (torch.float16, "float32"), (torch.int8, "float32"),
                                                (INT4, "float32"), (torch.int8, "int8"), (INT4, "int8")])
def test_many_rows_give_each_rows_bits(dtype, activations, isa):
    """A product of many rows (a prompt: from 12 rows on, the register- and k-blocked GEMM of tiles.inc) gives each
    row the bits it gets alone (the decode tiles), K past one k-block (1024) and N off the panel included."""
    g = torch.Generator().manual_seed(2)
    for n, k in [(100, 600), (37, 19), (300, 1344)]:
        lin = PackedLinear(torch.randn(n, k, generator=g), dtype, activations)
        x = torch.randn(29, k, generator=g)
        alone = torch.cat([lin(x[i: i + 1], 1) for i in range(29)])
        for rows in (12, 17, 29):
            assert torch.equal(lin(x[:rows], 2), alone[:rows]), (dtype, activations, n, k, rows)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_rows_join_and_leave(dtype, isa):
    """Continuous batching: admit into free rows, step the live prefix, release (the last row moves in);
    every step equals the reference engine driven the same way."""
    model = _model(seed=11, n_kv_heads=2)
    fast, ref = _pair(model, dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 2, 14, 7)]
    with torch.inference_mode():
        for e in (fast, ref):
            e.open_slots(4, 40)
        last = {}
        for i, script in enumerate([("admit", 0), ("admit", 1), ("step",), ("admit", 2), ("step",), ("step",),
                                    ("release", 0), ("step",), ("admit", 3), ("admit", 4), ("step",),
                                    ("release", 2), ("step",), ("step",)]):
            if script[0] == "admit":
                (ra, la), (rb, lb) = fast.admit(prompts[script[1]]), ref.admit(prompts[script[1]])
                assert ra == rb
                torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
                last[ra] = lb.argmax().item()
            elif script[0] == "release":
                moved = fast.release(script[1])
                assert ref.release(script[1]) == moved
                if moved is not None:
                    last[script[1]] = last.pop(moved)
                else:
                    last.pop(script[1])
            else:
                tok = torch.tensor([last[r] for r in range(fast.active)])
                a, b = fast.step(tok), ref.step(tok)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                last = {r: int(t) for r, t in enumerate(b.argmax(-1))}
            assert fast.lengths == ref.lengths, i
    assert torch.equal(fast.tokens[: fast.active], ref.tokens[: ref.active])


def test_step_checks_its_arguments():
    model = _model()
    eng = Engine(model)
    with torch.inference_mode():
        eng.prefill([[1, 2, 3]], 8)
        cache = eng.cache
        dec = eng._decoder
        logits = np.zeros((1, VOCAB), np.float32)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            dec.step(np.array([VOCAB], np.int64), cache.k.numpy(), cache.v.numpy(), cache.lengths.numpy(), logits, 1)
        with pytest.raises(ValueError, match="full"):
            dec.step(np.array([1], np.int64), cache.k.numpy(), cache.v.numpy(), np.array([8], np.int64), logits, 1)
        with pytest.raises(ValueError, match="layers, rows"):
            dec.step(np.array([1], np.int64), cache.k[:1].numpy(), cache.v[:1].numpy(), cache.lengths.numpy(), logits, 1)
        with pytest.raises(ValueError, match="logits"):
            dec.step(np.array([1], np.int64), cache.k.numpy(), cache.v.numpy(), cache.lengths.numpy(),
                     np.zeros((1, 5), np.float32), 1)
        assert eng.lengths == [3]  # nothing was written
    spec = PackedLinear(torch.randn(64, 64)).spec()
    with pytest.raises(ValueError, match="a layer is"):
        core().DecodeModel(np.zeros((4, 64), np.float32), np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32),
                           4, 4, 96, 1e-5, [(1, 2)], np.ones(64, np.float32), spec, 64)
    with pytest.raises(ValueError, match="packed"):
        core().DecodeModel(np.zeros((4, 64), np.float32), np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32),
                           4, 4, 96, 1e-5, [], np.ones(64, np.float32), PackedLinear(torch.randn(64, 32)).spec(), 64)
    with pytest.raises(ValueError, match="contiguous"):  # a float64 array would need a converted copy
        core().DecodeModel(np.zeros((4, 64)), np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32),
                           4, 4, 96, 1e-5, [], np.ones(64, np.float32), spec, 64)


DTYPES = ["float32", "bfloat16", "float16", "int8", "int4", "int8/int8", "int4/int8"]  # weights[/activations]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_logits_do_not_depend_on_its_batch(dtype, isa):
    """Batch invariance (seeded requests rely on it): one row's logits, bit for bit, alone and in batches of
    2..16 live rows of other prompts and lengths, at various row positions, on 1, 2 and 3 threads (prefill and
    steps alike). Matrices are large enough (N * K >= 65536) for the products to split over threads. And a
    prompt prefilled whole gives the bits of its first token prefilled and the rest fed as steps."""
    model = _model(seed=7, d_model=128, n_heads=4, n_kv_heads=2, d_ff=288, vocab_size=520, context_length=48)
    weights, _, activations = dtype.partition("/")
    eng = Engine(model, weight_dtype=weights, activations=activations or "float32")
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, 520, (14,), generator=g).tolist()  # 14 rows: the many-row GEMM (12 and more)
    steps = [int(t) for t in torch.randint(0, 520, (3,), generator=g)]

    def run(n_rows: int, at: int, threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        others = [torch.randint(0, 520, (1 + (7 * i + n_rows) % 23,), generator=g).tolist() for i in range(n_rows)]
        with torch.inference_mode():
            eng.open_slots(n_rows, 48)
            for p in others[:at]:
                eng.admit(p)
            out = [eng.admit(target)[1].clone()]
            for p in others[at + 1:]:
                eng.admit(p)
            for t in steps:  # rows of 1..23 tokens, the target at 14 + step
                toks = torch.randint(0, 520, (n_rows,), generator=g)
                toks[at] = t
                out.append(eng.step(toks)[at].clone())
        return out

    alone = run(1, 0, 1)
    for n_rows, at, threads in [(2, 1, 2), (5, 2, 1), (9, 8, 3), (16, 11, 2)]:
        got = run(n_rows, at, threads)
        for a, b in zip(alone, got):
            assert torch.equal(a, b), (dtype, n_rows, at, threads, (a - b).abs().max().item())
    with torch.inference_mode():  # the prompt's tokens one by one: the first prefilled, the rest as steps
        eng.open_slots(1, 48)
        eng.admit(target[:1])
        for t in target[1:-1]:
            eng.step(torch.tensor([t]))
        assert torch.equal(eng.step(torch.tensor([target[-1]]))[0], alone[0])


def test_a_prefill_reuses_a_same_shaped_cache_and_forgets_it():
    """A second prefill of the same shape reuses the cache's memory (no fresh pages to zero) and gives what a fresh
    engine gives, though the longer first prompt left its keys and values past the new rows' lengths."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    long, short = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (30, 9))
    e = Engine(model)
    e.prefill([long], 40)
    k0 = e.cache.k.data_ptr()
    assert bool(e.cache.k[:, 0, :, 9:30].abs().sum() > 0)  # what the short prompt must not see
    got = [e.prefill([short], 40)]
    assert e.cache.k.data_ptr() == k0 and e.lengths == [9]
    got += [e.step(got[-1].argmax(-1)) for _ in range(5)]
    fresh = Engine(model)
    want = [fresh.prefill([short], 40)]
    want += [fresh.step(want[-1].argmax(-1)) for _ in range(5)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    e.open_slots(1, 40)  # serving on the same shape: the same memory, every row empty
    assert e.cache.k.data_ptr() == k0 and e.lengths == [0] and e.free_slots == 1
    e.prefill([short, long[:9]], 40)  # another shape: a new cache
    assert e.cache.batch_size == 2 and e.lengths == [9, 9]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8/int8", "int4/int8"])
def test_every_tokens_logits_in_one_call_are_the_bits_of_single_steps(dtype, isa):
    """Checking drafted tokens: ``DecodeModel.step`` with logits shaped ``(B * T, V)`` returns the logits after
    each of a row's T tokens in one call (``Engine.verify``), the bits T single steps give, on 1 and 2 threads;
    the row's cache ends the same. A logits array of any other row count is refused."""
    model = _model(seed=3, d_model=128, n_heads=4, n_kv_heads=2, d_ff=288, vocab_size=520, context_length=48)
    weights, _, activations = dtype.partition("/")
    eng = Engine(model, weight_dtype=weights, activations=activations or "float32")
    prompt, fed = [5, 17, 300, 2, 9, 41], [7, 7, 250, 3, 19, 511, 0, 64]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            eng.open_slots(2, 48)
            eng.admit([1, 2, 3])
            eng.admit(prompt)
            one = [eng.step(torch.tensor([1, t]))[1].clone() for t in fed]  # single steps, beside another row
            k1, v1 = eng.cache.k[:, 1, :, :20].clone(), eng.cache.v[:, 1, :, :20].clone()
            eng.rollback(1, len(fed))
            many = eng.verify(1, fed)  # (T, V) in one call
            assert eng.lengths[1] == len(prompt) + len(fed)
            assert torch.equal(eng.cache.k[:, 1, :, :20], k1) and torch.equal(eng.cache.v[:, 1, :, :20], v1)
        for j, a in enumerate(one):
            assert torch.equal(many[j], a), (dtype, threads, j, (many[j] - a).abs().max().item())
    k, v, lengths, _ = eng._arrays
    with pytest.raises(ValueError, match=r"\(B \* T, head_n\)"):
        eng._decoder.step(np.array([1, 2, 3], np.int64), k, v, lengths[:1].copy(), np.zeros((2, 520), np.float32), 1)
