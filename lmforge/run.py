"""Run directories: how lmforge recognises one, creates one and opens one.

A run directory is made by ``lmforge train`` (or the speedrun) and holds ``config.yaml``, ``tokenizer.json``,
``checkpoints/``, ``metrics.jsonl``, ``loss.png`` and the marker ``lmforge-run.json``. The marker is what
makes a folder a run: training refuses a non-empty folder without it (unless forced), so a user's own
``config.yaml`` or ``metrics.jsonl`` is never overwritten by accident. Runs written before the marker existed
are recognised by a checkpoint written by ``lmforge train``; they get the marker on their next resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from lmforge import __version__
from lmforge.checkpoint import Checkpoint, CheckpointManager, grow_rows, lora_delta, read_checkpoint, read_metadata
from lmforge.common import atomic_write_text, sha256_file
from lmforge.config import load_yaml

MARKER = "lmforge-run.json"
"""File name of the marker that makes a directory an lmforge run."""
LOCK = ".lmforge-lock"
"""File in a run directory that the process training into it holds (``flock``; :func:`run_lock`)."""
BASE_FILE = "base.json"
"""File of a fine-tuned run naming its base: ``run``, ``checkpoint`` (the file it started from), its ``sha256``,
and ``lora`` (``{rank, alpha, targets}`` when the run's checkpoints hold LoRA adapters only, else null)."""


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a run directory made by lmforge (marker, or a pre-marker run's checkpoint)."""
    p = Path(path)
    if (p / MARKER).is_file():
        return True
    return (p / "config.yaml").is_file() and _has_training_checkpoint(p)


def _has_training_checkpoint(p: Path) -> bool:
    """A checkpoint written by ``lmforge train`` (pre-marker runs): its header carries the training state."""
    for _, path in reversed(CheckpointManager(p).steps()):
        try:
            extra = read_metadata(path).get("extra") or {}
        except (ValueError, OSError):
            continue
        if isinstance(extra.get("train"), dict):
            return True
    return False


def check_new_or_run(path: str | os.PathLike, force: bool = False) -> Path:
    """Check that training may write into ``path``; nothing is created here.

    Allowed: a path that does not exist, an empty directory, or an lmforge run (to resume it). A file, or a
    non-empty directory that is not a run, is refused with a ``ValueError`` unless ``force`` (then lmforge's
    files are written beside the ones already there, replacing any of the same names).
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"run directory {p} is an existing file, not a directory; choose another --run-dir")
    if not p.exists() or is_run_dir(p) or force:
        return p
    try:
        entries = sorted(e.name for e in p.iterdir() if e.name != LOCK)  # a lock alone: a run that never began
    except PermissionError:
        raise ValueError(f"run directory {p} is not readable; check its permissions") from None
    if entries:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ValueError(f"{p} is not empty ({shown}) and is not an lmforge run directory; choose a new --run-dir, "
                         "or pass --force to write the run's files into it anyway")
    return p


@contextlib.contextmanager
def run_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold run directory ``path``'s lock (created if needed) while training writes into it: a second process
    training into the same directory is refused with a ``ValueError`` instead of interleaving its checkpoints and
    metrics with the first's. The lock is the system's (``flock`` on :data:`LOCK`), so a killed process's lock
    goes with it; where ``flock`` does not exist nothing is locked."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    fd = os.open(p / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            raise ValueError(f"another process{f' (pid {holder})' if holder else ''} is training in {p}; wait for "
                             "it to finish (a later run resumes from its checkpoints), or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def mark(path: str | os.PathLike) -> None:
    """Write the marker into ``path`` (kept if present: it records when and by which version the run began)."""
    p = Path(path) / MARKER
    if p.is_file():
        return
    atomic_write_text(p, json.dumps({"format": 1, "created_by": f"lmforge {__version__}",
                                     "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")


def require_run(path: str | os.PathLike, needs: tuple[str, ...] = ("config.yaml",)) -> Path:
    """``path`` as a Path after checking it is an existing run directory holding the files ``needs``.

    Every command that reads a run (eval, generate, the speedrun's later stages) opens it through here, so
    a missing path, a file, or a folder that is not a run get the same one-line message.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"run directory {p} does not exist; train one first (lmforge train CONFIG.yaml "
                         f"--run-dir {p}, or lmforge speedrun --out {p})")
    if not p.is_dir():
        raise ValueError(f"{p} is a file, not a run directory; give the directory written by `lmforge train` "
                         "(a checkpoint file goes to --checkpoint)")
    if not is_run_dir(p):
        raise ValueError(f"{p} is not an lmforge run directory (no {MARKER}); give a directory written by "
                         "`lmforge train` or `lmforge speedrun`")
    for name in needs:
        if not (p / name).is_file():
            raise ValueError(f"{p} has no {name}; give a run directory written by `lmforge train`")
    return p


def write_base(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write a fine-tuned run's :data:`BASE_FILE` (atomically)."""
    atomic_write_text(Path(path) / BASE_FILE, json.dumps(record, indent=1) + "\n")


def read_base(path: str | os.PathLike) -> dict[str, Any] | None:
    """A run's :data:`BASE_FILE` as a dict, or None for a run that was not fine-tuned."""
    p = Path(path) / BASE_FILE
    if not p.is_file():
        return None
    try:
        record = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON ({e}); it records the run's base, restore it") from None
    if not isinstance(record, dict) or not {"run", "checkpoint", "sha256"} <= set(record):
        raise ValueError(f"{p} does not name a base run (run, checkpoint, sha256); restore it")
    return record


def check_no_other_checkpoints(path: str | os.PathLike, step: int, flag: str = "--out") -> None:
    """``ValueError`` when ``path`` holds checkpoints other than ``step_{step}`` (``--force`` onto a trained run):
    a model written there as one checkpoint would be outranked by a newer step, or mixed with a best or a
    sharded one, and readers would open the old model. So is a LoRA run's ``base.json`` (readers would fold its
    adapters into whatever is written there)."""
    ckpts = CheckpointManager(path)
    others = [p for s, p in ckpts.steps() if s != step] + [p for _, p in ckpts.dcp_steps()]
    others += [ckpts.best_path] if ckpts.best_path.exists() else []
    record = read_base(path) if Path(path).is_dir() else None
    others += [Path(path) / BASE_FILE] if record and record.get("lora") else []
    if others:
        raise ValueError(f"{flag} {path} holds another model's checkpoints ({others[0].name}"
                         f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}); the model written there "
                         f"would be mixed with them (the newest step wins), even with --force; choose a new {flag}, "
                         "or delete that run first")


def source_dirs(path: str | os.PathLike) -> list[Path]:
    """The directories that reading the run ``path`` opens: the run, and for a LoRA run its base run (and that
    one's base, while the bases are LoRA runs too). Writers check their output against them
    (:func:`lmforge.common.check_apart`)."""
    dirs = [Path(path)]
    record = read_base(dirs[-1]) if dirs[-1].is_dir() else None
    while record is not None and record.get("lora") and Path(record["run"]) not in dirs:
        dirs.append(Path(record["run"]))
        record = read_base(dirs[-1]) if dirs[-1].is_dir() else None
    return dirs


def _with_base(run_dir: Path, config: dict[str, Any], adapters: Checkpoint, record: dict[str, Any]) -> Checkpoint:
    """A LoRA run's checkpoint as a plain model's: the base checkpoint's weights, the embedding and head grown
    to ``model.vocab_size`` with mean rows and every adapter folded in (``W + alpha/rank · B A``): the same
    ``checkpoint.grow_rows`` and ``checkpoint.lora_delta`` that ``TransformerLM.resize_vocab`` and
    ``lmforge.model.lora.merge_lora`` use on a model."""
    import torch

    base_path = Path(record["checkpoint"])
    if not base_path.is_file():
        raise ValueError(f"{run_dir} holds LoRA adapters for the base checkpoint {base_path}, which is gone; "
                         "restore it (or merge the adapters into a plain run while it exists: lmforge lora merge)")
    if sha256_file(base_path) != record["sha256"]:
        raise ValueError(f"{run_dir} holds LoRA adapters trained on another base: {base_path} changed since "
                         "(sha256 differs); restore the base checkpoint they were trained on")
    base_run = Path(record["run"])
    inner = read_base(base_run) if base_run.is_dir() else None
    # the base itself a LoRA run (fine-tuned from one): its own adapters are folded first
    base = open_run(base_run, base_path).checkpoint if inner and inner.get("lora") else read_checkpoint(base_path)
    state = dict(base.model)
    vocab = int(config["model"]["vocab_size"])
    with torch.no_grad():
        tables = [k for k in state if k.startswith("value_embeddings.") and k.endswith(".weight")]
        for name in ("token_embeddings.weight", "lm_head.weight", *tables):  # every table indexed by token id
            w = state.get(name)
            if w is not None and w.shape[0] < vocab:
                state[name] = grow_rows(w, vocab)
        if config["model"].get("tie_embeddings") and "token_embeddings.weight" in state:
            state["lm_head.weight"] = state["token_embeddings.weight"]
        scale = float(record["lora"]["alpha"]) / int(record["lora"]["rank"])
        for key, a in adapters.model.items():
            if not key.endswith(".lora_A"):
                continue
            module = key[: -len(".lora_A")]
            w = state[f"{module}.weight"]
            state[f"{module}.weight"] = w + lora_delta(a, adapters.model[f"{module}.lora_B"], scale, w.dtype)
    return Checkpoint(model=state, optimizer=None, iteration=adapters.iteration, extra=adapters.extra)


@dataclasses.dataclass
class Run:
    """An opened run directory: its resolved config (as saved), its tokenizer file and one verified checkpoint."""

    path: Path
    config: dict[str, Any]
    """``config.yaml`` as a dict (``config["model"]`` builds the ``ModelConfig``)."""
    tokenizer_path: Path
    checkpoint_path: Path
    checkpoint: Checkpoint


def open_run(path: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> Run:
    """Open a run directory for reading: the one place that checks it and finds its checkpoint.

    ``checkpoint``: a file, ``"best"`` (``checkpoints/best.safetensors``) or None for the newest step checkpoint
    that verifies (a corrupt newer one is skipped with a warning). ``ValueError`` with what to do for a missing
    or foreign directory, a missing ``config.yaml``/``tokenizer.json``, or no checkpoint.

    A LoRA run's checkpoints hold its adapters only; here they are folded into its base's weights (found
    through :data:`BASE_FILE`, refused if that file changed), so every reader gets a plain model's checkpoint.
    """
    p = require_run(path, needs=("config.yaml", "tokenizer.json"))
    ckpts = CheckpointManager(p)
    if checkpoint is None:
        found = ckpts.load_latest()
        if found is None and ckpts.dcp_steps():
            raise ValueError(f"{ckpts.dir} holds sharded checkpoints only (training.checkpoint_format=dcp); write one "
                             f"as a file with `lmforge checkpoint consolidate {p}`, then try again")
        if found is None:
            raise ValueError(f"no checkpoint in {ckpts.dir}; train first, or pass --checkpoint FILE")
        ckpt_path, ckpt = found
    else:
        ckpt_path = ckpts.best_path if str(checkpoint) == "best" else Path(checkpoint)
        ckpt = read_checkpoint(ckpt_path)
    config = load_yaml(p / "config.yaml")
    record = read_base(p)
    if record is not None and record.get("lora"):
        ckpt = _with_base(p, config, ckpt, record)
    return Run(path=p, config=config, tokenizer_path=p / "tokenizer.json", checkpoint_path=ckpt_path,
               checkpoint=ckpt)
