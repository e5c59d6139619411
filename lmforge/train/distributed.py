"""Data-parallel training setup from the ``torchrun`` environment; the model code stays single-device.

``torchrun --nproc_per_node=8 -m lmforge.cli train cfg.yaml`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`setup_distributed` reads them, joins the process group (NCCL on CUDA, Gloo on CPU)
and picks this process's device. :func:`wrap_model` applies DDP or FSDP from outside, the data loader is
sharded by ``rank``/``world_size``, and :func:`all_reduce_mean` averages metrics across ranks. Without
``torchrun`` everything degrades to a single process with no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lmforge.common import resolve_device

logger = logging.getLogger("lmforge")

__all__ = ["DistInfo", "setup_distributed", "cleanup_distributed", "is_main_process", "get_rank", "get_world_size",
           "all_reduce_mean", "all_reduce_sum", "barrier", "checkpoint_blocks", "compile_blocks", "gradient_sync",
           "wrap_model", "full_state_dicts", "load_full_optimizer_state"]


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, rank on this machine, number of processes, its device."""
    rank: int
    local_rank: int
    world_size: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """True when a process group is active (more than one rank, or an explicit group of one)."""
        return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer (set by torchrun)") from e


def setup_distributed(device: str = "auto", backend: str | None = None, init_method: str | None = None) -> DistInfo:
    """Join the process group described by ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (if set) and pick a device.

    ``backend`` defaults to ``nccl`` on CUDA and ``gloo`` otherwise; ``init_method`` defaults to torchrun's
    ``env://`` (tests pass ``file://...`` or ``tcp://127.0.0.1:PORT``). On CUDA each rank takes
    ``cuda:LOCAL_RANK``. With no torchrun variables this is a plain single-process run.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not (0 <= rank < world_size):
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size}); launch with torchrun")
    dev = resolve_device(device)
    if dev.type == "cuda" and world_size > 1:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    in_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if (in_torchrun or init_method is not None) and not dist.is_initialized():
        if not dist.is_available():
            raise ValueError("torch.distributed is not available in this PyTorch build; run without torchrun")
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        # NCCL bound to this rank's GPU from the start (no guessing from the current device at the first collective)
        bound = (dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())) \
            if backend == "nccl" else None
        dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                device_id=bound)
        logger.info("joined process group: rank %d/%d (local %d), backend %s, device %s",
                    rank, world_size, local_rank, backend, dev)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def cleanup_distributed() -> None:
    """Leave the process group if one is active."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:

    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if _active() else 1


