"""`import_hf`: a random `transformers` Llama with a byte-level BPE tokenizer becomes an lmforge run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from interop_helpers import TEXTS, make_run, make_tokenizer
from lmforge.checkpoint import CheckpointManager
from lmforge.generate import Generator
from lmforge.interop.hf_export import export_hf
from lmforge.interop.hf_import import import_hf
from lmforge.model import ModelConfig
from lmforge.run import is_run_dir, open_run
from lmforge.tokenizer import EOT, Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _hf_tokenizer_json(path: Path) -> int:
    """Train a byte-level BPE with HF ``tokenizers`` itself (not lmforge) and save it; returns its vocab size."""
    from conftest import make_documents

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(make_documents(80, seed=2) + TEXTS * 2, vocab_size=400, min_frequency=2,
                            special_tokens=[EOT], show_progress=False)
    bpe.save(str(path))
    return bpe.get_vocab_size()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    d.mkdir()
    vocab = _hf_tokenizer_json(d / "tokenizer.json")
    config = transformers.LlamaConfig(vocab_size=vocab + 4, hidden_size=64, intermediate_size=112,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5000.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(d)
    return d


def test_imported_run_computes_hf_logits_and_generates(hf_folder, tmp_path):
    out = import_hf(hf_folder, tmp_path / "run")
    assert is_run_dir(out) and open_run(out).checkpoint.iteration == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    gen = Generator.from_run(out, device="cpu")  # compared with the HF model on the CPU
    hf_tok = tokenizers.Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    for text in TEXTS:  # the imported tokenizer gives the HF tokenizer's ids
        assert gen.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False).ids, text
    idx = torch.tensor([gen.tokenizer.encode(TEXTS[0][:30] + TEXTS[3][:30])])
    with torch.no_grad():
        diff = (gen.model(idx) - theirs(idx).logits).abs().max().item()
    assert diff <= 1e-5, diff
    ids = gen.generate_ids(idx[0].tolist(), max_new_tokens=16, temperature=0.0, stop_ids=[])
    ref = theirs.generate(idx, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, idx.shape[1]:].tolist()
    assert ids == ref


def test_imported_run_evaluates_after_prepare(hf_folder, tmp_path):
    """config.yaml points data.dir at RUN/data: prepare shards there with the run's tokenizer and eval works."""
    from conftest import make_corpus_text
    from lmforge.data import prepare
    from lmforge.train import evaluate_run

    out = import_hf(hf_folder, tmp_path / "run")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(160, seed=9), encoding="utf-8")
    prepare(Tokenizer.load(out / "tokenizer.json"), corpus, out / "data", val_fraction=0.5, progress=False)
    m = evaluate_run(out, max_batches=1, device="cpu")
    assert m["step"] == 0 and m["loss"] > 0


def test_export_then_import_round_trips_exactly(tmp_path):
    tok = make_tokenizer(pattern="gpt4")
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                      d_ff=64, rope_theta=1234.0, norm_eps=1e-6)
    run, ours = make_run(tmp_path / "run", tok, cfg)
    back = import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "back")
    assert Tokenizer.load(back / "tokenizer.json").fingerprint() == tok.fingerprint()
    ckpt = open_run(back).checkpoint
    for name, t in ours.state_dict().items():
        assert torch.equal(ckpt.model[name], t), name
    assert open_run(back).config["model"] == open_run(run).config["model"]


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, r"describes GPT2LMHeadModel, not LlamaForCausalLM"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, r"describes MistralForCausalLM"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"RoPE scaling \(linear\) is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, r"RoPE scaling \(llama3\) is not supported"),
    ({"attention_bias": True}, r"attention_bias=true, but lmforge's model has no biases"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"head_dim": 32}, r"head_dim=32 differs from hidden_size/num_attention_heads=16"),
    ({"attention_dropout": 0.1}, r"dropout is set"),
    ({"max_position_embeddings": 1e15}, r"max_position_embeddings=1e\+15 is not a context length lmforge can hold"),
    ({"max_position_embeddings": 2048.5}, r"max_position_embeddings=2048.5 is not a context length"),
    ({"max_position_embeddings": float("inf")}, r"max_position_embeddings=inf is not a context length"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0 is not a context length"),
])
def test_import_refuses_what_lmforge_cannot_hold(hf_folder, tmp_path, changes, message):
    src = _copy(hf_folder, tmp_path / "src", **changes)
    with pytest.raises(ValueError, match=message):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("missing, message", [
    ("config.json", r"has no config.json \(the model architecture\)"),
    ("tokenizer.json", r"has no tokenizer.json \(the byte-level BPE tokenizer\)"),
    ("model.safetensors", r"has no model.safetensors or model.safetensors.index.json"),
])
def test_import_names_the_missing_file(hf_folder, tmp_path, missing, message):
    src = _copy(hf_folder, tmp_path / "src")
    (src / missing).unlink()
    with pytest.raises(ValueError, match=message):
        import_hf(src, tmp_path / "run")


