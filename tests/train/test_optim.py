"""Optimizer tests: AdamW/SGD against torch.optim, the LR schedule at its edges, clipping, parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.train.optim import (SGD, AdamW, Muon, clip_grad_norm, cosine_lr, wsd_lr, describe_groups, muon_lr_ratio,
                                 muon_param_groups, newton_schulz, newton_schulz_batched, param_groups_for,
                                 adamw_param_groups, param_roles, muon_momentum_at, dmodel_lr_scale)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g)),
            torch.nn.Parameter(torch.randn(3, 4, 2, generator=g))]


def _run(opt_cls, kwargs, groups_fn, steps=8, skip_grad_at=None):
    torch.manual_seed(123)
    ps = _params()
    opt = opt_cls(groups_fn(ps), **kwargs)
    for t in range(steps):
        for i, p in enumerate(ps):
            p.grad = None if (skip_grad_at == (t, i)) else torch.randn_like(p)
        opt.step()
    return ps, opt


def _groups(ps):
    return [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0, "lr": 3e-3}]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("skip", [None, (2, 1)])
def test_adamw_matches_torch(skip, impl):
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    ours, _ = _run(AdamW, dict(kw, impl=impl), _groups, skip_grad_at=skip)
    theirs, _ = _run(torch.optim.AdamW, kw, _groups, skip_grad_at=skip)
    start = _params()
    for a, b, s in zip(ours, theirs, start):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_adamw_weight_decay_is_decoupled():
    p = torch.nn.Parameter(torch.full((3,), 2.0))
    opt = AdamW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(3)
    opt.step()  # zero gradient: only the decay moves p
    torch.testing.assert_close(p.detach(), torch.full((3,), 2.0 * (1 - 0.1 * 0.5)))


def test_sgd_matches_torch():
    for kw in (dict(lr=0.1), dict(lr=0.05, momentum=0.9, weight_decay=0.01)):
        ours, _ = _run(SGD, kw, lambda ps: ps)
        theirs, _ = _run(torch.optim.SGD, kw, lambda ps: ps)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)


def test_optimizer_validation():
    with pytest.raises(ValueError, match="lr"):
        AdamW(_params(), lr=-1)
    with pytest.raises(ValueError, match="betas"):
        AdamW(_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="impl"):
        AdamW(_params(), impl="magic")
    with pytest.raises(ValueError, match="momentum"):
        SGD(_params(), momentum=1.5)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_state_dict_round_trip_is_exact(impl):
    kw = dict(lr=1e-2, weight_decay=0.1, impl=impl)
    ps, opt = _run(AdamW, kw, _groups, steps=3)
    sd = opt.state_dict()
    for st in sd["state"].values():  # only tensors and plain numbers: storable as safetensors + JSON
        assert all(isinstance(v, (torch.Tensor, int, float)) for v in st.values())
    # what a checkpoint does: copy the tensors out (state_dict() returns the live ones)
    sd = {"state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
                    for k, st in sd["state"].items()}, "param_groups": sd["param_groups"]}
    clone = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = AdamW(_groups(clone), **kw)
    opt2.load_state_dict(sd)
    torch.manual_seed(7)
    grads = [torch.randn_like(p) for p in ps]
    for a, b, g in zip(ps, clone, grads):
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    for a, b in zip(ps, clone):
        assert torch.equal(a, b)
    assert opt2.state[clone[0]]["step"] == 4


def test_cosine_lr_edges():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert cosine_lr(0, **kw) == 0.0
    assert cosine_lr(5, **kw) == pytest.approx(0.5)
    assert cosine_lr(10, **kw) == pytest.approx(1.0)
    assert cosine_lr(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)
    assert cosine_lr(110, **kw) == pytest.approx(0.1)
    assert cosine_lr(111, **kw) == 0.1 and cosine_lr(10**6, **kw) == 0.1
    lrs = [cosine_lr(t, **kw) for t in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert cosine_lr(3, 1.0, 0.0, 0, 0) == 0.0  # no warm-up, no cycle: straight to min
    with pytest.raises(ValueError):
        cosine_lr(0, 1.0, 0.1, 10, 5)


def test_wsd_lr_edges():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, total_iters=110, cooldown_iters=40)
    assert wsd_lr(0, **kw) == 0.0 and wsd_lr(5, **kw) == pytest.approx(0.5)
    assert [wsd_lr(t, **kw) for t in (10, 40, 70)] == [1.0, 1.0, 1.0]  # stable until the cooldown starts at 70
    assert wsd_lr(90, **kw) == pytest.approx(1.0 - 0.5 * 0.9)  # halfway down, linearly
    assert wsd_lr(110, **kw) == pytest.approx(0.1) and wsd_lr(10**6, **kw) == 0.1
    lrs = [wsd_lr(t, **kw) for t in range(70, 111)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert wsd_lr(10, 1.0, 0.0, 10, 20, 50) == 1.0 and wsd_lr(15, 1.0, 0.0, 10, 20, 50) == 0.5  # cut to 10 steps
    with pytest.raises(ValueError):
        wsd_lr(0, 1.0, 0.1, 10, 5, 2)


def test_wsd_without_warmup_to_zero_is_nanochats_warmdown_one_step_earlier():
    """nanochat's base_train: step ``it`` of ``T`` at ``min(1, (T - it) / W)``, ``W = round(0.2 T)``; the loop's wsd with
    no warmup, cooldown_frac 0.2 and min_lr 0 runs step ``s`` at nanochat's ``s + 1``: the last step at 0."""
    from lmforge.train.config import OptimConfig
    from lmforge.train.loop import _lr_at

    oc = OptimConfig(lr=2.0, min_lr=0.0, warmup_steps=0, schedule="wsd", cooldown_frac=0.2)
    assert [_lr_at(s, oc, 10) for s in range(10)] == [2.0] * 8 + [1.0, 0.0]
    T, W = 53, round(0.2 * 53)
    nanochat = [min(1.0, (T - it) / W) for it in range(T + 1)]
    assert [_lr_at(s, oc, T) / 2.0 for s in range(T)] == pytest.approx(nanochat[1:])


