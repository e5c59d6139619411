"""Stage 2, text + tokenizer -> token shards -> batches: the shard format, loaders and ``prepare``.

``shards`` is the shard file format and its manifest (:class:`TokenDataset` memory-maps a split); ``loader``
turns a split into training batches with exact resume (``mixture``: synthetic copy data written into them);
``pipeline`` is ``prepare``: documents from :mod:`lmforge.corpus` -> shards in parallel, crash-resumable.
"""

from lmforge.data.loader import BlockLoader, get_batch, val_batches
from lmforge.data.mixture import COPY_SOURCES, CopyMixture, copy_mixture
from lmforge.data.pipeline import DEFAULT_SHARD_TOKENS, prepare, prepare_dataset
from lmforge.data.shards import TokenDataset, inspect, load_manifest

__all__ = ["BlockLoader", "get_batch", "val_batches", "COPY_SOURCES", "CopyMixture", "copy_mixture",
           "DEFAULT_SHARD_TOKENS", "prepare", "prepare_dataset", "TokenDataset", "inspect", "load_manifest"]
