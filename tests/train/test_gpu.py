"""CUDA paths: bf16 autocast training, SDPA's flash kernel against the reference attention, device="auto",
DDP with NCCL in one process. Marked ``gpu``; each skips, saying why, where there is no CUDA device."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))  # test_model's helpers, also when this file runs alone
from test_model import model_pair  # noqa: E402
from test_train import _cfg, _losses, _make_shards  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return _make_shards(tmp_path_factory.mktemp("data"), 300)


def test_auto_device_is_cuda() -> None:
    from lmforge.common import resolve_device

    assert resolve_device("auto").type == "cuda"


def test_bf16_autocast_training_on_cuda(shards, tmp_path, caplog) -> None:
    """bf16 autocast on CUDA follows the fp32 CUDA run (bf16 matmuls and attention: within 2%), really uses
    bf16 (the losses differ from fp32's), and trains on the GPU (train's own log line names the device)."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        with caplog.at_level(logging.INFO, logger="lmforge"):
            m = train_on(shards, tmp_path / dtype, dtype=dtype)
        assert " on cuda" in caplog.text
        caplog.clear()
        runs[dtype] = [v for _, v in _losses(tmp_path / dtype)], m["val_loss"]
    (fp32, val32), (bf16, val16) = runs["fp32"], runs["bf16"]
    assert len(bf16) == len(fp32) == 4 and bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=2e-2) and val16 == pytest.approx(val32, rel=2e-2)


def train_on(shards: Path, run: Path, **training) -> dict:
    """A 4-step tiny run on ``cuda`` (``training`` overrides the tests' usual config)."""
    from lmforge.train import train

    return train(_cfg(shards, training={"max_steps": 4, "eval_every": 4, "device": "cuda", "num_threads": None,
                                        **training}), run, progress=False)


def test_flash_attention_fast_path_matches_reference_in_bf16() -> None:
    """The fast path's SDPA call runs with only the flash kernel allowed (it fails if flash cannot take it),
    in bf16; its logits and gradients are as close to the fp32 reference as the bf16 reference path's are."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"flash attention needs compute capability >= 8.0, this GPU has "
                    f"{torch.cuda.get_device_capability()}")
    fast, ref = (m.cuda() for m in model_pair(context_length=64))
    exact = model_pair(context_length=64)[1].cuda().double()  # the oracle: reference path in float64
    x = torch.randint(0, 97, (4, 64), device="cuda")
    want = exact(x).float()
    fast.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = fast(x)
    base = ref(x)  # the reference path: explicit softmax, no SDPA
    err_fast, err_ref = (got.float() - want).abs().max().item(), (base.float() - want).abs().max().item()
    assert err_fast <= 2 * err_ref + 1e-2, (err_fast, err_ref)
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fast(x).float().logsumexp(-1).mean().backward()
    ref(x).float().logsumexp(-1).mean().backward()
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        a, b = a.grad.float(), b.grad.float()
        assert torch.isfinite(a).all() and (a - b).norm() <= 5e-2 * b.norm(), name  # bf16 vs bf16: within 5%


def test_ddp_one_process_nccl_matches_single_gpu(shards, tmp_path) -> None:
    """DDP over an NCCL group of one process on cuda:0 computes the single-GPU run's losses."""
    import torch.distributed as dist

    from lmforge.train.distributed import setup_distributed

    if not dist.is_nccl_available():
        pytest.skip("this PyTorch build has no NCCL")
    train_on(shards, tmp_path / "single")
    info = setup_distributed("cuda", init_method=f"file://{tmp_path / 'pg'}")
    try:
        assert dist.get_backend() == "nccl" and info.device.type == "cuda"
        train_on(shards, tmp_path / "ddp", parallel="ddp")
    finally:
        dist.destroy_process_group()
    ddp, single = _losses(tmp_path / "ddp"), _losses(tmp_path / "single")
    assert [s for s, _ in ddp] == [s for s, _ in single] == [1, 2, 3, 4]
    assert [v for _, v in ddp] == pytest.approx([v for _, v in single], rel=1e-4)
