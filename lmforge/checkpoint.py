"""Checkpoints: one safetensors file holding model, optimizer and anything else a resume needs.

File layout (``*.safetensors``, readable by any safetensors loader):

* tensors ``model/<name>`` (the model's ``state_dict``), ``optim/<k>`` and ``extra/<k>`` (tensors and
  NumPy arrays found inside the optimizer state and the ``extra`` dict);
* metadata ``format`` = ``lmforge-checkpoint``, ``version``, ``meta`` (JSON: iteration, the optimizer's
  state with each tensor replaced by a reference, param-group hyperparameters, ``extra``), and ``sha256``:
  a digest over every tensor's name, dtype, shape and bytes plus the ``meta`` JSON, checked on load, so
  a flipped bit or a truncated file gives a ``ValueError`` instead of a silently wrong model.

Nothing is pickled: Python containers go to JSON (tuples, int-keyed dicts and NumPy arrays are tagged so
they come back as they went in, which RNG states need). Writes go to a temporary file renamed into place.

:class:`CheckpointManager` adds the run-directory policy: ``checkpoints/step_{N:08d}.safetensors``, keep the
last K, keep ``best.safetensors`` by validation loss, and resume from the newest checkpoint that verifies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors.torch import load, load_file, save

from lmforge.common import atomic_open, check_input_file, remove_stale_temporaries

logger = logging.getLogger("lmforge")

FORMAT = "lmforge-checkpoint"
VERSION = 1
_WRITE_CHUNK = 64 << 20

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "read_metadata", "Checkpoint",
           "CheckpointManager", "unwrap_model", "grow_rows", "lora_delta"]


# The weight arithmetic shared by the model (TransformerLM.resize_vocab, LoRA merging) and by open_run, which
# applies it to a LoRA run's checkpoint without building a model: one definition for both.
def grow_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ``(n, d)`` grown to ``(rows, d)``; each new row is the mean of the old rows (for new tokens)."""
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)  # (1, d)
    return torch.cat([weight, mean.expand(rows - weight.shape[0], -1)], dim=0)  # (rows, d)


def lora_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """LoRA's weight update ``scale · B A`` ``(out, in)`` in ``dtype``, computed in at least float32."""
    dt = torch.promote_types(dtype, torch.float32)
    return (lora_b.to(dt) @ lora_a.to(dt) * scale).to(dtype)  # (out, r) @ (r, in)


# --------------------------------------------------------------------------------------------------
# Encoding Python containers + tensors into (JSON, tensor dict) and back
# --------------------------------------------------------------------------------------------------
def _encode(obj: Any, prefix: str, tensors: dict[str, Any]) -> Any:
    """Replace tensors / arrays inside ``obj`` by references, collecting them in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: _encode(v, prefix, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, prefix, tensors), _encode(v, prefix, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, prefix, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, prefix, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint (use tensors, arrays, numbers, str, "
                    "lists, tuples, dicts)")


def _decode(obj: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def encode_tree(obj: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """``obj`` (tensors, arrays, numbers, str, lists, tuples, dicts) as JSON plus the tensors it refers to, named
    ``prefix + n``; :func:`decode_tree` inverts it. The layout of a checkpoint's ``extra``."""
    tensors: dict[str, Any] = {}
    return _encode(obj, prefix, tensors), tensors


def decode_tree(obj: Any, tensors: dict[str, Any]) -> Any:
    """The object :func:`encode_tree` encoded (tuples, arrays and tensors restored)."""
    return _decode(obj, tensors)


def _digest(tensors: dict[str, Any], meta_json: str) -> str:
    """SHA-256 over (name, dtype, shape, raw bytes) of every tensor in name order, then the meta JSON."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # raw bytes, no copy
    h.update(meta_json.encode())
    return h.hexdigest()


def unwrap_model(model: Any) -> Any:
    """The plain module inside DDP/FSDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            return model
        model = inner