def is_main_process() -> bool:
    """True on rank 0: the process that writes files, logs and progress bars."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _active():
        dist.barrier()


def all_reduce_sum(values: list[float], device: Any = None) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (unchanged in a single process)."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_mean(value: float, device: Any = None) -> float:
    """Mean of a scalar metric over all ranks (e.g. a loss for logging)."""
    return all_reduce_sum([value], device)[0] / get_world_size()


def checkpoint_blocks(model: Any) -> int:
    """Activation checkpointing per Transformer block, applied from outside; returns the number of blocks.

    Each block's ``forward`` is replaced on the instance by one that runs it under ``torch.utils.checkpoint``
    (non-reentrant) while gradients are recorded: only the block's input is kept, its activations are recomputed
    in the backward pass. Module and parameter names are unchanged (LoRA targets, the HF key map and checkpoints
    see the same model); without gradients (eval, generation) the block runs as usual. Under FSDP2 the block's
    pre-backward hook gathers its parameters before the recomputation runs.
    """
    blocks = list(getattr(model, "layers", []))
    for block in blocks:
        if getattr(block, "_lmforge_checkpointed", False):
            continue
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return torch_checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._lmforge_checkpointed = True
    return len(blocks)


_COMPILE_OPTIONS: dict[str, Any] = {}
"""``torch.compile`` options of each block (defaults: inductor, graph breaks allowed; tests trace with others)."""


def compile_blocks(model: Any) -> int:
    """Compile each Transformer block in place (regional compilation, as torchtitan); returns the number of blocks.

    The blocks run one code object, so dynamo compiles one graph and reuses it for every block: seconds where the
    whole GPT-2 traced as one graph takes a minute or more. Compiled in place (``nn.Module.compile``), the module
    names and ``state_dict`` keys stay the same, and data-parallel wrappers keep their hooks outside the graphs
    (DDP's bucketed all-reduces overlap the backward; FSDP2 gathers and frees per block). The embedding, the final
    norm and the fused loss's GEMMs run eagerly; the loss's elementwise part per chunk (log-softmax, exp, minus the
    one-hot, the cast: ~6 passes over a float32 chunk of logits eagerly) is compiled on its own
    (:func:`lmforge.model.losses.softmax_grad`), used off the CPU, where the loss takes its sync-free form.
    """
    blocks = list(getattr(model, "layers", []))
    for block in blocks:
        block.compile(**_COMPILE_OPTIONS)
    if hasattr(model, "loss_compile"):  # the fused loss's elementwise part too (used off the CPU)
        model.loss_compile = dict(_COMPILE_OPTIONS)
    return len(blocks)


def wrap_model(model: Any, mode: Literal["none", "ddp", "fsdp"], info: DistInfo, compile: bool = False,
               activation_checkpointing: bool = False) -> Any:
    """Compile and/or wrap a single-device model for data parallelism (no wrapping without a process group).

    In torchtitan's order, innermost first: activation checkpointing per block, ``compile`` per block
    (:func:`compile_blocks`, in place), then ``ddp`` (replicate the model and average gradients) or ``fsdp``
    (shard parameters, gradients and optimizer state per Transformer block with FSDP2 ``fully_shard``).
    With ``fsdp`` build the optimizer *after* wrapping, and save/load through :func:`full_state_dicts`
    and :func:`load_full_optimizer_state`. Checkpoints always hold the full, unwrapped weights.
    """
    if mode not in ("none", "ddp", "fsdp"):
        raise ValueError(f"training.parallel must be none, ddp or fsdp, got {mode!r}")
    if activation_checkpointing:  # first, inside every other wrapper (as torchtitan: AC, compile, then FSDP)
        checkpoint_blocks(model)
    if compile:
        compile_blocks(model)
    if mode == "fsdp" and _active():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard  # here: importing FSDP costs every process ~1 s of CPU

        # the run's own device type: FSDP2's default mesh is the machine's accelerator, which moves a CPU run's
        # shards to CUDA on any machine that has a GPU
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in getattr(model, "layers", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "ddp" and _active():
        ids = [info.device.index] if info.device.type == "cuda" else None
        model = DDP(model, device_ids=ids)
    return model


@contextlib.contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """Reduce gradients across ranks in this backward (``enabled``) or only accumulate them locally, for the
    micro-batches before a step's last: DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``;
    nothing to do for a model that is not data-parallel."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


class _StateView:
    """Something with a ``state_dict()`` method, for passing gathered state dicts to ``save_checkpoint``."""
    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def full_state_dicts(model: Any, optimizer: Any) -> tuple[_StateView, _StateView]:
    """Full (unsharded, CPU) model and optimizer state of an FSDP model, as objects with ``state_dict()``.

    A collective: every rank must call it; the tensors are complete on rank 0, which writes the checkpoint.
    The optimizer state is keyed by parameter name (what :func:`load_full_optimizer_state` expects).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (_StateView(get_model_state_dict(model, options=opts)),
            _StateView(get_optimizer_state_dict(model, optimizer, options=opts)))


def load_full_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Load a full optimizer state written by :func:`full_state_dicts` into an FSDP model's optimizer."""
    if any(not isinstance(k, str) for k in state.get("state", {})):
        raise ValueError("this checkpoint's optimizer state was saved without FSDP; resume with the same "
                         "training.parallel it was trained with")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
