"""Checkpoints: round trip, checksum, truncation, rotation, best, fallback, full disk."""

from __future__ import annotations

import errno
import io
import json
import logging
import random
import struct

import numpy as np
import pytest
import torch

from lmforge import checkpoint as ck
from lmforge.checkpoint import CheckpointManager, load_checkpoint, read_checkpoint, read_metadata, save_checkpoint


class Tiny(torch.nn.Module):
    """Embedding + tied head + a bf16 buffer: covers aliasing and non-float32 dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


def _trained(seed: int = 0, steps: int = 3) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.arange(8) % 11).logsumexp(-1).mean().backward()
        opt.step()
    return m, opt


def _fresh() -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(123)
    m = Tiny()
    return m, torch.optim.AdamW(m.parameters(), lr=5.0)


def test_round_trip_model_optimizer_rng_loader(tmp_path) -> None:
    m, opt = _trained()
    extra = {"rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
             "loader": {"epoch": 2, "perm": np.arange(5, dtype=np.int64)[::-1], 3: "int key"}, "note": (1, 2.5)}
    path = tmp_path / "c.safetensors"
    save_checkpoint(m, opt, 42, path, extra)

    m2, opt2 = _fresh()
    assert load_checkpoint(path, m2, opt2) == 42
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), k
    assert m2.head.weight is m2.emb.weight  # tie survives loading
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]  # lr, betas, weight_decay restored
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(torch.as_tensor(s1["state"][i][k]), torch.as_tensor(s2["state"][i][k]))

    c = read_checkpoint(path)
    np.random.set_state(c.extra["rng"]["numpy"])
    random.setstate(c.extra["rng"]["python"])
    torch.set_rng_state(c.extra["rng"]["torch"])
    assert np.random.get_state()[1].tolist() == extra["rng"]["numpy"][1].tolist()
    assert random.getstate() == extra["rng"]["python"]
    assert c.extra["loader"]["perm"].tolist() == [4, 3, 2, 1, 0] and c.extra["loader"][3] == "int key"
    assert c.extra["note"] == (1, 2.5)

    # one more identical step on both models gives identical weights (optimizer state really restored)
    for model, o in ((m, opt), (m2, opt2)):
        o.zero_grad()
        model(torch.arange(8) % 11).logsumexp(-1).mean().backward()
        o.step()
    assert torch.equal(m.mid.weight, m2.mid.weight)


def test_file_object_and_model_only(tmp_path) -> None:
    m, opt = _trained()
    buf = io.BytesIO()
    save_checkpoint(m, opt, 7, buf)
    buf.seek(0)
    m2, _ = _fresh()
    assert load_checkpoint(buf, m2) == 7
    assert torch.equal(m.mid.bias, m2.mid.bias)
    assert read_metadata_bytes(buf.getvalue())["iteration"] == 7


def read_metadata_bytes(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["meta"])


def test_is_plain_safetensors(tmp_path) -> None:
    from safetensors.torch import load_file

    m, opt = _trained()
    save_checkpoint(m, opt, 1, tmp_path / "c.safetensors")
    tensors = load_file(tmp_path / "c.safetensors")
    assert torch.equal(tensors["model/mid.weight"], m.mid.weight)
    assert "model/head.weight" not in tensors  # tied: stored once
    assert read_metadata(tmp_path / "c.safetensors")["iteration"] == 1


def test_corruption_and_truncation_detected(tmp_path) -> None:
    m, opt = _trained()
    path = tmp_path / "c.safetensors"
    save_checkpoint(m, opt, 3, path)
    good = path.read_bytes()

    flipped = bytearray(good)
    flipped[-5] ^= 0x01  # one bit in the tensor payload
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(path, _fresh()[0])

    for cut in (len(good) - 10, 100, 4):
        path.write_bytes(good[:cut])
        with pytest.raises(ValueError, match="truncated|corrupt"):
            read_checkpoint(path)

    path.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")  # a header length that would need an exabyte
    with pytest.raises(ValueError, match="truncated"):
        read_metadata(path)
    with pytest.raises(ValueError, match="truncated"):
        read_checkpoint(path)

    path.write_bytes(b"not a checkpoint at all, just some text")
    with pytest.raises(ValueError):
        read_checkpoint(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_checkpoint(tmp_path / "nope.safetensors")


def test_shape_mismatch_is_value_error(tmp_path) -> None:
    m, opt = _trained()
    save_checkpoint(m, opt, 1, tmp_path / "c.safetensors")
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="checkpoint has no tensor 'weight' that this model needs"):
        load_checkpoint(tmp_path / "c.safetensors", other)


def test_mismatch_message_is_one_line_naming_the_first_tensor(tmp_path) -> None:
    from lmforge.model import ModelConfig, TransformerLM

    small = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=1, n_heads=2))
    save_checkpoint(small, None, 1, tmp_path / "c.safetensors")
    wide = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(ValueError) as e:
        load_checkpoint(tmp_path / "c.safetensors", wide)
    msg = str(e.value)
    assert "\n" not in msg
    assert "'token_embeddings.weight' has shape (50, 16) but this model's has (50, 32)" in msg
    deeper = TransformerLM(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=2, n_heads=2))
    with pytest.raises(ValueError, match=r"no tensor 'layers\.1\.attn\.q_proj\.weight'"):
        load_checkpoint(tmp_path / "c.safetensors", deeper)
    save_checkpoint(deeper, None, 1, tmp_path / "deep.safetensors")
    with pytest.raises(ValueError, match=r"has tensor 'layers\.1\..*' that this model does not have \(9 such\)"):
        load_checkpoint(tmp_path / "deep.safetensors", small)


def test_rotation_keeps_last_k_and_best(tmp_path) -> None:
    m, opt = _trained()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        mgr.save(m, opt, step, {"step": step})
    assert [s for s, _ in mgr.steps()] == [30, 40]
    assert mgr.path_for(40).name == "step_00000040.safetensors"

    assert mgr.save_best(m, opt, 10, 3.0)
    assert not mgr.save_best(m, opt, 20, 3.5)  # worse: kept the old best
    assert mgr.best_val_loss() == 3.0
    assert mgr.save_best(m, opt, 30, 2.0)
    assert read_checkpoint(mgr.best_path).iteration == 30
    assert mgr.best_val_loss() == 2.0
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_fallback_to_previous_valid(tmp_path, caplog) -> None:
    m, opt = _trained()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    assert mgr.load_latest() is None
    for step in (1, 2, 3):
        mgr.save(m, opt, step)
    newest = mgr.path_for(3)
    newest.write_bytes(newest.read_bytes()[:-7])  # truncated, e.g. by a crash on a non-atomic filesystem
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        path, c = mgr.load_latest()
    assert path == mgr.path_for(2) and c.iteration == 2
    assert f"checkpoint {newest} is corrupt" in caplog.text and f"falling back to {mgr.path_for(2)}" in caplog.text

    assert newest.exists()  # reading never moves files by default
    mgr.load_latest(quarantine=True)
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").exists()  # kept, no longer counted
    assert [s for s, _ in mgr.steps()] == [1, 2]
    for step in (1, 2):
        mgr.path_for(step).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="every checkpoint .* is corrupt"):
        mgr.load_latest()


def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch) -> None:
    m, opt = _trained()
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(m, opt, 5)
    before = mgr.path_for(5).read_bytes()

    def write_half_then_fail(f, data):
        f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "_write_all", write_half_then_fail)
    m2, opt2 = _trained(seed=1)
    with pytest.raises(OSError, match="No space left"):
        mgr.save(m2, opt2, 6)
    monkeypatch.undo()
    assert [s for s, _ in mgr.steps()] == [5]  # no half-written step 6, step 5 not rotated away
    assert mgr.path_for(5).read_bytes() == before
    assert list(mgr.dir.glob(".*.tmp")) == []  # temporary cleaned up
    assert mgr.load_latest()[1].iteration == 5


def test_unwrap_model_sees_through_compile_and_data_parallel_wrappers():
    from lmforge.checkpoint import unwrap_model

    class DataParallelLike(torch.nn.Module):  # DDP and FSDP hold the model as `.module`
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    inner = torch.nn.Linear(2, 2)
    compiled = torch.compile(inner)  # wraps lazily (`._orig_mod`); nothing is compiled until called
    assert unwrap_model(DataParallelLike(compiled)) is inner
    assert unwrap_model(compiled) is inner and unwrap_model(inner) is inner
