"""`export_gguf`: every key and tensor read back with the `gguf` package's reader equals the source;
llama.cpp itself (through `llama-cpp-python`, when installed) computes lmforge's logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from interop_helpers import TEXTS, make_run, make_tokenizer
from lmforge.chat import ChatFormat
from lmforge.generate import Generator
from lmforge.generate.packed import INT4, PackedLinear
from lmforge.interop.gguf import LLAMA3_REGEX, TENSOR_NAMES, export_gguf
from lmforge.interop.hf_tokenizer import chat_template
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import EOT
from lmforge.tokenizer.reference import bytes_to_unicode

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, object]:
    tok = make_tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size + 2, context_length=64, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=96, rope_theta=500.0)
    return make_run(tmp_path_factory.mktemp("gguf") / "run", tok, cfg)


def _field(reader, key: str):
    return reader.fields[key].contents()


def _tensors(reader) -> dict[str, object]:
    return {t.name: t for t in reader.tensors}


def test_f32_metadata_vocab_and_tensors_read_back_equal(run, tmp_path):
    path, model = run
    out = export_gguf(path, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(out)
    cfg, tok = model.cfg, make_tokenizer()
    assert _field(reader, "GGUF.version") == 3
    expect = {"general.architecture": "llama", "llama.context_length": 64, "llama.embedding_length": 64,
              "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
              "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16, "llama.vocab_size": cfg.vocab_size,
              "general.file_type": 0, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
              "tokenizer.ggml.bos_token_id": tok.special_tokens[EOT],
              "tokenizer.ggml.eos_token_id": tok.special_tokens[EOT],
              "tokenizer.ggml.eot_token_id": tok.special_tokens["<|assistant_end|>"],
              "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
              "tokenizer.chat_template": chat_template()}
    for key, value in expect.items():
        assert _field(reader, key) == value, key
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(500.0)
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)

    enc = bytes_to_unicode()
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    specials = {i: s for s, i in tok.special_tokens.items()}
    assert len(tokens) == len(types) == cfg.vocab_size
    for i in range(tok.vocab_size):
        want = specials.get(i) or "".join(enc[b] for b in tok.vocab[i])
        assert tokens[i] == want and types[i] == (3 if i in specials else 1), i
    assert types[tok.vocab_size:] == [5, 5]  # padding rows: UNUSED
    merges = _field(reader, "tokenizer.ggml.merges")
    assert merges == [f"{''.join(enc[x] for x in a)} {''.join(enc[x] for x in b)}" for a, b in tok.merges]

    tensors = _tensors(reader)
    state = model.state_dict()
    assert len(tensors) == 2 + 9 * cfg.n_layers + 1
    for ours, theirs in TENSOR_NAMES.items():
        for i in range(cfg.n_layers):
            t = tensors[theirs.format(i=i)]
            w = state[ours.format(i=i)].numpy()
            assert list(t.shape) == list(reversed(w.shape))  # ggml order: ne[0] is the row length
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w)  # q/k unpermuted: see gguf.py


def test_f16_and_q8_0_within_their_rounding(run, tmp_path):
    path, model = run
    state = model.state_dict()
    r16 = _tensors(gguf.GGUFReader(export_gguf(path, tmp_path / "h.gguf", dtype="f16")))
    r8 = gguf.GGUFReader(export_gguf(path, tmp_path / "q.gguf", dtype="q8_0"))
    assert r8.fields["general.file_type"].contents() == 7
    r8 = _tensors(r8)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight", "output.weight"):
        ours = next(k for k, v in TENSOR_NAMES.items() if v.replace("{i}", name[4:5]) == name)
        w = state[ours.replace("{i}", name[4:5])].numpy()
        assert r16[name].tensor_type == gguf.GGMLQuantizationType.F16
        np.testing.assert_array_equal(np.asarray(r16[name].data).reshape(w.shape), w.astype(np.float16))
        t = r8[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        block_max = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)  # q8_0: 32 values, one fp16 scale
        err = np.abs(back - w).reshape(-1, 32)
        # half a step, plus the fp16 rounding of the scale (2^-11 relative, times up to 127 steps)
        assert (err <= block_max / 127 * (0.5 + 127 / 2048)).all()
        assert err.max() > 0  # really quantised
    assert r8["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay f32


def test_q4_0_holds_the_int4_decoders_weights(run, tmp_path):
    """q4_0 blocks read back (gguf's dequantize) are exactly the weights lmforge's int4 decoder computes with."""
    path, model = run
    reader = gguf.GGUFReader(export_gguf(path, tmp_path / "q4.gguf", dtype="q4_0"))
    assert reader.fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0
    tensors = _tensors(reader)
    state = model.state_dict()
    for ours, theirs in TENSOR_NAMES.items():
        for i in range(model.cfg.n_layers if "{i}" in ours else 1):
            t, w = tensors[theirs.format(i=i)], state[ours.format(i=i)]
            if w.dim() == 1:
                assert t.tensor_type == gguf.GGMLQuantizationType.F32
                continue
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
            back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
            np.testing.assert_array_equal(back, PackedLinear(w, INT4).weight().numpy())


def test_q4_0_refuses_rows_not_in_blocks_of_32(tmp_path):
    tok = make_tokenizer(vocab_size=300, chat=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=16, d_model=64, n_layers=1, n_heads=2, d_ff=72)
    path, _ = make_run(tmp_path / "run", tok, cfg)
    with pytest.raises(ValueError, match=r"q4_0 stores each row in blocks of 32 values, but blk.0.ffn_down.weight is "
                                         r"64 x 72 \(rows of 72\); export this model with --dtype q8_0"):
        export_gguf(path, tmp_path / "m.gguf", dtype="q4_0")
    assert not (tmp_path / "m.gguf").exists()
    export_gguf(path, tmp_path / "m.gguf", dtype="q8_0")  # q8_0 writes that matrix as f16 instead
    down = _tensors(gguf.GGUFReader(tmp_path / "m.gguf"))["blk.0.ffn_down.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.F16


def test_refusals(run, tmp_path):
    path, _ = run
    with pytest.raises(ValueError, match=r"GGUF dtype 'q4_1' is not supported; use one of f32, f16, q8_0, q4_0"):
        export_gguf(path, tmp_path / "x.gguf", dtype="q4_1")
    (tmp_path / "x.gguf").write_bytes(b"mine")
    with pytest.raises(ValueError, match=r"already exists; pass force=True \(CLI: --force\)"):
        export_gguf(path, tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"mine"
    export_gguf(path, tmp_path / "x.gguf", force=True)
    assert (tmp_path / "x.gguf").read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("pattern, shown", [("nanochat", r"\(nanochat\)"), (r"\S+|\s+", r"\(custom regex")])
def test_a_pattern_llama_cpp_cannot_express_is_refused(tmp_path, pattern, shown):
    tok = make_tokenizer(vocab_size=300, pattern=pattern, chat=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    path, _ = make_run(tmp_path / "run", tok, cfg)
    with pytest.raises(ValueError, match=rf"split pattern {shown}.* has no llama.cpp pre-tokenizer"):
        export_gguf(path, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("pattern", ["gpt4", LLAMA3_REGEX])
def test_gpt4_and_llama3_patterns_map_to_llama_bpe(tmp_path, pattern):
    tok = make_tokenizer(vocab_size=300, pattern=pattern, chat=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                      tie_embeddings=True)
    path, _ = make_run(tmp_path / "run", tok, cfg)
    reader = gguf.GGUFReader(export_gguf(path, tmp_path / "m.gguf"))
    assert reader.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert "output.weight" not in _tensors(reader)  # tied: llama.cpp reads the head from token_embd
    assert "tokenizer.chat_template" not in reader.fields


def _llama_greedy(llm, prompt: list[int], stops: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation of ``prompt``: up to ``n`` tokens, ending before a stop id."""
    got = []
    for t in llm.generate(prompt, temp=0.0, reset=True):
        if t in stops or len(got) == n:
            break
        got.append(t)
    return got


def test_llama_cpp_computes_lmforge_logits_and_greedy_tokens(run, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path, model = run
    out = export_gguf(path, tmp_path / "m.gguf")
    tok = make_tokenizer()
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    eot = tok.special_tokens[EOT]
    for text in TEXTS:  # llama.cpp's gpt-2 pre-tokenizer + our merges give lmforge's ids
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text), text
        # by default after EOT, the BOS: what lmforge's evals condition on, as the HF export's tokenizer adds it
        assert llm.tokenize(text.encode(), special=True) == [eot] + tok.encode(text), text
    # a chat prompt through the file's template gets that EOT once (the template writes it; no BOS is added)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    llm.create_chat_completion(messages, max_tokens=1, temperature=0.0)
    want = ChatFormat(tok).render_for_completion(messages)
    assert [int(t) for t in llm.input_ids[: len(want)]] == want
    prompt = tok.encode("Hello, world! The quick")
    llm.reset()
    llm.eval(prompt)
    theirs = np.asarray(llm.scores[: len(prompt)])
    with torch.no_grad():
        ours = model(torch.tensor([prompt]))[0].numpy()
    assert np.abs(theirs - ours).max() <= 1e-3
    stops = [tok.special_tokens[EOT], tok.special_tokens["<|assistant_end|>"]]
    ref = Generator(model, tok).generate_ids(prompt, max_new_tokens=16, temperature=0.0, stop_ids=stops)
    got = _llama_greedy(llm, prompt, stops, 16)
    assert got == ref


@pytest.mark.parametrize("pattern", ["gpt4", LLAMA3_REGEX])
def test_llama_cpp_llama_bpe_tokenizes_like_lmforge(tmp_path, pattern):
    llama_cpp = pytest.importorskip("llama_cpp")
    tok = make_tokenizer(vocab_size=400, pattern=pattern)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    path, _ = make_run(tmp_path / "run", tok, cfg)
    llm = llama_cpp.Llama(model_path=str(export_gguf(path, tmp_path / "m.gguf")), vocab_only=True, verbose=False)
    for text in TEXTS + ["x\n\n\n  y", "1234567890 12,345"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text), text


def _model_of_file(path: Path, like) -> TransformerLM:
    """lmforge's model with the weights a GGUF file holds (dequantized): the exported model's own rounding."""
    tensors = _tensors(gguf.GGUFReader(path))
    state = {}
    for ours, theirs in TENSOR_NAMES.items():
        for i in range(like.cfg.n_layers if "{i}" in ours else 1):
            t = tensors[theirs.format(i=i)]
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            state[ours.format(i=i)] = torch.from_numpy(w.reshape(like.state_dict()[ours.format(i=i)].shape).copy())
    model = TransformerLM(like.cfg).eval()
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_llama_cpp_runs_quantized_files_as_lmforge_does(run, tmp_path, dtype):
    """llama.cpp on a q8_0 / q4_0 export: lmforge's token ids, and lmforge's greedy text on the file's own weights
    (dequantized; for q4_0 also lmforge's int4 decoder, which holds the same weights). llama.cpp rounds the
    activations to 8 bits inside its products, so logits agree only to ~1e-2 (checked at 5e-2)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path, model = run
    out = export_gguf(path, tmp_path / f"m-{dtype}.gguf", dtype=dtype)
    tok = make_tokenizer()
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text), text
    rounded = _model_of_file(out, model)
    assert (rounded.lm_head.weight - model.lm_head.weight).abs().max() > 1e-4  # really rounded
    prompt = tok.encode("Hello, world! The quick")
    llm.reset()
    llm.eval(prompt)
    with torch.no_grad():
        ours = rounded(torch.tensor([prompt]))[0].numpy()
    assert np.abs(np.asarray(llm.scores[: len(prompt)]) - ours).max() <= 5e-2
    stops = [tok.special_tokens[EOT], tok.special_tokens["<|assistant_end|>"]]
    ref = Generator(rounded, tok).generate_ids(prompt, max_new_tokens=16, temperature=0.0, stop_ids=stops)
    got = _llama_greedy(llm, prompt, stops, 16)
    # llama.cpp's greedy path, step by step, is lmforge's argmax up to the activation rounding: at each step its
    # token's logit (lmforge's, on the same prefix) is within 2 x 5e-2 of lmforge's best. Exact equality of the
    # two greedy texts would fail at any near tie (seen on a random model: two logits 2e-2 apart).
    with torch.no_grad():
        forced = rounded(torch.tensor([prompt + got]))[0]
    for i, t in enumerate(got):
        row = forced[len(prompt) - 1 + i]
        assert row[t] >= row.max() - 0.1, (i, t, int(row.argmax()), float(row.max() - row[t]))
    if dtype == "q4_0":  # lmforge's int4 decoder holds the file's matrices (q4_0 rounding is idempotent)
        assert torch.equal(Generator(model, tok, weight_dtype="int4").engine.model.lm_head.weight,
                           rounded.lm_head.weight)
        int4 = Generator(rounded, tok, weight_dtype="int4", activations="float32")  # the file's embeddings too
        assert int4.generate_ids(prompt, max_new_tokens=16, temperature=0.0, stop_ids=stops) == ref
