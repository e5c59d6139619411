"""Stage 1, text -> token ids: byte-level BPE tokenizers, their training and their file formats.

``reference`` is the pure-Python spec (pre-tokenizer patterns, BPE training and encoding); ``training`` is
the fast ``train_bpe`` over the C++ counter; ``formats`` reads and writes lmforge JSON, GPT-2
``vocab.json``/``merges.txt``, HF ``tokenizer.json`` and tiktoken; ``tokenizer`` holds :class:`Tokenizer`.
"""

from lmforge.corpus.specials import EOT  # defined in stage 0, where the corpus readers meet it first
from lmforge.tokenizer.tokenizer import Tokenizer, load_tokenizer, text_stats
from lmforge.tokenizer.training import train_bpe, train_bpe_from_iterator

__all__ = ["EOT", "Tokenizer", "load_tokenizer", "text_stats", "train_bpe", "train_bpe_from_iterator"]
