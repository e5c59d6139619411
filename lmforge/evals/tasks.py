"""Eval tasks: the JSONL schema of each task type (this docstring is its one description) and their readers.

A task file is JSONL, one item per line (blank lines are skipped). The type of a file is read from its first
item's keys; every line must then be of that type. Any problem is a ``ValueError`` starting ``path:line:``.

**choice** — multiple choice scored by log-likelihood (lm-eval-harness's ``multiple_choice`` output type)::

    {"context": "Question: Which is a mammal?\\nAnswer:", "choices": [" a whale", " a shark"], "gold": 0}
    {"contexts": ["The trophy fits the case, the trophy", "The trophy fits the case, the case"],
     "continuation": " is small.", "gold": 1}

  The first form shares one context; each choice is the exact string appended to it (put the space in the
  choice). The second ("partial" scoring, Winogrande) has one context per choice and one shared continuation.
  At least 2 choices, ``gold`` a 0-based index. Each choice's log-likelihood is ``sum log p(continuation
  tokens | context)``. The metrics are lm-eval-harness's (0.4.13, ``api/task.py``): ``acc`` is 1 when the gold
  choice has the highest log-likelihood; ``acc_norm`` when it has the highest log-likelihood divided by the
  choice's length in characters (``len(choice)``); ``acc_bytes`` the same divided by its length in UTF-8 bytes
  (lm-eval's docs call acc_norm byte-normalised; its code divides by characters and reports bytes as
  ``acc_bytes``; the two differ only on non-ASCII text). The "choice" is what lm-eval's ``doc_to_choice``
  returns: in the first form the continuation, in the second each choice's *context* (lm-eval's Winogrande
  ``doc_to_choice`` gives the sentence up to the blank with the option filled in), so there ``acc_norm`` divides
  the shared continuation's log-likelihood by its context's length, exactly as lm-eval does.
  Ties go to the first choice (``argmax``), as in lm-eval.

**cloze** — one gold continuation (LAMBADA)::

    {"context": "He put the book back on the", "continuation": " shelf"}

  ``acc`` is 1 when greedy decoding reproduces every continuation token (lm-eval's ``is_greedy``); the
  continuation's log-likelihood also gives its perplexity and bits per byte.

**text** — perplexity and bits per byte of documents::

    {"text": "a whole document ..."}

  A ``.txt`` file (documents separated by the end-of-text token) or a shard directory made by
  ``lmforge data prepare`` (its ``val`` split, or the only split it has) are text tasks too.

**chat** — generative exact match (the chat format's JSONL, e.g. ``lmforge data get chat-tasks``)::

    {"messages": [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]}

  The prompt is the conversation up to its last user message, rendered with
  ``ChatFormat.render_for_completion``; the reply is generated greedily until ``<|assistant_end|>``, and the
  item is correct when the reply equals the final assistant message after stripping whitespace at both ends.
  Tool calls are not run while evaluating: an item whose answer needs the calculator is scored on what the
  model writes without its result.

Token sequences longer than the model's context are truncated from the left (the oldest context tokens
go) and counted in the result's ``truncated``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path
from typing import Any, Iterator

from lmforge.chat import check_conversation
from lmforge.common import atomic_open, check_input_file

__all__ = ["TASK_TYPES", "ChoiceItem", "ClozeItem", "ChatItem", "Task", "read_task_file", "parse_item",
           "write_task_file"]

TASK_TYPES = ("choice", "cloze", "text", "chat")


@dataclasses.dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice item: ``requests[k] = (context, continuation)`` of choice ``k``; ``gold`` the index."""

    requests: tuple[tuple[str, str], ...]
    gold: int

    @property
    def choice_texts(self) -> list[str]:
        """What tells the choices apart, as lm-eval's ``doc_to_choice`` gives it (``acc_norm`` divides by its
        length): each continuation when the context is shared, else each context (the Winogrande form)."""
        if len({c for c, _ in self.requests}) == 1:
            return [x for _, x in self.requests]
        return [c for c, _ in self.requests]

    def to_json(self) -> dict[str, Any]:
        contexts = {c for c, _ in self.requests}
        if len(contexts) == 1:
            return {"context": self.requests[0][0], "choices": [x for _, x in self.requests], "gold": self.gold}
        return {"contexts": [c for c, _ in self.requests], "continuation": self.requests[0][1], "gold": self.gold}


@dataclasses.dataclass(frozen=True)
class ClozeItem:
    """A context and its one gold continuation."""

    context: str
    continuation: str

    def to_json(self) -> dict[str, Any]:
        return {"context": self.context, "continuation": self.continuation}


