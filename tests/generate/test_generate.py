"""Generation: cached decoding == naive recompute, batching, sampling filters, stop handling, streaming, loading."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import torch_threads
from lmforge.generate.engine import Engine
from lmforge.generate.generator import Generator
from lmforge.generate.rows import Row, RowStep, TextStream
from lmforge.generate.packed import kernel_available
from lmforge.generate.sampling import check_sampling, sample_next
from lmforge.model import ModelConfig, TransformerLM

VOCAB = 400  # the conftest tiny_tokenizer's size


def tiny_model(seed: int = 0, **kw) -> TransformerLM:
    cfg = dict(vocab_size=VOCAB, context_length=48, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    cfg.update(kw)
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(**cfg)).eval()


def byte_tokenizer():
    """Every byte is one token (so characters split across tokens), plus <|endoftext|> = 256."""
    from lmforge.tokenizer import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = b"<|endoftext|>"
    return Tokenizer(vocab, [], ["<|endoftext|>"])


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 32))]


# --------------------------------------------------------------------------------------------------
# The engine: cached == naive, batched == alone
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"tie_embeddings": True}, {"fast": False}])
def test_cached_greedy_equals_naive_recompute(kw):
    gen = Generator(tiny_model(**kw))
    cached = gen.generate_ids(PROMPTS, 30, temperature=0)
    with torch_threads(1):  # the reference: full forwards of tiny tensors
        naive = gen.generate_ids(PROMPTS, 30, temperature=0, naive=True)
    assert cached == naive
    assert all(len(r) == 30 for r in cached)
    assert len(set(map(tuple, cached))) == 3  # not a degenerate model emitting one constant token


def test_cached_logits_match_full_forward():
    model = tiny_model(n_kv_heads=2)
    dec = Engine(model)
    seq = torch.randint(0, VOCAB, (2, 20))
    with torch.inference_mode():
        full = model(seq)  # (B, T, V)
        got = [dec.prefill(seq[:, :8].tolist(), 20)]
        got += [dec.step(seq[:, t]) for t in range(8, 19)]
    torch.testing.assert_close(torch.stack(got, 1), full[:, 7:19], rtol=1e-4, atol=1e-4)


def test_batched_greedy_equals_one_at_a_time():
    gen = Generator(tiny_model(seed=1))
    batched = gen.generate_ids(PROMPTS, 25, temperature=0)
    alone = [gen.generate_ids(p, 25, temperature=0) for p in PROMPTS]
    assert batched == alone
    same_length = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])  # a (B, T) tensor works as well as lists
    assert gen.generate_ids(same_length, 25, temperature=0) == [alone[2], gen.generate_ids(PROMPTS[2][::-1], 25,
                                                                                          temperature=0)]


def test_sampling_is_reproducible_with_seed():
    gen = Generator(tiny_model())
    a = gen.generate_ids(PROMPTS[0], 40, temperature=1.0, seed=7)
    b = gen.generate_ids(PROMPTS[0], 40, temperature=1.0, seed=7)
    c = gen.generate_ids(PROMPTS[0], 40, temperature=1.0, seed=8)
    assert a == b and a != c
    assert gen.generate_ids(PROMPTS[0], 40, temperature=1.0, seed=7, naive=True) == a


def test_refresh_sees_new_weights():
    model = tiny_model()
    gen = Generator(model)
    before = gen.generate_ids(PROMPTS[0], 10, temperature=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    gen.refresh()
    assert gen.generate_ids(PROMPTS[0], 10, temperature=0) == gen.generate_ids(PROMPTS[0], 10, temperature=0, naive=True)
    assert gen.generate_ids(PROMPTS[0], 10, temperature=0) != before


# --------------------------------------------------------------------------------------------------
# Sampling filters
# --------------------------------------------------------------------------------------------------
def _draws(logits, n=400, **kw) -> set[int]:
    g = torch.Generator().manual_seed(0)
    batch = logits.expand(n, -1)
    return set(sample_next(batch, generator=g, **kw).tolist())


def test_greedy_and_top_k():
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]])
    assert sample_next(logits, temperature=0).tolist() == [1]
    assert _draws(logits, top_k=1) == {1}
    assert _draws(logits, top_k=2) == {1, 2}
    assert _draws(logits, top_k=100) == {0, 1, 2, 3}


def test_greedy_is_torch_argmax():
    """Greedy picks what ``torch.argmax`` picks (on CPU float32 it runs numpy's): ties to the lowest id, a NaN
    as the maximum, on a column slice too (the generator cuts the model's padding ids off that way)."""
    nan = float("nan")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 1.0, nan, 2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -2.0, 5.0, 5.0]])
    for x in (logits, logits[:, :3], logits.double(), logits.T.contiguous().T):
        got = sample_next(x, temperature=0)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert _draws(logits, top_p=0.45) == {0}
    assert _draws(logits, top_p=0.55) == {0, 1}
    assert _draws(logits, top_p=0.85) == {0, 1, 2}
    assert _draws(logits, top_p=1e-9) == {0}  # p -> 0 keeps the argmax, never an empty set
    flat = torch.zeros(1, 50)
    assert _draws(flat, n=4000, top_p=1.0) == set(range(50))  # p = 1 keeps every token


