"""Conversation data sets in the messages format: the built-in chat tasks and the chitchat conversion.

Both write JSONL files of ``{"messages": [...], ...}`` lines in the schema :mod:`lmforge.chat.format` documents
(``system``/``user``/``assistant``/``tool`` messages; an assistant ``tool_call`` followed by the ``tool`` result).
Downloading lives in :mod:`lmforge.corpus.datasets`; this module only generates and converts.

**Chat tasks** (:func:`chat_tasks`), seeded and deterministic, each with one exact answer: the final assistant
message (what ``lmforge eval --task`` scores by exact match). Every record names its ``task``:

==============  ==========================================  ===============================================
task            user                                        final assistant message
==============  ==========================================  ===============================================
``arithmetic``  ``What is 482+37?`` (``+`` or ``-``, 1–3      ``519``
                digits, never negative)
``spelling``    ``Spell the word honour.``                  ``h-o-n-o-u-r``
``counting``    ``How many times does the letter o appear    ``2``
                in honour?``
``uppercase``   ``Write honour in capital letters.``        ``HONOUR``
``identity``    ``Hi, my name is Honour. Who are you?``      ``Nice to meet you, Honour! I am lmforge, a small
                                                            language model.``
``calculator``  ``Use the calculator: what is 123*45?``      an assistant ``tool_call`` ``123*45``, the
                                                            ``tool`` result ``5535``, then ``5535``
==============  ==========================================  ===============================================

Words are the most frequent lowercase words of the built-in Shakespeare corpus (3 to 9 letters). Validation
items are drawn first; a training item whose user message equals a validation item's is drawn again, so no
validation prompt appears in training.

**How the training items teach** (``teach=True``, the default; validation items are drawn exactly as without it,
from the same random stream, and answered the same): ``arithmetic``, ``spelling`` and ``uppercase`` training
items answer through the calculator, as nanochat's GSM8K data teaches tool use (``What is 482+37?`` -> a
``tool_call`` ``482+37``, the ``tool`` result ``519``, then ``519``; ``Spell the word honour.`` -> ``'-'.join('
honour'.strip())`` -> ``h-o-n-o-u-r``; ``Write honour in capital letters.`` -> ``' honour'.strip().upper()`` ->
``HONOUR``), so the model copies the question's tokens into the call and the result into the answer instead of
computing in its head or seeing letters inside its tokens; and ``spelling`` and ``uppercase`` get one training
item for every word of the list that is not one of their own validation words. Measured: docs/benchmarks.md,
"Chat tasks".

**Spelling as nanochat teaches it** (``spell_words``): a token does not show its letters, so a model can spell a
word only if it was shown spelled. Given a list of words (the speedrun passes the tokenizer's vocabulary words,
:func:`vocabulary_words`, and the task words), every one of them gets one ``spelling_bee`` training item that
spells it letter by letter and counts one letter with a running tally, as nanochat's SpellingBee does
(``Spell honour letter by letter and count the letter o.`` -> ``h-o-n-o-u-r. Counting o: h 0, o 1, n 1, o 2, u 2,
r 2. Answer: 2``). The spelled form is the ``spelling`` task's answer form, so a ``spelling`` validation word is
shown spelled in training, never asked as its validation prompt is. The letter is drawn from
``random.Random(seed + SPELL_SEED_OFFSET)`` (from the word 70% of the time, any letter otherwise), so validation
items, and the other training items, stay those drawn without it; only the final shuffle sees more items. The
question's form is its own, so the plain ``counting`` question is still answered with the number alone.

**Chitchat** (:func:`chitchat_conversations`): the ``dataset.json`` of the PyPI package ``chitchat-dataset``
(BYU PCC lab's Chit-Chat Challenge, MIT licence, 7,168 two-person conversations). Each conversation is a list of
turns; a turn is one or more consecutive utterances of one sender, which we join with a space (the package's own
default). Empty turns are dropped and consecutive turns of the same sender merged; the first sender becomes
``user`` and the other ``assistant``, alternating; a final unanswered ``user`` turn is dropped and conversations
with fewer than two turns are skipped. A conversation goes to validation when the SHA-256 of its id falls in the
lowest ``val_fraction`` (5% by default), so the split is stable across versions of this code.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import re
from typing import Any, Callable, Iterable

__all__ = ["TASKS", "chat_tasks", "chitchat_conversations", "common_words", "to_jsonl", "vocabulary_words",
           "spelling_bee", "SPELL_SEED_OFFSET"]

Record = dict[str, Any]


def common_words(text: str, n: int = 1000, min_len: int = 3, max_len: int = 9) -> list[str]:
    """The ``n`` most frequent lowercase words of ``text`` (``min_len``..``max_len`` letters a-z), ties by
    spelling."""
    counts = collections.Counter(w for w in re.findall(r"(?<![A-Za-z'])[a-z]+(?![A-Za-z'])", text)
                                 if min_len <= len(w) <= max_len)
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def vocabulary_words(pieces: Iterable[bytes | str], min_len: int = 2) -> list[str]:
    """The words among a tokenizer's pieces (its vocabulary's byte strings, in id order): a piece that is, after
    at most one leading space, ``min_len`` or more ASCII letters, lowercased; each word once, in first-seen order."""
    out: dict[str, None] = {}
    for piece in pieces:
        try:
            text = piece.decode("utf-8") if isinstance(piece, bytes) else piece
        except UnicodeDecodeError:
            continue
        word = text[1:] if text.startswith(" ") else text
        if len(word) >= min_len and word.isascii() and word.isalpha():
            out.setdefault(word.lower(), None)
    return list(out)


SPELL_SEED_OFFSET = 52
"""``spelling_bee`` items draw their letters from ``random.Random(seed + SPELL_SEED_OFFSET)``."""


def spelling_bee(word: str, letter: str) -> Record:
    """A ``spelling_bee`` training item: ``word`` spelled letter by letter, then ``letter`` counted with a running
    tally (see the module docstring)."""
    if not word.isalpha() or len(letter) != 1:
        raise ValueError(f"spelling_bee needs a word of letters and one letter, got {word!r} and {letter!r}")
    tally, n = [], 0
    for ch in word:
        n += ch == letter
        tally.append(f"{ch} {n}")
    return _qa("spelling_bee", f"Spell {word} letter by letter and count the letter {letter}.",
               f"{'-'.join(word)}. Counting {letter}: {', '.join(tally)}. Answer: {n}")


def _qa(task: str, question: str, answer: str) -> Record:
    return {"task": task, "messages": [{"role": "user", "content": question},
                                       {"role": "assistant", "content": answer}]}


def _arithmetic(rng: random.Random, words: list[str]) -> Record:
    a, b = (rng.randrange(10 ** rng.randint(1, 3)) for _ in range(2))
    if rng.random() < 0.5:
        return _qa("arithmetic", f"What is {a}+{b}?", str(a + b))
    a, b = max(a, b), min(a, b)
    return _qa("arithmetic", f"What is {a}-{b}?", str(a - b))


def _spelling(rng: random.Random, words: list[str]) -> Record:
    w = rng.choice(words)
    return _qa("spelling", f"Spell the word {w}.", "-".join(w))


def _counting(rng: random.Random, words: list[str]) -> Record:
    w = rng.choice(words)
    c = rng.choice(w) if rng.random() < 0.7 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    return _qa("counting", f"How many times does the letter {c} appear in {w}?", str(w.count(c)))


def _uppercase(rng: random.Random, words: list[str]) -> Record:
    w = rng.choice(words)
    return _qa("uppercase", f"Write {w} in capital letters.", w.upper())


def _identity(rng: random.Random, words: list[str]) -> Record:
    name = rng.choice(words).capitalize()
    return _qa("identity", f"Hi, my name is {name}. Who are you?",
               f"Nice to meet you, {name}! I am lmforge, a small language model.")


def _calculator(rng: random.Random, words: list[str]) -> Record:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return {"task": "calculator", "messages": [
        {"role": "user", "content": f"Use the calculator: what is {a}*{b}?"},
        {"role": "assistant", "content": "", "tool_call": f"{a}*{b}"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)}]}


TASKS: dict[str, Callable[[random.Random, list[str]], Record]] = {
    "arithmetic": _arithmetic, "spelling": _spelling, "counting": _counting, "uppercase": _uppercase,
    "identity": _identity, "calculator": _calculator,
}
"""Each built-in chat task: a function drawing one record from a seeded ``random.Random`` and a word list."""


def _through_calculator(r: Record, expr: str) -> Record:
    """Item ``r`` answered through the calculator: the tool call ``expr``, its result, then the same answer."""
    question, answer = r["messages"][0]["content"], r["messages"][-1]["content"]
    return {"task": r["task"], "messages": [
        {"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_call": expr},
        {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]}


def _last_word(r: Record) -> str:
    """The word a ``spelling`` or ``uppercase`` question asks about."""
    q = r["messages"][0]["content"]
    return q.split()[-1].rstrip(".") if r["task"] == "spelling" else q.split()[1]


_TEACH: dict[str, Callable[[Record], Record]] = {
    # the expression as the question writes it; the word with the space it has in the question, so the call
    # copies the question's own token
    "arithmetic": lambda r: _through_calculator(r, r["messages"][0]["content"].removeprefix("What is ")[:-1]),
    "spelling": lambda r: _through_calculator(r, f"'-'.join(' {_last_word(r)}'.strip())"),
    "uppercase": lambda r: _through_calculator(r, f"' {_last_word(r)}'.strip().upper()"),
}
"""How a task's training items are rewritten to teach it (see the module docstring)."""
_EVERY_WORD: dict[str, Callable[[str], Record]] = {
    "spelling": lambda w: _qa("spelling", f"Spell the word {w}.", "-".join(w)),
    "uppercase": lambda w: _qa("uppercase", f"Write {w} in capital letters.", w.upper()),
}
"""Tasks that get one training item per word of the list (their own validation words excepted)."""


