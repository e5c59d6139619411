"""The end-of-text token, written once: ``EOT`` separates documents everywhere in lmforge.

It is the default document delimiter of the text readers (:mod:`lmforge.corpus.sources`), the special token
the tokenizer learns and appends after each document, and where generation stops. It lives here, in stage 0,
because the corpus readers meet it first: every later stage (tokenizer, data, generate through
``lmforge.tokenizer``) then imports it the way data flows (tests/test_architecture.py), which a home in the
tokenizer would not allow.
"""

EOT = "<|endoftext|>"