def test_top_p_boundary_is_inclusive():
    """On the boundary: the kept set is the smallest whose total is >= top_p, so at top_p == 0.75 exactly with
    probabilities 0.5, 0.25, 0.1875, 0.0625 (exact in float32, as is every partial sum) the first two are
    kept and the third is not; a hair above 0.75 needs the third. The hair, 2**-20, is exact in float32 too."""
    p = torch.tensor([[0.5, 0.25, 0.1875, 0.0625]])
    logits = p.log()
    assert torch.equal(torch.softmax(logits, -1), p)  # the premise: these are the probabilities sampled from
    hair = 2.0**-20
    assert _draws(logits, top_p=0.5) == {0}
    assert _draws(logits, top_p=0.5 + hair) == {0, 1}
    assert _draws(logits, top_p=0.75 - hair) == {0, 1}
    assert _draws(logits, top_p=0.75) == {0, 1}
    assert _draws(logits, top_p=0.75 + hair) == {0, 1, 2}
    assert _draws(logits, top_p=0.9375) == {0, 1, 2}
    assert _draws(logits, n=2000, top_p=0.9375 + hair) == {0, 1, 2, 3}


def test_top_p_order_independent_of_token_ids():
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log()  # the argmax is id 1
    assert _draws(logits, top_p=0.45) == {1}
    assert _draws(logits, top_p=0.75) == {1, 2}


@pytest.mark.parametrize("kw, msg", [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                     ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
                                     ({"temperature": float("nan")}, "temperature"),
                                     ({"temperature": float("inf")}, "temperature must be a finite number"),
                                     ({"temperature": "1"}, "temperature"), ({"top_p": float("nan")}, "top_p")])
def test_bad_sampling_parameters(kw, msg):
    args = {"temperature": 1.0, "top_k": None, "top_p": None, **kw}
    with pytest.raises(ValueError, match=msg):
        check_sampling(**args)
    with pytest.raises(ValueError, match=msg):
        Generator(tiny_model()).generate_ids([1, 2], 5, **kw)


