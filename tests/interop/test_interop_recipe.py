"""Export of runs with the model's training-recipe options: what Llama cannot express is refused naming the option
(HF, GGUF and PEFT adapters alike, before anything is written); init-only options export as the plain Llama they train
into."""

from __future__ import annotations

import pytest

from interop_helpers import make_run, make_tokenizer
from lmforge.interop.gguf import export_gguf
from lmforge.interop.hf import check_llama_expressible, hf_config_dict
from lmforge.interop.hf_export import export_hf
from lmforge.interop.peft_adapters import load_peft_adapters, save_peft_adapters
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.lora import LoraConfig, apply_lora, has_lora

BASE = dict(vocab_size=300, context_length=16, d_model=32, n_layers=2, n_heads=2)
REFUSED = [("smear", True), ("smear_keys", True), ("value_embeds", 1), ("unet_skips", True), ("mlp", "relu2"), ("logit_softcap", 15.0),
           ("qk_norm", True), ("key_offset", True)]


@pytest.mark.parametrize("name, value", REFUSED)
def test_each_option_llama_cannot_express_is_refused_by_name(name, value):
    cfg = ModelConfig(**BASE, **{name: value})
    with pytest.raises(ValueError, match=rf"^model\.{name}={value!r} has no counterpart in a Llama model"):
        check_llama_expressible(cfg)


@pytest.mark.parametrize("name, value", REFUSED)
def test_peft_adapters_of_a_model_llama_cannot_express_are_refused_by_name(name, value, tmp_path):
    """PEFT adapters name the HF Llama's modules (relu2's ``w1``/``w2`` would pass for ``gate_proj``/``down_proj``):
    neither written for such a model nor loaded onto one."""
    lora = LoraConfig(rank=2, alpha=4.0)
    model = TransformerLM(ModelConfig(**BASE, **{name: value}))
    apply_lora(model, lora)
    refused = rf"^model\.{name}={value!r} has no counterpart in a Llama model"
    with pytest.raises(ValueError, match=refused):
        save_peft_adapters(tmp_path / "peft", model, lora)
    assert not (tmp_path / "peft").exists()
    llama = TransformerLM(ModelConfig(**BASE))
    apply_lora(llama, lora)
    save_peft_adapters(tmp_path / "llama", llama, lora)
    plain = TransformerLM(ModelConfig(**BASE, **{name: value}))
    with pytest.raises(ValueError, match=refused):
        load_peft_adapters(tmp_path / "llama", plain)
    assert not has_lora(plain)


def test_init_only_options_export_as_llama():
    cfg = ModelConfig(**BASE, zero_init=True, head_init_std=0.001)
    check_llama_expressible(cfg)
    assert hf_config_dict(cfg)["architectures"] == ["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def smear_run(tmp_path_factory):
    tok = make_tokenizer()
    path, _ = make_run(tmp_path_factory.mktemp("recipe") / "run", tok,
                       ModelConfig(**{**BASE, "vocab_size": tok.vocab_size}, smear=True))
    return path


def test_hf_and_gguf_export_refuse_a_smear_run_before_writing(smear_run, tmp_path):
    with pytest.raises(ValueError, match=r"model\.smear=True has no counterpart"):
        export_hf(smear_run, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"model\.smear=True has no counterpart"):
        export_gguf(smear_run, tmp_path / "m.gguf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.gguf").exists()
