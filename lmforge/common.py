"""Small shared helpers: atomic file writes, device/dtype choice, seeding, logging.

Everything here is dependency-light and side-effect free at import time; torch is imported lazily
inside the functions that need it so that the tokenizer can be used without loading torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

logger = logging.getLogger("lmforge")


# --------------------------------------------------------------------------------------------------
# Files: atomic writes and refusing to clobber
# --------------------------------------------------------------------------------------------------
def check_output_path(path: str | os.PathLike, force: bool = False) -> Path:
    """Return ``path`` as a Path after checking it may be written.

    Raises ``ValueError`` when the file already exists and ``force`` is false, or when the path is
    an existing directory, so that no user data is overwritten by accident.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"output path {p} is a directory; give a file path")
    if p.exists() and not force:
        raise ValueError(f"output file {p} already exists; pass force=True (CLI: --force) to overwrite it")
    return p


def check_apart(out: str | os.PathLike, *sources: str | os.PathLike, flag: str = "--out") -> None:
    """``ValueError`` when the output path ``out`` is one of the ``sources`` a command reads, lies inside one,
    or holds one: ``--force`` replaces what is at ``out``, and must never replace the command's own input."""
    o = Path(out).resolve()
    for source in sources:
        s = Path(source).resolve()
        where = "is" if o == s else "is inside" if s in o.parents else "holds" if o in s.parents else None
        if where:
            raise ValueError(f"{flag} {out} {where} {source}, which this command reads: writing there (even with "
                             f"--force) would replace its own input; choose a {flag} outside it")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` and rename it over ``path`` only on success.

    A crash, a full disk or an exception while writing leaves the previous file intact and no
    half-written file under the final name. The data is fsync'ed before the rename.
    """
    if "b" in mode:
        encoding = None
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f


_TEMP_TAG = ".lmforge-"  # atomic_open's temporaries are ".{name}.lmforge-{random}.tmp": never a user's file


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed over ``path`` only when the block succeeds (data fsync'ed first).

    For writers that open the file themselves (``gguf.GGUFWriter``); :func:`atomic_open` is built on it.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temporary(p.parent, f".{p.name}{_TEMP_TAG}", ".tmp")
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_current_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _new_temporary(directory: Path, prefix: str, suffix: str) -> str:
    """Create an empty file ``prefix + 16 random hex digits + suffix`` in ``directory`` (mode 0600, never an
    existing file: ``O_EXCL``), like ``tempfile.mkstemp``, whose import (with random) costs ~1 ms of every
    command that writes a file."""
    while True:
        name = os.path.join(directory, f"{prefix}{os.urandom(8).hex()}{suffix}")
        try:
            os.close(os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
            return name
        except FileExistsError:
            continue


def temporary_target(path: str | os.PathLike) -> str | None:
    """The file name a temporary of :func:`atomic_open` was going to become, or None if ``path`` is not one."""
    name = Path(path).name
    if not (name.startswith(".") and name.endswith(".tmp")) or _TEMP_TAG not in name:
        return None
    return name[1:].rsplit(_TEMP_TAG, 1)[0]


def remove_stale_temporaries(directory: str | os.PathLike, names: Iterable[str] | None = None) -> list[Path]:
    """Delete :func:`atomic_open` temporaries in ``directory`` left by a killed process; returns them.

    Only lmforge's own temporaries are touched (a user's ``.notes.tmp`` is not), and with ``names`` only
    those whose target is one of ``names``.
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    wanted = None if names is None else set(names)
    removed = []
    for p in d.glob(f".*{_TEMP_TAG}*.tmp"):
        target = temporary_target(p)
        if target is not None and (wanted is None or target in wanted):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks (flat memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def check_input_file(path: str | os.PathLike) -> Path:
    """Return ``path`` as a Path after checking it is a readable regular file (``ValueError`` if not)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"input file {p} does not exist; check the path")
    if p.is_dir():
        raise ValueError(f"input path {p} is a directory; give a file (or a glob such as '{p}/*.txt')")
    if not os.access(p, os.R_OK):
        raise ValueError(f"input file {p} is not readable; check its permissions")
    return p


def is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode: no lone surrogate (which JSON can spell, ``"\\ud800"``, and no UTF-8
    text holds)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Token ids
# --------------------------------------------------------------------------------------------------
def token_ids(ids: Iterable[Any], vocab_size: int, what: str = "token id") -> list[int]:
    """``ids`` as a list of ints after checking each is an integer in ``[0, vocab_size)``.

    Floats (``3.0`` or ``3.7``), booleans and strings are refused rather than truncated, and a negative id
    is refused rather than read from the end of a table; integer numpy/torch arrays and scalars are accepted.
    """
    if hasattr(ids, "dtype") and hasattr(ids, "tolist"):  # a numpy array or a torch tensor: check its dtype once
        kind = str(ids.dtype)
        if "int" not in kind or "bool" in kind:
            raise ValueError(f"{what}s must be integers, got an array of {kind}")
        out = ids.tolist()
        out = out if isinstance(out, list) else [out]
    else:
        out = []
        for i in ids:
            if hasattr(i, "dtype") and hasattr(i, "item") and "int" in str(i.dtype) and "bool" not in str(i.dtype):
                i = i.item()
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"{what}s must be integers, got {i!r} ({type(i).__name__})")
            out.append(i)
    for i in out:
        if isinstance(i, list) or not 0 <= i < vocab_size:
            raise ValueError(f"{what} {i!r} is out of range [0, {vocab_size}); was the text encoded with a "
                             "different tokenizer, or is the model's vocabulary smaller?")
    return out


# --------------------------------------------------------------------------------------------------
# Devices, dtypes, seeds (torch imported lazily)
# --------------------------------------------------------------------------------------------------
def resolve_device(name: str = "auto") -> "Any":
    """Turn ``"auto" | "cpu" | "cuda" | "cuda:N" | "mps"`` into a ``torch.device``.

    ``auto`` prefers CUDA, then Apple MPS, then the CPU. Asking for a device that is not present
    raises ``ValueError`` with the devices that are.
    """
    import torch  # here: the tokenizer and data stages run without torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (n := torch.cuda.device_count()):
        raise ValueError(f"device {name!r} is out of range: this machine has {n} CUDA device{'s' if n > 1 else ''} "
                         f"(cuda:0{f' .. cuda:{n - 1}' if n > 1 else ''}); use one of those, cuda or auto")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} requested but MPS is not available; use --device cpu or auto")
    return dev


def cuda_matmul_defaults(device: Any) -> str:
    """On CUDA, let float32 matmuls run on the tensor cores as TF32 (10-bit mantissa inputs, float32 sums), as
    nanoGPT and Lightning advise, unless the caller chose a precision; returns the setting to restore after.

    Only torch's default (``"highest"``) is changed, and only for a CUDA ``device``: CPU numerics stay exact.
    """
    import torch  # here: the tokenizer and data stages run without torch

    previous = torch.get_float32_matmul_precision()
    if getattr(device, "type", None) == "cuda" and previous == "highest":
        torch.set_float32_matmul_precision("high")
    return previous


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_dtype(name: str) -> "Any":
    """Map ``"fp32" | "bf16" | "fp16"`` (or full names) to a ``torch.dtype``; ``ValueError`` otherwise."""
    import torch  # here: the tokenizer and data stages run without torch

    key = _DTYPES.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return getattr(torch, key)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (all devices)."""
    import random  # here, like numpy and torch: the tokenizer stage never seeds

    import numpy as np  # here: tokenizer training keeps numpy out of the process (~13 MB)
    import torch  # here: the tokenizer and data stages run without torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the ``lmforge`` logger once for command-line use (never called on import)."""
    if not logger.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(h)
    logger.setLevel(level)
    logger.propagate = False


def num_threads_default() -> int:
    """Worker threads for CPU-parallel work: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
