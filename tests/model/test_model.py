"""Model tests: every block against its formula, the fast path against the reference, KV cache, configs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import torch_threads

from lmforge.model.layers import cross_entropy as cross_entropy_reference
from lmforge.train.optim import AdamW, param_groups_for
from lmforge.model import (CausalSelfAttention, Embedding, KVCache, Linear, ModelConfig, Norm, RMSNorm,
                           RotaryPositionalEmbedding, SwiGLU, TransformerBlock, TransformerLM, cross_entropy,
                           flops_per_token, linear_cross_entropy, matmul_params_per_token, num_params,
                           scaled_dot_product_attention, silu, softmax)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waiting on a busy machine (10x faster here)."""
    with torch_threads(1):
        yield


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, context_length=32, d_model=64, n_layers=2, n_heads=4)
    base.update(kw)
    return ModelConfig(**base)


def model_pair(**kw) -> tuple[TransformerLM, TransformerLM]:
    """(fast, reference) models with identical weights."""
    torch.manual_seed(0)
    fast = TransformerLM(tiny_cfg(fast=True, **kw))
    ref = TransformerLM(tiny_cfg(fast=False, **kw))
    ref.load_state_dict(fast.state_dict())
    return fast, ref


# --------------------------------------------------------------------------------------------------
# Primitives against direct formulas
# --------------------------------------------------------------------------------------------------
def test_linear_embedding_formulas():
    torch.manual_seed(0)
    lin = Linear(6, 5)
    x = torch.randn(2, 3, 6)
    assert lin.weight.shape == (5, 6)
    torch.testing.assert_close(lin(x), torch.einsum("btk,ok->bto", x, lin.weight))
    emb = Embedding(11, 4)
    ids = torch.tensor([[0, 3], [10, 3]])
    torch.testing.assert_close(emb(ids), torch.stack([emb.weight[[0, 3]], emb.weight[[10, 3]]]))


def test_rmsnorm_formula_and_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    xb = x.bfloat16()
    out = norm(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (xb.float() / torch.sqrt((xb.float() ** 2).mean(-1, keepdim=True) + 1e-5)
                                             * norm.weight).bfloat16().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_rmsnorm_matches_reference_with_gradients(dtype):
    torch.manual_seed(0)
    ref = RMSNorm(16)
    fast = Norm(16, fast=True)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        fast.weight.copy_(ref.weight)
    x = (torch.randn(3, 5, 16) * 3).to(dtype).requires_grad_()
    g = torch.randn(3, 5, 16).to(dtype)
    outs = []
    for m in (ref, fast):
        y = m(x)
        assert y.dtype == dtype
        outs.append((y, *torch.autograd.grad(y, (x, m.weight), g)))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **tol)


def test_swiglu_formula_and_default_width():
    torch.manual_seed(0)
    ff = SwiGLU(16, 32)
    x = torch.randn(2, 4, 16)
    a = x @ ff.w1.weight.T
    expected = (a * torch.sigmoid(a) * (x @ ff.w3.weight.T)) @ ff.w2.weight.T
    torch.testing.assert_close(ff(x), expected)
    assert SwiGLU(512).d_ff == 1344 and SwiGLU(768).d_ff == 2048
    torch.testing.assert_close(silu(x), F.silu(x))


def test_softmax_stable_and_matches_torch():
    x = torch.randn(4, 7) * 10
    torch.testing.assert_close(softmax(x, dim=-1), torch.softmax(x, dim=-1))
    torch.testing.assert_close(softmax(x, dim=0), torch.softmax(x, dim=0))
    big = torch.tensor([[1000.0, 1001.0, 999.0]])
    assert torch.isfinite(softmax(big, -1)).all()
    torch.testing.assert_close(softmax(big, -1), torch.softmax(big, -1))