# --------------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------------
def _checkpoint_bytes(model: Any, optimizer: Any, iteration: int, extra: dict[str, Any] | None) -> bytes:
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}  # tied weights: store the shared tensor once
    seen: dict[tuple, str] = {}
    for name, t in unwrap_model(model).state_dict().items():
        if type(t).__name__ == "DTensor":
            raise ValueError("the model's parameters are sharded (FSDP); gather them first with "
                             "lmforge.train.distributed.full_state_dicts(model, optimizer) and save those")
        t = t.detach()
        sig = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if sig is not None and sig in seen:
            aliases[name] = seen[sig]
            continue
        if sig is not None:
            seen[sig] = name
        tensors[f"model/{name}"] = t.cpu().contiguous()
    meta = {
        "iteration": int(iteration),
        "aliases": aliases,
        "optimizer": _encode(optimizer.state_dict(), "optim/", tensors) if optimizer is not None else None,
        "extra": _encode(dict(extra or {}), "extra/", tensors),
    }
    meta_json = json.dumps(meta, separators=(",", ":"))
    metadata = {"format": FORMAT, "version": str(VERSION), "meta": meta_json, "sha256": _digest(tensors, meta_json)}
    return save(tensors, metadata=metadata)


def _write_all(f: IO[bytes], data: bytes) -> None:
    """Write ``data`` in chunks (a full disk surfaces as ``OSError`` part-way; the caller cleans up)."""
    view = memoryview(data)
    for i in range(0, len(view), _WRITE_CHUNK):
        f.write(view[i : i + _WRITE_CHUNK])


def save_checkpoint(model: Any, optimizer: Any, iteration: int, out: str | os.PathLike | IO[bytes],
                    extra: dict[str, Any] | None = None) -> None:
    """Save model weights, optimizer state (tensors + param-group hyperparameters) and ``iteration``.

    ``out`` is a path (written atomically: a crash or a full disk leaves any previous file intact) or a
    binary file object. ``extra`` holds whatever else a resume needs (RNG states, data-loader position,
    config): tensors, NumPy arrays, numbers, strings and nested lists/tuples/dicts of them.
    """
    data = _checkpoint_bytes(model, optimizer, iteration, extra)
    if isinstance(out, (str, os.PathLike)):
        with atomic_open(out, "wb") as f:
            _write_all(f, data)
    else:
        _write_all(out, data)


@dataclasses.dataclass
class Checkpoint:
    """A verified checkpoint in memory: model state dict, optimizer state dict, iteration, extra."""

    model: dict[str, Any]
    optimizer: dict[str, Any] | None
    iteration: int
    extra: dict[str, Any]


def _parse_header(data: bytes, name: str) -> dict[str, Any]:
    if len(data) < 8:
        raise ValueError(f"checkpoint {name} is truncated ({len(data)} bytes); it cannot be loaded")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"checkpoint {name} is truncated (header needs {n} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {name} has a corrupt header ({e}); it is not a valid safetensors file") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{name} is not an lmforge checkpoint (no '{FORMAT}' metadata)")
    if int(meta.get("version", 0)) > VERSION:
        raise ValueError(f"checkpoint {name} has format version {meta['version']}, newer than this lmforge "
                         f"({VERSION}); upgrade lmforge")
    return meta


