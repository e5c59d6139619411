"""Interoperability: lmforge runs to and from other tools.

* :mod:`~lmforge.interop.hf` — the one key map between lmforge and HF Llama weights, and the config mapping.
* :mod:`~lmforge.interop.hf_export` — ``export_hf``: a run -> a ``transformers`` ``LlamaForCausalLM`` folder.
* :mod:`~lmforge.interop.hf_import` — ``import_hf``: a local HF Llama folder -> a run.
* :mod:`~lmforge.interop.hf_tokenizer` — the HF tokenizer files and the chat template.
* :mod:`~lmforge.interop.gguf` — ``export_gguf``: a run -> a GGUF file for llama.cpp.
* :mod:`~lmforge.interop.source` — a run opened and checked for export.

The package itself imports nothing; its modules import torch, and ``gguf.py`` the ``gguf`` package only when
writing a file.
"""
