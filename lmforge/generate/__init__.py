"""Stage 5, a trained model -> text: the KV-cache inference engine, the row step, and the drivers of both.

``engine`` runs a model over its KV cache (on CPU in the C++ decode kernels, on weights ``packed`` for them);
``rows`` decides what each token means (``sampling``, ``constraints``, ``speculative`` drafts, stops, text);
``generator`` (the user API, chat turns) and ``scheduler`` (a server's many requests) decide who waits, both with
``prefix_cache``. Generation sees models and tokenizers, never training.
"""

from lmforge.generate.engine import Engine
from lmforge.generate.generator import Generator
from lmforge.generate.sampling import check_sampling, sample_next

__all__ = ["Generator", "Engine", "sample_next", "check_sampling"]
