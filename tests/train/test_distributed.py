"""lmforge.train.distributed: the order of the wrappers and when gradients are reduced (CPU, gloo, a group of one;
the same code runs over NCCL in the GPU check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.checkpoint import unwrap_model
from lmforge.model import ModelConfig, TransformerLM
from lmforge.train import distributed as D


@pytest.fixture
def group(tmp_path: Path, monkeypatch):
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = D.setup_distributed("cpu", init_method=f"file://{tmp_path / 'pg'}")
    try:
        yield info
    finally:
        dist.destroy_process_group()


def _model() -> TransformerLM:
    return TransformerLM(ModelConfig(vocab_size=32, context_length=8, d_model=16, n_layers=2, n_heads=2))


def test_ddp_is_compiled_from_outside_so_buckets_overlap_the_backward(group) -> None:
    """``torch.compile(DDP(m))``: dynamo sees DDP and splits the graph at its buckets (compiling inside DDP hides
    the buckets, so no all-reduce starts before the whole backward ends). Compilation itself is lazy: not run here."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    wrapped = D.wrap_model(model, "ddp", group, compile=True)
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule) and isinstance(wrapped._orig_mod, DDP)
    assert unwrap_model(wrapped) is model
    assert isinstance(D.wrap_model(_model(), "ddp", group), DDP)  # not compiled: DDP alone


def test_gradient_sync_is_skipped_before_the_last_micro_batch(group) -> None:
    """DDP (also inside a compiled wrapper): ``no_sync`` for the micro-batches before the last; FSDP2: gradient
    reduction switched off and back on; a plain model: nothing."""
    ddp = D.wrap_model(_model(), "ddp", group, compile=True)
    with D.gradient_sync(ddp, False):
        assert ddp._orig_mod.require_backward_grad_sync is False
    assert ddp._orig_mod.require_backward_grad_sync is True
    with D.gradient_sync(ddp, True):
        assert ddp._orig_mod.require_backward_grad_sync is True

    class FSDPLike:  # FSDP2's switch, recorded (the real one runs in the FSDP tests, whose losses must not move)
        def __init__(self) -> None:
            self.calls: list[bool] = []

        def set_requires_gradient_sync(self, on: bool) -> None:
            self.calls.append(on)

    fsdp = FSDPLike()
    with pytest.raises(RuntimeError, match="boom"), D.gradient_sync(fsdp, False):
        raise RuntimeError("boom")
    assert fsdp.calls == [False, True]  # switched back on even when the backward failed
    with D.gradient_sync(fsdp, True):
        pass
    assert fsdp.calls == [False, True]
    fsdp_model = D.wrap_model(_model(), "fsdp", group)
    assert hasattr(fsdp_model, "set_requires_gradient_sync") and not hasattr(fsdp_model, "no_sync")
    with D.gradient_sync(torch.nn.Linear(2, 2), False):
        pass