def test_muon_momentum_warmup_and_dmodel_lr_scale():
    assert [muon_momentum_at(s, 0.95, 0.85, 300) for s in (0, 150, 300, 400)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert muon_momentum_at(0, 0.95, 0.85, 0) == 0.95  # no warm-up: the momentum throughout
    with pytest.raises(ValueError, match="warmup_steps"):
        muon_momentum_at(0, 0.95, 0.85, -1)
    assert dmodel_lr_scale(768) == 1.0 and dmodel_lr_scale(256) == pytest.approx(3 ** 0.5)
    model = _Extras()
    for kw in ({}, {"embed_lr": 0.2, "head_lr": 0.004}):  # shared or separate embedding and head groups
        plain = muon_param_groups(model, 1e-3, 0.02, 0.0, scalar_lr=0.02, **kw)
        scaled = muon_param_groups(model, 1e-3, 0.02, 0.0, scalar_lr=0.02, embed_head_scale=3.0, **kw)
        want = [g["lr"] * (3.0 if "embeddings" in g["name"] or "head" in g["name"] else 1.0) for g in plain]
        assert [g["lr"] for g in scaled] == pytest.approx(want) and [g["lr_scale"] for g in scaled] == pytest.approx(
            [w / 1e-3 for w in want])
    adamw = adamw_param_groups(model, 1e-3, 0.1, head_lr=0.004, embed_head_scale=3.0)
    assert [g["lr"] for g in adamw] == pytest.approx([1e-3, 3e-3, 0.012, 1e-3])


def test_muon_ns_dtype_auto_is_fp32_without_native_bf16(monkeypatch):
    """``auto``: bf16 Newton–Schulz only where bf16 is native (an AVX2-only CPU multiplies it ~100x slower)."""
    import lmforge.train.optim as optim

    for native, want in ((False, "fp32"), (True, "bf16")):
        monkeypatch.setattr(optim, "native_bf16", lambda device, native=native: native)
        opt = Muon([{"params": _params()[:1], "use_muon": True}], ns_dtype="auto")
        assert {g["ns_dtype"] for g in opt.param_groups} == {want}


def test_clip_grad_norm():
    ps = _params()
    for p in ps:
        p.grad = torch.randn_like(p)
    expected = math.sqrt(sum(float((p.grad**2).sum()) for p in ps))
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm(ps, max_norm=1.0)
    assert float(norm) == pytest.approx(expected, rel=1e-5)
    after = math.sqrt(sum(float((p.grad**2).sum()) for p in ps))
    assert after == pytest.approx(1.0, rel=1e-4)
    for b, p in zip(before, ps):  # direction kept
        torch.testing.assert_close(p.grad, b * (1.0 / (expected + 1e-6)))
    same = [p.grad.clone() for p in ps]
    assert float(clip_grad_norm(ps, max_norm=10.0)) == pytest.approx(1.0, rel=1e-4)  # below max: no-op
    for s, p in zip(same, ps):
        assert torch.equal(s, p.grad)
    ps[0].grad = None  # parameters without gradients are skipped
    clip_grad_norm(ps, 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(ps, 0.0)


@pytest.mark.parametrize("max_norm, poison", [(1.0, None), (1e9, None), (1.0, float("nan")), (1.0, float("inf"))])
def test_clip_grad_norm_on_the_device_equals_the_host_decision(monkeypatch, max_norm, poison):
    """The GPU form (the factor kept on the device, no host sync) scales float32 gradients bit for bit as the CPU
    form (the norm read on the host): clipped, not clipped, and a non-finite norm (gradients left untouched)."""
    from lmforge.train import optim

    torch.manual_seed(4)
    grads = [torch.randn(5, 3) * 3, torch.randn(7), torch.randn(2, 2).to(torch.bfloat16)]
    if poison is not None:
        grads[1][2] = poison
    out = {}
    for form in ("host", "device"):
        monkeypatch.setattr(optim, "_host_reads_free", lambda t: form == "host")
        ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        norm = clip_grad_norm(ps, max_norm)
        out[form] = (norm, [p.grad for p in ps])
    (n_host, g_host), (n_dev, g_dev) = out["host"], out["device"]
    assert torch.equal(n_host, n_dev) or (n_host.isnan() and n_dev.isnan())
    for a, b, g in zip(g_host, g_dev, grads):
        if g.dtype == torch.bfloat16:  # the factor is rounded to the gradient's dtype on the device: one bf16 ulp
            torch.testing.assert_close(a, b, rtol=2**-7, atol=0, equal_nan=True)
        else:
            assert torch.equal(a, b) or (poison is not None and torch.equal(a.isnan(), b.isnan()))
    clipped = poison is None and max_norm == 1.0
    assert clipped == (not torch.equal(g_dev[0], grads[0]))  # clipped exactly when the norm is finite and over
    if not clipped:
        assert all(torch.equal(a, g) or torch.equal(a.isnan(), g.isnan()) for a, g in zip(g_dev, grads))


def test_param_groups_rule():
    model = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=2, n_heads=2,
                                      tie_embeddings=True))
    decay, no_decay = param_groups_for(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})
    assert len(no_decay["params"]) == 2 * 2 + 1  # ln1, ln2 per layer + ln_final
    AdamW(param_groups_for(model, 0.1), lr=1e-3)  # accepted by the optimizer


