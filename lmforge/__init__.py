"""lmforge: build a language model from scratch and understand every part of it.

The package is flat and data flows one way:
``common/config -> tokenizer -> data -> model -> train -> generate/serve``, with a thin CLI on top.
Importing :mod:`lmforge` has no side effects (no CUDA queries, no logging setup, no file writes).
"""

__version__ = "0.1.0"
