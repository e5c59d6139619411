"""``torch.compile`` on the fast path gives the eager numbers (forward and gradients).

The compiled graph takes branches eager never does (``_rope_fast``'s real-arithmetic form, the fused loss's
sync-free chunks), so this is their only check; ``fullgraph=True`` makes any graph break (a host sync, a
data-dependent branch) fail the test. The default test traces with dynamo + AOT autograd (``aot_eager``: our code as the
compiler sees it, in seconds); the inductor test generates and runs C++ kernels too, which takes a
minute or more on 2 cores, so it runs only with ``LMFORGE_TEST_INDUCTOR=1``.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM

RECIPE = dict(smear=True, smear_keys=True, value_embeds=1, unet_skips=True, mlp="relu2", logit_softcap=5.0,
              qk_norm=True, zero_init=True)


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=[
        pytest.mark.slow,
        pytest.mark.skipif(not os.environ.get("LMFORGE_TEST_INDUCTOR"), reason="set LMFORGE_TEST_INDUCTOR=1"),
        pytest.mark.skipif(shutil.which("c++") is None, reason="inductor needs a C++ compiler on CPU")]),
])
@pytest.mark.parametrize("recipe", [{}, RECIPE], ids=["llama", "recipe"])
def test_compiled_model_matches_eager_forward_and_backward(backend, recipe):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                      **recipe)
    model = TransformerLM(cfg)
    with torch.no_grad():  # off the init: the smear and the zero-initialised projections take part
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    y = torch.randint(0, cfg.vocab_size, (2, 32))

    loss_eager = model(x, targets=y)
    loss_eager.backward()
    grads_eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    logits_eager = model(x).detach()
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # one graph: a break anywhere is an error
    loss_c = compiled(x, targets=y)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_eager, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_eager[n], rtol=1e-4, atol=1e-5, msg=n)
    torch.testing.assert_close(compiled(x).detach(), logits_eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_grad_is_the_sync_free_chunk_and_compiles_to_it(dtype, weighted):
    """The loss's elementwise part written out of place (what ``training.compile`` compiles, used off the CPU)
    gives the in-place eager chunk's loss and gradients bit for bit, and compiled the same."""
    from lmforge.model.losses import _chunk_sync_free, compiled_softmax_grad, softmax_grad

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(37, 16, generator=g).to(dtype), torch.randn(50, 16, generator=g).to(dtype)
    t = torch.randint(0, 50, (37,), generator=g)
    valid = torch.rand(37, generator=g) * (torch.rand(37, generator=g) > 0.3) if weighted else None
    want = _chunk_sync_free(h, w, t, valid, 16, 1 / 37, True)
    got = _chunk_sync_free(h, w, t, valid, 16, 1 / 37, True, softmax_grad)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    compiled = _chunk_sync_free(h, w, t, valid, 16, 1 / 37, True, compiled_softmax_grad(backend="aot_eager"))
    for a, b in zip(compiled, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compile_blocks_compiles_the_loss_chunk_and_training_is_unchanged(monkeypatch):
    """``training.compile`` (compile_blocks) compiles each block and hands the model the loss chunk's compile
    options; on a GPU the loss then runs eagerly in its sync-free form with the compiled chunk (simulated here: the
    CPU's host-sync form switched off), with eager's loss and gradients."""
    from lmforge.model import losses
    from lmforge.train import distributed

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=128)
    model = TransformerLM(cfg)
    x, y = torch.randint(0, 96, (2, 32)), torch.randint(0, 96, (2, 32))
    loss = model(x, targets=y)
    want = torch.autograd.grad(loss, list(model.parameters()))
    monkeypatch.setattr(distributed, "_COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(losses, "_sync_ok", lambda t: False)  # the GPU's form of the loss
    import lmforge.model.transformer as transformer

    calls = []
    monkeypatch.setattr(transformer, "compiled_softmax_grad",
                        lambda **o: calls.append(o) or losses.compiled_softmax_grad(**o))
    torch._dynamo.reset()
    twin = TransformerLM(cfg)
    twin.load_state_dict(model.state_dict())
    assert distributed.compile_blocks(twin) == 2 and twin.loss_compile == {"backend": "aot_eager"}
    got_loss = twin(x, targets=y)
    got = torch.autograd.grad(got_loss, list(twin.parameters()))
    assert calls == [{"backend": "aot_eager"}]
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