# --------------------------------------------------------------------------------------------------
# Muon
# --------------------------------------------------------------------------------------------------
def _muon_run(make_opt, shapes=((8, 5), (5, 8), (8, 5), (6, 6)), steps=5, seed=0):
    """Parameters of ``shapes`` after ``steps`` updates by ``make_opt(params)`` on seeded random gradients."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = make_opt(ps)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_reference_equals_torch_optim_muon(adjust, nesterov):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    for seed in range(3):
        ours, _ = _muon_run(lambda ps: Muon([{"params": ps, "use_muon": True}], adjust_lr=adjust, impl="reference",
                                            **kw), seed=seed)
        theirs, _ = _muon_run(lambda ps: torch.optim.Muon(ps, adjust_lr_fn=adjust, **kw), seed=seed)
        start, _ = _muon_run(lambda ps: torch.optim.SGD(ps, lr=0.0), seed=seed)
        for a, b, s in zip(ours, theirs, start):
            assert not torch.equal(a, s)
            assert torch.equal(a, b)  # same ops in the same order: bit for bit


@pytest.mark.parametrize("ns_dtype, tol", [("fp32", 1e-6), ("bf16", 2e-3)])
def test_muon_batched_equals_reference(ns_dtype, tol):
    shapes = ((8, 5), (5, 8), (8, 5), (6, 6), (8, 5), (3, 7))
    make = lambda impl: (lambda ps: Muon([{"params": ps[:5], "use_muon": True},
                                          {"params": ps[5:], "use_muon": True, "lr": 0.05, "weight_decay": 0.0}],
                                         lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, impl=impl))
    fast, opt_fast = _muon_run(make("batched"), shapes=shapes, steps=6)
    ref, opt_ref = _muon_run(make("reference"), shapes=shapes, steps=6)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
        torch.testing.assert_close(opt_fast.state[a]["momentum_buffer"], opt_ref.state[b]["momentum_buffer"],
                                   atol=tol, rtol=0)


def test_newton_schulz_orthogonalises_and_batches():
    g = torch.Generator().manual_seed(0)
    for shape in ((32, 16), (16, 32), (24, 24)):
        k = min(shape)  # singular values spread over 1..30 (condition number 30)
        u = torch.linalg.qr(torch.randn(3, shape[0], k, generator=g)).Q
        v = torch.linalg.qr(torch.randn(3, shape[1], k, generator=g)).Q
        x = u @ torch.diag_embed(torch.logspace(0, math.log10(30), k).expand(3, k)) @ v.mT
        o = newton_schulz_batched(x, dtype="fp32")
        assert o.shape == x.shape and o.dtype == torch.float32
        s = torch.linalg.svdvals(o)  # the quintic brings them near 1 (not exactly: ~[0.7, 1.2])
        assert s.min() > 0.5 and s.max() < 1.5
        assert (o - u @ v.mT).norm() / (u @ v.mT).norm() < 0.3  # close to the orthogonal factor U·Vᵀ
        for i in range(3):
            torch.testing.assert_close(newton_schulz(x[i], dtype="fp32"), o[i], atol=1e-6, rtol=0)
    assert newton_schulz(torch.randn(4, 6), dtype="bf16").dtype == torch.bfloat16
    assert newton_schulz(torch.zeros(4, 6), dtype="fp32").abs().sum() == 0  # eps guards the normalisation


def test_muon_lr_ratio():
    assert muon_lr_ratio((64, 16), "original") == 2.0 and muon_lr_ratio((16, 64), "original") == 1.0
    assert muon_lr_ratio((16, 64), "match_rms_adamw") == pytest.approx(0.2 * 8)
    with pytest.raises(ValueError, match="adjust_lr must be 'original' or 'match_rms_adamw'"):
        muon_lr_ratio((2, 2), "spectral")


def test_muon_adamw_groups_equal_adamw():
    shapes = ((8, 5), (7,), (4, 3))
    groups = lambda ps: [{"params": ps[:1], "use_muon": True}, {"params": ps[1:], "use_muon": False, "lr": 3e-3,
                                                                "weight_decay": 0.05}]
    ours, _ = _muon_run(lambda ps: Muon(groups(ps), lr=0.02, betas=(0.9, 0.95), eps=1e-8), shapes=shapes)
    theirs, _ = _muon_run(lambda ps: torch.optim.AdamW(ps[1:], lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                                       weight_decay=0.05), shapes=shapes)
    for a, b in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_muon_validation():
    with pytest.raises(ValueError, match=r"2-D matrices only.*\[\(7,\)\].*use_muon=False"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(7))], "use_muon": True}])
    with pytest.raises(ValueError, match="momentum"):
        Muon(_params(), momentum=1.0)
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(_params(), ns_dtype="fp8")
    with pytest.raises(ValueError, match="impl"):
        Muon(_params(), impl="fused")


def test_muon_param_groups_rule():
    for tie in (False, True):
        model = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=2, n_heads=2,
                                          tie_embeddings=tie))
        muon, embed_head, other = groups = muon_param_groups(model, 1e-3, 0.02, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        assert sorted(names[id(p)].split(".", 2)[2] for p in muon["params"]) == sorted(
            ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.output_proj.weight",
             "ffn.w1.weight", "ffn.w2.weight", "ffn.w3.weight"] * 2)
        assert {names[id(p)] for p in embed_head["params"]} == (
            {"token_embeddings.weight"} if tie else {"token_embeddings.weight", "lm_head.weight"})
        assert all(p.dim() == 1 for p in other["params"]) and len(other["params"]) == 5
        assert (muon["lr"], muon["lr_scale"], embed_head["lr"], embed_head["lr_scale"]) == (0.02, 20.0, 1e-3, 1.0)
        assert (muon["weight_decay"], embed_head["weight_decay"], other["weight_decay"]) == (0.0, 0.1, 0.0)
        ids = [id(p) for g in groups for p in g["params"]]
        assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})
        Muon(groups)  # accepted
    assert describe_groups(groups).startswith("muon: 14 tensors (0.00819M params, lr x20); adamw_embeddings_head: 1 ")


def test_muon_state_dict_round_trip_is_exact():
    model = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=1, n_heads=2))
    twin = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=1, n_heads=2))
    opt = Muon(muon_param_groups(model, 1e-3, 0.02, 0.1))
    x = torch.randint(0, 50, (2, 8))
    for _ in range(2):
        model(x, targets=x).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    for st in sd["state"].values():  # only tensors and plain numbers: storable as safetensors + JSON
        assert all(isinstance(v, (torch.Tensor, int, float)) for v in st.values())
    for g in sd["param_groups"]:
        assert all(isinstance(v, (bool, int, float, str, tuple, list)) for v in g.values())
    sd = {"state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
                    for k, st in sd["state"].items()}, "param_groups": sd["param_groups"]}
    twin.load_state_dict(model.state_dict())
    opt2 = Muon(muon_param_groups(twin, 1e-3, 0.02, 0.1))
    opt2.load_state_dict(sd)
    for m, o in ((model, opt), (twin, opt2)):
        m(x, targets=x).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


class _Extras(torch.nn.Module):
    """A model with the tensors the recipe's model options add, for the role rule: a value embedding inside a
    block, a gate matrix and a skip weight outside the blocks, a per-block scalar."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.inner = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=2, n_heads=2,
                                               tie_embeddings=tie))
        self.cfg, self.layers = self.inner.cfg, self.inner.layers
        self.value_embeds = torch.nn.ModuleList(torch.nn.Embedding(50, 16) for _ in range(2))
        self.smear_gate = torch.nn.Parameter(torch.zeros(1, 12))
        self.skip_weights = torch.nn.Parameter(torch.ones(1))
        self.layers[0].lam = torch.nn.Parameter(torch.ones(()))


