"""Stage 5, a trained model -> text: the KV-cache inference engine, sampling, and ``Generator``.

``engine`` runs a model over its KV cache (prefill, then one token per step; on CPU the step's products,
attention and small ops run in the C++ decode kernels on weights packed by ``packed``); ``sampling`` picks the
next token; ``generator`` drives both and turns ids into text; ``scheduler`` decodes many requests together
on one engine (continuous batching: rows join and leave between steps) for a server.
Generation sees models and tokenizers, never training.
"""

from lmforge.generate.engine import Engine
from lmforge.generate.generator import Generator
from lmforge.generate.sampling import check_sampling, sample_next

__all__ = ["Generator", "Engine", "sample_next", "check_sampling"]
