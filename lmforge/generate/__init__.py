"""Stage 5, a trained model -> text: the KV-cache inference engine, the row step, and the drivers of both.

``engine`` runs a model over its KV cache (prefill, one token per step, verify, rollback, fork; on CPU in the C++
decode kernels on weights packed by ``packed``); ``rows`` decides what each token means (``sampling``,
``constraints``, ``speculative`` drafts, stop ids and strings, text); ``generator`` (the user API and chat turns,
with ``prefix_cache``) and ``scheduler`` (many requests on one engine, rows joining and leaving between steps, for
a server) decide who waits. Generation sees models and tokenizers, never training.
"""

from lmforge.generate.engine import Engine
from lmforge.generate.generator import Generator
from lmforge.generate.sampling import check_sampling, sample_next

__all__ = ["Generator", "Engine", "sample_next", "check_sampling"]