# --------------------------------------------------------------------------------------------------
# Prompts, context length, stop tokens
# --------------------------------------------------------------------------------------------------
def test_bad_prompts():
    gen = Generator(tiny_model())
    with pytest.raises(ValueError, match="empty"):
        gen.generate_ids([[1, 2], []], 5)
    with pytest.raises(ValueError, match="context length"):
        gen.generate_ids(list(range(49)), 5)
    with pytest.raises(ValueError, match=rf"prompt 0: token id {VOCAB} is out of range \[0, {VOCAB}\)"):
        gen.generate_ids([1, VOCAB], 5)
    with pytest.raises(ValueError, match=r"prompt 1: token id -1 is out of range"):
        gen.generate_ids([[1], [2, -1]], 5)
    for floats in ([1.0, 2.0], [[1, 2.7]], torch.tensor([1.0, 2.0]), np.array([[1.5, 2.0]])):
        with pytest.raises(ValueError, match="must be integers, got"):  # refused, never truncated
            gen.generate_ids(floats, 5)
    with pytest.raises(ValueError, match="must be integers, got True"):
        gen.generate_ids([1, True], 5)
    assert len(gen.generate_ids(torch.tensor([1, 2]), 3, temperature=0)) == 3  # integer tensors are fine
    assert len(gen.generate_ids(np.array([[1, 2]], dtype=np.int32), 3, temperature=0)[0]) == 3
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate_ids([1, 2], 0)


def test_context_limit_stops_with_warning_when_asked(caplog):
    gen = Generator(tiny_model())
    prompt = list(range(1, 41))  # 40 of 48 positions used
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        out = gen.generate_ids(prompt, 20, temperature=0, stop_ids=[], overflow="stop")
    assert len(out) == 48 - 40 + 1
    assert "exceeds the context length" in caplog.text
    assert out == gen.generate_ids(prompt, 20, temperature=0, stop_ids=[], naive=True, overflow="stop")
    assert len(gen.generate_ids(list(range(48)), 3, temperature=0, stop_ids=[], overflow="stop")) == 1
    slid = gen.generate_ids(prompt, 20, temperature=0, stop_ids=[])  # the default slides on
    assert len(slid) == 20 and slid[:9] == out
    with pytest.raises(ValueError, match="overflow must be"):
        gen.generate_ids(prompt, 20, overflow="wrap")


def test_stop_ids_end_each_row_separately():
    gen = Generator(tiny_model())
    full = gen.generate_ids(PROMPTS, 30, temperature=0, stop_ids=[])
    stop = full[0][10]
    out = gen.generate_ids(PROMPTS, 30, temperature=0, stop_ids=[stop])
    for row, got in zip(full, out):
        want = row[: row.index(stop)] if stop in row else row
        assert got == want
    streamed = list(gen.generate_ids(PROMPTS, 30, temperature=0, stop_ids=[stop], stream=True))
    assert [[t for b, t in streamed if b == i] for i in range(3)] == out


# --------------------------------------------------------------------------------------------------
# Text: UTF-8 streaming and stop strings
# --------------------------------------------------------------------------------------------------
def test_text_stream_never_splits_characters():
    text = "héllo wörld — 日本語 🙂!"
    data = text.encode()
    for cut in range(1, 5):  # feed 1, 2, 3, 4 bytes at a time
        ts = TextStream([])
        pieces = [ts.feed(data[i : i + cut]) for i in range(0, len(data), cut)] + [ts.finish()]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_text_stream_stop_string_split_across_feeds():
    ts = TextStream(["END", "xyz"])
    pieces = [ts.feed(b) for b in (b"abc E", b"N", b"xE", b"ND tail")]
    assert "".join(pieces) == "abc ENx" and ts.done
    assert "E" not in pieces[0][-1:]  # the possible start of "END" was held back
    ts = TextStream(["END"])
    assert ts.feed(b"the E") == "the " and ts.finish() == "E"  # never completed: flushed at the end


def test_text_stream_flushes_a_cut_character_once():
    ts = TextStream(["END"])
    assert ts.feed(b"ok E\xe6\x97") == "ok "  # "E" may start the stop string; the character is incomplete
    assert ts.finish() == "E\ufffd" and ts.done and ts.finish() == ""
    ts = TextStream(["END"])
    assert ts.feed(b"aEND\xe6") == "a" and ts.finish() == ""  # after a stop string nothing more is text