def test_sdpa_formula_any_batch_dims_and_mask():
    torch.manual_seed(0)
    Q, K, V = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4)
    mask = torch.rand(5, 6) > 0.3
    mask[:, 0] = True
    out = scaled_dot_product_attention(Q, K, V, mask)
    assert out.shape == (2, 3, 5, 4)
    s = torch.einsum("bhqd,bhkd->bhqk", Q, K) / math.sqrt(8)
    s = s.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ V)
    torch.testing.assert_close(scaled_dot_product_attention(Q[0, 0], K[0, 0], V[0, 0]),
                               F.scaled_dot_product_attention(Q[0, 0], K[0, 0], V[0, 0]))


def test_rope_formula_and_relative_position_property():
    torch.manual_seed(0)
    d, theta = 8, 10000.0
    rope = RotaryPositionalEmbedding(theta, d, max_seq_len=64)
    x = torch.randn(1, 3, d)
    pos = torch.tensor([0, 5, 17])
    out = rope(x, pos)
    for r, p in enumerate(pos.tolist()):
        for i in range(d // 2):
            ang = p * theta ** (-2 * i / d)
            x0, x1 = x[0, r, 2 * i], x[0, r, 2 * i + 1]
            torch.testing.assert_close(out[0, r, 2 * i], x0 * math.cos(ang) - x1 * math.sin(ang))
            torch.testing.assert_close(out[0, r, 2 * i + 1], x0 * math.sin(ang) + x1 * math.cos(ang))
    q, k = torch.randn(d), torch.randn(d)

    def dot(m, n):
        return (rope(q[None], torch.tensor([m])) * rope(k[None], torch.tensor([n]))).sum()

    torch.testing.assert_close(dot(3, 1), dot(12, 10))
    torch.testing.assert_close(dot(40, 40), q @ k)
    assert "cos" not in rope.state_dict()
    with pytest.raises(ValueError, match="RoPE table"):
        rope(x, torch.tensor([0, 1, 64]))


def test_cross_entropy_matches_torch_and_ignore_index():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 5
    targets = torch.randint(0, 11, (3, 5))
    ref = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    torch.testing.assert_close(cross_entropy_reference(logits, targets), ref)
    torch.testing.assert_close(cross_entropy(logits, targets), ref)
    targets[0, :3] = -100
    ref = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(cross_entropy(logits, targets, ignore_index=-100), ref)
    n = int((targets != -100).sum())
    torch.testing.assert_close(cross_entropy(logits, targets, -100, reduction="sum"), ref * n)
    huge = torch.tensor([[1e4, 0.0, -1e4]])
    assert torch.isfinite(cross_entropy(huge, torch.tensor([2])))


@pytest.fixture(params=["host", "sync-free"])
def loss_form(request, monkeypatch) -> str:
    """Both forms of the fused loss's chunks: the CPU's (reads ``p[target]`` on the host) and the one a GPU and a
    compiled graph take (no host sync, no data-dependent branch), each held to torch below."""
    if request.param == "sync-free":
        from lmforge.model import losses

        monkeypatch.setattr(losses, "_sync_ok", lambda t: False)
    return request.param


@pytest.mark.parametrize("ignore", [None, 3])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_fast_cross_entropies_gradients_match_torch(ignore, chunk_rows, loss_form):
    torch.manual_seed(0)
    h = torch.randn(13, 16, requires_grad=True)
    w = torch.randn(23, 16, requires_grad=True)
    t = torch.randint(0, 23, (13,))
    t[::4] = 3
    ref = F.cross_entropy(h @ w.T, t, ignore_index=-100 if ignore is None else ignore)
    gh, gw = torch.autograd.grad(ref * 2, (h, w))
    for fn in (lambda: cross_entropy(h @ w.T, t, ignore), lambda: linear_cross_entropy(h, w, t, ignore, chunk_rows=chunk_rows)):
        loss = fn()
        torch.testing.assert_close(loss, ref)
        gh2, gw2 = torch.autograd.grad(loss * 2, (h, w))
        torch.testing.assert_close(gh2, gh)
        torch.testing.assert_close(gw2, gw)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, ignore, chunk_rows=chunk_rows), ref)


