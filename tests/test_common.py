"""common.py: atomic writes never leave half files, output paths are not clobbered, devices/dtypes validate."""

import os
import stat

import pytest

from lmforge import common


def test_atomic_write_replaces_and_keeps_umask_mode(tmp_path):
    p = tmp_path / "a.txt"
    common.atomic_write_text(p, "one")
    common.atomic_write_text(p, "two")
    assert p.read_text() == "two"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask
    assert [q.name for q in tmp_path.iterdir()] == ["a.txt"]  # no temporary file left behind


def test_atomic_open_failure_keeps_previous_file(tmp_path):
    p = tmp_path / "a.bin"
    common.atomic_write_bytes(p, b"old")
    with pytest.raises(OSError):
        with common.atomic_open(p, "wb") as f:
            f.write(b"partial")
            raise OSError(28, "No space left on device")
    assert p.read_bytes() == b"old"
    assert [q.name for q in tmp_path.iterdir()] == ["a.bin"]


def test_check_output_path(tmp_path):
    p = tmp_path / "out.json"
    assert common.check_output_path(p) == p
    p.write_text("x")
    with pytest.raises(ValueError, match="already exists.*--force"):
        common.check_output_path(p)
    assert common.check_output_path(p, force=True) == p
    with pytest.raises(ValueError, match="is a directory"):
        common.check_output_path(tmp_path, force=True)


def test_check_apart_refuses_the_source_inside_and_around_it_only(tmp_path):
    run = tmp_path / "a" / "run"
    (run / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(run)
    for out, where in [(run, "is"), (run / "sub", "is inside"), (run / "new" / "deeper", "is inside"),
                       (tmp_path / "a", "holds"), (tmp_path / "link", "is"), (run / "sub" / "..", "is")]:
        with pytest.raises(ValueError, match=f"--out {out} {where} {run}, which this command reads: writing there "
                                             r"\(even with --force\) would replace its own input"):
            common.check_apart(out, tmp_path / "other", run)
    for out in [tmp_path / "a" / "run2", tmp_path / "a" / "ru", tmp_path / "other" / "run"]:  # sharing a prefix
        common.check_apart(out, run)
    with pytest.raises(ValueError, match="--run-dir"):
        common.check_apart(run, run, flag="--run-dir")


def test_check_input_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        common.check_input_file(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="is a directory"):
        common.check_input_file(tmp_path)
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert common.check_input_file(f) == f


def test_sha256_file(tmp_path):
    import hashlib

    f = tmp_path / "f.bin"
    data = os.urandom(3 << 20)
    f.write_bytes(data)
    assert common.sha256_file(f, chunk_size=1 << 16) == hashlib.sha256(data).hexdigest()


def test_devices_and_dtypes():
    import torch

    assert common.resolve_device("cpu") == torch.device("cpu")
    assert common.resolve_device("auto").type in {"cpu", "cuda", "mps"}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            common.resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        common.resolve_device("tpu-9000")
    assert common.resolve_dtype("bf16") is torch.bfloat16
    assert common.resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        common.resolve_dtype("int3")


def test_a_cuda_index_past_the_visible_devices_is_refused_early(monkeypatch):
    """``cuda:7`` on a one-GPU machine: a ValueError naming the devices there, before anything touches CUDA
    (checked here with CUDA faked present: the real check runs in the GPU suite's CLI sweep)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:7' is out of range: this machine has 1 CUDA device \(cuda:0\)"):
        common.resolve_device("cuda:7")
    with pytest.raises(ValueError, match=r"'cuda:1' is out of range"):
        common.resolve_device("cuda:1")
    assert common.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert common.resolve_device("cuda") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert common.resolve_device("cuda:7") == torch.device("cuda", 7)
    with pytest.raises(ValueError, match=r"8 CUDA devices \(cuda:0 \.\. cuda:7\)"):
        common.resolve_device("cuda:8")


def test_cuda_matmul_defaults_turn_tf32_on_for_cuda_only():
    """Training on CUDA runs float32 matmuls as TF32 unless the user chose a precision; a CPU is never touched
    (conftest puts the global setting back after the test)."""
    import torch

    torch.set_float32_matmul_precision("highest")
    assert common.cuda_matmul_defaults(torch.device("cpu")) == "highest"
    assert torch.get_float32_matmul_precision() == "highest"
    assert common.cuda_matmul_defaults(torch.device("cuda")) == "highest"  # only sets a flag: no GPU needed
    assert torch.get_float32_matmul_precision() == "high"
    torch.set_float32_matmul_precision("medium")
    assert common.cuda_matmul_defaults(torch.device("cuda", 0)) == "medium"
    assert torch.get_float32_matmul_precision() == "medium"  # a choice the user made stays


def test_human_bytes():
    assert common.human_bytes(512) == "512 B"
    assert common.human_bytes(1536) == "1.5 KiB"
    assert common.human_bytes(3 * 1024**3) == "3.0 GiB"


def test_import_has_no_side_effects():
    import subprocess
    import sys

    code = ("import logging, sys, lmforge, lmforge.common, lmforge.tokenizer, lmforge.data, lmforge.model, "
            "lmforge.train, lmforge.generate, lmforge.rl, lmforge.chat.sft, lmforge.cli\n"
            "assert not logging.getLogger().handlers and not logging.getLogger('lmforge').handlers\n"
            "import torch\nassert not torch.cuda.is_initialized()\n"
            "assert 'wandb' not in sys.modules\n"
            # FSDP, DTensor and distributed checkpoints cost every process ~1.5 s of CPU: imported when used
            "heavy = [m for m in sys.modules if m.startswith(('torch.distributed.tensor', 'torch.distributed.fsdp', "
            "'torch.distributed.checkpoint'))]\nassert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)
