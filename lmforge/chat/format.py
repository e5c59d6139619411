"""The chat format: OpenAI-style messages -> token ids and a loss mask. This module is its only owner.

A conversation is a list of messages ``{"role": ..., "content": str}`` with roles ``system`` (optional, first),
``user``, ``assistant`` and ``tool``. An assistant message may call the calculator tool with
``"tool_call": "EXPR"`` (its ``content``, said before the call, may then be empty); the next message is the
``tool`` result, then an ``assistant`` message continues the same turn. Turns alternate user -> assistant.

Layout (no text between the pieces; ``{...}`` is the message text encoded as plain text)::

    EOT                                                       (the end-of-text token, lmforge.corpus.EOT)
    <|system_start|>{system}<|system_end|>                    (only when there is a system message)
    <|user_start|>{user}<|user_end|>
    <|assistant_start|>{assistant}<|assistant_end|>
    ...one user/assistant pair per turn...

and an assistant turn with a tool call::

    <|assistant_start|>{content}<|python_start|>{tool_call}<|python_end|><|output_start|>{tool}<|output_end|>{content}<|assistant_end|>

Worked example: ``[system "Be brief.", user "2+2?", assistant "4"]`` renders to (ids shown as their text,
split as a small tokenizer might; ``.`` = mask 0, ``#`` = mask 1)::

    ids   EOT <|system_start|> Be ␣brief . <|system_end|> <|user_start|> 2 + 2 ? <|user_end|>
    mask  .   .                .  .      . .             .              . . . . .
    ids   <|assistant_start|> 4 <|assistant_end|>
    mask  .                   # #

and ``decode(ids)`` is ``EOT + "<|system_start|>Be brief.<|system_end|><|user_start|>2+2?<|user_end|>
<|assistant_start|>4<|assistant_end|>"`` (one line).

``mask[i] == 1`` means ``ids[i]`` is a training target, predicted from ``ids[:i]`` (train on inputs
``ids[:-1]``, targets ``ids[1:]`` weighted by ``mask[1:]``). Trained: the assistant's text, its tool call
(``<|python_start|>``, the expression, ``<|python_end|>``) and ``<|assistant_end|>``, which teaches the model
to stop. Never trained: the start token, system/user text, every role header (``<|assistant_start|>`` is
written by the engine, as :meth:`ChatFormat.render_for_completion` does) and the tool output with its
delimiters (the engine inserts those after running the tool).

Decisions:

* The conversation starts with ``EOT``, not a new ``<|bos|>``: ``prepare`` ends every pretraining
  document with it, so the base model has seen every document start right after it; a new token would
  start from an untrained row. :data:`CHAT_SPECIAL_TOKENS` lists it first, so a tokenizer without it gets it.
* Message text is encoded with ``special="plain"``: a user typing ``<|user_end|>`` gets the ordinary tokens
  of those characters, never the special id. Only this renderer emits special ids. (``"disallowed"`` would
  make a chat or a server fail on such input instead.)
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from lmforge.common import check_input_file
from lmforge.tokenizer import EOT, Tokenizer

__all__ = ["CHAT_SPECIAL_TOKENS", "ROLES", "ChatFormat", "add_chat_tokens", "check_conversation",
           "load_conversations", "read_conversations"]

CHAT_SPECIAL_TOKENS: tuple[str, ...] = (
    EOT,  # conversation start (the pretraining document separator)
    "<|system_start|>", "<|system_end|>",
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant's calculator call
    "<|output_start|>", "<|output_end|>",  # the tool's result
)
"""Every special token of the chat format, in the order :func:`add_chat_tokens` appends missing ones."""

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]


def add_chat_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` with the :data:`CHAT_SPECIAL_TOKENS` it lacks appended (no retraining; a no-op the second
    time). Grow the model to match with ``model.resize_vocab(new.vocab_size)``."""
    return tokenizer.with_special_tokens(CHAT_SPECIAL_TOKENS)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------
