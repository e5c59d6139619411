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


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=[
        pytest.mark.slow,
        pytest.mark.skipif(not os.environ.get("LMFORGE_TEST_INDUCTOR"), reason="set LMFORGE_TEST_INDUCTOR=1"),
        pytest.mark.skipif(shutil.which("c++") is None, reason="inductor needs a C++ compiler on CPU")]),
])
def test_compiled_model_matches_eager_forward_and_backward(backend):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    model = TransformerLM(cfg)
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
