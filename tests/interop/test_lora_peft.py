"""lmforge LoRA adapters against the real PEFT on the HF Llama built from the same weights
(lmforge.interop.peft_adapters): the q/k adapter mapping, PEFT's on-disk format both ways."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.interop import hf
from lmforge.interop.peft_adapters import from_peft_state_dict, load_peft_adapters, save_peft_adapters, to_peft_state_dict
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, DEFAULT_TARGETS, LoraConfig, apply_lora, has_lora,
                                lora_parameters, lora_state_dict)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CFG = ModelConfig(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  rope_theta=500.0)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(CFG).eval()


def _lora(targets=None) -> TransformerLM:
    m = _base()
    apply_lora(m, LoraConfig(rank=4, alpha=12.0, targets=targets or list(DEFAULT_TARGETS)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(m):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


def _llama(model: TransformerLM):
    """HF LlamaForCausalLM with ``model``'s base weights."""
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}
    llama = transformers.LlamaForCausalLM(hf.hf_config(CFG)).eval()
    llama.load_state_dict(hf.to_hf_state_dict(sd, CFG))
    return llama


IDS = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))


def _logits(m) -> torch.Tensor:
    with torch.no_grad():
        out = m(IDS)
    return out.logits if hasattr(out, "logits") else out


def test_mapped_adapters_in_peft_on_hf_llama_give_lmforge_logits():
    ours = _lora()
    pm = peft.get_peft_model(_llama(ours), peft.LoraConfig(r=4, lora_alpha=12.0, target_modules=HF_TARGETS)).eval()
    mapped = to_peft_state_dict(lora_state_dict(ours), CFG)
    assert len(mapped) == 2 * 7 * CFG.n_layers
    own = {k.replace(".default.weight", ".weight"): p for k, p in pm.named_parameters() if ".lora_" in k}
    assert set(own) == set(mapped)
    with torch.no_grad():
        for k, t in mapped.items():
            own[k].copy_(t)
    torch.testing.assert_close(_logits(pm), _logits(ours), rtol=1e-5, atol=1e-5)
    # the permutation of q/k's B rows does real work: copied unpermuted, the logits differ
    raw = lora_state_dict(ours)
    with torch.no_grad():
        own["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].copy_(raw["layers.0.attn.q_proj.lora_B"])
    assert not torch.allclose(_logits(pm), _logits(ours), atol=1e-4)


def test_mapping_permutes_only_q_and_k_B_rows():
    sd = lora_state_dict(_lora())
    mapped = to_peft_state_dict(sd, CFG)
    pre = "base_model.model.model.layers.1."
    assert torch.equal(mapped[pre + "self_attn.q_proj.lora_A.weight"], sd["layers.1.attn.q_proj.lora_A"])
    assert torch.equal(mapped[pre + "self_attn.v_proj.lora_B.weight"], sd["layers.1.attn.v_proj.lora_B"])
    assert torch.equal(mapped[pre + "mlp.gate_proj.lora_B.weight"], sd["layers.1.ffn.w1.lora_B"])
    for which, heads in (("q", CFG.n_heads), ("k", CFG.n_kv_heads)):
        b = sd[f"layers.1.attn.{which}_proj.lora_B"]  # (heads·D, r): rows 0,2,4.. then 1,3,5.. of each head
        D = CFG.head_dim
        perm = torch.cat([h * D + torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)]) for h in range(heads)])
        assert torch.equal(mapped[pre + f"self_attn.{which}_proj.lora_B.weight"], b[perm])
    back = from_peft_state_dict(mapped, CFG)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_peft_from_pretrained_loads_saved_adapters(tmp_path):
    ours = _lora(targets=["attn.q_proj", "attn.k_proj", "v_proj", "w2", "lm_head"])
    out = save_peft_adapters(tmp_path / "peft", ours, LoraConfig(rank=4, alpha=12.0, dropout=0.05))
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    pm = peft.PeftModel.from_pretrained(_llama(ours), str(out)).eval()
    assert pm.peft_config["default"].r == 4 and pm.peft_config["default"].lora_alpha == 12.0
    torch.testing.assert_close(_logits(pm), _logits(ours), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already exists; pass force=True"):
        save_peft_adapters(out, ours, LoraConfig(rank=4, alpha=12.0))
    save_peft_adapters(out, ours, LoraConfig(rank=4, alpha=12.0), force=True)
    # and back onto a plain lmforge model
    fresh = _base()
    lcfg = load_peft_adapters(out, fresh)
    assert (lcfg.rank, lcfg.alpha) == (4, 12.0)
    torch.testing.assert_close(_logits(fresh), _logits(ours), rtol=1e-6, atol=1e-6)


def test_adapters_trained_by_peft_load_onto_lmforge(tmp_path):
    base = _base()
    pm = peft.get_peft_model(_llama(base), peft.LoraConfig(r=2, lora_alpha=5.0, target_modules=["q_proj", "down_proj"]))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for k, p in pm.named_parameters():
            if ".lora_" in k:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.eval().save_pretrained(str(tmp_path))
    lcfg = load_peft_adapters(tmp_path, base)
    assert lcfg.targets == [f"layers.{i}.{m}" for i in range(2) for m in ("attn.q_proj", "ffn.w2")]
    torch.testing.assert_close(_logits(base), _logits(pm), rtol=1e-5, atol=1e-5)


def test_load_peft_adapters_errors(tmp_path):
    save_peft_adapters(tmp_path, _lora(), LoraConfig(rank=4, alpha=12.0))
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    fresh = _base()
    with pytest.raises(ValueError, match=r"PEFT options \['use_dora'\] have no lmforge counterpart"):
        load_peft_adapters(tmp_path, fresh)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ValueError, match=r"shape mismatch"):
        load_peft_adapters(tmp_path, fresh)
    assert not has_lora(fresh)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="not a PEFT LoRA config"):
        load_peft_adapters(tmp_path, fresh)
    with pytest.raises(ValueError, match="not a LoRA factor"):
        from_peft_state_dict({"base_model.model.model.layers.0.self_attn.q_proj.ia3_l.weight": torch.zeros(1)}, CFG)