def chat_tasks(words: list[str], n_train: int = 1000, n_val: int = 50, seed: int = 0,
               tasks: Iterable[str] = tuple(TASKS), teach: bool = False,
               spell_words: Iterable[str] = ()) -> tuple[list[Record], list[Record]]:
    """``(train, val)`` records: ``n_train`` / ``n_val`` per task (with ``teach``, also one ``spelling`` and one
    ``uppercase`` item per word; with ``spell_words``, one ``spelling_bee`` item per word of it), train shuffled,
    val in task order.

    Validation prompts are distinct and never appear in training (see the module docstring); ``teach`` and
    ``spell_words`` change the training items only. ``ValueError`` when the word list is too small to draw
    ``n_val`` distinct validation items of a task.
    """
    names = list(tasks)
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown chat task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if len(words) < 2:
        raise ValueError(f"the chat tasks need a word list of at least 2 words, got {len(words)}")
    rng = random.Random(seed)
    train: list[Record] = []
    val: list[Record] = []
    for name in names:
        draw = TASKS[name]
        seen: dict[str, Record] = {}
        for _ in range(100 * n_val):
            if len(seen) == n_val:
                break
            r = draw(rng, words)
            seen.setdefault(r["messages"][0]["content"], r)
        if len(seen) < n_val:
            raise ValueError(f"task {name}: could draw only {len(seen)} distinct validation items of {n_val}; "
                             "give more words or ask for fewer validation items")
        val.extend(seen.values())
        for _ in range(n_train):
            for _ in range(1000):
                r = draw(rng, words)
                if r["messages"][0]["content"] not in seen:
                    break
            else:
                raise ValueError(f"task {name}: every item drawn is a validation item; give more words")
            train.append(_TEACH[name](r) if teach and name in _TEACH else r)
        if teach and name in _EVERY_WORD:  # no random draws here: the validation items that follow stay the same
            every = (_EVERY_WORD[name](w) for w in dict.fromkeys(words))
            teach_one = _TEACH.get(name, lambda r: r)
            train.extend(teach_one(r) for r in every if r["messages"][0]["content"] not in seen)
    bee_rng = random.Random(seed + SPELL_SEED_OFFSET)  # its own stream: every other item stays as drawn without it
    for w in dict.fromkeys(spell_words):
        letter = bee_rng.choice(w) if bee_rng.random() < 0.7 else bee_rng.choice("abcdefghijklmnopqrstuvwxyz")
        train.append(spelling_bee(w, letter))
    rng.shuffle(train)
    return train, val