@dataclasses.dataclass(frozen=True)
class ChatItem:
    """A prompt conversation (ends with a user message) and the expected final assistant reply."""

    prompt: tuple[dict[str, str], ...]
    answer: str


@dataclasses.dataclass
class Task:
    """A named list of items of one type (``text`` tasks hold documents as ``str``, or a shard directory)."""

    name: str
    type: str
    items: list[Any]
    source: str
    shards: Path | None = None


def _where(path: Path, lineno: int) -> str:
    return f"{path}:{lineno}"


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{where}: {key!r} must be a string, got {v!r:.60}")
    return v


def _kind(obj: dict[str, Any]) -> str | None:
    if "messages" in obj:
        return "chat"
    if "choices" in obj or "contexts" in obj:
        return "choice"
    if "text" in obj:
        return "text"
    if "context" in obj and "continuation" in obj:
        return "cloze"
    return None


def parse_item(obj: Any, where: str, kind: str | None = None) -> tuple[str, Any]:
    """``(type, item)`` of one decoded JSON line (see the module docstring); ``ValueError`` naming ``where``."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    found = _kind(obj)
    if found is None:
        raise ValueError(f"{where}: cannot tell the task type from keys {sorted(obj)}; a line holds "
                         "context+choices+gold (choice), contexts+continuation+gold (choice), context+continuation "
                         "(cloze), text (text) or messages (chat)")
    if kind is not None and found != kind:
        raise ValueError(f"{where}: a {found} item in a file of {kind} items (its first item); one type per file")
    if found == "text":
        return found, _str(obj, "text", where)
    if found == "cloze":
        ctx, cont = _str(obj, "context", where), _str(obj, "continuation", where)
        if not cont:
            raise ValueError(f"{where}: the continuation is empty; give the text to score")
        return found, ClozeItem(ctx, cont)
    if found == "chat":
        msgs = obj["messages"]
        try:
            msgs = check_conversation(msgs, for_training=True)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        return found, ChatItem(tuple(msgs[: last_user + 1]), msgs[-1]["content"])
    # choice
    if "contexts" in obj:
        contexts, cont = obj["contexts"], _str(obj, "continuation", where)
        if not isinstance(contexts, list) or not all(isinstance(c, str) for c in contexts):
            raise ValueError(f"{where}: 'contexts' must be a list of strings")
        if any(not c for c in contexts):
            raise ValueError(f"{where}: a context is empty; in the contexts form each choice is its context "
                             "(acc_norm divides by its length), so give each one text")
        requests = tuple((c, cont) for c in contexts)
    else:
        ctx, choices = _str(obj, "context", where), obj["choices"]
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{where}: 'choices' must be a list of strings, got {choices!r:.60}")
        requests = tuple((ctx, c) for c in choices)
    if len(requests) < 2:
        raise ValueError(f"{where}: a multiple-choice item needs at least 2 choices, got {len(requests)}; "
                         "a single gold continuation is a cloze item {\"context\", \"continuation\"}")
    if any(not cont for _, cont in requests):
        raise ValueError(f"{where}: a choice is empty; every choice must add text to score")
    gold = obj.get("gold")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(requests):
        raise ValueError(f"{where}: 'gold' must be the 0-based index of the right choice (0..{len(requests) - 1}), "
                         f"got {gold!r}")
    return found, ChoiceItem(requests, gold)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            yield from enumerate(f, 1)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text (byte {e.start}); is it a JSONL file?") from None


def read_task_file(path: str | os.PathLike, name: str | None = None) -> Task:
    """The task in a JSONL file (``.jsonl`` or ``.jsonl.gz``) of one type (see the module docstring)."""
    p = check_input_file(path)
    kind: str | None = None
    items: list[Any] = []
    for lineno, line in _lines(p):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{_where(p, lineno)}: not valid JSON ({e.msg} at column {e.colno})") from None
        kind, item = parse_item(obj, _where(p, lineno), kind)
        items.append(item)
    if not items:
        raise ValueError(f"{p} holds no items; write one JSON object per line (see `lmforge eval --help`)")
    assert kind is not None
    task_name = name or p.name.removesuffix(".gz").removesuffix(".jsonl")
    return Task(task_name, kind, items, str(p))


def write_task_file(path: str | os.PathLike, items: list[Any]) -> Path:
    """Write choice/cloze items as a task JSONL file (atomically)."""
    with atomic_open(path) as f:
        for it in items:
            f.write(json.dumps(it.to_json(), ensure_ascii=False) + "\n")
    return Path(path)
