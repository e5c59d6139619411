"""The one loader of lmforge's C++ extension ``lmforge._core`` (sources in ``csrc/``, signatures in
``_core.pyi``).

Every module that uses the extension asks here: ``core()`` returns it or raises an ``ImportError`` that
says how to build it; ``available(name)`` says whether it is built and offers ``name``, so the caller can
take its pure-Python path instead::

    from lmforge import _native
    if _native.available("split_documents"):
        return _native.core().split_documents(buf, sep, final, want_crc)

The extension is imported on the first call, not when this module is imported.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["ABI_VERSION", "BF16_ACTIVATIONS_ENV", "REBUILD_COMMAND", "available", "core"]

# The ABI_VERSION these Python sources are written against; csrc/bindings.cpp sets the built one. Bump
# both together when a binding changes, so that a stale build says so instead of failing mid-call.
ABI_VERSION = 9
REBUILD_COMMAND = "pip install --no-build-isolation -e ."
# "1": the decode kernels' opt-in bf16-activation products (``_core.linear_bf16_activations``) from the first
# ``core()`` on; "0" or unset: off.
BF16_ACTIVATIONS_ENV = "LMFORGE_BF16_ACTIVATIONS"


_loaded: ModuleType | None = None  # set once the extension has loaded and its ABI checked


def core() -> ModuleType:
    """The ``lmforge._core`` module, built from these sources.

    Raises ``ImportError`` with the command that builds it when the extension is missing, does not load,
    or was built from other sources (its ``ABI_VERSION`` differs), ``ValueError`` when ``BF16_ACTIVATIONS_ENV``
    is set to other than "0" or "1" (when "1", the first call switches that mode on). After the first success
    this is one global read: the decode kernels call it on every product.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        mod = importlib.import_module("lmforge._core")
    except ImportError as e:
        raise ImportError(f"lmforge._core, the C++ extension, is not built or does not load ({e}); build it "
                          f"from the repository root with `{REBUILD_COMMAND}` (needs cmake and a C++17 "
                          "compiler)") from e
    built = getattr(mod, "ABI_VERSION", None)
    if built != ABI_VERSION:
        raise ImportError(f"lmforge._core was built from other sources (ABI_VERSION {built}, these sources "
                          f"need {ABI_VERSION}); rebuild it from the repository root with `{REBUILD_COMMAND}`")
    mode = os.environ.get(BF16_ACTIVATIONS_ENV, "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"{BF16_ACTIVATIONS_ENV} must be 0 or 1 (the decode kernels' bf16 activations), got {mode!r}")
    if mode == "1":
        mod.linear_bf16_activations(True)
    _loaded = mod
    return mod


def available(feature: str | None = None) -> bool:
    """Whether ``core()`` loads and, if ``feature`` is given, offers it: a name of ``_core.pyi``, such as
    ``"Encoder"``, ``"split_documents"`` or ``"linear_rows"`` (the decode kernels)."""
    try:
        mod = core()
    except ImportError:
        return False
    return feature is None or hasattr(mod, feature)
