"""Optimizer tests: AdamW/SGD against torch.optim, the LR schedule at its edges, clipping, parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.train.optim import SGD, AdamW, clip_grad_norm, cosine_lr, param_groups_for


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
