"""Generation with the model's training-recipe options: the engine decodes them through the model's forward (the C++
step lacks them) and cached greedy decoding equals the naive full recompute, through ragged prompts and slides."""

from __future__ import annotations

import pytest
import torch

from conftest import torch_threads
from lmforge.generate.engine import Engine
from lmforge.generate.generator import Generator
from lmforge.model import ModelConfig, TransformerLM

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 32))]


def recipe_model(**kw) -> TransformerLM:
    """A tiny model with the options on, its parameters moved off their init (the smear starts at zero)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, smear=True, smear_keys=True,
               value_embeds=1, unet_skips=True, mlp="relu2", logit_softcap=6.0, qk_norm=True)
    cfg.update(kw)
    model = TransformerLM(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kw", [{}, {"fast": False}, {"value_embeds": 0, "unet_skips": False, "mlp": "swiglu",
                                                      "logit_softcap": None, "qk_norm": False,
                                                      "smear_keys": False}])
def test_cached_greedy_equals_naive_recompute(kw):
    model = recipe_model(**kw)
    assert not Engine(model)._kernel
    with pytest.raises(ValueError, match=r"does not implement this model's model\.smear=True"):
        Engine(model, use_kernel=True)
    gen = Generator(model)
    cached = gen.generate_ids(PROMPTS, 12, temperature=0)  # 12 + 12 > 16: rows slide
    with torch_threads(1):
        naive = gen.generate_ids(PROMPTS, 12, temperature=0, naive=True)
    assert cached == naive
    assert len(set(map(tuple, cached))) == 3