@pytest.mark.parametrize("ignore", [None, 3])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_weighted_cross_entropies_equal_the_weighted_torch_formula(ignore, reduction):
    """``weights`` (any sign: RL's advantages) multiply each target's loss and gradient; the mean still divides
    by the number of counted targets; the fused and unfused fast paths and the reference agree with torch."""
    torch.manual_seed(3)
    h = torch.randn(13, 16, requires_grad=True)
    w = torch.randn(23, 16, requires_grad=True)
    t = torch.randint(0, 23, (13,))
    t[::4] = 3
    wt = torch.randn(13)  # negative and positive weights
    per = F.cross_entropy(h @ w.T, t, ignore_index=-100 if ignore is None else ignore, reduction="none") * wt
    counted = (t != (-100 if ignore is None else ignore)).sum()
    ref = {"sum": per.sum(), "mean": per.sum() / counted, "none": per}[reduction]
    gh, gw = torch.autograd.grad(ref.sum() * 2, (h, w))
    for fn in (lambda: cross_entropy(h @ w.T, t, ignore, reduction, weights=wt),
               lambda: cross_entropy_reference(h @ w.T, t, ignore, reduction, weights=wt),
               lambda: linear_cross_entropy(h, w, t, ignore, reduction, chunk_rows=4, weights=wt)):
        loss = fn()
        torch.testing.assert_close(loss, ref)
        gh2, gw2 = torch.autograd.grad(loss.sum() * 2, (h, w))
        torch.testing.assert_close(gh2, gh)
        torch.testing.assert_close(gw2, gw)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_plain_backward_matches_torch(reduction, loss_form):
    """``loss.backward()`` (incoming gradient 1): the 1/N folded into the GEMMs, no scaling in backward."""
    torch.manual_seed(1)
    h = torch.randn(11, 16, requires_grad=True)
    w = torch.randn(29, 16, requires_grad=True)
    t = torch.randint(0, 29, (11,))
    ref = F.cross_entropy(h @ w.T, t, reduction=reduction)
    ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss = linear_cross_entropy(h, w, t, reduction=reduction, chunk_rows=4)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, gh)
    torch.testing.assert_close(w.grad, gw)


def test_linear_cross_entropy_rows_whose_target_probability_underflows(loss_form):
    """Rows where softmax[target] underflows float32 take the exact logsumexp formula: finite, equal to torch."""
    torch.manual_seed(2)
    h = (torch.randn(6, 8) * 30).requires_grad_()  # logit gaps of hundreds: p[target] == 0 in float32
    w = torch.randn(12, 8, requires_grad=True)
    t = torch.randint(0, 12, (6,))
    with torch.no_grad():
        assert bool((torch.softmax(h @ w.T, -1).gather(1, t[:, None]) < 1e-30).any())
    ref = F.cross_entropy(h @ w.T, t)
    gh, gw = torch.autograd.grad(ref, (h, w))
    loss = linear_cross_entropy(h, w, t, chunk_rows=4)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), (gh, gw)):
        torch.testing.assert_close(a, b)


def test_linear_cross_entropy_default_chunks_are_even():
    from lmforge.model.losses import _chunk_rows

    assert _chunk_rows(2048, 10_000) == 683  # three chunks, not four full ones and a short fifth
    assert _chunk_rows(10, 10_000) == 10
    assert _chunk_rows(0, 10_000) == 1
    # a GPU takes chunks ~16x larger (thousands of rows per GEMM): GPT-2's 50k vocabulary, 32k tokens -> 13 chunks
    assert _chunk_rows(32 * 1024, 50_257, "cuda") == 2521 and _chunk_rows(32 * 1024, 50_257) < 200


