"""LoRA (lmforge.model.lora): wrapping, frozen base, every forward path, merge, save/load, and equality with
the real PEFT (on lmforge's own model, and on the HF Llama built from the same weights)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lmforge.model import Linear, ModelConfig, TransformerLM
from lmforge.model.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, DEFAULT_TARGETS, LoraConfig, LoraLinear, apply_lora,
                                base_fingerprint, has_lora, load_adapters, load_lora_state_dict, lora_parameters,
                                lora_state_dict, merge_lora, merged_copy, save_adapters, target_matches)

CFG = dict(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


def _model(fast: bool = True, seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(**{**CFG, **kw, "fast": fast}))


def _randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero B (a fresh adapter is the identity: B = 0) so that the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _ids(B: int = 2, T: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def _lora_model(fast: bool = True, lcfg: LoraConfig | None = None, **kw) -> TransformerLM:
    m = _model(fast, **kw)
    apply_lora(m, lcfg or LoraConfig(rank=4, alpha=8.0))
    _randomize(m)
    return m


# --------------------------------------------------------------------------------------------------
# Config and matching
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(rank=0), "rank"), (dict(rank=2.0), "rank"), (dict(rank=True), "rank"),
    (dict(alpha=0), "alpha"), (dict(alpha=-1.0), "alpha"), (dict(alpha=float("inf")), "alpha"),
    (dict(dropout=1.0), "dropout"), (dict(dropout=-0.1), "dropout"),
    (dict(targets=[]), "targets"), (dict(targets="q_proj"), "targets"), (dict(targets=[""]), "targets"),
])
def test_config_rejects_bad_fields(kw, field):
    with pytest.raises(ValueError, match=rf"lora\.{field}"):
        LoraConfig(**kw)


def test_config_defaults_and_scale():
    cfg = LoraConfig()
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.targets) == (8, 16.0, 0.0, list(DEFAULT_TARGETS))
    assert LoraConfig(rank=4, alpha=2).scale == 0.5


@pytest.mark.parametrize("name, pattern, hit", [
    ("layers.3.attn.q_proj", "q_proj", True), ("layers.3.attn.q_proj", "attn.q_proj", True),
    ("layers.3.attn.q_proj", "layers.3.attn.q_proj", True), ("layers.3.attn.q_proj", "layers.*.attn.*_proj", True),
    ("layers.3.attn.q_proj", "proj", False), ("layers.3.attn.q_proj", "layers.1.attn.q_proj", False),
    ("layers.13.ffn.w1", "layers.1.ffn.w1", False), ("layers.0.ffn.w2", "ffn.w?", True), ("lm_head", "lm_head", True),
])
def test_target_matches(name, pattern, hit):
    assert target_matches(name, pattern) is hit


# --------------------------------------------------------------------------------------------------
# apply_lora
# --------------------------------------------------------------------------------------------------
def test_apply_wraps_targets_keeps_base_parameters_and_freezes_everything_else():
    m = _model()
    before = dict(m.named_parameters())
    names = apply_lora(m, LoraConfig(rank=4))
    assert names == [f"layers.{i}.{s}" for i in range(2) for s in
                     ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w2", "ffn.w3")]
    after = dict(m.named_parameters())
    for k, p in before.items():
        assert after[k] is p and not p.requires_grad  # same Parameter object, frozen
    trainable = {k for k, p in after.items() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}" for n in names for x in "AB"}
    assert [id(p) for p in lora_parameters(m)] == [id(after[f"{n}.lora_{x}"]) for n in names for x in "AB"]
    for n in names:
        lin = m.get_submodule(n)
        assert isinstance(lin, LoraLinear)
        assert lin.lora_A.shape == (4, lin.in_features) and lin.lora_B.shape == (lin.out_features, 4)
        # PEFT's init: A ~ kaiming_uniform(a=√5) = U(-1/√in, 1/√in), B = 0
        bound = 1 / lin.in_features ** 0.5
        assert lin.lora_A.abs().max() <= bound and lin.lora_A.std() > bound / 3
        assert torch.equal(lin.lora_B, torch.zeros_like(lin.lora_B))


def test_fresh_adapter_changes_nothing():
    base, m = _model(), _model()
    apply_lora(m, LoraConfig())
    with torch.no_grad():
        torch.testing.assert_close(m(_ids()), base(_ids()), rtol=0, atol=1e-6)


def test_apply_errors():
    m = _model()
    with pytest.raises(ValueError, match=r"\['qproj'\] match no Linear module; available: \['layers.0.attn.q_proj'"):
        apply_lora(m, LoraConfig(targets=["q_proj", "qproj"]))
    assert not has_lora(m) and all(p.requires_grad for p in m.parameters())  # nothing changed
    with pytest.raises(ValueError, match="needs a LoraConfig"):
        apply_lora(m, {"rank": 4})
    apply_lora(m, LoraConfig(targets=["q_proj"]))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(m, LoraConfig(targets=["v_proj"]))
    tied = _model(tie_embeddings=True)
    with pytest.raises(ValueError, match=r"'lm_head' shares its weight with \['token_embeddings.weight'\]"):
        apply_lora(tied, LoraConfig(targets=["lm_head"]))


# --------------------------------------------------------------------------------------------------
# Every forward path sees the adapters
# --------------------------------------------------------------------------------------------------
def _manual_logits(model: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    """The merged model's logits: W + scale·B·A written into a plain copy (an independent oracle)."""
    plain = _model(fast=False)
    sd = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}
    for k in list(sd):
        mod = k.removesuffix(".weight")
        if f"{mod}.lora_A" in model.state_dict():
            s = model.state_dict()
            sd[k] += model.get_submodule(mod).scale * s[f"{mod}.lora_B"] @ s[f"{mod}.lora_A"]
    plain.load_state_dict(sd)
    with torch.no_grad():
        return plain(ids)


