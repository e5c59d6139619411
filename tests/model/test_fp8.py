"""Float8 training matmuls (lmforge.model.fp8) on the CPU: PyTorch's own ``_scaled_mm`` kernel held to the
dequantize-and-multiply spec, a swapped projection's forward and gradients to that arithmetic, a converted
model's state dict, evaluation and training against the float32 model's, and the refusals."""

from __future__ import annotations

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM, fp8
from lmforge.model.fp8 import (E4M3, E5M2, Float8Linear, check_fp8_device, convert_to_float8, float8_modules,
                               scaled_mm, scaled_mm_reference, to_float8)
from lmforge.model.layers import Linear


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_to_float8_scales_the_largest_magnitude_to_the_formats_top(fmt):
    t = torch.randn(64, 48) * 7
    q, s = to_float8(t, fmt)
    assert q.dtype == fmt and float(_deq(q, s).abs().max()) == pytest.approx(float(t.abs().max()), rel=1e-6)
    rel = 2 ** -3 if fmt == E4M3 else 2 ** -2  # half a unit in the last place of 3 or 2 mantissa bits
    big = t.abs() > t.abs().max() / 64  # away from the subnormals
    assert ((_deq(q, s) - t).abs()[big] <= rel * t.abs()[big] / 2 + 1e-6).all()


@pytest.mark.parametrize("a_fmt,out", [(E4M3, torch.float32), (E5M2, torch.float32), (E4M3, torch.bfloat16)])
def test_scaled_mm_equals_its_reference(a_fmt, out):
    a, sa = to_float8(torch.randn(32, 64), a_fmt)
    b, sb = to_float8(torch.randn(48, 64), E4M3)
    got = scaled_mm(a, sa, b.t(), sb, out)
    want = scaled_mm_reference(a, sa, b.t(), sb, out)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if out == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("rows", [32, 21])  # 21: padded to 32 inside, the pad never shows
def test_float8_linear_computes_the_float8_arithmetic_both_ways(rows):
    torch.manual_seed(0)
    lin = Linear(64, 48)
    f8 = Float8Linear.from_linear(lin)
    assert f8.weight is lin.weight
    x = torch.randn(rows, 64, requires_grad=True)
    y = f8(x)
    g = torch.randn_like(y)
    y.backward(g)
    x8, sx = to_float8(x.detach(), E4M3)
    w8, sw = to_float8(lin.weight.detach(), E4M3)
    g8, sg = to_float8(g, E5M2)
    torch.testing.assert_close(y.detach(), _deq(x8, sx) @ _deq(w8, sw).T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, _deq(g8, sg) @ _deq(w8, sw), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, _deq(g8, sg).T @ _deq(x8, sx), rtol=1e-5, atol=1e-5)
    # close to the float32 product (the point of the scales), and plain outside autograd
    assert float((y.detach() - x.detach() @ lin.weight.detach().T).norm() / y.detach().norm()) < 0.05
    with torch.no_grad():
        torch.testing.assert_close(f8(x), x @ lin.weight.T)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 96, "context_length": 32, "d_model": 64, "n_layers": 2, "n_heads": 4,
                          "d_ff": 128, **kw})


@pytest.mark.parametrize("fast", [True, False])
def test_a_converted_model_keeps_its_state_and_evaluates_alike(fast):
    torch.manual_seed(0)
    model = TransformerLM(_cfg(fast=fast))
    ref = TransformerLM(_cfg(fast=fast))
    ref.load_state_dict(model.state_dict())
    names = convert_to_float8(model)
    assert len(names) == 2 * 7 and set(names) == set(float8_modules(model))  # q k v out w1 w3 w2 per block
    assert model.state_dict().keys() == ref.state_dict().keys()
    idx = torch.randint(0, 96, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref(idx))  # evaluation and decoding: the plain products
    calls = []
    real = fp8._Float8Matmul.apply
    fp8._Float8Matmul.apply = lambda *a: calls.append(a[1].shape) or real(*a)
    try:
        loss, loss_ref = model(idx, targets=idx), ref(idx, targets=idx)
    finally:
        fp8._Float8Matmul.apply = real
    assert len(calls) == 2 * 7  # every projection of both paths multiplies in float8 while training
    loss.backward()
    loss_ref.backward()
    assert abs(float(loss) - float(loss_ref)) < 0.02 * float(loss_ref)
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), p_ref.grad.flatten(), dim=0)
        assert cos > 0.98, (n, float(cos))


def test_float8_training_follows_float32_training():
    """30 AdamW steps from the same weights on the same batches: the float8 run's losses stay within 2% of the
    float32 run's, and both learn."""
    def run(fp8: bool) -> list[float]:
        torch.manual_seed(0)
        model = TransformerLM(_cfg())
        if fp8:
            convert_to_float8(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 96, (30, 4, 33), generator=g) % 24  # a small alphabet: learnable
        losses = []
        for batch in data:
            loss = model(batch[:, :-1], targets=batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses

    base, f8 = run(False), run(True)
    assert base[-1] < 0.8 * base[0] and f8[-1] < 0.8 * f8[0]
    assert max(abs(a - b) / a for a, b in zip(base, f8)) < 0.02, list(zip(base, f8))


def test_sides_that_float8_cannot_multiply_stay_plain_and_none_is_refused():
    model = TransformerLM(_cfg(d_ff=120))  # w1/w3/w2 have a side of 120: not a multiple of 16
    names = convert_to_float8(model)
    assert len(names) == 2 * 4 and not any("ffn" in n for n in names)
    with pytest.raises(ValueError, match="no projection has both sides a multiple of 16"):
        convert_to_float8(TransformerLM(_cfg(d_model=40, n_heads=4, d_ff=72)))
    with pytest.raises(ValueError, match="model.layers"):
        convert_to_float8(torch.nn.Linear(4, 4))


def test_gpus_without_float8_are_refused_in_one_line(monkeypatch):
    check_fp8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .* A100-SXM4-80GB is 8.0"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="not on mps"):
        check_fp8_device(torch.device("mps"))