def test_linear_cross_entropy_compiles_without_a_graph_break():
    """Compiled (``fullgraph=True``: any graph break is an error) the fused loss takes its sync-free form and
    gives eager's loss and gradients; a host read of ``p[target]`` would break the graph here and on a GPU."""
    torch.manual_seed(3)
    h = torch.randn(13, 16, requires_grad=True)
    w = torch.randn(23, 16, requires_grad=True)
    t = torch.randint(0, 23, (13,))

    def loss_and_grads(fn):
        loss = fn(h, w, t)
        return (loss, *torch.autograd.grad(loss * 3, (h, w)))

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_rows=4), backend="aot_eager",
                             fullgraph=True)
    for got, want in zip(loss_and_grads(compiled), loss_and_grads(lambda a, b, c: F.cross_entropy(a @ b.T, c))):
        torch.testing.assert_close(got, want)


def test_linear_cross_entropy_under_bf16_autocast(loss_form):
    torch.manual_seed(0)
    h = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(23, 16, requires_grad=True)
    t = torch.randint(0, 23, (10,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy(h @ w.T, t)  # logits in bf16, loss in float32
        fused = linear_cross_entropy(h, w, t, chunk_rows=3)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, ref, atol=1e-3, rtol=1e-3)
    g_ref = torch.autograd.grad(ref, (h, w))
    g_fused = torch.autograd.grad(fused, (h, w))
    for a, b in zip(g_fused, g_ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_linear_cross_entropy_backward_twice_is_refused():
    h = torch.randn(4, 8, requires_grad=True)
    loss = linear_cross_entropy(h, torch.randn(5, 8), torch.randint(0, 5, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


# --------------------------------------------------------------------------------------------------
# Attention and blocks
# --------------------------------------------------------------------------------------------------
def test_attention_matches_explicit_multihead_formula():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4)  # no RoPE
    x = torch.randn(2, 6, 32)
    q = (x @ attn.q_proj.weight.T).view(2, 6, 4, 8).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(2, 6, 4, 8).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(2, 6, 4, 8).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 32)
    torch.testing.assert_close(attn(x), y @ attn.output_proj.weight.T)
    attn.fast = True
    torch.testing.assert_close(attn(x), y @ attn.output_proj.weight.T)


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    for fast in (False, True):
        gqa = CausalSelfAttention(32, 4, max_seq_len=16, theta=10000.0, num_kv_heads=2, fast=fast)
        mha = CausalSelfAttention(32, 4, max_seq_len=16, theta=10000.0, fast=fast)
        with torch.no_grad():
            mha.q_proj.weight.copy_(gqa.q_proj.weight)
            mha.output_proj.weight.copy_(gqa.output_proj.weight)
            for name in ("k_proj", "v_proj"):  # kv head j serves query heads 2j and 2j+1
                w = getattr(gqa, name).weight.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
                getattr(mha, name).weight.copy_(w)
        x = torch.randn(2, 10, 32)
        torch.testing.assert_close(gqa(x), mha(x))


def test_block_is_two_residual_lines():
    torch.manual_seed(0)
    blk = TransformerBlock(32, 4, 64, max_seq_len=16, theta=10000.0)
    x = torch.randn(2, 7, 32)
    h = x + blk.attn(blk.ln1(x))
    torch.testing.assert_close(blk(x), h + blk.ffn(blk.ln2(h)))


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"tie_embeddings": True}])
def test_fast_path_equals_reference_forward_and_backward(kw):
    fast, ref = model_pair(**kw)
    x = torch.randint(0, 97, (3, 20))
    y = torch.randint(0, 97, (3, 20))
    torch.testing.assert_close(fast(x), ref(x), atol=2e-5, rtol=1e-4)
    lf, lr = fast(x, targets=y), ref(x, targets=y)
    torch.testing.assert_close(lf, lr, atol=1e-5, rtol=1e-5)
    lf.backward()
    lr.backward()
    for (name, pf), (_, pr) in zip(fast.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(pf.grad, pr.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_causality_future_tokens_do_not_change_past_logits():
    for model in model_pair():
        x = torch.randint(0, 97, (2, 16))
        x2 = x.clone()
        x2[:, 9:] = torch.randint(0, 97, (2, 7))
        a, b = model(x), model(x2)
        torch.testing.assert_close(a[:, :9], b[:, :9])
        assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 1}])