def test_a_tool_forcing_an_id_outside_the_vocabulary_ends_its_row_only():
    steps = RowStep([b"a", b"b", b"c"])
    bad, good = (Row([0], 5, temperature=0.0, tool=lambda t: [t + 1, 3]), Row([0], 5, temperature=0.0))
    for r in (bad, good):
        steps.advance(r, torch.tensor([0.0, 1.0, 0.0]))
    assert bad.finish == "error" and "forced token id 3, out of range [0, 3)" in bad.error and not bad.forced
    assert good.finish is None and good.ids == [1]


def test_generate_text_stop_strings_and_streaming(tiny_tokenizer):
    gen = Generator(tiny_model(seed=3), tiny_tokenizer)
    full = gen.generate("the cat", 40, temperature=0)
    assert isinstance(full, str) and full
    stop = full[len(full) // 3 : len(full) // 3 + 4]  # a stop string somewhere inside, likely spanning tokens
    cut = gen.generate("the cat", 40, temperature=0, stop=[stop])
    assert cut == full[: full.index(stop)]
    assert "".join(gen.generate("the cat", 40, temperature=0, stream=True)) == full
    assert "".join(gen.generate("the cat", 40, temperature=0, stop=stop, stream=True)) == cut
    many = gen.generate(["the cat", "a dog sat"], 40, temperature=0)
    assert many[0] == full and many[1] == gen.generate("a dog sat", 40, temperature=0)


def test_generate_text_utf8_with_byte_tokens():
    tok = byte_tokenizer()
    gen = Generator(tiny_model(vocab_size=257, seed=5), tok)
    pieces = list(gen.generate("日本", 40, temperature=1.0, seed=0, stream=True))
    ids = gen.generate_ids(tok.encode("日本"), 40, temperature=1.0, seed=0)
    assert "".join(pieces) == tok.decode(ids)
    with pytest.raises(ValueError, match="empty"):
        gen.generate("", 5)


def test_tokenizer_larger_than_model_is_rejected(tiny_tokenizer):
    with pytest.raises(ValueError, match="tokenizer has 400 tokens"):
        Generator(tiny_model(vocab_size=300), tiny_tokenizer)


def test_padded_model_vocab_never_samples_beyond_tokenizer(tiny_tokenizer):
    gen = Generator(tiny_model(vocab_size=512), tiny_tokenizer)
    ids = gen.generate_ids([[1, 2, 3]] * 8, 40, temperature=2.0, seed=0, stop_ids=[])
    assert max(max(r) for r in ids) < tiny_tokenizer.vocab_size


# --------------------------------------------------------------------------------------------------
# Loading a run directory; the CLI
# --------------------------------------------------------------------------------------------------
def make_run_dir(path, tokenizer, steps=(3, 5)):
    """A minimal run directory as `lmforge train` writes it: config.yaml, tokenizer.json, checkpoints."""
    from lmforge.checkpoint import CheckpointManager
    from lmforge.config import dump_yaml
    from lmforge.run import mark

    model = tiny_model(seed=11)
    path.mkdir(parents=True, exist_ok=True)
    dump_yaml({"model": model.cfg, "training": {"max_steps": 5}}, path / "config.yaml")
    tokenizer.save(path / "tokenizer.json")
    mark(path)
    mgr = CheckpointManager(path)
    for s in steps:
        mgr.save(model, None, s)
    return model


def test_from_run_loads_newest_valid_checkpoint(tmp_path, tiny_tokenizer, caplog):
    model = make_run_dir(tmp_path / "run", tiny_tokenizer)
    want = Generator(model, tiny_tokenizer).generate("the dog", 20, temperature=0)
    assert Generator.from_run(tmp_path / "run", device="cpu").generate("the dog", 20, temperature=0) == want
    newest = tmp_path / "run/checkpoints/step_00000005.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated: falls back to step 3 with a warning
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        gen = Generator.from_run(tmp_path / "run", device="cpu")
    assert "falling back" in caplog.text
    assert gen.generate("the dog", 20, temperature=0) == want
    with pytest.raises(ValueError, match="does not exist"):  # this run kept no best.safetensors
        Generator.from_run(tmp_path / "run", checkpoint="best")


def test_from_run_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="does not exist; train one first"):
        Generator.from_run(tmp_path / "nope")
    make_run_dir(tmp_path / "run", tiny_tokenizer, steps=())
    with pytest.raises(ValueError, match="no checkpoint"):
        Generator.from_run(tmp_path / "run")
    (tmp_path / "run/tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Generator.from_run(tmp_path / "run")


def test_cli_generate(tmp_path, tiny_tokenizer, capsys):
    from lmforge.cli import main

    model = make_run_dir(tmp_path / "run", tiny_tokenizer)
    want = Generator(model, tiny_tokenizer).generate(["the cat", "a dog"], 15, temperature=0)
    run = str(tmp_path / "run")
    for draft in ([], ["--no-draft"]):  # one streamed prompt runs through the row step: the batched path's tokens
        assert main(["generate", "--run", run, "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "15",
                     *draft]) == 0
        assert capsys.readouterr().out == "the cat" + want[0] + "\n"
    ckpt = str(tmp_path / "run/checkpoints/step_00000003.safetensors")
    assert main(["generate", "--checkpoint", ckpt, "--prompt", "the cat", "--prompt", "a dog", "--no-stream",
                 "--temperature", "0", "--max-new-tokens", "15", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "the cat" + want[0] in out and "a dog" + want[1] in out
    packed = [{"weight_dtype": "bf16"}, {"weight_dtype": "int4"}, {"weight_dtype": "int4", "activations": "float32"}]
    for kw in packed:
        flags = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", v)]
        argv = ["generate", "--run", run, "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "15", *flags]
        if not kernel_available():  # the packed weights run on the C++ kernels only: one line, exit 2, without them
            assert main(argv) == 2 and "C++ extension" in capsys.readouterr().err
            continue
        want_packed = Generator(model, tiny_tokenizer, **kw).generate("the cat", 15, temperature=0)
        assert main(argv) == 0
        assert capsys.readouterr().out == "the cat" + want_packed + "\n"
    with pytest.raises(SystemExit) as bad_dtype:  # argparse refuses an unknown choice with exit code 2
        main(["generate", "--run", run, "--prompt", "x", "--weight-dtype", "int3"])
    assert bad_dtype.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    for bad in (["--prompt", "x", "--top-p", "0"], ["--prompt", "x", "--temperature", "-1"], [],
                ["--prompt", ""], ["--prompt", "x " * 100]):
        assert main(["generate", "--run", run, *bad]) == 2
    assert main(["generate", "--run", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    out, err = capsys.readouterr()
    assert "x" not in out  # bad sampling flags are refused before the prompt is echoed
    assert "top_p must be in (0, 1]" in err and "does not exist" in err and "context length" in err


@pytest.mark.skipif(not kernel_available(), reason="C++ extension not built")
def test_packed_weights_take_the_cpu_where_a_gpu_is(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    """With packed weights (the CPU kernels' only) the default device ``auto`` means the CPU, also on a
    machine with a GPU (as in the GPU check, where `lmforge generate --weight-dtype bf16` loaded on cuda:0
    and refused). CUDA is reported present here; loading there would fail on this machine."""
    from lmforge.cli import main

    model = make_run_dir(tmp_path / "run", tiny_tokenizer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gen = Generator.from_run(tmp_path / "run", weight_dtype="int8")
    assert gen.device.type == "cpu" and gen.engine._kernel
    want = Generator(model, tiny_tokenizer, weight_dtype="bf16").generate("the cat", 6, temperature=0)
    argv = ["generate", "--run", str(tmp_path / "run"), "--prompt", "the cat", "--temperature", "0",
            "--max-new-tokens", "6", "--weight-dtype", "bf16"]
    assert main(argv) == 0 and capsys.readouterr().out == "the cat" + want + "\n"


def test_cli_generate_on_one_thread(tmp_path, tiny_tokenizer):
    """The real `lmforge generate` in a fresh process with PyTorch on one thread (as under OMP_NUM_THREADS=1,
    `taskset -c 0` or a one-core container) prints the library's greedy text and exits 0."""
    model = make_run_dir(tmp_path / "run", tiny_tokenizer)
    want = Generator(model, tiny_tokenizer).generate("the king", 5, temperature=0)
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "generate", "--run", str(tmp_path / "run"), "--prompt",
                        "the king", "--max-new-tokens", "5", "--temperature", "0", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "the king" + want + "\n"


# --------------------------------------------------------------------------------------------------
# Tiny sampling values and seeds: the library, `lmforge generate` and `lmforge chat`
# --------------------------------------------------------------------------------------------------
def test_tiny_temperature_and_top_p_sample_the_likeliest_token():
    """temperature 1e-40 overflowed float32 logits to inf (NaN probabilities, a RuntimeError) and top_p 1e-50
    rounded to 0 in float32 (no token kept): below the floor a temperature is greedy, and top_p always keeps
    the likeliest token."""
    from lmforge.generate.sampling import MIN_TEMPERATURE, is_greedy

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 10
    want = logits.argmax(-1)
    g = torch.Generator().manual_seed(0)
    for x in (logits, logits.double(), logits.bfloat16()):
        for kw in (dict(temperature=1e-40), dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-50),
                   dict(temperature=2.0, top_p=1e-300, top_k=5), dict(temperature=MIN_TEMPERATURE * 0.99)):
            assert torch.equal(sample_next(x, generator=g, **kw), x.argmax(-1)), (x.dtype, kw)
    assert is_greedy(0) and is_greedy(1e-40) and not is_greedy(MIN_TEMPERATURE) and not is_greedy(0.7)
    assert torch.equal(sample_next(logits, temperature=MIN_TEMPERATURE, generator=g), want)  # sharp enough


@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1, 2 ** 70, 1.5, True])
def test_seeds_outside_a_signed_64_bit_integer_are_refused(seed):
    gen = Generator(tiny_model(), byte_tokenizer())
    msg = r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"
    with pytest.raises(ValueError, match=msg):
        gen.generate_ids([1, 2], 3, seed=seed)
    with pytest.raises(ValueError, match=msg):
        gen.generate("ab", 3, seed=seed)
    with pytest.raises(ValueError, match=msg):
        gen.rng(seed)


def test_seeds_at_both_ends_of_the_range_work():
    gen = Generator(tiny_model(), byte_tokenizer())
    for seed in (2 ** 63 - 1, -(2 ** 63)):
        assert gen.generate_ids([1, 2], 4, seed=seed) == gen.generate_ids([1, 2], 4, seed=seed)


def test_cli_generate_and_chat_take_tiny_sampling_values(tmp_path, tiny_tokenizer, capsys, monkeypatch):
    """`lmforge generate` and `lmforge chat` with temperature 1e-40 or top_p 1e-50 print the greedy text (they
    printed a traceback)."""
    import io

    from lmforge.chat.session import ChatSession
    from lmforge.cli import main

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from serve_helpers import random_chat_run

    model = make_run_dir(tmp_path / "run", tiny_tokenizer)
    want = Generator(model, tiny_tokenizer).generate("the cat", 10, temperature=0)
    for flags in (["--temperature", "1e-40"], ["--top-p", "1e-50"], ["--temperature", "1e-40", "--top-p", "1e-50"]):
        assert main(["generate", "--run", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "10",
                     "--seed", "1", *flags]) == 0
        assert capsys.readouterr().out == "the cat" + want + "\n"
    chat = random_chat_run(tmp_path / "chat")
    session = ChatSession.from_run(chat, temperature=0, max_new_tokens=10)
    greedy = "".join(session.send("Hello there"))
    for flags in (["--temperature", "1e-40"], ["--top-p", "1e-50", "--seed", str(2 ** 63 - 1)]):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Hello there\n")))
        assert main(["chat", "--run", str(chat), "--max-new-tokens", "10", *flags]) == 0
        out = capsys.readouterr().out
        assert out == greedy.replace("\\", "\\\\").replace("\n", "\\n") + "\n"
