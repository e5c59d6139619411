"""Stage 2, files -> token shards -> batches: corpora, readers, the shard format, loaders, ``prepare``.

``corpora`` names the built-in corpora and downloads them; ``sources`` reads documents from txt/jsonl/parquet
files (compressed, globs, directories) and routes them to splits; ``shards`` is the shard file format and its
manifest (:class:`TokenDataset` memory-maps a split); ``loader`` turns a split into training batches with exact
resume; ``pipeline`` is ``prepare``: corpora -> shards in parallel, crash-resumable.
"""

from lmforge.data.corpora import DATASETS, get_dataset
from lmforge.data.loader import BlockLoader, get_batch, val_batches
from lmforge.data.pipeline import DEFAULT_SHARD_TOKENS, prepare, prepare_dataset
from lmforge.data.shards import TokenDataset, inspect, load_manifest
from lmforge.data.sources import expand_inputs, iter_documents

__all__ = ["DATASETS", "get_dataset", "BlockLoader", "get_batch", "val_batches", "DEFAULT_SHARD_TOKENS", "prepare",
           "prepare_dataset", "TokenDataset", "inspect", "load_manifest", "expand_inputs", "iter_documents"]
