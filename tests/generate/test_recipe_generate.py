"""Generation with the model's training-recipe options: the engine decodes them through the model's forward (the C++
step lacks them) and cached greedy decoding equals the naive full recompute, through ragged prompts and slides; every
path of the engine gives the logits of the model's forward (not only its argmax), for every recipe option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import torch_threads
from lmforge.generate.engine import Engine
from lmforge.generate.generator import Generator
from lmforge.generate.packed import KERNEL_IMPLEMENTS, kernel_available, kernel_unsupported
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.transformer import RECIPE_OPTIONS

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


CAP = 2.0
OPTION_CASES = {"smear": {"smear": True}, "smear_keys": {"smear_keys": True}, "value_embeds": {"value_embeds": 1},
                "unet_skips": {"unet_skips": True}, "mlp": {"mlp": "relu2"}, "logit_softcap": {"logit_softcap": CAP},
                "qk_norm": {"qk_norm": True}, "zero_init": {"zero_init": True}, "head_init_std": {"head_init_std": 0.0},
                "embed_norm": {"embed_norm": True}, "qk_norm_scale": {"qk_norm": True, "qk_norm_scale": 0.5},
                "key_offset": {"key_offset": True}}
OPTION_CASES["all"] = {k: v for kw in OPTION_CASES.values() for k, v in kw.items()}
OFF = dict(smear=False, smear_keys=False, value_embeds=0, unet_skips=False, mlp="swiglu", logit_softcap=None,
           qk_norm=False)  # what recipe_model turns on, turned off


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 summation order (a cached step and the full forward add in different orders, and on one
    thread differently again: up to 5e-5 seen); a dropped soft-cap or option is off by whole units."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["engine", "static-steps"])
@pytest.mark.parametrize("kw", OPTION_CASES.values(), ids=OPTION_CASES)
def test_every_engine_path_gives_the_forwards_logits(kw, static):
    """Random weights, each recipe option (and all of them): prefill of ragged rows, several steps, admit into a
    slot, verifying drafts -- each one's logits equal ``model(sequence)``'s at the same position (the soft-capped
    ones too: an engine that skipped the cap passed the greedy tests, whose argmax tanh keeps)."""
    assert set(OPTION_CASES) == {*RECIPE_OPTIONS, "all"}
    model = recipe_model(**OFF | kw, context_length=24)
    engine = Engine(model, use_kernel=False, static_steps=True) if static else Engine(model)

    def forward(seq: list[int]) -> torch.Tensor:  # (T, V): the logits after each token of seq
        return model(torch.tensor([seq]))[0]

    rows = [[1, 2, 3, 4, 5], [7, 8, 9]]
    with torch.inference_mode():
        if "logit_softcap" in kw:  # the cap bites: the head alone gives logits far past it
            raw = model.lm_head(model.hidden(torch.tensor([rows[0]])))
            assert float(forward(rows[0]).abs().max()) < CAP < float(raw.abs().max()) / 2
        logits = engine.prefill(rows, 24)
        for step in range(4):
            for b, seq in enumerate(rows):
                _close(logits[b], forward(seq)[-1])
            nxt = [(11 * step + 5 * b) % 64 for b in range(len(rows))]  # fixed tokens, whatever the logits say
            rows = [seq + [t] for seq, t in zip(rows, nxt)]
            logits = engine.step(torch.tensor(nxt))
        for b, seq in enumerate(rows):
            _close(logits[b], forward(seq)[-1])
        engine.open_slots(2)
        engine.admit([3, 1, 4])
        row, first = engine.admit(rows[1])
        _close(first, forward(rows[1])[-1])
        drafts = [10, 20, 30]
        _close(engine.verify(row, drafts), forward(rows[1] + drafts)[-3:])


# the options that change the forward at a value the C++ decode step does not compute
KERNEL_LACKS = [("smear", True), ("smear_keys", True), ("key_offset", True), ("value_embeds", 1), ("unet_skips", True),
                ("mlp", "relu2"), ("logit_softcap", 2.0), ("qk_norm", True)]
BASE = dict(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4)


@pytest.mark.parametrize("name, value", KERNEL_LACKS)
def test_the_decode_kernel_refuses_each_option_it_lacks_by_name(name, value):
    assert kernel_unsupported(ModelConfig(**BASE, **{name: value})) == [f"model.{name}={value!r}"]


def test_the_decode_kernels_allow_list():
    """What the step implements runs on it at any value (with the init-only and numerics-only fields), and gives the
    forward's logits; a field nobody classified is refused as soon as it leaves its default, so a new option cannot
    decode wrongly."""
    assert kernel_unsupported(ModelConfig(**BASE)) == []
    assert set(KERNEL_IMPLEMENTS) <= {f.name for f in dataclasses.fields(ModelConfig)}
    llama = ModelConfig(vocab_size=50, context_length=12, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=80,
                        rope_theta=500.0, tie_embeddings=True, norm_eps=1e-3, fast=False, zero_init=True)
    assert kernel_unsupported(llama) == []
    if kernel_available():
        torch.manual_seed(0)
        model = TransformerLM(llama).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        engine = Engine(model)
        assert engine._kernel
        seq = [3, 1, 4, 1, 5, 9, 2, 6]
        with torch.inference_mode():
            _close(engine.prefill([seq[:5]], 12)[0], model(torch.tensor([seq[:5]]))[0, -1])
            _close(engine.verify(0, seq[5:]), model(torch.tensor([seq]))[0, 5:])
    assert kernel_unsupported(ModelConfig(**BASE, head_init_std=0.0)) == []
    assert kernel_unsupported(ModelConfig(**BASE, **dict(KERNEL_LACKS))) == [f"model.{n}={v!r}" for n, v in KERNEL_LACKS]

    @dataclasses.dataclass
    class WithNewOption(ModelConfig):
        attention_window: int | None = None

    assert kernel_unsupported(WithNewOption(**BASE)) == []  # at its default: the model the step computes
    assert kernel_unsupported(WithNewOption(**BASE, attention_window=8)) == ["model.attention_window=8"]


def test_key_offset_decodes_through_the_scheduler_with_prefix_cache_and_drafts_as_without():
    """The partial key offset reads the previous column's key at every step: replies through the scheduler are the
    same with the prefix cache (rows restored from stored blocks) and with speculative drafts (verified, the rejected
    ones rolled back) as without either; the engine runs it through the model's forward."""
    from lmforge.generate.prefix_cache import PrefixCache
    from tests.generate.test_prefix_cache import SYSTEM, replies
    from tests.generate.test_speculative import PROMPTS, decode, joined

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=260, context_length=128, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                                      key_offset=True)).eval()
    assert not Engine(model)._kernel
    gen = Generator(model)
    assert gen.generate_ids(PROMPTS[:3], 12, temperature=0) == gen.generate_ids(PROMPTS[:3], 12, temperature=0,
                                                                                naive=True)
    off, _ = decode(model, PROMPTS, False, temperature=0)
    on, load = decode(model, PROMPTS, True, temperature=0)
    assert joined(on) == joined(off) and load["spec_passes"] > 0
    assert load["spec_drafted"] > load["spec_accepted"] > 0  # drafts accepted and rejected (rolled back)
    prompts = [SYSTEM + list(b"Q: hi"), SYSTEM + list(b"Q: bye"), SYSTEM + list(b"Q: hi")]
    plain, _ = replies(model, prompts, None, False)
    cached, load = replies(model, prompts, PrefixCache(1 << 20, block=8), False)
    assert cached == plain and load["prefix_hit_tokens"] > 0
