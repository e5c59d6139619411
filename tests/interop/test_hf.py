"""The HF Llama key map: our TransformerLM and transformers' LlamaForCausalLM agree after mapping weights."""

from __future__ import annotations

import pytest
import torch

from lmforge.interop import hf
from lmforge.model import ModelConfig, TransformerLM

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"tie_embeddings": True}])
def test_logits_match_transformers_llama(kw):
    cfg = ModelConfig(vocab_size=128, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=96,
                      rope_theta=500.0, **kw)
    torch.manual_seed(0)
    ours = TransformerLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so a swapped ln1/ln2 would show
        for name, p in ours.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)
    theirs = transformers.LlamaForCausalLM(hf.hf_config(cfg)).eval()
    theirs.load_state_dict(hf.to_hf_state_dict(ours.state_dict(), cfg), strict=not cfg.tie_embeddings)
    if cfg.tie_embeddings:
        theirs.tie_weights()
    idx = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=1e-4, atol=1e-4)
    back = hf.from_hf_state_dict(theirs.state_dict(), cfg)
    for name, t in ours.state_dict().items():
        assert torch.equal(back[name], t), name


def test_rope_permutation_is_needed():
    """Without the q/k row permutation the logits differ: the map's permutation is doing real work."""
    cfg = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    torch.manual_seed(1)
    ours = TransformerLM(cfg).eval()
    sd = {name: t.clone() for name, t in ours.state_dict().items()}
    theirs = transformers.LlamaForCausalLM(hf.hf_config(cfg)).eval()
    mapped = hf.to_hf_state_dict(sd, cfg)
    mapped["model.layers.0.self_attn.q_proj.weight"] = sd["layers.0.attn.q_proj.weight"]
    mapped["model.layers.0.self_attn.k_proj.weight"] = sd["layers.0.attn.k_proj.weight"]
    theirs.load_state_dict(mapped)
    idx = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(theirs(idx).logits, ours(idx), atol=1e-3)


def test_unknown_key_is_rejected():
    cfg = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    with pytest.raises(ValueError, match="no counterpart"):
        hf.to_hf_state_dict({"layers.0.attn.bias": torch.zeros(1)}, cfg)
