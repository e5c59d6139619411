"""The training-recipe options of ModelConfig: each against its formula, fast path == reference (gradients too),
cached decoding == the full forward, the fused loss under soft-capping, init, config checks, checkpoints, LoRA."""

from __future__ import annotations

import io

import pytest
import torch

from conftest import torch_threads

from lmforge.checkpoint import load_checkpoint, save_checkpoint
from lmforge.model import KVCache, ModelConfig, TransformerLM, linear_cross_entropy, matmul_params_per_token, num_params
from lmforge.model.layers import cross_entropy as cross_entropy_reference
from lmforge.model.lora import LoraConfig, apply_lora
from lmforge.model.recipe import (Smear, offset_keys, offset_keys_reference, smear_keys, smear_keys_reference, softcap,
                                  softcap_reference)
from lmforge.model.transformer import RECIPE_OPTIONS

OPTIONS = {"smear": {"smear": True}, "smear_keys": {"smear_keys": True}, "value_embeds": {"value_embeds": 1}, "unet_skips": {"unet_skips": True},
           "relu2": {"mlp": "relu2"}, "softcap": {"logit_softcap": 3.0}, "qk_norm": {"qk_norm": True},
           "zero_init": {"zero_init": True}, "head_init_std": {"head_init_std": 0.01}, "embed_norm": {"embed_norm": True},
           "qk_norm_scale": {"qk_norm": True, "qk_norm_scale": 0.4}, "key_offset": {"key_offset": True}}
ALL = {k: v for kw in OPTIONS.values() for k, v in kw.items()}
CASES = [*OPTIONS.values(), {**ALL, "n_kv_heads": 2}, {**ALL, "value_embeds": 2, "n_layers": 4}]
IDS = [*OPTIONS, "all-gqa", "all-4layers"]


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def cfg_of(**kw) -> ModelConfig:
    base = dict(vocab_size=97, context_length=32, d_model=64, n_layers=3, n_heads=4)
    base.update(kw)
    return ModelConfig(**base)


