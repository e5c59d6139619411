"""Sharded checkpoints (``training.checkpoint_format: dcp``) with ``torch.distributed.checkpoint``.

Each rank writes its own shard of the model and optimizer state: no gather to rank 0, so the checkpoint never
has to fit in one process's memory. The state dicts come from ``get_state_dict`` (FSDP2 DTensor shards, or the
full tensors of a replicated/plain model) and go back through ``set_state_dict``, which reshards them: a
checkpoint written at world size N loads at world size M, into an FSDP2 model, a DDP model or a plain single
process.

A checkpoint is a directory ``checkpoints/step_{N:08d}.dcp/``:

* ``__{rank}_0.distcp``: the shards (one file per rank that held data), written by DCP;
* ``.metadata``: DCP's index of them. It is written and read by torch with ``pickle``; it is the one pickled
  file lmforge reads, and only from the run's own checkpoint directory (never point a run at a checkpoint
  directory you did not make);
* ``extra.safetensors`` + ``lmforge-dcp.json`` (written last): step, world size, the file list with sizes,
  the model's tensor shapes, and the training state (data-loader position, RNG states, config) as JSON with
  the RNG arrays in the small safetensors file.

The directory is written as ``.step_{N:08d}.dcp.partial`` and renamed into place once every rank finished, so
a run killed while saving leaves no checkpoint that looks complete (the partial one is deleted on resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save
from torch.utils._pytree import tree_map_only

from lmforge.checkpoint import DCP_MARKER, CheckpointManager, check_state_dict_fits, decode_tree, encode_tree
from lmforge.common import atomic_open
from lmforge.train.distributed import barrier, get_world_size, is_main_process

logger = logging.getLogger("lmforge")

__all__ = ["save_dcp", "load_dcp", "read_dcp_meta", "DCP_FORMAT"]

DCP_FORMAT = "lmforge-dcp"
DCP_VERSION = 1
_EXTRA = "extra.safetensors"


def _group() -> bool:
    """Whether a process group is active (else DCP runs in this one process)."""
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: that is intended (a plain run, or consolidate)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_dcp(ckpts: CheckpointManager, model: Any, optimizer: Any, step: int, extra: dict[str, Any]) -> Path:
    """Save a sharded checkpoint of ``step`` into ``ckpts.dcp_path_for(step)``; returns that directory.

    A collective: every rank calls it with its (FSDP-sharded or replicated) bare model and optimizer. Rank 0
    writes the JSON metadata from its ``extra`` and renames the finished directory into place; the newest
    ``keep_last`` sharded checkpoints are kept.
    """
    final, tmp = ckpts.dcp_path_for(step), ckpts.dcp_partial_for(step)
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()  # the directory exists before any rank writes into it
    import torch.distributed.checkpoint as dcp  # here, not at import: DCP costs every process ~1 s of CPU
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), no_dist=not _group())
    barrier()  # every rank's shard is on disk before rank 0 lists them
    if is_main_process():
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        encoded, tensors = encode_tree(extra, "extra/")
        with atomic_open(tmp / _EXTRA, "wb") as f:
            f.write(save(tensors))
        meta = {"format": DCP_FORMAT, "version": DCP_VERSION, "iteration": int(step), "world_size": get_world_size(),
                "files": files, "model_shapes": {k: list(v.shape) for k, v in msd.items()}, "extra": encoded}
        with atomic_open(tmp / DCP_MARKER) as f:
            json.dump(meta, f)
        if final.exists():  # the same step saved again (a re-run of a finished run's last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        ckpts.prune_dcp()
        logger.info("saved sharded checkpoint %s (%d ranks)", final, get_world_size())
    barrier()  # no rank goes on (or resumes from it) before the checkpoint is in place
    return final


def read_dcp_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of a sharded checkpoint, after checking every file it lists is there at its size.

    ``ValueError`` names a missing or truncated shard (never a silent start from scratch).
    """
    path = Path(path)
    marker = path / DCP_MARKER
    if not marker.is_file():
        raise ValueError(f"{path} is not a complete lmforge sharded checkpoint (no {DCP_MARKER}, written last); "
                         "move it out of the checkpoints folder to resume from an older one")
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{marker} is corrupt ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != DCP_FORMAT:
        raise ValueError(f"{marker} is not an lmforge sharded-checkpoint record (format {DCP_FORMAT!r})")
    if int(meta.get("version", 0)) > DCP_VERSION:
        raise ValueError(f"sharded checkpoint {path} has format version {meta['version']}, newer than this lmforge "
                         f"({DCP_VERSION}); upgrade lmforge")
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"sharded checkpoint {path} is missing {name} (one of the {len(meta['files'])} files "
                             f"DCP wrote for {meta['world_size']} ranks); copy it back from the machine that wrote it, or move "
                             f"{path.name} away to resume from an older checkpoint")
        if f.stat().st_size != size:
            raise ValueError(f"sharded checkpoint {path}: {name} has {f.stat().st_size} bytes, {size} were written; "
                             "it is truncated or was replaced")
    return meta


def read_dcp_extra(path: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``extra`` (training state and config) from the JSON metadata and ``extra.safetensors``."""
    return decode_tree(meta["extra"], load_file(Path(path) / _EXTRA))


def load_dcp(path: str | os.PathLike, model: Any, optimizer: Any = None) -> tuple[int, dict[str, Any]]:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), at any world size; returns
    ``(iteration, extra)``.

    A collective when a process group is active (every rank calls it); works without one in a plain process.
    The model must already be wrapped (FSDP2) and the optimizer built on it. ``ValueError`` names the first
    tensor whose shape differs from the model's (a checkpoint of another model config) and any missing shard.
    """
    path = Path(path)
    meta = read_dcp_meta(path)
    saved = {k: torch.empty(s, device="meta") for k, s in meta["model_shapes"].items()}
    check_state_dict_fits(saved, {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()})
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _group())
    # get_state_dict's tensors may alias the live parameters and optimizer state (world size 1, no FSDP):
    # set_state_dict then copies a tensor onto itself; clone so that no later step can write through an alias.
    state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(meta["iteration"]), read_dcp_extra(path, meta)