def test_kv_cache_decode_equals_full_forward(kw):
    for model in model_pair(**kw):
        x = torch.randint(0, 97, (3, 18))
        with torch.no_grad():
            full = model(x)
            cache = KVCache.for_model(model, batch_size=3)
            parts = [model(x[:, :7], cache=cache), model(x[:, 7:10], cache=cache)]  # prefill, then a chunk
            parts += [model(x[:, t:t + 1], cache=cache) for t in range(10, 18)]  # one token at a time
        assert cache.lengths.tolist() == [18, 18, 18]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)


def test_decoding_sees_weight_updates():
    """The fast path caches fused weights while decoding; an in-place update must invalidate them."""
    model, _ = model_pair()
    x = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        model(x, cache=KVCache.for_model(model, 1))
        for p in model.parameters():
            p.mul_(1.1)
        cache = KVCache.for_model(model, 1)
        torch.testing.assert_close(model(x, cache=cache), model(x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 1}])
def test_kv_cache_rows_of_different_lengths_decode_independently(kw):
    """Right-padded prompts: each row continues after its own length, as if it were alone, in both paths."""
    for model in model_pair(**kw):
        a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 5))
        batch = torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], 1)])  # (2, 9), b right-padded
        nxt = torch.randint(0, 97, (2, 3))
        with torch.no_grad():
            cache = KVCache.for_model(model, 2)
            out = model(batch, cache=cache)
            cache.lengths[1] = 5  # the pads are forgotten: row 1 goes on after its 5 real tokens
            step = model(nxt, cache=cache)  # rows start at columns 9 and 5: a (B, 1, T, S) mask
            one = model(nxt[:, :1], cache=cache)  # one query per row, different lengths
            torch.testing.assert_close(out[0], model(a)[0], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out[1, :5], model(b)[0], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(step[0], model(torch.cat([a, nxt[:1]], 1))[0, 9:], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(step[1], model(torch.cat([b, nxt[1:]], 1))[0, 5:], atol=2e-5, rtol=1e-4)
            want = model(torch.cat([b, nxt[1:], nxt[1:, :1]], 1))[0, -1]
            torch.testing.assert_close(one[1, 0], want, atol=2e-5, rtol=1e-4)
        assert cache.lengths.tolist() == [13, 9]


def test_kv_cache_row_views_share_storage():
    model, _ = model_pair()
    x = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        cache = KVCache.for_model(model, 2)
        model(x, cache=cache)
        row = cache.rows(1)
        row.reset()  # row 1 empties; row 0 keeps its 6 tokens
        model(x[1:, 3:], cache=row)  # refill row 1 alone with 3 tokens
        assert cache.lengths.tolist() == [6, 3]
        nxt = torch.randint(0, 97, (2, 1))
        out = model(nxt, cache=cache)
        torch.testing.assert_close(out[1, 0], model(torch.cat([x[1:, 3:], nxt[1:]], 1))[0, -1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[0, 0], model(torch.cat([x[:1], nxt[:1]], 1))[0, -1], atol=2e-5, rtol=1e-4)


def test_context_length_and_cache_errors():
    model = TransformerLM(tiny_cfg())
    with pytest.raises(ValueError, match=r"the input has 33 tokens but the model's context length is 32; shorten it"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="batch dimension"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 5))
    cache = KVCache.for_model(model, 1, capacity=8)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"a cached row \(8 cached \+ 1 new tokens\) has 9 tokens but the KV "
                                             r"cache's capacity is 8"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="a batch of 2 rows does not fit a KV cache of 1 rows"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=KVCache.for_model(model, 1))
    with pytest.raises(ValueError, match=r"cache capacity must be in \[1, context_length=32\]"):
        KVCache.for_model(model, 1, capacity=33)
    with pytest.raises(ValueError, match="not both"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.arange(2), KVCache.for_model(model, 1))


# --------------------------------------------------------------------------------------------------
# Whole model: names, init, config, counting, numerics
# --------------------------------------------------------------------------------------------------
def test_state_dict_names_cs336():
    model = TransformerLM(tiny_cfg(n_layers=1))
    expected = {"token_embeddings.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight",
                "layers.0.attn.v_proj.weight", "layers.0.attn.output_proj.weight", "layers.0.ln1.weight",
                "layers.0.ffn.w1.weight", "layers.0.ffn.w2.weight", "layers.0.ffn.w3.weight", "layers.0.ln2.weight",
                "ln_final.weight", "lm_head.weight"}
    assert set(model.state_dict()) == expected
    cs336 = TransformerLM(97, 32, 64, 1, 4, 128, 10000.0)  # the handout's signature
    assert set(cs336.state_dict()) == expected and not cs336.cfg.fast


def test_init_weights_follow_docstring():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, context_length=16, d_model=256, n_layers=1, n_heads=4, d_ff=512)
    model = TransformerLM(cfg)
    sd = model.state_dict()
    emb = sd["token_embeddings.weight"]
    assert abs(emb.std().item() - 0.986) < 0.02 and emb.abs().max() <= 3.0  # std of N(0,1) cut at ±3σ ≈ 0.986
    for name, (fan_in, fan_out) in {"layers.0.attn.q_proj.weight": (256, 256), "layers.0.ffn.w1.weight": (256, 512),
                                    "layers.0.ffn.w2.weight": (512, 256), "lm_head.weight": (256, 4096)}.items():
        std = math.sqrt(2 / (fan_in + fan_out))
        w = sd[name]
        assert abs(w.std().item() / (0.986 * std) - 1) < 0.05, name
        assert w.abs().max() <= 3 * std + 1e-6, name
    for name in ("layers.0.ln1.weight", "layers.0.ln2.weight", "ln_final.weight"):
        assert torch.equal(sd[name], torch.ones(256))
    tied = TransformerLM(ModelConfig(vocab_size=4096, context_length=16, d_model=256, n_layers=1, n_heads=4,
                                     tie_embeddings=True))
    assert tied.lm_head.weight is tied.token_embeddings.weight
    assert abs(tied.lm_head.weight.std().item() / (0.986 * math.sqrt(2 / (256 + 4096))) - 1) < 0.05