def model_pair(**kw) -> tuple[TransformerLM, TransformerLM]:
    """(fast, reference) models with identical weights, every parameter moved off its init (a smear that starts at
    zero, or a zero-initialised projection, would otherwise hide a wrong formula)."""
    torch.manual_seed(0)
    fast = TransformerLM(cfg_of(fast=True, **kw))
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ref = TransformerLM(cfg_of(fast=False, **kw))
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def test_every_recipe_option_is_tested_and_off_by_default():
    assert set(RECIPE_OPTIONS) == set(ALL)
    default = cfg_of()
    assert all(getattr(default, k) in (False, 0, None, "swiglu") for k in RECIPE_OPTIONS)
    assert set(TransformerLM(default).state_dict()) == set(TransformerLM(cfg_of(zero_init=True)).state_dict())


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_fast_path_equals_reference_forward_and_backward(kw):
    fast, ref = model_pair(**kw)
    x, y = torch.randint(0, 97, (3, 20)), torch.randint(0, 97, (3, 20))
    torch.testing.assert_close(fast(x), ref(x), atol=1e-4, rtol=1e-4)  # logits of a few units
    lf, lr = fast(x, targets=y), ref(x, targets=y)
    torch.testing.assert_close(lf, lr, atol=1e-5, rtol=1e-5)
    lf.backward()
    lr.backward()
    for (name, pf), (_, pr) in zip(fast.named_parameters(), ref.named_parameters()):
        assert pf.grad is not None, name
        torch.testing.assert_close(pf.grad, pr.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_cached_decoding_equals_the_full_forward(kw):
    """Prefill, a chunk, then one token at a time: the same logits as one forward over the whole sequence."""
    for model in model_pair(**kw):
        x = torch.randint(0, 97, (2, 14))
        with torch.no_grad():
            full = model(x)
            cache = KVCache.for_model(model, batch_size=2)
            parts = [model(x[:, :6], cache=cache), model(x[:, 6:9], cache=cache)]
            parts += [model(x[:, t:t + 1], cache=cache) for t in range(9, 14)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fast", [True, False])
def test_smear_decodes_right_padded_rows_and_forked_rows(fast):
    """The smear reads each row's last real token (column lengths-1), not a pad; a row copied by
    ``KVCache.copy_row`` continues as its source does; a static cache (CUDA graphs' form) too."""
    model = model_pair(smear=True)[0 if fast else 1]
    a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 5))
    batch = torch.cat([a, torch.cat([b, torch.full((1, 4), 7)], 1)])  # (2, 9), b right-padded with id 7
    nxt = torch.randint(0, 97, (2, 1))
    with torch.no_grad():
        cache = KVCache.for_model(model, 3)
        model(torch.cat([batch, batch[:1]]), cache=cache)
        cache.lengths[1] = 5  # the pads are forgotten
        cache.copy_row(1, 2)  # row 2 (was a) becomes a fork of row 1 (b)
        step = model(torch.cat([nxt, nxt[1:]]), cache=cache)
        torch.testing.assert_close(step[0], model(torch.cat([a, nxt[:1]], 1))[0, -1:], atol=2e-5, rtol=1e-4)
        want_b = model(torch.cat([b, nxt[1:]], 1))[0, -1:]
        torch.testing.assert_close(step[1], want_b, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(step[2], want_b, atol=2e-5, rtol=1e-4)
        cache.lengths[:] = torch.tensor([9, 5, 5])
        cache.static = True
        again = model(torch.cat([nxt, nxt[1:]]), cache=cache)
        torch.testing.assert_close(again, step, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fast", [True, False])
def test_smear_formula(fast):
    torch.manual_seed(0)
    smear = Smear(64, fast=fast)
    with torch.no_grad():
        smear.gate.normal_()
        smear.lam.fill_(0.7)
    x, prev = torch.randn(2, 5, 64), torch.randn(2, 1, 64)
    out = smear(x, prev)
    for t in range(5):
        before = prev[:, 0] if t == 0 else x[:, t - 1]
        g = 0.7 * torch.sigmoid(x[:, t, :24] @ smear.gate)
        torch.testing.assert_close(out[:, t], x[:, t] + g[:, None] * before)
    assert torch.equal(Smear(64, fast=fast)(x, prev), x)  # starts as the identity


def test_smeared_keys_formula_and_cached_rows():
    """Key head h at column j: k_j + sigmoid(a_h)(k_{j-1} - k_j), k_{-1} = 0 (both forms); the cache keeps raw keys,
    so a row copied or right-padded continues exactly (no other state)."""
    k, a = torch.randn(2, 3, 5, 4), torch.tensor([-1.0, 0.0, 2.0])
    for form in (smear_keys, smear_keys_reference):
        out = form(k, a)
        for h in range(3):
            s = torch.sigmoid(a[h])
            for j in range(5):
                prev = k[:, h, j - 1] if j else torch.zeros(2, 4)
                torch.testing.assert_close(out[:, h, j], (1 - s) * k[:, h, j] + s * prev)
    model = model_pair(smear_keys=True, n_kv_heads=2)[0]
    assert model.layers[0].attn.key_smear.shape == (2,)
    _continues_padded_and_copied_rows(model)


def _continues_padded_and_copied_rows(model: TransformerLM) -> None:
    """A right-padded row (its pads forgotten) and a copy of it (``KVCache.copy_row``) each continue as the row's
    tokens alone would: the cache holds nothing per row but its columns."""
    a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        cache = KVCache.for_model(model, 2)
        model(torch.cat([a, torch.cat([b, torch.full((1, 4), 7)], 1)]), cache=cache)
        cache.lengths[1] = 5
        cache.copy_row(1, 0)
        nxt = torch.randint(0, 97, (2, 2))
        got = model(nxt, cache=cache)
        for r in (0, 1):
            torch.testing.assert_close(got[r], model(torch.cat([b, nxt[r:r + 1]], 1))[0, 5:], atol=1e-4, rtol=1e-4)


def test_key_offset_formula_and_cached_rows():
    """Column j: the first half of each key head's dimensions its own, the second half column j-1's (column 0 keeps
    its own), in both forms; in the model after RoPE (the attention rebuilt by hand), and with smeared keys after the
    smear; the cache keeps raw keys, so a right-padded or copied row continues exactly."""
    k = torch.randn(2, 3, 5, 6)
    for form in (offset_keys, offset_keys_reference):
        out = form(k)
        assert torch.equal(out[..., :3], k[..., :3]) and torch.equal(out[..., 0, 3:], k[..., 0, 3:])
        assert torch.equal(out[..., 1:, 3:], k[..., :-1, 3:])
    for smear in (False, True):
        attn = model_pair(key_offset=True, smear_keys=smear, n_layers=1)[1].layers[0].attn
        h = torch.randn(2, 7, 64)
        q, k, v = ((h @ w.weight.T).unflatten(-1, (4, 16)).transpose(1, 2)
                   for w in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = attn.rope(q), attn.rope(k)
        if smear:
            s = torch.sigmoid(attn.key_smear)[:, None, None]
            k = (1 - s) * k + s * torch.nn.functional.pad(k, (0, 0, 1, 0))[..., :-1, :]
        k = torch.cat([k[..., :8], torch.cat([k[..., :1, 8:], k[..., :-1, 8:]], dim=-2)], dim=-1)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(attn(h), want.transpose(1, 2).flatten(-2) @ attn.output_proj.weight.T,
                                   atol=1e-5, rtol=1e-4)
    for model in model_pair(key_offset=True, n_kv_heads=2):
        _continues_padded_and_copied_rows(model)


def test_value_embeddings_and_unet_skips_follow_their_formulas():
    """Rebuild ``hidden`` by hand from the blocks: table j feeds layers j and n-k+j; layer n-1-j adds
    skip_weights[j] times layer j's output."""
    model = model_pair(value_embeds=2, unet_skips=True, n_layers=5)[1]
    idx = torch.randint(0, 97, (2, 7))
    x = model.token_embeddings(idx)
    ves = [t(idx) for t in model.value_embeddings]
    feeds = {0: ves[0], 1: ves[1], 3: ves[0], 4: ves[1]}
    outs = []
    for i, layer in enumerate(model.layers):
        if i >= 3:
            x = x + model.skip_weights[4 - i] * outs[4 - i]
        x = layer(x, ve=feeds.get(i))
        outs.append(x)
    torch.testing.assert_close(model.hidden(idx), model.ln_final(x))
    assert [layer.attn.ve_lambda is not None for layer in model.layers] == [True, True, False, True, True]


def test_relu2_and_qk_norm_formulas():
    model = model_pair(mlp="relu2", qk_norm=True, n_layers=1)[1]
    blk = model.layers[0]
    assert blk.ffn.d_ff == 4 * 64 and not hasattr(blk.ffn, "w3")
    h = torch.randn(2, 5, 64)
    torch.testing.assert_close(blk.ffn(h), (h @ blk.ffn.w1.weight.T).relu().pow(2) @ blk.ffn.w2.weight.T)
    attn = blk.attn
    q = (h @ attn.q_proj.weight.T).unflatten(-1, (4, 16)).transpose(1, 2)
    k = (h @ attn.k_proj.weight.T).unflatten(-1, (4, 16)).transpose(1, 2)
    v = (h @ attn.v_proj.weight.T).unflatten(-1, (4, 16)).transpose(1, 2)
    q, k = (t / t.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() for t in (q, k))
    q, k = attn.rope(q), attn.rope(k)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn(h), want.transpose(1, 2).flatten(-2) @ attn.output_proj.weight.T,
                               atol=1e-5, rtol=1e-4)
    assert num_params(model) - 97 * 64 == matmul_params_per_token(model.cfg) + 64 * 3  # + the three norms


@pytest.mark.parametrize("fast", [True, False])
def test_embed_norm_and_qk_norm_scale_formulas(fast):
    """``embed_norm``: the blocks read each token's embedding divided by its RMS (no gain); ``qk_norm_scale``: the
    scores are ``s · q̂·k̂`` of the normalised heads, not ``q̂·k̂ / sqrt(head_dim)``. Both paths, written out here."""
    model = model_pair(embed_norm=True, qk_norm=True, qk_norm_scale=0.9, n_layers=2)[0 if fast else 1]
    with torch.no_grad():
        model.token_embeddings.weight.mul_(5.0)  # rows of RMS ~5: unnormalised they would be far off
    idx = torch.randint(0, 97, (2, 7))
    e = model.token_embeddings.weight[idx]
    x = e / e.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    for layer in model.layers:
        x = layer(x)
    torch.testing.assert_close(model.hidden(idx), model.ln_final(x))
    attn, h = model.layers[0].attn, torch.randn(2, 5, 64)
    q, k, v = ((h @ w.weight.T).unflatten(-1, (4, 16)).transpose(1, 2) for w in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = (attn.rope(t / t.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()) for t in (q, k))
    scores = (0.9 * q @ k.transpose(-2, -1)).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(1, 2).flatten(-2) @ attn.output_proj.weight.T
    torch.testing.assert_close(attn(h), want, atol=1e-5, rtol=1e-4)
    assert scores.max() <= 0.9 * 16 + 1e-4  # |q̂·k̂| <= head_dim


def test_embed_norm_and_qk_norm_scale_are_refused_by_the_decode_kernel_and_the_llama_export():
    """Neither is in the C++ step's allow-list nor in Llama's: the engine decodes them through the forward and the
    HF/GGUF export refuses them by name (the scale too where ``qk_norm`` itself were allowed)."""
    from lmforge.generate.packed import KERNEL_IMPLEMENTS, kernel_unsupported
    from lmforge.interop.hf import LLAMA_EXPRESSES, check_llama_expressible
    from lmforge.model.transformer import options_beyond

    assert kernel_unsupported(cfg_of(embed_norm=True)) == ["model.embed_norm=True"]
    with pytest.raises(ValueError, match=r"^model\.embed_norm=True has no counterpart in a Llama model"):
        check_llama_expressible(cfg_of(embed_norm=True))
    scaled = cfg_of(qk_norm=True, qk_norm_scale=0.4)
    for allowed in (KERNEL_IMPLEMENTS, LLAMA_EXPRESSES):
        assert options_beyond(scaled, [*allowed, "qk_norm"]) == [("qk_norm_scale", 0.4, None)]


def test_softcap_bounds_the_logits_in_both_paths():
    z = torch.linspace(-300.0, 300.0, 601)
    for form in (softcap, softcap_reference):
        torch.testing.assert_close(form(z, 2.0), 2.0 * torch.tanh(z / 2.0))
        assert torch.equal(form(z, None), z)
    for model in model_pair(logit_softcap=2.0):
        x = torch.randint(0, 97, (2, 9))
        logits, raw = model(x), model.lm_head(model.hidden(x))
        assert logits.abs().max() < 2.0 < raw.abs().max()
        torch.testing.assert_close(logits, 2.0 * torch.tanh(raw / 2.0))


@pytest.fixture(params=["host", "sync-free"])
def loss_form(request, monkeypatch) -> str:
    """Both forms of the fused loss's chunks (the CPU's and the GPU/compiled one), as tests/model/test_model.py."""
    if request.param == "sync-free":
        from lmforge.model import losses

        monkeypatch.setattr(losses, "_sync_ok", lambda t: False)
    return request.param


@pytest.mark.parametrize("ignore", [None, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_loss_applies_the_softcap_exactly(ignore, reduction, loss_form):
    """The chunked LM-head loss with a soft-cap equals the reference cross-entropy of the capped logits: the loss,
    the gradients (the chain rule through tanh), with and without grad."""
    torch.manual_seed(0)
    h, w = torch.randn(10, 16, requires_grad=True), torch.randn(37, 16, requires_grad=True)
    y = torch.randint(0, 37, (10,))
    y[2] = 3
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ours = linear_cross_entropy(h, w, y, ignore, reduction, chunk_rows=4, softcap=2.5)
    ref = cross_entropy_reference(softcap(h2 @ w2.T, 2.5), y, ignore, reduction)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, ignore, reduction, chunk_rows=4, softcap=2.5), ref)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(ref, cross_entropy_reference(h2 @ w2.T, y, ignore, reduction))  # the cap bites


def test_init_follows_the_docstring():
    torch.manual_seed(0)
    m = TransformerLM(cfg_of(**ALL))
    for layer in m.layers:
        assert not layer.attn.output_proj.weight.any() and not layer.ffn.w2.weight.any()
        assert layer.attn.q_proj.weight.std() > 0.05
    assert 0.005 < m.lm_head.weight.std() < 0.015 and m.lm_head.weight.abs().max() <= 0.03 + 1e-6
    assert not m.smear.gate.any() and not m.smear.lam.any()
    assert m.skip_weights.tolist() == [1.0]
    assert [float(layer.attn.ve_lambda.detach()) for layer in (m.layers[0], m.layers[2])] == [0.5, 0.5]
    assert m.layers[1].attn.key_smear.tolist() == pytest.approx([-2.0, -2 / 3, 2 / 3, 2.0])
    assert 0.9 < m.value_embeddings[0].weight.std() < 1.1
    assert not TransformerLM(cfg_of(head_init_std=0)).lm_head.weight.any()


@pytest.mark.parametrize("kw, match", [
    ({"value_embeds": 2}, "value_embeds must be an integer in"), ({"value_embeds": True}, "value_embeds"),
    ({"mlp": "gelu"}, "model.mlp must be one of swiglu, relu2"), ({"logit_softcap": 0}, "logit_softcap must be"),
    ({"logit_softcap": float("inf")}, "logit_softcap"), ({"head_init_std": -1.0}, "head_init_std must be"),
    ({"head_init_std": 0.01, "tie_embeddings": True}, "drop one of them"), ({"smear": 1}, "model.smear must be"),
    ({"unet_skips": True, "n_layers": 1}, "unet_skips needs at least 2 layers"),
    ({"qk_norm": True, "qk_norm_scale": 0.0}, "qk_norm_scale must be a positive number"),
    ({"qk_norm": True, "qk_norm_scale": True}, "qk_norm_scale must be"), ({"qk_norm_scale": 0.2}, "set model.qk_norm: true"),
    ({"embed_norm": 1}, "model.embed_norm must be true or false"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg_of(**kw)


def test_bf16_autocast_and_a_pure_bf16_model_with_every_option_on():
    fast, ref = model_pair(**ALL)
    x, y = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    base = ref(x, targets=y)
    for model in (fast, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, targets=y)
        assert loss.dtype == torch.float32 and abs(loss.item() - base.item()) < 0.05 * base.item()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    half = TransformerLM(cfg_of(**ALL), dtype=torch.bfloat16)
    half(x, targets=y).backward()
    with torch.no_grad():
        cache = KVCache.for_model(half, 2)
        assert half(x, cache=cache).dtype == torch.bfloat16


def test_checkpoint_round_trip_with_every_option_on():
    fast, _ = model_pair(**ALL)
    buf = io.BytesIO()
    save_checkpoint(fast, None, 3, buf)
    buf.seek(0)
    loaded = TransformerLM.for_loading(fast.cfg)
    assert load_checkpoint(buf, loaded) == 3
    x = torch.randint(0, 97, (2, 11))
    assert torch.equal(loaded(x), fast(x))


def test_resize_vocab_grows_the_value_embeddings_too():
    model = model_pair(value_embeds=1)[0]
    x = torch.randint(0, 97, (1, 6))
    before = model(x)
    model.resize_vocab(100)
    for table in model.value_embeddings:
        assert table.weight.shape == (100, 64)
        torch.testing.assert_close(table.weight[99], table.weight[:97].mean(0))
    torch.testing.assert_close(model(x)[..., :97], before)
    model(torch.tensor([[98, 99]]))  # the new ids run


def test_lora_wraps_the_new_linears():
    model = model_pair(**ALL)[0]
    names = apply_lora(model, LoraConfig(rank=2, alpha=4.0))
    assert "layers.0.ffn.w1" in names and "layers.0.ffn.w2" in names and not any("w3" in n for n in names)
    x = torch.randint(0, 97, (2, 8))
    model(x, targets=x).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora" in n)
    with pytest.raises(ValueError, match="match no Linear"):
        apply_lora(model_pair(mlp="relu2")[0], LoraConfig(rank=2, alpha=4.0, targets=["w3"]))