def test_import_refuses_pickled_weights_and_names_them(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "src")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: pickled weights, which lmforge never loads"):
        import_hf(src, tmp_path / "run")


def test_import_refuses_a_tokenizer_that_is_not_byte_level(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "src")
    sp = tokenizers.SentencePieceBPETokenizer()  # Metaspace pre-tokenizer: Llama 2 style
    sp.train_from_iterator(TEXTS * 4, vocab_size=300, show_progress=False)
    sp.save(str(src / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"not byte-level \(pre-tokenizer/decoder: Metaspace\)"):
        import_hf(src, tmp_path / "run")
    wp = tokenizers.BertWordPieceTokenizer()
    wp.train_from_iterator(TEXTS * 4, vocab_size=300, show_progress=False)
    wp.save(str(src / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"holds a WordPiece tokenizer, not byte-level BPE"):
        import_hf(src, tmp_path / "run")


def test_import_refuses_an_existing_target_without_force(hf_folder, tmp_path):
    out = import_hf(hf_folder, tmp_path / "run")
    before = CheckpointManager(out).steps()[0][1].read_bytes()
    with pytest.raises(ValueError, match="already exists and is not empty"):
        import_hf(hf_folder, out)
    assert CheckpointManager(out).steps()[0][1].read_bytes() == before
    import_hf(hf_folder, out, force=True)
    assert is_run_dir(out)


def test_import_with_force_never_lands_on_a_trained_run_or_its_own_folder(hf_folder, tiny_run, tmp_path):
    """A trained run's newer checkpoints would outrank the imported step 0 (every reader would open the old
    model): refused even with --force, the run untouched; so is writing into the HF folder being read."""
    run = tmp_path / "trained"
    shutil.copytree(tiny_run, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"holds another model's checkpoints \(step_00000004\.safetensors"):
        import_hf(hf_folder, run, force=True)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    src = _copy(hf_folder, tmp_path / "src")
    with pytest.raises(ValueError, match=r"which this command reads: writing there \(even with --force\)"):
        import_hf(src, src, force=True)
    with pytest.raises(ValueError, match=r"is inside .*src, which this command reads"):
        import_hf(src, src / "run", force=True)
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in hf_folder.iterdir())


def test_import_warns_about_a_post_processor_that_adds_a_bos(hf_folder, tmp_path, caplog):
    src = _copy(hf_folder, tmp_path / "src")
    tj = json.loads((src / "tokenizer.json").read_text())
    eot_id = next(t["id"] for t in tj["added_tokens"] if t["content"] == EOT)
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": EOT, "type_id": 0}},
                                                                     {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [], "special_tokens": {EOT: {"id": EOT, "ids": [eot_id], "tokens": [EOT]}}}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with caplog.at_level("WARNING", logger="lmforge"):
        import_hf(src, tmp_path / "run")
    assert "post-processor (TemplateProcessing) that adds tokens" in caplog.text


def test_import_of_a_sharded_tied_checkpoint_written_by_transformers(tmp_path):
    d = tmp_path / "tied"
    vocab = _hf_tokenizer_json((d.mkdir() or d) / "tokenizer.json")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(1)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(d, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file()
    out = import_hf(d, tmp_path / "run")
    assert open_run(out).config["model"]["tie_embeddings"] is True
    gen = Generator.from_run(out, device="cpu")  # compared with the HF model on the CPU
    idx = torch.randint(0, vocab, (2, 20))
    with torch.no_grad():
        assert (gen.model(idx) - theirs(idx).logits).abs().max().item() <= 1e-5


def test_import_refuses_weights_that_do_not_fit_the_config(hf_folder, tmp_path):
    src = _copy(hf_folder, tmp_path / "src", intermediate_size=128)
    with pytest.raises(ValueError, match=r"weights do not fit config.json: checkpoint tensor 'layers.0.ffn.w1.weight' "
                                         r"has shape \(112, 64\)"):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()
