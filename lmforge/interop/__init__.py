"""Interoperability: lmforge models and tokenizers to and from other tools (Hugging Face ``transformers``)."""