@pytest.mark.parametrize("kw, match", [
    (dict(d_model=60, n_heads=8), "divisible by model.n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "divisible by model.n_kv_heads"),
    (dict(d_model=0), "model.d_model must be a positive integer"),
    (dict(vocab_size=-1), "model.vocab_size"),
    (dict(d_model=36, n_heads=4), "must be even"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(d_ff=0), "model.d_ff"),
    (dict(fast="yes"), "model.fast must be true or false"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_cfg(**kw)


def test_config_defaults_resolved():
    cfg = tiny_cfg(d_model=512, n_heads=8)
    assert cfg.n_kv_heads == 8 and cfg.d_ff == 1344 and cfg.head_dim == 64


def test_num_params_and_flops():
    cfg = tiny_cfg()
    model = TransformerLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert num_params(model) == total
    assert num_params(model, exclude_embeddings=True) == total - 97 * 64
    assert num_params(model, exclude_embeddings=True) == matmul_params_per_token(cfg) + 64 * (2 * 2 + 1)
    tied = TransformerLM(tiny_cfg(tie_embeddings=True))
    assert num_params(tied) == total - 97 * 64 == num_params(tied, exclude_embeddings=True)
    assert flops_per_token(cfg, 16) == 6 * matmul_params_per_token(cfg) + 12 * 2 * 64 * 16


def test_bf16_autocast_runs_and_stays_close():
    fast, ref = model_pair()
    x, y = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    base = ref(x, targets=y)
    for model in (fast, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, targets=y)
            logits = model(x)
        assert loss.dtype == torch.float32 and logits.dtype == torch.bfloat16
        assert abs(loss.item() - base.item()) < 0.05
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_pure_bf16_model_trains_and_keeps_rope_tables_float32():
    fast, ref = model_pair()
    for model in (fast, ref):
        model.to(torch.bfloat16)
        rope = model.layers[0].attn.rope
        assert rope.cos.dtype == torch.float32
        torch.testing.assert_close(rope.cos, RotaryPositionalEmbedding(10000.0, 16, 32).cos)
        x, y = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
        loss = model(x, targets=y)
        assert model(x).dtype == torch.bfloat16 and loss.dtype == torch.float32
        loss.backward()
        assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in model.parameters())


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=32, context_length=16, d_model=32, n_layers=2, n_heads=2))
    x = torch.randint(0, 32, (4, 16))
    y = torch.roll(x, -1, dims=1)
    opt = AdamW(param_groups_for(model, 0.0), lr=1e-2)
    for _ in range(100):
        loss = model(x, targets=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_builds_from_cs336_model_config(shared_fixtures):
    """The CS336 suite's model config builds through the handout's constructor signature."""
    import json

    c = json.loads((shared_fixtures / "ts_tests/model_config.json").read_text())
    model = TransformerLM(c["vocab_size"], c["context_length"], c["d_model"], c["num_layers"], c["num_heads"],
                          c["d_ff"], c["rope_theta"])
    sd = model.state_dict()
    assert sd["layers.2.ffn.w1.weight"].shape == (c["d_ff"], c["d_model"])
    assert sd["lm_head.weight"].shape == (c["vocab_size"], c["d_model"])
    per_layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert num_params(model) == 2 * 10000 * 64 + 3 * per_layer + 64
    x = torch.randint(0, c["vocab_size"], (2, c["context_length"]))
    assert model(x).shape == (2, c["context_length"], c["vocab_size"])


def test_token_ids_out_of_range_are_refused_not_wrapped() -> None:
    """A negative id would silently read the embedding table from its end; both paths refuse it."""
    from lmforge.model import ModelConfig, TransformerLM

    model = TransformerLM(ModelConfig(vocab_size=20, context_length=8, d_model=16, n_layers=1, n_heads=2))
    for fast in (True, False):
        model.set_fast(fast)
        with pytest.raises(ValueError, match=r"token id -1 is out of range \[0, 20\)"):
            model(torch.tensor([[1, -1]]))
        with pytest.raises(ValueError, match=r"token id 20 is out of range"):
            model(torch.tensor([[20, 1]]), targets=torch.tensor([[1, 1]]))
    assert model(torch.tensor([[0, 19]])).shape == (1, 2, 20)


@pytest.mark.parametrize("tie", [False, True])
def test_for_loading_then_a_checkpoint_equals_the_trained_model(tie):
    """``TransformerLM.for_loading`` skips the random init; after a strict load it is the same model: same
    logits, the same RoPE tables as a normally built model, tied embeddings still one tensor."""
    cfg = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, tie_embeddings=tie)
    torch.manual_seed(0)
    trained = TransformerLM(cfg)
    loaded = TransformerLM.for_loading(cfg)
    loaded.load_state_dict(trained.state_dict(), strict=True)
    rope, want = loaded.layers[0].attn.rope, trained.layers[0].attn.rope
    assert torch.equal(rope.cos, want.cos) and torch.equal(rope.sin, want.sin) and rope.cos.device.type == "cpu"
    assert (loaded.lm_head.weight is loaded.token_embeddings.weight) == tie
    x = torch.randint(0, 64, (2, 16))
    assert torch.equal(loaded(x), trained(x))
