"""Static decode steps (:mod:`lmforge.generate.graphs`): on the CPU the static step runs eagerly and is held to the
model's ordinary forward over the cache; on CUDA (marked ``gpu``) its CUDA-graph replays are held to the eager
static step, bit for bit, and greedy decoding to the ordinary path."""

from __future__ import annotations

import logging

import pytest
import torch

from lmforge.generate import Generator
from lmforge.generate.engine import Engine
from lmforge.model import ModelConfig, TransformerLM

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")


def _model(device: str = "cpu", context: int = 32) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, context_length=context, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return TransformerLM(cfg).to(device).eval()


def _pair(model: TransformerLM) -> tuple[Engine, Engine]:
    return Engine(model, use_kernel=False, static_steps=False), Engine(model, use_kernel=False, static_steps=True)


def test_static_steps_match_the_forward_through_slides() -> None:
    """Ragged rows decoded past the context (each row slides at its own step): the same logits within float32
    rounding (the static step attends over the whole cache under a mask) and the same lengths at every step."""
    plain, static = _pair(_model())
    rows = [[1, 2, 3, 4, 5], [6, 7]]
    a, b = plain.prefill(rows, 32), static.prefill(rows, 32)
    torch.testing.assert_close(b, a, rtol=0, atol=0)  # prefill is the ordinary forward on both
    for _ in range(70):  # past 32 columns twice
        t = a.argmax(-1)
        a, b = plain.step(t), static.step(t)
        assert plain.lengths == static.lengths
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert static.tokens.tolist() == plain.tokens.tolist()


def test_static_steps_follow_rows_joining_and_leaving() -> None:
    """Continuous batching: admit, fork and release change the live batch between steps; each batch size gets its
    own static step over the same cache."""
    engines = _pair(_model())
    logits: list[list[torch.Tensor]] = [[], []]
    for e, out in zip(engines, logits):
        e.open_slots(4, 32)
        for p in ([3, 1, 4], [1, 5, 9, 2, 6], [5]):
            out.append(e.admit(p)[1][None])
        tok = torch.stack([x[0].argmax() for x in out])
        for i in range(12):
            if i == 3:
                e.release(1)
                tok = tok[[0, 2]]
            if i == 6:
                e.fork(0)
                tok = torch.cat([tok, tok[:1]])
            step = e.step(tok)
            out.append(step)
            tok = step.argmax(-1)
    assert engines[0].lengths == engines[1].lengths
    for a, b in zip(*logits):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert sorted(engines[1]._graphs._entries) == [2, 3]


def test_a_same_shaped_cache_is_reused_and_zeroed() -> None:
    """A second generation of the same shape keeps the cache's storage (CUDA graphs stay valid) and gives what a
    fresh engine gives."""
    model = _model()
    gen = Generator(model)
    gen.engine = Engine(model, use_kernel=False, static_steps=True)
    first = gen.generate_ids([[1, 2, 3], [4, 5]], 10, temperature=0)
    k = gen.engine.cache.k
    again = gen.generate_ids([[7, 8, 9], [1, 1]], 10, temperature=0)
    assert gen.engine.cache.k is k  # same storage
    fresh = Generator(model)
    fresh.engine = Engine(model, use_kernel=False, static_steps=True)
    assert again == fresh.generate_ids([[7, 8, 9], [1, 1]], 10, temperature=0)
    assert first == Generator(model).generate_ids([[1, 2, 3], [4, 5]], 10, temperature=0)


def test_a_failed_capture_keeps_decoding_without_graphs(caplog) -> None:
    """A capture the driver refuses: the step that ran eagerly is returned, one warning, and later steps run
    eagerly (and right); no graph is counted."""
    from lmforge.generate.graphs import StepGraphs

    class Refused(StepGraphs):
        def _warm(self, e):  # the CPU has no side streams: the eager step itself
            return self.run(e.tokens, e.view)

        def _capture(self, e):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    model = _model()
    plain, static = _pair(model)
    static._graphs = Refused(static._graphs.run, capture=True)
    a, b = plain.prefill([[1, 2, 3]], 16), static.prefill([[1, 2, 3]], 16)
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        for _ in range(5):
            t = a.argmax(-1)
            a, b = plain.step(t), static.step(t)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert [r.getMessage() for r in caplog.records] == [
        "decoding without CUDA graphs from now on: capturing the batch-1 step failed (operation not permitted when "
        "stream is capturing)"]
    assert not static._graphs.capture and static._graphs.captured == 0


def test_static_steps_are_the_pytorch_paths() -> None:
    from lmforge.generate.packed import kernel_available

    if kernel_available():
        with pytest.raises(ValueError, match="static_steps is the PyTorch path's"):
            Engine(_model(), use_kernel=True, static_steps=True)
    assert Engine(_model(), use_kernel=False)._graphs is None  # off on the CPU unless asked for


@pytest.mark.gpu
@cuda
def test_cuda_graph_replays_equal_the_eager_static_step_and_greedy_the_plain_path() -> None:
    """On CUDA the default engine captures one graph per batch size; replays give the eager static step's bits;
    greedy tokens (float32) equal the ordinary forward's; a second generation of the same shape recaptures none."""
    model = _model("cuda", context=64)
    graphs = Engine(model)
    assert graphs._graphs is not None and graphs._graphs.capture
    eager = Engine(model, static_steps=True)
    eager._graphs.capture = False
    rows = [[1, 2, 3, 4, 5], [6, 7]]
    a, b = graphs.prefill(rows, 64), eager.prefill(rows, 64)
    for _ in range(80):  # past the context: slides between replays
        t = a.argmax(-1)
        a, b = graphs.step(t), eager.step(t)
        assert torch.equal(a, b)
    assert graphs._graphs.captured == 1
    plain = Generator(model)
    plain.engine = Engine(model, static_steps=False)
    fast = Generator(model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    assert fast.generate_ids(prompts, 40, temperature=0) == plain.generate_ids(prompts, 40, temperature=0)
    n = fast.engine._graphs.captured
    assert fast.generate_ids(prompts, 40, temperature=0) == plain.generate_ids(prompts, 40, temperature=0)
    assert fast.engine._graphs.captured == n == 1
    fused = Generator(model)
    fused.engine = Engine(model, compile_steps=True)  # inductor, then captured
    assert fused.generate_ids(prompts, 40, temperature=0) == plain.generate_ids(prompts, 40, temperature=0)
    assert fused.engine._graphs.captured == 1


def test_compiled_static_steps_match_the_forward() -> None:
    """``compile_steps``: the static step traced and compiled (``aot_eager`` here: the trace is what could break),
    one graph per batch size, with the ordinary forward's logits through a slide."""
    torch._dynamo.reset()
    model = _model()
    plain = Engine(model, use_kernel=False, static_steps=False)
    compiled = Engine(model, use_kernel=False, static_steps=True, compile_steps={"backend": "aot_eager",
                                                                                 "fullgraph": True})
    rows = [[1, 2, 3, 4, 5], [6, 7]]
    a, b = plain.prefill(rows, 32), compiled.prefill(rows, 32)
    for _ in range(40):  # past the context: slides between compiled steps
        t = a.argmax(-1)
        a, b = plain.step(t), compiled.step(t)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert plain.lengths == compiled.lengths
    with pytest.raises(ValueError, match="compile_steps compiles the static steps"):
        Engine(model, use_kernel=False, static_steps=False, compile_steps=True)