def _read_header(path: Path) -> dict[str, Any]:
    """The safetensors metadata of a file, reading only its header (a lying length cannot over-allocate)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        head += f.read(min(n, size))
    return _parse_header(head, str(path))


def read_metadata(src: str | os.PathLike) -> dict[str, Any]:
    """The JSON ``meta`` of a checkpoint file (iteration, extra without tensors), reading only its header.

    Not verified against the checksum: use it for cheap listings, and :func:`read_checkpoint` to load.
    """
    return json.loads(_read_header(check_input_file(src))["meta"])


def read_checkpoint(src: str | os.PathLike | IO[bytes]) -> Checkpoint:
    """Read and verify a checkpoint (``ValueError`` if truncated, corrupt or not a checkpoint).

    A path is memory-mapped (peak memory ~ one copy of the tensors); a file object is read whole.
    """
    try:
        if isinstance(src, (str, os.PathLike)):
            name = str(src)
            meta = _read_header(check_input_file(src))
            tensors = load_file(src)
        else:
            name = getattr(src, "name", "<file object>")
            data = src.read()
            meta = _parse_header(data, name)
            tensors = load(data)
    except ValueError:
        raise
    except Exception as e:  # safetensors raises its own error type for inconsistent offsets / short data
        raise ValueError(f"checkpoint {name} is truncated or corrupt ({e})") from e
    if _digest(tensors, meta["meta"]) != meta.get("sha256"):
        raise ValueError(f"checkpoint {name} is corrupt (sha256 of its contents does not match the stored checksum)")
    info = json.loads(meta["meta"])
    model_state = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    for name_, target in info["aliases"].items():
        model_state[name_] = model_state[target]
    optim = _decode(info["optimizer"], tensors) if info["optimizer"] is not None else None
    return Checkpoint(model=model_state, optimizer=optim, iteration=int(info["iteration"]),
                      extra=_decode(info["extra"], tensors))


def apply_checkpoint(ckpt: Checkpoint, model: Any, optimizer: Any = None) -> int:
    """Copy a :class:`Checkpoint` into ``model`` (and ``optimizer``); returns the iteration."""
    check_state_dict_fits(ckpt.model, unwrap_model(model).state_dict())
    unwrap_model(model).load_state_dict(ckpt.model, strict=True)
    if optimizer is not None:
        if ckpt.optimizer is None:
            raise ValueError("checkpoint holds no optimizer state; load it with optimizer=None")
        try:
            optimizer.load_state_dict(ckpt.optimizer)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"checkpoint optimizer state does not fit this optimizer: {e}") from e
    return ckpt.iteration


def check_state_dict_fits(saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """``ValueError`` in one line naming the first tensor that is missing, unexpected or of another shape.

    PyTorch's own ``load_state_dict`` error lists every mismatch over many lines; the first one is enough to
    see that the checkpoint belongs to a model of another config.
    """
    for name, want in expected.items():
        got = saved.get(name)
        if got is None:
            raise ValueError(f"checkpoint has no tensor {name!r} that this model needs: it was written by a model "
                             "of another architecture or config")
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got.shape)} but this model's has "
                             f"{tuple(want.shape)}: the checkpoint was written with another model config (compare "
                             "its config with the run's config.yaml)")
    extra = [k for k in saved if k not in expected]
    if extra:
        raise ValueError(f"checkpoint has tensor {extra[0]!r} that this model does not have ({len(extra)} such); "
                         "it was written by a model of another architecture or config")


def load_checkpoint(src: str | os.PathLike | IO[bytes], model: Any, optimizer: Any = None) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    Verifies the checksum first (``ValueError`` for corrupt/truncated files or shape mismatches) and
    returns the saved iteration.
    """
    return apply_checkpoint(read_checkpoint(src), model, optimizer)


# --------------------------------------------------------------------------------------------------
# Run-directory policy
# --------------------------------------------------------------------------------------------------
_STEP_RE = re.compile(r"^step_(\d{8,})\.safetensors$")
_DCP_RE = re.compile(r"^step_(\d{8,})\.dcp$")
DCP_MARKER = "lmforge-dcp.json"  # written last into a sharded checkpoint directory (see lmforge/train/dcp.py)