@pytest.mark.parametrize("training", [False, True])
def test_fast_and_reference_paths_agree_with_the_merged_oracle(training):
    targets = list(DEFAULT_TARGETS) + ["lm_head"]
    m = _lora_model(fast=True, lcfg=LoraConfig(rank=4, alpha=8.0, targets=targets))
    m.train(training)
    ids = _ids()
    want = _manual_logits(m, ids)
    for fast in (True, False):
        m.set_fast(fast)
        with torch.no_grad():
            torch.testing.assert_close(m(ids), want, rtol=1e-5, atol=1e-5)
            # the loss path: the fused LM-head loss must not skip a wrapped head
            tgt = _ids(seed=4)
            ref = torch.nn.functional.cross_entropy(want.flatten(0, 1), tgt.flatten())
            torch.testing.assert_close(m(ids, targets=tgt), ref, rtol=1e-5, atol=1e-5)


def test_fast_and_reference_gradients_agree():
    grads = {}
    for fast in (True, False):
        m = _lora_model(fast=fast)
        m(_ids(), targets=_ids(seed=4)).backward()
        grads[fast] = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        assert all(p.grad is None for p in m.parameters() if not p.requires_grad)
    assert grads[True].keys() == grads[False].keys()
    for k in grads[True]:
        torch.testing.assert_close(grads[True][k], grads[False][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fast", [True, False])
def test_optimizer_step_moves_only_the_adapters(fast):
    m = _lora_model(fast=fast)
    base = {k: v.clone() for k, v in m.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}
    adapters = {k: v.clone() for k, v in lora_state_dict(m).items()}
    opt = torch.optim.AdamW(lora_parameters(m), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        m(_ids(), targets=_ids(seed=4)).backward()
        opt.step()
        opt.zero_grad()
    for k, v in m.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k  # bit-identical
    assert all(not torch.equal(v, adapters[k]) for k, v in lora_state_dict(m).items())


def test_kv_cache_decoding_sees_the_adapters():
    m = _lora_model().eval()
    ids = _ids(B=1, T=10)
    with torch.no_grad():
        full = m(ids)
        from lmforge.model import KVCache
        cache = KVCache.for_model(m, 1, 16)
        first = m(ids[:, :6], cache=cache)
        rest = torch.cat([m(ids[:, t:t + 1], cache=cache) for t in range(6, 10)], dim=1)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# merge
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fast", [True, False])
def test_merge_keeps_logits_and_restores_plain_layers(fast):
    plain_keys = set(_model().state_dict())
    m = _lora_model(fast=fast, lcfg=LoraConfig(rank=4, targets=list(DEFAULT_TARGETS) + ["lm_head"])).eval()
    weight = m.layers[0].attn.q_proj.weight
    ids = _ids()
    with torch.no_grad():
        before = m(ids)
        twin = merged_copy(m)
        assert has_lora(m) and not has_lora(twin)
        torch.testing.assert_close(twin(ids), before, rtol=1e-5, atol=1e-5)
        merge_lora(m)
        after = m(ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert set(m.state_dict()) == plain_keys
    assert type(m.layers[0].attn.q_proj) is Linear and m.layers[0].attn.q_proj.weight is weight
    assert not any(isinstance(x, LoraLinear) for x in m.modules())
    with pytest.raises(ValueError, match="no LoRA adapters to merge"):
        merge_lora(m)


def test_engine_decodes_a_merged_copy_like_the_lora_model():
    from lmforge.generate.engine import Engine
    m = _lora_model().eval()
    eng = Engine(merged_copy(m))
    rows = [[1, 2, 3, 4, 5], [7, 8, 9]]
    with torch.no_grad():
        got = eng.prefill(rows, 16)
        step = eng.step(torch.tensor([11, 12]))
        want0 = torch.stack([m(torch.tensor([r]))[0, -1] for r in rows])
        want1 = torch.stack([m(torch.tensor([r + [t]]))[0, -1] for r, t in zip(rows, (11, 12))])
    torch.testing.assert_close(got, want0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, want1, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# state dicts, fingerprint, save / load
# --------------------------------------------------------------------------------------------------
def test_lora_state_dict_round_trip_and_errors():
    src = _lora_model()
    sd = lora_state_dict(src)
    assert set(sd) == {k for k, p in src.named_parameters() if p.requires_grad}
    dst = _model()
    with pytest.raises(ValueError, match="no LoRA adapters to load into"):
        load_lora_state_dict(dst, sd)
    apply_lora(dst, LoraConfig(rank=4, alpha=8.0))
    load_lora_state_dict(dst, sd)
    with torch.no_grad():
        torch.testing.assert_close(dst(_ids()), src(_ids()), rtol=0, atol=0)
    bad = dict(sd)
    bad.pop("layers.0.attn.q_proj.lora_A")
    bad["layers.0.attn.nope.lora_A"] = torch.zeros(1)
    bad["layers.1.ffn.w2.lora_B"] = torch.zeros(32, 8)
    with pytest.raises(ValueError, match=r"missing \['layers.0.attn.q_proj.lora_A'\]; unexpected "
                                         r"\['layers.0.attn.nope.lora_A'\]; shape mismatch "
                                         r"\['layers.1.ffn.w2.lora_B: saved \(32, 8\), model \(32, 4\)'\]"):
        load_lora_state_dict(dst, bad)


def test_base_fingerprint_ignores_adapters_and_sees_weights():
    m = _model()
    fp = base_fingerprint(m)
    assert len(fp) == 64
    apply_lora(m, LoraConfig())
    _randomize(m)
    assert base_fingerprint(m) == fp
    with torch.no_grad():
        m.ln_final.weight[0] += 1e-3
    assert base_fingerprint(m) != fp


def test_base_fingerprint_is_stable_across_processes():
    code = ("import torch; from lmforge.model import ModelConfig, TransformerLM; "
            "from lmforge.model.lora import base_fingerprint; torch.manual_seed(0); "
            f"print(base_fingerprint(TransformerLM(ModelConfig(**{CFG!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == base_fingerprint(_model())


def test_save_and_load_adapters(tmp_path):
    src = _lora_model(fast=True, lcfg=LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=["attn.*_proj", "w2"]))
    cfg = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=["attn.*_proj", "w2"])
    out = save_adapters(tmp_path / "ad", src, cfg, base_fingerprint(src))
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["attn.*_proj", "w2"]}
    dst = _model(fast=False)
    assert load_adapters(out, dst) == cfg
    assert dst.layers[1].ffn.w2.dropout == 0.1
    with torch.no_grad():
        torch.testing.assert_close(dst.eval()(_ids()), src.eval()(_ids()), rtol=1e-5, atol=1e-5)
    # nothing overwritten without force
    stamp = (out / ADAPTER_WEIGHTS).read_bytes()
    _randomize(src, seed=9)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors already exists; pass force=True"):
        save_adapters(out, src, cfg, base_fingerprint(src))
    assert (out / ADAPTER_WEIGHTS).read_bytes() == stamp
    save_adapters(out, src, cfg, base_fingerprint(src), force=True)
    assert (out / ADAPTER_WEIGHTS).read_bytes() != stamp
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_load_adapters_refuses_wrong_base_and_mismatches(tmp_path):
    src = _lora_model()
    fp = base_fingerprint(src)
    save_adapters(tmp_path, src, LoraConfig(rank=4, alpha=8.0), fp)
    other = _model(seed=5)
    with pytest.raises(ValueError, match=rf"saved base fingerprint {fp}, this model's {base_fingerprint(other)}"):
        load_adapters(tmp_path, other)
    assert not has_lora(other)
    wrapped = _lora_model()
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        load_adapters(tmp_path, wrapped)
    # a config whose targets select other modules than the saved weights
    meta = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    meta["lora"]["targets"] = ["q_proj"]
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(meta))
    fresh = _model()
    with pytest.raises(ValueError, match=r"saved targets \['q_proj'\] select"):
        load_adapters(tmp_path, fresh)
    assert not has_lora(fresh) and all(p.requires_grad for p in fresh.parameters())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(ValueError, match="adapter format version 99; this lmforge reads version 1"):
        load_adapters(tmp_path, fresh)
    (tmp_path / ADAPTER_CONFIG).write_text('{"format": ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_adapters(tmp_path, fresh)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(meta))
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        load_adapters(tmp_path, fresh)
    assert not has_lora(fresh)
    (tmp_path / ADAPTER_CONFIG).write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not an lmforge LoRA adapter config"):
        load_adapters(tmp_path, fresh)
    with pytest.raises(ValueError, match="does not exist"):
        load_adapters(tmp_path / "nope", fresh)
    with pytest.raises(ValueError, match="no LoRA adapters to save"):
        save_adapters(tmp_path / "x", fresh, LoraConfig(), fp)
    with pytest.raises(ValueError, match="is a file; give a directory"):
        save_adapters(tmp_path / ADAPTER_CONFIG, src, LoraConfig(rank=4, alpha=8.0), fp)
    with pytest.raises(ValueError, match="base_fingerprint must be the 64-hex-digit string"):
        save_adapters(tmp_path / "y", src, LoraConfig(rank=4, alpha=8.0), "abc")


def test_adapter_file_is_small_for_the_demo_model(tmp_path):
    """The demo's model shape (speedrun 'small' preset), rank 8 on every projection: well under a few MB."""
    torch.manual_seed(0)
    m = TransformerLM(ModelConfig(vocab_size=4096, context_length=256, d_model=256, n_layers=4, n_heads=8))
    cfg = LoraConfig()
    apply_lora(m, cfg)
    save_adapters(tmp_path, m, cfg, base_fingerprint(m))
    size = (tmp_path / ADAPTER_WEIGHTS).stat().st_size
    n_adapter = sum(p.numel() for p in lora_parameters(m))
    assert size < 1.1 * 4 * n_adapter + 4096 and size < 2 * 2**20
    assert n_adapter < 0.05 * sum(p.numel() for p in m.parameters())


# --------------------------------------------------------------------------------------------------
# Equality with PEFT
# --------------------------------------------------------------------------------------------------
peft = pytest.importorskip("peft")


def _peft_on_lmforge(model: TransformerLM, lcfg: LoraConfig):
    """PEFT's LoRA on a copy of lmforge's own model (its custom-module API wraps lmforge's ``Linear``), holding
    ``model``'s base weights and adapter factors. PEFT's layers expose only the base ``weight`` to the fast
    path, so the copy runs the reference path."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    base = _model(fast=False)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))})
    pc = peft.LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout, target_modules=lcfg.targets)
    pc._register_custom_module({Linear: PeftLoraLinear})
    pm = peft.get_peft_model(base, pc)
    sd = lora_state_dict(model)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_" in name:
                mod, ab = name.removeprefix("base_model.model.").split(".lora_")
                p.copy_(sd[f"{mod}.lora_{ab[0]}"])
    return pm


@pytest.mark.parametrize("fast", [True, False])
def test_logits_and_gradients_equal_peft_on_lmforge_model(fast):
    lcfg = LoraConfig(rank=4, alpha=12.0, targets=list(DEFAULT_TARGETS))
    m = _lora_model(fast=fast, lcfg=lcfg)
    pm = _peft_on_lmforge(m, lcfg)
    assert {n.removeprefix("base_model.model.").replace(".default.weight", "")
            for n, p in pm.named_parameters() if p.requires_grad} == set(lora_state_dict(m))
    ids, tgt = _ids(), _ids(seed=4)
    ours, theirs = m(ids), pm(ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.nn.functional.cross_entropy(ours.flatten(0, 1), tgt.flatten()).backward()
    torch.nn.functional.cross_entropy(theirs.flatten(0, 1), tgt.flatten()).backward()
    peft_grads = {n.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
                  for n, p in pm.named_parameters() if p.requires_grad}
    for n, p in m.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, peft_grads[n], rtol=1e-4, atol=1e-6)


def test_dropout_equals_peft_in_training_mode():
    """Same seed, same dropout masks: PEFT and lmforge draw them in the same order (q, k, v, out, w1, w3, w2)."""
    lcfg = LoraConfig(rank=4, alpha=8.0, dropout=0.3)
    m = _lora_model(fast=True, lcfg=lcfg).train()
    pm = _peft_on_lmforge(m, lcfg).train()
    ids = _ids()
    for fast in (True, False):
        m.set_fast(fast)
        torch.manual_seed(123)
        ours = m(ids)
        torch.manual_seed(123)
        theirs = pm(ids)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.manual_seed(7)
    assert not torch.allclose(m(ids), ours, atol=1e-4)  # dropout is on: another seed, other masks
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(ids), pm.eval()(ids), rtol=1e-5, atol=1e-5)


def test_engine_decodes_an_unmerged_lora_model_like_its_merged_copy() -> None:
    """The decode kernels pack plain weights: an engine given an unmerged LoRA model must still apply the adapters."""
    from lmforge.generate.engine import Engine
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B starts at zero: make the adapters change the output
    merged = merged_copy(model)
    prompt = [[1, 2, 3, 4, 5]]
    out = []
    for m in (model, merged):
        eng = Engine(m)
        logits = eng.prefill(prompt, capacity=16)
        out.append(eng.step(logits.argmax(-1).view(-1)))
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():  # zero adapters: the base alone, which must decode differently
        if "lora_B" in name:
            torch.nn.init.zeros_(p)
    eng = Engine(model)
    base = eng.step(eng.prefill(prompt, capacity=16).argmax(-1).view(-1))
    assert (base - out[0]).abs().max() > 1e-3
