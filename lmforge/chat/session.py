"""A conversation with a model: history, the context budget, streamed replies with tool calls.

:class:`ChatSession` holds the messages of one conversation (an optional system message, then user and
assistant turns) and renders them with the one renderer (:meth:`ChatFormat.render_for_completion`) for every
reply, so what the model sees is exactly what SFT trained on. A reply streams token by token from
:meth:`Generator.turn <lmforge.generate.Generator.turn>` and stops at ``<|assistant_end|>``; a calculator call
(``<|python_start|>EXPR<|python_end|>``) is run by :class:`~lmforge.chat.tools.ToolUse` and its output
(``<|output_start|>RESULT<|output_end|>``) is fed to the model in the same turn. With the generator's
``prefix_cache`` set (``lmforge chat`` sets one), a turn prefills only what the previous turn did not leave in it
(its new message: :attr:`Reply.prefilled`); the replies are the same.

History and the context: before each reply, the prompt must leave room for the reply (``reserve`` tokens: at
most half the context, or ``max_new_tokens`` if smaller). While it does not, the oldest turn (a user message
and the assistant's answer to it) is dropped; ``send`` reports how many were dropped. The system message is
kept. A message that does not fit even alone is refused (``ValueError``) with the history untouched. A reply
is stored in history as messages (an assistant ``tool_call``, the ``tool`` result, and the continuation), so it
is rendered back as the same ids; an empty reply (the model ended at once) is not kept, nor is the user message
it answered, since the format has no empty assistant message.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

from lmforge.chat.format import CHAT_SPECIAL_TOKENS, ChatFormat, Message
from lmforge.chat.tools import ToolUse
from lmforge.generate import Generator
from lmforge.generate.sampling import check_sampling
from lmforge.model.cache import check_context
from lmforge.run import require_run
from lmforge.tokenizer import Tokenizer

__all__ = ["ChatSession", "Reply", "messages_from_reply"]


@dataclasses.dataclass
class Reply:
    """The outcome of one :meth:`ChatSession.send`, complete once its stream is exhausted."""

    text: str = ""
    """The reply as streamed (special tokens as their strings, e.g. a tool call and its output)."""
    ids: list[int] = dataclasses.field(default_factory=list)
    """Every token id of the reply, forced tool-output ids included, without the stop token."""
    messages: list[Message] = dataclasses.field(default_factory=list)
    """The reply as messages (assistant, and tool + assistant per tool call), as added to the history."""
    finish_reason: str = ""
    """``stop`` (``<|assistant_end|>``), ``length`` (``max_new_tokens``) or ``context`` (context full)."""
    dropped_turns: int = 0
    """Oldest turns dropped from the history so the prompt fits the context."""
    tool_calls: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """``(expression, output)`` of each calculator call in the reply."""
    prefilled: int = 0
    """Prompt tokens run through the model; the rest came from the generator's prefix cache (the previous turns)."""


def messages_from_reply(fmt: ChatFormat, ids: list[int]) -> list[Message]:
    """Split a generated assistant reply into messages: ``assistant`` text, and per completed tool call an
    ``assistant`` message with ``tool_call`` plus a ``tool`` message with the output. Rendering them after the
    prompt gives back ``ids`` (plus ``<|assistant_end|>``) when the reply's text is canonically tokenized.

    A reply cut inside a call (``max_new_tokens``) keeps the unfinished call as text. Returns ``[]`` when the
    last assistant piece is empty (the format has no empty assistant message).
    """
    sp, dec = fmt.ids, fmt.tokenizer.decode
    out: list[Message] = []
    text: list[int] = []
    i = 0
    while i < len(ids):
        t = ids[i]
        if t == sp["<|python_start|>"]:
            try:
                end = ids.index(sp["<|python_end|>"], i + 1)
                o_start = end + 1
                o_end = ids.index(sp["<|output_end|>"], o_start + 1)
            except ValueError:  # an unfinished call: the rest is text
                text.extend(ids[i:])
                break
            if o_start >= len(ids) or ids[o_start] != sp["<|output_start|>"]:
                text.extend(ids[i:])
                break
            out.append({"role": "assistant", "content": dec(text), "tool_call": dec(ids[i + 1:end])})
            out.append({"role": "tool", "content": dec(ids[o_start + 1:o_end])})
            text, i = [], o_end + 1
            continue
        text.append(t)
        i += 1
    last = dec(text)
    if not last.strip():
        return []
    if any(not m["content"].strip() and "tool_call" not in m for m in out) or \
            any(not m.get("tool_call", "x").strip() for m in out):
        return []
    out.append({"role": "assistant", "content": last})
    return out