def test_param_roles_put_every_option_tensor_in_a_sensible_group():
    for tie in (False, True):
        model = _Extras(tie)
        roles = param_roles(model)
        names = {id(p): n for n, p in model.named_parameters()}
        named = {r: {names[id(p)] for p in ps} for r, ps in roles.items()}
        assert named["embeddings"] == {"inner.token_embeddings.weight", "value_embeds.0.weight", "value_embeds.1.weight"}
        assert named["head"] == (set() if tie else {"inner.lm_head.weight"})
        assert {"smear_gate", "skip_weights", "inner.layers.0.lam"} <= named["scalars"]
        assert all(p.dim() == 2 for p in roles["hidden"]) and len(roles["hidden"]) == 14
        ids = [id(p) for ps in roles.values() for p in ps]
        assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})


def test_per_group_learning_rates_muon_and_adamw():
    model = _Extras()
    muon, emb, head, scal = groups = muon_param_groups(model, 1e-3, 0.02, 0.1, embed_lr=0.05, head_lr=0.004,
                                                       scalar_lr=0.01)
    assert [g["name"] for g in groups] == ["muon", "adamw_embeddings", "adamw_head", "adamw_norms_biases"]
    assert [g["lr_scale"] for g in groups] == pytest.approx([20.0, 50.0, 4.0, 10.0])
    assert [g["weight_decay"] for g in groups] == [0.0, 0.1, 0.1, 0.0] and len(emb["params"]) == 3
    Muon(groups)  # accepted: only 2-D matrices in the Muon group
    # without embed_lr/head_lr: the three groups of before (old checkpoints still load), scalars at scalar_lr
    three = muon_param_groups(model, 1e-3, 0.02, 0.1, scalar_lr=0.01)
    assert [g["name"] for g in three] == ["muon", "adamw_embeddings_head", "adamw_norms_biases"]
    assert [g["lr"] for g in three] == [0.02, 1e-3, 0.01]
    adamw = adamw_param_groups(model, 1e-3, 0.1, head_lr=0.004)
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in adamw] == [
        ("hidden", 1e-3, 0.1), ("embeddings", 1e-3, 0.1), ("head", 0.004, 0.1), ("scalars", 1e-3, 0.0)]
    # each group steps at its own rate: one AdamW step moves a parameter by ~lr (sign of the gradient)
    x = torch.randint(0, 50, (2, 8))
    before = {id(p): p.detach().clone() for p in model.parameters()}
    opt = AdamW(adamw, lr=1e-3, weight_decay=0.0)
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    model.inner(x, targets=x).backward()
    opt.step()
    moved = {g["name"]: max((p - before[id(p)]).abs().max().item() for p in g["params"] if p.grad is not None)
             for g in opt.param_groups}
    assert moved["head"] == pytest.approx(0.004, rel=1e-3) and moved["hidden"] == pytest.approx(1e-3, rel=1e-3)