class CheckpointManager:
    """Checkpoints of one run: ``<run_dir>/checkpoints/step_{N:08d}.safetensors`` plus ``best.safetensors``.

    Keeps the newest ``keep_last`` step checkpoints, a copy of the best by validation loss, and finds
    the newest checkpoint that verifies (a corrupt newest one is reported and skipped).
    """

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}); the newest checkpoint is needed to resume")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.best_path = self.dir / "best.safetensors"

    def path_for(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}.safetensors"

    def steps(self) -> list[tuple[int, Path]]:
        """Step checkpoints on disk, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP_RE.match(p.name))]
        return sorted(found)

    def dcp_path_for(self, step: int) -> Path:
        """Directory of the sharded (``checkpoint_format: dcp``) checkpoint of ``step``."""
        return self.dir / f"step_{step:08d}.dcp"

    def dcp_steps(self) -> list[tuple[int, Path]]:
        """Sharded checkpoint directories on disk (complete ones: renamed into place after every rank wrote),
        oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.dir.iterdir() if (m := _DCP_RE.match(p.name)) and p.is_dir())

    def prune_dcp(self) -> None:
        """Delete sharded checkpoints beyond the newest ``keep_last``."""
        for _, old in self.dcp_steps()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
            logger.debug("removed old checkpoint %s", old)

    def best_val_loss(self) -> float | None:
        """Validation loss recorded in ``best.safetensors`` (None if there is none or it is unreadable)."""
        if not self.best_path.exists():
            return None
        try:
            return float(read_metadata(self.best_path)["extra"]["val_loss"])
        except (ValueError, KeyError, TypeError, OSError):
            return None

    def save(self, model: Any, optimizer: Any, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Write ``step_{step}.safetensors`` atomically, then delete step checkpoints beyond the newest K."""
        path = self.path_for(step)
        save_checkpoint(model, optimizer, step, path, extra)
        logger.info("saved checkpoint %s", path)
        for _, old in self.steps()[: -self.keep_last]:
            old.unlink(missing_ok=True)
            logger.debug("removed old checkpoint %s", old)
        return path

    def save_best(self, model: Any, optimizer: Any, step: int, val_loss: float,
                  extra: dict[str, Any] | None = None) -> bool:
        """Replace ``best.safetensors`` if ``val_loss`` beats the recorded best; returns whether it did."""
        best = self.best_val_loss()
        if best is not None and not val_loss < best:
            return False
        save_checkpoint(model, optimizer, step, self.best_path, {**(extra or {}), "val_loss": float(val_loss)})
        logger.info("new best val loss %.4f at step %d -> %s", val_loss, step, self.best_path)
        return True

    def dcp_partial_for(self, step: int) -> Path:
        """Where a sharded checkpoint is written before it is complete (then renamed to :meth:`dcp_path_for`)."""
        return self.dir / f".step_{step:08d}.dcp.partial"

    def remove_stale_temporaries(self) -> None:
        """Delete half-written temporary files and sharded-checkpoint directories left by a killed process
        (never a finished checkpoint)."""
        remove_stale_temporaries(self.dir)
        if self.dir.is_dir():
            for p in self.dir.glob(".step_*.dcp.partial"):
                shutil.rmtree(p, ignore_errors=True)

    def load_latest(self, quarantine: bool = False) -> tuple[Path, Checkpoint] | None:
        """Newest step checkpoint that verifies, with its contents; None when there is none.

        A corrupt or truncated newer file is skipped with the warning
        ``checkpoint X is corrupt (...); falling back to Y``; if none verifies, ``ValueError`` (never
        silently restarting over a run's checkpoints). ``quarantine=True`` (the training loop) renames each
        skipped file to ``*.corrupt`` so it is kept for inspection but no longer counts as a checkpoint.
        """
        candidates = list(reversed(self.steps()))
        for i, (_, path) in enumerate(candidates):
            try:
                return path, read_checkpoint(path)
            except ValueError as e:
                if i + 1 == len(candidates):
                    raise ValueError(f"every checkpoint in {self.dir} is corrupt (newest error: {e}); move them "
                                     "away to start this run from scratch, or use a new run directory") from e
                logger.warning("checkpoint %s is corrupt (%s); falling back to %s", path, e, candidates[i + 1][1])
                if quarantine:
                    os.replace(path, path.with_name(path.name + ".corrupt"))
        return None