def _val_bucket(key: str) -> float:
    """A stable number in [0, 1) from ``key`` (the first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2 ** 64


def chitchat_conversations(data: dict[str, Any], val_fraction: float = 0.05) -> tuple[list[Record], list[Record]]:
    """``(train, val)`` records ``{"id", "messages"}`` from the chitchat ``dataset.json`` object (see the module
    docstring for the conversion), in id order."""
    if not isinstance(data, dict):
        raise ValueError(f"chitchat dataset.json must hold an object of conversations, got {type(data).__name__}")
    train: list[Record] = []
    val: list[Record] = []
    for cid in sorted(data):
        turns: list[tuple[str, str]] = []  # (sender, text)
        for group in data[cid].get("messages", []):
            text = " ".join(u["text"].strip() for u in group if u.get("text", "").strip())
            if not text:
                continue
            sender = group[0]["sender"]
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, turns[-1][1] + " " + text)
            else:
                turns.append((sender, text))
        if len(turns) % 2:
            turns.pop()  # a last user turn has no answer
        if len(turns) < 2:
            continue
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                    for i, (_, text) in enumerate(turns)]
        (val if _val_bucket(cid) < val_fraction else train).append({"id": cid, "messages": messages})
    return train, val


def to_jsonl(records: Iterable[Record]) -> str:
    """One JSON object per line (UTF-8 text kept as is)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