def check_conversation(messages: Any, for_training: bool = True) -> list[Message]:
    """The messages, checked against the rules in the module docstring (``ValueError`` naming the message).

    ``for_training``: the conversation must end with a finished assistant reply (else it trains nothing);
    otherwise (a prompt for :meth:`ChatFormat.render_for_completion`) it must end with a user message, and an
    assistant message may be empty (a model may end its turn at once, or right after a tool's output, and a
    server's client sends such a reply back as it got it).
    """
    if isinstance(messages, tuple):
        messages = list(messages)
    if not isinstance(messages, list) or not messages:
        hint = "; pass record[\"messages\"], not the record" if isinstance(messages, dict) else ""
        raise ValueError(f"a conversation is a non-empty list of messages, got {type(messages).__name__} "
                         f"{messages!r:.60}{hint}")
    expect = {"system", "user"}  # roles allowed at the next position
    for k, m in enumerate(messages):
        where = f"message {k}"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object {{\"role\": ..., \"content\": ...}}, got {m!r:.60}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where} has unknown role {role!r}; use one of {', '.join(ROLES)}")
        extra = set(m) - {"role", "content", "tool_call"}
        if extra or ("tool_call" in m and role != "assistant"):
            bad = sorted(extra)[0] if extra else "tool_call"
            raise ValueError(f"{where} ({role}) has key {bad!r}; messages hold role and content, and an assistant "
                             "message may add tool_call: \"EXPR\" (a calculator call)")
        content, call = m.get("content"), m.get("tool_call")
        if not isinstance(content, str) or ("tool_call" in m and not isinstance(call, str)):
            raise ValueError(f"{where} ({role}): content and tool_call must be strings, got {content!r:.60}")
        if call is not None and not call.strip():
            raise ValueError(f"{where} (assistant) has an empty tool_call; give the expression or drop the key")
        if not content.strip() and call is None and (for_training or role != "assistant"):
            raise ValueError(f"{where} ({role}) has empty content; give it text or drop the message")
        if role not in expect:
            raise ValueError(f"{where} has role {role!r} but {' or '.join(sorted(expect))} must come here: "
                             "an optional system message first, then user and assistant turns alternating, "
                             "and a tool message right after each assistant tool_call")
        expect = {"system": {"user"}, "user": {"assistant"}, "tool": {"assistant"},
                  "assistant": {"tool"} if call is not None else {"user"}}[role]
    last = messages[-1]
    if for_training:
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("the conversation has no assistant message, so it has nothing to train on; "
                             "add the assistant's reply")
        if "tool_call" in last:
            raise ValueError("the conversation ends with an assistant tool_call; add the tool message with its "
                             "result and the assistant's reply")
        if last["role"] != "assistant":
            raise ValueError(f"the conversation ends with a {last['role']} message that is not answered; end it "
                             "with the assistant's reply")
    elif last["role"] != "user":
        raise ValueError(f"a prompt must end with a user message (the reply is generated), not {last['role']}")
    return messages


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------
class ChatFormat:
    """Renders conversations with ``tokenizer``, which must hold :data:`CHAT_SPECIAL_TOKENS`.

    ``self.ids`` maps each chat special token to its id; ``assistant_end_id`` is where generation stops.

    >>> from lmforge.tokenizer import Tokenizer
    >>> tok = add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, []))  # bytes only, no merges
    >>> ids, mask = ChatFormat(tok).render([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
    >>> tok.decode(ids) == EOT + "<|user_start|>2+2?<|user_end|><|assistant_start|>4<|assistant_end|>"
    True
    >>> mask
    [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        have = tokenizer.special_tokens
        missing = [t for t in CHAT_SPECIAL_TOKENS if t not in have]
        if missing:
            raise ValueError(f"the tokenizer lacks the chat special tokens {', '.join(missing)}; add them with "
                             "lmforge.chat.add_chat_tokens(tokenizer) and grow the model with "
                             "model.resize_vocab(tokenizer.vocab_size)")
        self.tokenizer = tokenizer
        self.ids: dict[str, int] = {t: have[t] for t in CHAT_SPECIAL_TOKENS}
        self.assistant_end_id = self.ids["<|assistant_end|>"]

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, special="plain")

    def _render(self, messages: list[Message], completion: bool) -> tuple[list[int], list[int]]:
        sp = self.ids
        ids: list[int] = [sp[EOT]]
        mask: list[int] = [0]

        def add(part: list[int], trained: int) -> None:
            ids.extend(part)
            mask.extend([trained] * len(part))

        for k, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role in ("system", "user"):
                add([sp[f"<|{role}_start|>"], *self._text(content), sp[f"<|{role}_end|>"]], 0)
            elif role == "tool":
                add(self.tool_output_ids(content), 0)
            else:  # assistant; after a tool message it continues the same turn
                if messages[k - 1]["role"] != "tool":
                    add([sp["<|assistant_start|>"]], 0)
                add(self._text(content), 1)
                if "tool_call" in m:
                    add([sp["<|python_start|>"], *self._text(m["tool_call"]), sp["<|python_end|>"]], 1)
                else:
                    add([sp["<|assistant_end|>"]], 1)
        if completion:
            add([sp["<|assistant_start|>"]], 0)
        return ids, mask

    def render(self, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a whole conversation for training (see the module docstring)."""
        return self._render(check_conversation(messages, for_training=True), completion=False)

    def render_for_completion(self, messages: Sequence[Message]) -> list[int]:
        """Prompt ids of a conversation ending with a user message, ending with ``<|assistant_start|>``."""
        return self._render(check_conversation(messages, for_training=False), completion=True)[0]

    def tool_output_ids(self, output: str) -> list[int]:
        """``<|output_start|>{output}<|output_end|>``: what the engine feeds back after running a tool call."""
        return [self.ids["<|output_start|>"], *self._text(output), self.ids["<|output_end|>"]]


# --------------------------------------------------------------------------------------------------
# JSONL files
# --------------------------------------------------------------------------------------------------
def read_conversations(path: str | os.PathLike) -> list[tuple[int, list[Message]]]:
    """``(line number, messages)`` of each conversation in a JSONL file of ``{"messages": [...]}`` lines.

    Blank lines are skipped; every conversation is checked for training (:func:`check_conversation`), and
    any problem is a ``ValueError`` that starts with ``path:line:``.
    """
    p = check_input_file(path)
    out = []
    with open(p, encoding="utf-8") as f:
        try:
            lines = list(enumerate(f, 1))
        except UnicodeDecodeError as e:
            raise ValueError(f"{p} is not UTF-8 text (byte {e.start}); is it a JSONL file?") from None
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                             "object {\"messages\": [...]}") from None
        if not isinstance(obj, dict) or "messages" not in obj:
            raise ValueError(f"{p}:{lineno}: expected an object {{\"messages\": [...]}}, got {line.strip()!r:.60}")
        try:
            out.append((lineno, check_conversation(obj["messages"], for_training=True)))
        except ValueError as e:
            raise ValueError(f"{p}:{lineno}: {e}") from None
    return out


def load_conversations(path: str | os.PathLike) -> list[list[Message]]:
    """The conversations of a JSONL file of ``{"messages": [...]}`` lines (see :func:`read_conversations`)."""
    return [messages for _, messages in read_conversations(path)]
