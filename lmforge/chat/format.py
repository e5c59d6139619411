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

Function tools (the client runs them; OpenAI's ``tools``/``tool_calls``), with the :data:`TOOL_SPECIAL_TOKENS`: a
conversation may come with ``tools``, a list of function definitions rendered as one JSON text after the
system message (or first)::

    <|tools_start|>{json.dumps(tools)}<|tools_end|>

an assistant message may hold ``"tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]``
(``arguments``: a JSON text, or an object rendered with ``json.dumps``), each call a JSON object in its own
block, and the turn ends after the calls; one ``tool`` message per call (``tool_call_id`` naming it) follows
with its result, then a new assistant turn (or a user message)::

    <|assistant_start|>{content}<|call_start|>{"name": NAME, "arguments": ARGS}<|call_end|>...<|assistant_end|>
    <|output_start|>{result}<|output_end|>...<|assistant_start|>{reply}<|assistant_end|>

(JSON as ``json.dumps(..., ensure_ascii=False)`` writes it: ``", "`` and ``": "``.) Trained: the calls and
their tokens like the assistant's text; never trained: the tools block and the results.

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

__all__ = ["CHAT_SPECIAL_TOKENS", "ROLES", "TOOL_SPECIAL_TOKENS", "ChatFormat", "ConversationError", "add_chat_tokens",
           "call_text", "check_conversation", "check_tools", "load_conversations", "read_conversations", "read_records"]

CHAT_SPECIAL_TOKENS: tuple[str, ...] = (
    EOT,  # conversation start (the pretraining document separator)
    "<|system_start|>", "<|system_end|>",
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant's calculator call
    "<|output_start|>", "<|output_end|>",  # the tool's result
)
"""Every special token a chat tokenizer must hold, in the order :func:`add_chat_tokens` appends missing ones."""

TOOL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|tools_start|>", "<|tools_end|>",  # the function definitions
    "<|call_start|>", "<|call_end|>",  # one JSON function call of the assistant
)
"""The function-tool tokens, appended after :data:`CHAT_SPECIAL_TOKENS` (a tokenizer from before them chats
without function tools)."""

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, Any]


