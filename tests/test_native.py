"""lmforge._native, the one loader of the C++ extension: what it returns when the extension is built, what it
says when the extension is missing or stale, and that every caller then takes its pure-Python path."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import make_corpus_text

from lmforge import _native
from lmforge.corpus.sources import split_documents
from lmforge.tokenizer import Tokenizer, train_bpe

PKG = Path(_native.__file__).parent
needs_core = pytest.mark.skipif(not _native.available(), reason="C++ extension not built")


@needs_core
def test_core_is_the_built_extension():
    import lmforge._core

    assert _native.core() is lmforge._core
    assert lmforge._core.ABI_VERSION == _native.ABI_VERSION
    assert _native.available() and _native.available("linear_rows")


def test_every_feature_asked_for_is_a_name_of_the_extension():
    # A misspelt name would quietly send its caller down the slow pure-Python path.
    asked = set()
    for path in PKG.rglob("*.py"):
        asked |= set(re.findall(r"_native\.available\(\"(\w+)\"\)", path.read_text(encoding="utf-8")))
    assert {"Encoder", "PretokenCounter", "train_bpe", "split_documents"} <= asked
    stub = (PKG / "_core.pyi").read_text(encoding="utf-8")
    for name in asked:
        assert re.search(rf"^(?:def|class) {name}\b", stub, re.M), f"lmforge._core has no {name!r}"
        if _native.available():
            assert _native.available(name), name
    assert not _native.available("no_such_kernel")


def test_a_missing_extension_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(_native, "_loaded", None)  # forget the loaded module, as in a fresh process
    monkeypatch.setitem(sys.modules, "lmforge._core", None)  # the import fails as if never built
    with pytest.raises(ImportError, match=re.escape(f"`{_native.REBUILD_COMMAND}`")):
        _native.core()
    assert not _native.available() and not _native.available("Encoder")


def test_a_stale_extension_says_to_rebuild(monkeypatch):
    stale = types.ModuleType("lmforge._core")
    stale.ABI_VERSION = _native.ABI_VERSION - 1
    stale.Encoder = object
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.setitem(sys.modules, "lmforge._core", stale)
    with pytest.raises(ImportError, match=rf"ABI_VERSION {_native.ABI_VERSION - 1}.*rebuild"):
        _native.core()
    assert not _native.available("Encoder")


def test_callers_take_the_python_path_without_the_extension(monkeypatch, tmp_path, tiny_tokenizer):
    corpus = tmp_path / "c.txt"
    corpus.write_text(make_corpus_text(40, seed=3), encoding="utf-8")
    buf = b"  one \n\ntwo\n\n\n\nthree"
    fast = train_bpe(corpus, 300, ["<|endoftext|>"], progress=False), split_documents(buf, b"\n\n", True, want_crc=True)

    monkeypatch.setattr(_native, "_loaded", None)  # forget the loaded module, as in a fresh process
    monkeypatch.setitem(sys.modules, "lmforge._core", None)
    assert Tokenizer(tiny_tokenizer.vocab, tiny_tokenizer.merges).backend == "python"
    with pytest.raises(ValueError, match=re.escape(_native.REBUILD_COMMAND)):
        Tokenizer(tiny_tokenizer.vocab, tiny_tokenizer.merges, backend="cpp")
    slow = train_bpe(corpus, 300, ["<|endoftext|>"], progress=False), split_documents(buf, b"\n\n", True, want_crc=True)
    assert slow[0] == fast[0]
    assert all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(slow[1], fast[1], strict=True))


def test_importing_the_loader_and_its_callers_does_not_load_the_extension():
    code = ("import sys, lmforge._native, lmforge.corpus.sources, lmforge.tokenizer, lmforge.data\n"
            "assert 'lmforge._core' not in sys.modules, 'lmforge._core imported at import time'")
    subprocess.run([sys.executable, "-c", code], check=True)
