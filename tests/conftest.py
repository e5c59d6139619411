"""Shared pytest fixtures: per-test restore of global state, the optional CS336 fixture directory and tiny
corpora written into tmp_path.

Every test starts from the same global state whatever ran before it (``_restore_global_state``), so the
suite passes in any order: ``pytest --reverse`` runs it backwards, ``pytest --random-order`` shuffled
(pytest-random-order, in the test extras; ``--random-order-seed=N`` repeats an order).

The main suite is hermetic: it makes its own data. Tests that need the CS336 fixtures (GPT-2
vocab/merges, corpus.en, ...) take the ``shared_fixtures`` fixture, which skips cleanly when the
directory beside the repository is absent (a user's clone has no ``../shared``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

SHARED_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared/fixtures/cs336/fixtures"

_WORDS = ("the a cat dog sat on mat and ran to house little big happy girl boy tree sun day "
          "said was it he she they we you I lower lowest newer wider don't it's we'll 42 2024 "
          "3.14 héllo naïve 世界 你好 ok!").split()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): two workers share the two cores, so
        torch.set_num_threads(1)  # each computes on one (two each only spin-wait for the core the other holds)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reverse", action="store_true", help="run the collected tests in reverse order")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()


def global_state() -> dict[str, Any]:
    """The process-wide settings a test can change and leave behind: torch's threads, default dtype, grad
    mode, numerics flags, the global RNGs, the ``lmforge`` logger (the CLI configures it), the working
    directory and the environment."""
    log = logging.getLogger("lmforge")
    return {
        "num_threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "anomaly": torch.is_anomaly_enabled(),
        "rng_torch": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "rng_python": random.getstate(),
        "rng_numpy": np.random.get_state(),
        "logger": (list(log.handlers), log.level, log.propagate),
        "cwd": os.getcwd(),
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},  # pytest's own
    }


def set_global_state(s: dict[str, Any]) -> None:
    """Put back what :func:`global_state` returned."""
    if torch.get_num_threads() != s["num_threads"]:
        torch.set_num_threads(s["num_threads"])
    torch.set_default_dtype(s["default_dtype"])
    torch.set_grad_enabled(s["grad_enabled"])
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != \
            s["deterministic"]:  # only if changed: the first call takes seconds (it imports half of torch)
        torch.use_deterministic_algorithms(s["deterministic"][0], warn_only=s["deterministic"][1])
    torch.set_float32_matmul_precision(s["matmul_precision"])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = s["cudnn"]
    torch.set_anomaly_enabled(s["anomaly"])
    torch.set_rng_state(s["rng_torch"])
    if s["rng_cuda"] is not None:
        torch.cuda.set_rng_state_all(s["rng_cuda"])
    random.setstate(s["rng_python"])
    np.random.set_state(s["rng_numpy"])
    log = logging.getLogger("lmforge")
    log.handlers[:], log.propagate = s["logger"][0], s["logger"][2]
    log.setLevel(s["logger"][1])
    os.chdir(s["cwd"])
    for k in [k for k in os.environ if k not in s["environ"] and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[k]
    os.environ.update({k: v for k, v in s["environ"].items() if os.environ.get(k) != v})


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """PyTorch on ``n`` threads within, the caller's count after. Tests run their tiny reference computations
    (full recomputes, a few hundred steps of a toy model) on one: on tensors this small a second OpenMP thread
    only spin-waits, which costs ~10x the time on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    """Each test leaves the process as it found it (see :func:`global_state`)."""
    before = global_state()
    yield
    set_global_state(before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Under ``pytest -n N`` a test marked ``serial`` (it measures time: a latency bound, a GIL share) runs, its
    fixtures' setup and teardown included, while no other worker runs anything. Every test holds a shared lock
    on one file and a ``serial`` test an exclusive one; a second file, taken by every test on its way in and
    held by a ``serial`` test throughout, keeps the other workers from starving it. Without xdist: nothing."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return (yield)
    folder = Path(tempfile.gettempdir()) / f"lmforge-pytest-{run}"
    folder.mkdir(exist_ok=True)
    serial = item.get_closest_marker("serial") is not None
    with open(folder / "door", "a") as door, open(folder / "room", "a") as room:
        fcntl.flock(door, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(door, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(door, fcntl.LOCK_UN)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (those the kernel lets programs use); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.fixture(params=["avx512_vnni", "avx512", "avx2", "scalar"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on each instruction set of the C++ decode kernels (``_core.linear_isa()``'s names) that this
    CPU has, the wider ones switched off for it; all must match the reference. The sets the CPU lacks are skipped,
    and so is a forced "avx512" on a VNNI CPU: it runs the AVX-512 float tiles, which "avx512_vnni" runs too, and the
    AVX2 integer tiles, which "avx2" runs (tests/generate/test_decode_step.py compares the sets' bits directly).
    ``LMFORGE_TEST_ISAS`` (comma-separated names, "widest" for the CPU's widest) limits the sets (tools/sanitize.sh).
    The bf16-activation mode is off throughout (the default arithmetic; tests/generate/test_bf16_activations.py
    holds the mode to its own reference). Needs the extension: use it in modules that skip without it."""
    from lmforge._native import core

    _core = core()
    wanted = os.environ.get("LMFORGE_TEST_ISAS", "").replace("widest", _core.linear_isa()).split(",")
    if wanted != [""] and request.param not in wanted:
        pytest.skip(f"LMFORGE_TEST_ISAS={os.environ['LMFORGE_TEST_ISAS']}")
    if request.param == "avx512" and _core.linear_isa() == "avx512_vnni":
        pytest.skip("on an AVX-512 VNNI CPU the avx512_vnni and avx2 runs cover every kernel a forced avx512 runs")
    _core.linear_bf16_activations(False)
    _core.linear_force_scalar(request.param == "scalar")
    _core.linear_force_avx2(request.param == "avx2")
    _core.linear_force_avx512(request.param == "avx512")
    try:
        runs = _core.linear_isa()
        if runs != request.param:
            pytest.skip(f"this CPU has no {request.param} for the decode kernels (they run {runs})")
        yield request.param
    finally:
        _core.linear_force_scalar(False)
        _core.linear_force_avx2(False)
        _core.linear_force_avx512(False)


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """The CS336 fixtures directory (``../shared/fixtures/cs336/fixtures``); skips the test when absent."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"CS336 fixtures not found at {SHARED_FIXTURES}")
    return SHARED_FIXTURES


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


# csrc/unicode_tables.h (the C++ pre-tokenizers' letter/number/space classes) is generated from a release of the
# `regex` module; the tests compare the C++ side with the installed `regex`.
_TABLES = Path(__file__).resolve().parents[1] / "csrc" / "unicode_tables.h"
TABLES_REGEX = _version(m.group(1)) if _TABLES.is_file() and (m := re.search(
    r"`regex` module ([\d.]+)", _TABLES.read_text(encoding="utf-8")[:300])) else ()


def regex_knows_the_tables() -> bool:
    """Whether the installed ``regex`` knows at least the Unicode version the C++ tables were made from. An
    older one (a GPU image's, say) has no class for the code points assigned since: there, and only there, the
    C++ side and the ``regex`` reference rightly differ."""
    import regex

    return _version(regex.__version__) >= TABLES_REGEX


def characters() -> Any:
    """A Hypothesis strategy of single code points for comparing the C++ pre-tokenizers with ``regex``: any but
    surrogates, and where the installed ``regex`` is older than the C++ tables, only code points it has a class
    for (assigned both in this Python's Unicode database and in ``regex``'s)."""
    import regex
    from hypothesis import strategies as st

    if regex_knows_the_tables():
        return st.characters(exclude_categories=("Cs",))
    unassigned = regex.compile(r"\p{Cn}")
    return st.characters(exclude_categories=("Cs", "Cn")).filter(lambda c: not unassigned.match(c))


def make_documents(n_docs: int = 40, seed: int = 0, words_per_doc: int = 60) -> list[str]:
    """Deterministic English-like documents with punctuation, digits, contractions, newlines and non-ASCII."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(words_per_doc // 2, words_per_doc))]
        text = ""
        for i, w in enumerate(words):
            sep = rng.choice([" ", " ", " ", " ", ", ", ". ", "\n", "  ", "\n\n"]) if i else ""
            text += sep + (w.capitalize() if sep.endswith(("\n", ". ")) else w)
        docs.append(text + ".")
    return docs


def tiny_lm(seed: int = 0, **kw: Any) -> Any:
    """A seeded ``TransformerLM`` in eval mode, d_model 64 x 2 layers, vocab 97, context 48 (``kw`` overrides the
    config): the decoder tests' small model."""
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, context_length=48, d_model=64, n_layers=2, n_heads=4, d_ff=96) | kw
    return TransformerLM(ModelConfig(**cfg)).eval()


def make_corpus_text(n_docs: int = 40, seed: int = 0, eot: str = "<|endoftext|>") -> str:
    """:func:`make_documents` joined by ``eot`` (the usual layout of a pretraining text file)."""
    return eot.join(make_documents(n_docs, seed))


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    """A ~10 KB UTF-8 text file of 40 documents separated by ``<|endoftext|>``."""
    p = tmp_path / "tiny_corpus.txt"
    p.write_text(make_corpus_text(), encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A Tokenizer (vocab 400, ``<|endoftext|>``) trained with the reference on :func:`make_corpus_text`."""
    from lmforge.tokenizer.reference import train_bpe_reference
    from lmforge.tokenizer import Tokenizer

    vocab, merges = train_bpe_reference(make_corpus_text().split("<|endoftext|>"), 400, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished 4-step training run (shards with train + val, tokenizer, checkpoints) to read from."""
    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe
    from lmforge.train import load_run_config, train

    d = tmp_path_factory.mktemp("tiny_run")
    corpus = d / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(make_documents(300, seed=3)), encoding="utf-8")
    tok = Tokenizer(*train_bpe(corpus, 300, ["<|endoftext|>"], progress=False), ["<|endoftext|>"])
    prepare(tok, corpus, d / "shards", val_fraction=0.1, progress=False)
    cfg = load_run_config(base={
        "model": {"vocab_size": 320, "context_length": 32, "d_model": 32, "n_layers": 2, "n_heads": 2},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "training": {"max_steps": 4, "batch_size": 4, "device": "cpu", "eval_every": 4, "eval_batches": 2,
                     "checkpoint_every": 4},
        "data": {"dir": str(d / "shards")}})
    train(cfg, d / "run", progress=False)
    return d / "run"
