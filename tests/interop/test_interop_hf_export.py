"""`export_hf`: the exported folder opens in `transformers` (offline) and computes what lmforge computes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from interop_helpers import TEXTS, make_run, make_tokenizer
from lmforge.chat import ChatFormat
from lmforge.generate import Generator
from lmforge.interop.hf import check_llama_expressible
from lmforge.interop.hf_export import INDEX_NAME, WEIGHTS_NAME, export_hf
from lmforge.model import ModelConfig
from lmforge.tokenizer import EOT

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> tuple[Path, object]:
    tok = make_tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size + 3, context_length=64, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=96, rope_theta=500.0)  # 3 padding rows beyond the tokenizer
    return make_run(tmp_path_factory.mktemp("chat") / "run", tok, cfg)


@pytest.fixture(scope="module")
def exported(chat_run, tmp_path_factory) -> Path:
    return export_hf(chat_run[0], tmp_path_factory.mktemp("hf") / "out")


def _hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_export_writes_the_hf_files(exported, chat_run):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", WEIGHTS_NAME, "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    tok = make_tokenizer()
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.special_tokens[EOT], tok.special_tokens["<|assistant_end|>"]]


def test_logits_and_greedy_tokens_equal_lmforge(exported, chat_run):
    run, ours = chat_run
    theirs = _hf_model(exported)
    idx = torch.randint(0, make_tokenizer().vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (theirs(idx).logits - ours(idx)).abs().max().item()
    assert diff <= 1e-5, diff

    prompt = make_tokenizer().encode("Hello, world! The quick")
    stops = theirs.generation_config.eos_token_id
    ref = Generator.from_run(run).generate_ids(prompt, max_new_tokens=24, temperature=0.0, stop_ids=stops)
    out = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    if out and out[-1] in stops:
        out = out[:-1]  # transformers returns the stop token; lmforge does not
    assert out == ref and len(ref) > 0
    # from text: the tokenizer's BOS (EOT) comes first, so HF continues [EOT] + prompt, as a document starts
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    enc = hf_tok("Hello, world! The quick", return_tensors="pt")
    assert enc["input_ids"][0].tolist() == [make_tokenizer().special_tokens[EOT]] + prompt
    ref = Generator.from_run(run).generate_ids(enc["input_ids"][0].tolist(), max_new_tokens=24, temperature=0.0,
                                               stop_ids=stops)
    out = theirs.generate(**enc, max_new_tokens=24, do_sample=False)[0, len(prompt) + 1:].tolist()
    assert (out[:-1] if out and out[-1] in stops else out) == ref


def test_autotokenizer_gives_lmforge_ids(exported):
    tok = make_tokenizer()
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok.encode(text, add_special_tokens=False) == ids, text
        assert hf_tok.decode(ids) == tok.decode(ids), text
    assert hf_tok.eos_token == EOT


def test_autotokenizer_starts_every_text_with_endoftext_as_lmforge_evals_do(exported):
    """By default HF tools condition on what lmforge's evals condition on (``encode_request``: EOT, then the
    context), so ``lm_eval --model hf --model_args pretrained=DIR`` needs no tokenizer option."""
    from lmforge.evals import encode_request

    tok = make_tokenizer()
    eot = tok.special_tokens[EOT]
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert hf_tok.bos_token == EOT and hf_tok.bos_token_id == eot
    for text in TEXTS:
        assert hf_tok.encode(text) == hf_tok(text)["input_ids"] == [eot] + tok.encode(text), text
    for context, continuation in [("The quick brown", " fox"), ("Question: 2+2?\nAnswer: ", "4")]:
        ctx, cont = encode_request(tok, context, continuation)
        whole = hf_tok.encode(context + continuation)
        assert hf_tok.encode(context.rstrip()) == ctx and whole == ctx + cont  # lm-eval's _encode_pair
    for name in ("config.json", "generation_config.json"):
        assert json.loads((exported / name).read_text())["bos_token_id"] == eot, name


CONVERSATIONS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"},
     {"role": "assistant", "content": "Fine, thanks!"}, {"role": "user", "content": "  spaces\n\nand lines "},
     {"role": "assistant", "content": "ünïcödé 日本 🙂"}],
    [{"role": "user", "content": "What is 12*7?"},
     {"role": "assistant", "content": "Let me compute.", "tool_call": "12*7"},
     {"role": "tool", "content": "84"}, {"role": "assistant", "content": "It is 84."}],
    [{"role": "user", "content": "sum?"}, {"role": "assistant", "content": "", "tool_call": "1+2"},
     {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3", "tool_call": "3*3"},
     {"role": "tool", "content": "9"}, {"role": "assistant", "content": "then 9"},
     {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "You're welcome."}],
]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOL_CONVERSATIONS = [  # (tools, messages): function definitions, JSON calls (text or object arguments), results
    ([WEATHER], [{"role": "user", "content": "Weather in Zürich?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                 {"role": "assistant", "content": "21 °C."}]),
    ([WEATHER, TIME], [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Time and weather?"},
                       {"role": "assistant", "content": "Checking.", "tool_calls": [
                           {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": {}}},
                           {"id": "b", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                       {"role": "tool", "tool_call_id": "a", "content": "12:00"},
                       {"role": "tool", "tool_call_id": "b", "content": "cold"},
                       {"role": "assistant", "content": "Noon, cold.", "tool_call": "2+2"},
                       {"role": "tool", "content": "4"}, {"role": "assistant", "content": "And 4."},
                       {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Bye."}]),
]


@pytest.mark.parametrize("k", range(len(CONVERSATIONS) + len(TOOL_CONVERSATIONS)))
def test_chat_template_renders_like_chatformat(exported, k):
    fmt = ChatFormat(make_tokenizer())
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    tools, messages = (None, CONVERSATIONS[k]) if k < len(CONVERSATIONS) else TOOL_CONVERSATIONS[k - len(CONVERSATIONS)]
    ids = hf_tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert ids == fmt.render(messages, tools)[0]
    # every prefix ending with a user message or the last result of function calls, as a prompt for the reply
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "user" or
            (m["role"] == "tool" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool") and
             any("tool_calls" in p for p in messages[max(0, i - 3): i]))]
    for end in ends:
        prompt = hf_tok.apply_chat_template(messages[:end], tools=tools, tokenize=True, add_generation_prompt=True,
                                            return_dict=False)
        assert prompt == fmt.render_for_completion(messages[:end], tools)
    if tools:
        assert ids.count(fmt.ids["<|call_start|>"]) == sum(len(m.get("tool_calls", [])) for m in messages)


def test_chat_template_without_tool_tokens_refuses_tools():
    """A tokenizer from before the function-tool tokens: its template renders plain chats and refuses tools and
    tool_calls (rather than rendering their token names as text)."""
    import jinja2

    from lmforge.interop.hf_tokenizer import chat_template

    env = jinja2.Environment()
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    env.filters["tojson"] = json.dumps
    template = env.from_string(chat_template(tools=False))
    assert template.render(messages=CONVERSATIONS[0]).startswith(EOT)
    for tools, messages in TOOL_CONVERSATIONS:
        with pytest.raises(ValueError, match="no function-tool tokens"):
            template.render(messages=messages, tools=tools)
        with pytest.raises(ValueError, match="no function-tool tokens"):
            template.render(messages=messages)


def test_sharded_export_with_tied_embeddings(tmp_path):
    tok = make_tokenizer(chat=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                      tie_embeddings=True)
    run, ours = make_run(tmp_path / "run", tok, cfg)
    out = export_hf(run, tmp_path / "hf", max_shard_size=40_000)
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / WEIGHTS_NAME).exists()
    assert "lm_head.weight" not in index["weight_map"]  # tied: HF re-ties it to the embedding
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    theirs = _hf_model(out)
    idx = torch.randint(0, tok.vocab_size, (1, 20))
    with torch.no_grad():
        assert (theirs(idx).logits - ours(idx)).abs().max().item() <= 1e-5


def test_export_refuses_an_existing_target_and_force_replaces_old_shards(chat_run, tmp_path):
    out = tmp_path / "out"
    export_hf(chat_run[0], out, max_shard_size=50_000)
    assert (out / INDEX_NAME).exists()
    with pytest.raises(ValueError, match="already exists and is not empty.*--force"):
        export_hf(chat_run[0], out)
    (out / "README.md").write_text("mine")
    export_hf(chat_run[0], out, force=True)
    assert (out / WEIGHTS_NAME).exists() and not (out / INDEX_NAME).exists()
    assert not list(out.glob("model-*-of-*.safetensors")) and (out / "README.md").read_text() == "mine"


def test_export_refuses_a_run_without_checkpoint(chat_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(chat_run[0], run)
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(ValueError, match="no checkpoint"):
        export_hf(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_option_llama_cannot_express_is_refused():
    @dataclasses.dataclass
    class WithWindow(ModelConfig):
        sliding_window: int | None = None

    cfg = dict(vocab_size=300, context_length=16, d_model=32, n_layers=1, n_heads=2)
    check_llama_expressible(WithWindow(**cfg))  # the default is what Llama computes
    with pytest.raises(ValueError, match=r"model.sliding_window=8 has no counterpart in a Llama model"):
        check_llama_expressible(WithWindow(**cfg, sliding_window=8))