# --------------------------------------------------------------------------------------------------
# Function calling (appended: the six tasks above, their items, order and seeds are untouched)
# --------------------------------------------------------------------------------------------------
FUNCTION_TOOLS: list[Record] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather now in a city: temperature in °C and the sky.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_population", "description": "How many people live in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}},
]
"""The function definitions every ``function_call`` record carries (its ``tools``)."""

_SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy")


def _function_call(rng: random.Random, words: list[str]) -> Record:
    """The ``function_call`` task: the user asks about a city; the assistant calls the right function with JSON
    arguments (``tool_calls``), the ``tool`` result comes back as JSON, and the final reply states it."""
    city = rng.choice(words).capitalize()
    if rng.random() < 0.5:
        name, question = "get_weather", f"What is the weather in {city}?"
        temp, sky = rng.randint(-10, 35), rng.choice(_SKIES)
        result, answer = {"temperature": temp, "sky": sky}, f"It is {temp} °C and {sky} in {city}."
    else:
        name, question = "get_population", f"How many people live in {city}?"
        people = rng.randint(1, 999) * 1000
        result, answer = {"population": people}, f"{city} has {people} people."
    call = {"id": "call_0", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"city": city}, ensure_ascii=False)}}
    return {"task": "function_call", "tools": FUNCTION_TOOLS, "messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result, ensure_ascii=False)},
        {"role": "assistant", "content": answer}]}


FUNCTION_TASKS: dict[str, Callable[[random.Random, list[str]], Record]] = {"function_call": _function_call}
"""Chat tasks with function tools (records carry ``tools``), kept apart from :data:`TASKS` so adding them leaves
the built-in tasks' draws and order as they were."""

FUNCTION_SEED_OFFSET = 26
"""The function tasks draw from ``random.Random(seed + FUNCTION_SEED_OFFSET)``, not the built-in tasks' stream."""


def with_function_tasks(train: list[Record], val: list[Record], words: list[str], n_train: int = 1000,
                        n_val: int = 50, seed: int = 0) -> tuple[list[Record], list[Record]]:
    """``(train, val)`` of :func:`chat_tasks` with the :data:`FUNCTION_TASKS` added: their validation items
    (distinct prompts, never in training) after the others, their training items inserted at seeded places, so
    the other records keep their relative order."""
    if len(words) < 2:
        raise ValueError(f"the chat tasks need a word list of at least 2 words, got {len(words)}")
    extra_train: list[Record] = []
    extra_val: list[Record] = []
    rng = random.Random(seed + FUNCTION_SEED_OFFSET)
    for name, draw in FUNCTION_TASKS.items():
        seen: dict[str, Record] = {}
        for _ in range(100 * n_val):
            if len(seen) == n_val:
                break
            r = draw(rng, words)
            seen.setdefault(r["messages"][0]["content"], r)
        if len(seen) < n_val:
            raise ValueError(f"task {name}: could draw only {len(seen)} distinct validation items of {n_val}; "
                             "give more words or ask for fewer validation items")
        extra_val.extend(seen.values())
        for _ in range(n_train):
            for _ in range(1000):
                r = draw(rng, words)
                if r["messages"][0]["content"] not in seen:
                    break
            else:
                raise ValueError(f"task {name}: every item drawn is a validation item; give more words")
            extra_train.append(r)
    merged = list(train)
    for r in extra_train:
        merged.insert(rng.randint(0, len(merged)), r)
    return merged, list(val) + extra_val


__all__ += ["FUNCTION_TASKS", "FUNCTION_TOOLS", "with_function_tasks"]
