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


def test_compile_is_per_block_in_place_inside_the_parallel_wrapper(group, monkeypatch) -> None:
    """``training.compile`` compiles each block in place (names and state_dict keys unchanged, no wrapper to
    unwrap), inside DDP (its hooks stay outside the graphs); the compiled model computes eager's loss and gradients
    (traced here with aot_eager and fullgraph=True: a graph break inside a block would fail), from one graph."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch._dynamo.utils import counters

    monkeypatch.setattr(D, "_COMPILE_OPTIONS", {"backend": "aot_eager", "fullgraph": True})
    torch._dynamo.reset()
    counters.clear()
    model, twin = _model(), _model()
    twin.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    wrapped = D.wrap_model(model, "ddp", group, compile=True, activation_checkpointing=True)
    assert isinstance(wrapped, DDP) and unwrap_model(wrapped) is model and list(model.state_dict()) == keys
    assert all(b._compiled_call_impl is not None for b in model.layers) and model._compiled_call_impl is None
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    loss, want = wrapped(x, targets=y), twin(x, targets=y)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both blocks: compile time of one block
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert D.wrap_model(_model(), "none", group) is not None and all(
        b._compiled_call_impl is None for b in D.wrap_model(_model(), "none", group).layers)


def test_gradient_sync_is_skipped_before_the_last_micro_batch(group) -> None:
    """DDP: ``no_sync`` for the micro-batches before the last; FSDP2: gradient reduction switched off and back on;
    a plain model: nothing."""
    ddp = D.wrap_model(_model(), "ddp", group)
    with D.gradient_sync(ddp, False):
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is True
    with D.gradient_sync(ddp, True):
        assert ddp.require_backward_grad_sync is True

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


def test_fsdp_shards_live_on_the_runs_device_even_where_an_accelerator_is(group, monkeypatch) -> None:
    """FSDP2 shards a CPU run on a CPU mesh, also on a machine with a GPU (FSDP2's default mesh is the
    machine's accelerator: a CPU run's shards went to cuda:0 on the GPU machine). Here the accelerator is
    reported as CUDA, as there: the old default tried to build a CUDA mesh."""
    from torch.distributed.tensor import DTensor

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    model = D.wrap_model(_model(), "fsdp", group)
    weights = [p for p in model.parameters()]
    assert weights and all(isinstance(p, DTensor) and p.device_mesh.device_type == "cpu" for p in weights)
    assert all(p.device.type == "cpu" for p in weights)
    loss = model(torch.randint(0, 32, (2, 8)), targets=torch.randint(0, 32, (2, 8)))
    loss.backward()
    assert loss.device.type == "cpu" and all(p.grad is not None for p in weights)