class ChatSession:
    """One conversation with a chat model (see the module docstring).

    >>> chat = ChatSession(Generator.from_run("runs/sft"), system="Be brief.")  # doctest: +SKIP
    >>> reply = chat.send("What is 12*7?")                                        # doctest: +SKIP
    >>> for piece in reply: print(piece, end="")                                  # doctest: +SKIP
    """

    def __init__(self, generator: Generator, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, tools: bool = True) -> None:
        tok = generator.tokenizer
        if tok is None:
            raise ValueError("a chat needs the Generator's tokenizer; build it with Generator.from_run or tokenizer=")
        self.fmt = ChatFormat(tok)  # ValueError naming the missing chat tokens
        self.generator = generator
        self.max_new_tokens = max_new_tokens
        self.sampling: dict[str, Any] = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        self.tools = tools
        self.rng = generator.rng(seed)  # one stream for the whole conversation: a seed repeats it
        self.system: str | None = None
        self.history: list[Message] = []
        self.set_system(system)
        check_sampling(temperature, top_k, top_p)  # now, not at the first reply
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                 device: str = "auto", **kwargs: Any) -> "ChatSession":
        """A session with the model of a run directory; ``ValueError`` if its tokenizer lacks the chat tokens."""
        check_sampling(kwargs.get("temperature", 0.8), kwargs.get("top_k"), kwargs.get("top_p"))  # before loading
        tok = Tokenizer.load(require_run(run_dir, needs=("config.yaml", "tokenizer.json")) / "tokenizer.json")
        missing = [t for t in CHAT_SPECIAL_TOKENS if t not in tok.special_tokens]  # checked before loading the model
        if missing:
            raise ValueError(f"{run_dir} is not a chat model: its tokenizer lacks the chat tokens ({missing[0]} and "
                             f"{len(missing) - 1} more); fine-tune it first (lmforge sft --base {run_dir} --data "
                             "FILE.jsonl --run-dir OUT, e.g. on `lmforge data get chat-tasks`), then chat with --run OUT")
        return cls(Generator.from_run(run_dir, checkpoint, device=device), **kwargs)

    @property
    def context_length(self) -> int:
        """The model's context length (tokens)."""
        return int(self.generator.cfg.context_length)

    @property
    def reserve(self) -> int:
        """Tokens kept free for a reply when fitting the history: ``max_new_tokens``, at most half the context."""
        return max(1, min(self.max_new_tokens, self.context_length // 2))

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.history = []

    def set_system(self, text: str | None) -> None:
        """Set (or with None / blank text, remove) the system message; the history stays."""
        self.system = text if text and text.strip() else None

    def messages(self) -> list[Message]:
        """The conversation so far, system message first."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.history]

    def _fit(self, user: str) -> tuple[list[int], int]:
        """Prompt ids for the history plus ``user``, dropping oldest turns to leave :attr:`reserve` tokens."""
        turns = self._turns()
        dropped = 0
        while True:
            kept = [m for turn in turns[dropped:] for m in turn]
            head = [{"role": "system", "content": self.system}] if self.system else []
            ids = self.fmt.render_for_completion(head + kept + [{"role": "user", "content": user}])
            if len(ids) + self.reserve <= self.context_length or dropped == len(turns):
                break
            dropped += 1
        # refuse a message that does not fit even alone before touching the history: a refused paste loses nothing
        check_context(len(ids) + 1, self.context_length, what="the system message and your message (plus one "
                      "reply token)")
        if dropped:
            self.history = [m for turn in turns[dropped:] for m in turn]
        return ids, dropped

    def _turns(self) -> list[list[Message]]:
        """The history cut into turns, each starting at a user message."""
        turns: list[list[Message]] = []
        for m in self.history:
            if m["role"] == "user" or not turns:
                turns.append([])
            turns[-1].append(m)
        return turns

    def send(self, text: str) -> "ReplyStream":
        """Stream the reply to the user message ``text``: iterate the returned :class:`ReplyStream` for text
        pieces; its ``reply`` is complete (and the history updated) when the iteration ends.

        ``ValueError`` for an empty message or one that does not fit the context even alone.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the message is empty; type some text")
        ids, dropped = self._fit(text)
        return ReplyStream(self, text, ids, dropped)


class ReplyStream:
    """Iterate for the reply's text pieces; :attr:`reply` holds the result (see :class:`Reply`)."""

    def __init__(self, session: ChatSession, user: str, prompt: list[int], dropped: int) -> None:
        self.session, self.user, self.prompt = session, user, prompt
        self.reply = Reply(dropped_turns=dropped)

    def __iter__(self) -> Iterator[str]:
        s = self.session
        tool = ToolUse(s.fmt) if s.tools else None
        turn = s.generator.turn(self.prompt, s.max_new_tokens, rng=s.rng, stop_ids=s.fmt.stop_ids,
                                inject=tool.feed if tool else None, **s.sampling)
        for _, piece, _ in turn:
            self.reply.text += piece
            if piece:
                yield piece
        r = self.reply
        r.ids, r.finish_reason, r.prefilled = turn.ids, turn.finish_reason or "", turn.prefilled
        r.tool_calls = list(tool.calls) if tool else []
        r.messages = messages_from_reply(s.fmt, turn.ids)
        if r.messages:
            s.history += [{"role": "user", "content": self.user}, *r.messages]