def add_chat_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` with the :data:`CHAT_SPECIAL_TOKENS` and :data:`TOOL_SPECIAL_TOKENS` it lacks appended (no
    retraining; a no-op the second time). Grow the model to match with ``model.resize_vocab(new.vocab_size)``."""
    return tokenizer.with_special_tokens(CHAT_SPECIAL_TOKENS + TOOL_SPECIAL_TOKENS)


def call_text(call: Any) -> str:
    """A function call's text in the chat format: ``{"name": NAME, "arguments": ARGS}`` (``ARGS``: the call's
    ``arguments`` text as given, or an object as ``json.dumps`` writes it). ``ValueError`` for a malformed call."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"a tool call is {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                         f"\"arguments\"}}}}, got {call!r:.80}")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ' + args + "}"


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------
class ConversationError(ValueError):
    """A conversation :func:`check_conversation` refuses; ``index``: the message at fault (None: the whole)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def check_conversation(messages: Any, for_training: bool = True) -> list[Message]:
    """The messages, checked against the rules in the module docstring (:class:`ConversationError` naming the
    message).

    ``for_training``: the conversation must end with a finished assistant reply (else it trains nothing);
    otherwise (a prompt for :meth:`ChatFormat.render_for_completion`) it must end with a user message, and an
    assistant message may be empty (a model may end its turn at once, or right after a tool's output, and a
    server's client sends such a reply back as it got it).
    """
    if isinstance(messages, tuple):
        messages = list(messages)
    if not isinstance(messages, list) or not messages:
        hint = "; pass record[\"messages\"], not the record" if isinstance(messages, dict) else ""
        raise ConversationError(f"a conversation is a non-empty list of messages, got {type(messages).__name__} "
                                f"{messages!r:.60}{hint}")
    expect = {"system", "user"}  # roles allowed at the next position
    pending: list[dict[str, Any]] = []  # function calls not yet answered by a tool message
    for k, m in enumerate(messages):
        where = f"message {k}"
        if not isinstance(m, dict):
            raise ConversationError(f"{where} must be an object {{\"role\": ..., \"content\": ...}}, got {m!r:.60}",
                                    k)
        role = m.get("role")
        if role not in ROLES:
            raise ConversationError(f"{where} has unknown role {role!r}; use one of {', '.join(ROLES)}", k)
        extra = set(m) - {"role", "content", "tool_call", "tool_calls", "tool_call_id"}
        misplaced = [k for k in ("tool_call", "tool_calls") if k in m and role != "assistant"] + \
            (["tool_call_id"] if "tool_call_id" in m and role != "tool" else [])
        if extra or misplaced or ("tool_call" in m and "tool_calls" in m):
            bad = sorted(extra)[0] if extra else misplaced[0] if misplaced else "tool_calls"
            raise ConversationError(f"{where} ({role}) has key {bad!r}; messages hold role and content, an assistant "
                                    "message may add tool_call: \"EXPR\" (a calculator call) or tool_calls (function "
                                    "calls), and a tool message tool_call_id", k)
        content, call, calls = m.get("content"), m.get("tool_call"), m.get("tool_calls")
        if not isinstance(content, str) or ("tool_call" in m and not isinstance(call, str)):
            raise ConversationError(f"{where} ({role}): content and tool_call must be strings, got {content!r:.60}",
                                    k)
        if call is not None and not call.strip():
            raise ConversationError(f"{where} (assistant) has an empty tool_call; give the expression or drop the "
                                    "key", k)
        if calls is not None:
            if not isinstance(calls, list) or not calls:
                raise ConversationError(f"{where} (assistant): tool_calls must be a non-empty list, got "
                                        f"{calls!r:.60}", k)
            for c in calls:
                call_text(c)
        if not content.strip() and call is None and not calls and (for_training or role != "assistant"):
            raise ConversationError(f"{where} ({role}) has empty content; give it text or drop the message", k)
        if role not in expect:
            raise ConversationError(f"{where} has role {role!r} but {' or '.join(sorted(expect))} must come here: "
                                    "an optional system message first, then user and assistant turns alternating, "
                                    "and a tool message right after each assistant tool_call (one per tool_calls "
                                    "entry)", k)
        if role == "tool" and pending:
            tid = m.get("tool_call_id")
            ids = [c.get("id") for c in pending]
            if tid is not None and any(ids) and tid not in ids:
                raise ConversationError(f"{where} (tool) answers tool_call_id {tid!r:.60}, which no unanswered call "
                                        f"of the assistant has ({', '.join(map(str, filter(None, ids)))})", k)
            pending.pop(ids.index(tid) if tid in ids else 0)
            expect = {"tool"} if pending else {"assistant", "user"}
            continue
        if role == "assistant" and calls:
            pending = list(calls)
            expect = {"tool"}
            continue
        expect = {"system": {"user"}, "user": {"assistant"}, "tool": {"assistant"},
                  "assistant": {"tool"} if call is not None else {"user"}}[role]
    last = messages[-1]
    if for_training:
        if not any(m["role"] == "assistant" for m in messages):
            raise ConversationError("the conversation has no assistant message, so it has nothing to train on; "
                                    "add the assistant's reply")
        if "tool_call" in last or pending or last.get("tool_calls"):
            raise ConversationError("the conversation ends with an assistant tool call; add the tool message with "
                                    "its result and the assistant's reply")
        if last["role"] != "assistant":
            raise ConversationError(f"the conversation ends with a {last['role']} message that is not answered; end "
                                    "it with the assistant's reply")
    elif pending or last.get("tool_calls"):
        raise ConversationError(f"the prompt's last assistant message has {len(pending) or len(last['tool_calls'])} "
                                "function call(s) without a tool message answering each; add the results")
    elif last["role"] != "user" and not (last["role"] == "tool" and _answers_functions(messages)):
        raise ConversationError(f"a prompt must end with a user message (the reply is generated), not {last['role']}")
    return messages


def _answers_functions(messages: list[Message]) -> bool:
    """Whether the trailing tool messages answer an assistant's function calls (not a calculator call)."""
    k = len(messages) - 1
    while k >= 0 and messages[k]["role"] == "tool":
        k -= 1
    return k >= 0 and bool(messages[k].get("tool_calls"))


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools``: a list of ``{"type": "function", "function": {"name", ...}}`` (``ValueError`` otherwise)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of function definitions, got {tools!r:.60}")
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                             f"\"description\", \"parameters\"}}}}, got {t!r:.80}")
    return tools


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
        self.ids: dict[str, int] = {t: have[t] for t in CHAT_SPECIAL_TOKENS + TOOL_SPECIAL_TOKENS if t in have}
        self.assistant_end_id = self.ids["<|assistant_end|>"]
        self.stop_ids = (self.assistant_end_id, self.ids[EOT], self.ids["<|user_start|>"])
        """The ids that end a reply: ``<|assistant_end|>``, the end-of-text token and ``<|user_start|>`` (a model
        starting the user's next turn)."""
        self.has_tools = all(t in have for t in TOOL_SPECIAL_TOKENS)
        """Whether the tokenizer holds the :data:`TOOL_SPECIAL_TOKENS` (function tools can be rendered)."""

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, special="plain")

    def _render(self, messages: list[Message], completion: bool,
                tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
        sp = self.ids
        uses_functions = bool(tools) or any(m.get("tool_calls") for m in messages)
        if uses_functions and not self.has_tools:
            raise ValueError("this tokenizer has no function-tool tokens (" + ", ".join(TOOL_SPECIAL_TOKENS) +
                             "); fine-tune the model with a tokenizer from lmforge.chat.add_chat_tokens to use tools")
        ids: list[int] = [sp[EOT]]
        mask: list[int] = [0]

        def add(part: list[int], trained: int) -> None:
            ids.extend(part)
            mask.extend([trained] * len(part))

        def add_tools() -> None:
            if tools:
                add([sp["<|tools_start|>"], *self._text(json.dumps(tools, ensure_ascii=False)),
                     sp["<|tools_end|>"]], 0)

        if not messages or messages[0]["role"] != "system":
            add_tools()
        calculator = False  # the last assistant message called the calculator: its turn goes on after the output
        for m in messages:
            role, content = m["role"], m["content"]
            if role in ("system", "user"):
                add([sp[f"<|{role}_start|>"], *self._text(content), sp[f"<|{role}_end|>"]], 0)
                if role == "system":
                    add_tools()
            elif role == "tool":
                add(self.tool_output_ids(content), 0)
            else:  # assistant; after a calculator's output it continues the same turn
                if not calculator:
                    add([sp["<|assistant_start|>"]], 0)
                add(self._text(content), 1)
                calculator = "tool_call" in m
                if calculator:
                    add([sp["<|python_start|>"], *self._text(m["tool_call"]), sp["<|python_end|>"]], 1)
                    continue
                for c in m.get("tool_calls") or ():
                    add([sp["<|call_start|>"], *self._text(call_text(c)), sp["<|call_end|>"]], 1)
                add([sp["<|assistant_end|>"]], 1)
        if completion:
            add([sp["<|assistant_start|>"]], 0)
        return ids, mask

    def render(self, messages: Sequence[Message],
               tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a whole conversation for training (see the module docstring), with the
        function definitions ``tools`` when given."""
        return self._render(check_conversation(messages, for_training=True), False,
                            check_tools(tools) if tools is not None else None)

    def render_for_completion(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt ids of a conversation ending with a user message (or the results of function calls), ending
        with ``<|assistant_start|>``."""
        return self._render(check_conversation(messages, for_training=False), True,
                            check_tools(tools) if tools is not None else None)[0]

    def tool_output_ids(self, output: str) -> list[int]:
        """``<|output_start|>{output}<|output_end|>``: what the engine feeds back after running a tool call."""
        return [self.ids["<|output_start|>"], *self._text(output), self.ids["<|output_end|>"]]


# --------------------------------------------------------------------------------------------------
# JSONL files
# --------------------------------------------------------------------------------------------------
def read_records(path: str | os.PathLike) -> list[tuple[int, list[Message], list[dict[str, Any]] | None]]:
    """``(line number, messages, tools)`` of each conversation in a JSONL file of ``{"messages": [...]}`` lines
    (``"tools"``: the conversation's function definitions, optional; None without).

    Blank lines are skipped; every conversation is checked for training (:func:`check_conversation`,
    :func:`check_tools`), and any problem is a ``ValueError`` that starts with ``path:line:``.
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
            tools = check_tools(obj["tools"]) if obj.get("tools") is not None else None
            out.append((lineno, check_conversation(obj["messages"], for_training=True), tools))
        except ValueError as e:
            raise ValueError(f"{p}:{lineno}: {e}") from None
    return out


def read_conversations(path: str | os.PathLike) -> list[tuple[int, list[Message]]]:
    """``(line number, messages)`` of each conversation in a JSONL file (:func:`read_records` without the tools)."""
    return [(lineno, messages) for lineno, messages, _ in read_records(path)]


def load_conversations(path: str | os.PathLike) -> list[list[Message]]:
    """The conversations of a JSONL file of ``{"messages": [...]}`` lines (see :func:`read_conversations`)."""
    return [messages for _, messages in read_conversations(path)]
