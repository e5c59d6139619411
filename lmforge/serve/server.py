"""A run loaded for serving (:class:`ServedModel`: the engine and tokenizer behind the batching scheduler, API
requests turned into prompt ids through the one chat renderer, their limits) and the process that serves it
(:func:`serve`: 127.0.0.1 unless told otherwise, uvicorn on :func:`~lmforge.serve.app.create_app`, drain on SIGTERM).
A chat reply shows calculator calls in the :data:`TOOL_TEXT` markup, read back by :func:`messages_from_text`.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import re
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from lmforge.chat.format import ChatFormat, ConversationError, Message, check_conversation
from lmforge.chat.tools import ToolUse
from lmforge.generate import Generator
from lmforge.generate.constraints import Grammars
from lmforge.generate.engine import Engine
from lmforge.generate.prefix_cache import PrefixCache
from lmforge.generate.scheduler import Scheduler
from lmforge.serve.access import exposure_warning
from lmforge.serve.errors import APIError
from lmforge.serve.response_store import ResponseStore
from lmforge.tokenizer import Tokenizer

logger = logging.getLogger("lmforge")

__all__ = ["DEFAULT_PREFIX_CACHE_MB", "ServedModel", "TOOL_TEXT", "bind", "messages_from_text", "serve"]

DEFAULT_PREFIX_CACHE_MB = 512
"""The prefix cache's default budget (MiB)."""

TOOL_TEXT: dict[str, str] = {"<|python_start|>": "<calculator>", "<|python_end|>": "</calculator>",
                             "<|output_start|>": "<output>", "<|output_end|>": "</output>"}
"""How a chat reply over the API shows the calculator's special tokens (the call, then the tool's output)."""

_TOOL_CALL = re.compile("{}(.*?){}{}(.*?){}".format(*map(re.escape, TOOL_TEXT.values())), re.DOTALL)


def messages_from_text(content: str) -> list[Message]:
    """An assistant message's text split at each calculator call shown in the :data:`TOOL_TEXT` markup, so a reply
    sent back as it came renders the prompt ids ``lmforge chat`` renders: ``assistant`` text with ``tool_call``,
    the ``tool`` output, ..., then the ``assistant`` text after the last call (possibly empty: the model may end
    its turn right after the output). Text without the markup is one assistant message; a call with a blank
    expression (the chat format has none) stays text.

    >>> messages_from_text("Let me see. <calculator>6*7</calculator><output>42</output>It is 42.")
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'assistant', 'content': 'Let me see. ', 'tool_call': '6*7'}, {'role': 'tool', 'content': '42'},
     {'role': 'assistant', 'content': 'It is 42.'}]
    """
    out: list[Message] = []
    start = 0  # where the current assistant text starts
    for m in _TOOL_CALL.finditer(content):
        if not m.group(1).strip():
            continue
        out.append({"role": "assistant", "content": content[start:m.start()], "tool_call": m.group(1)})
        out.append({"role": "tool", "content": m.group(2)})
        start = m.end()
    out.append({"role": "assistant", "content": content[start:]})
    return out


class ServedModel:
    """An engine and tokenizer behind the API, under the model id ``model_id``.

    ``max_batch``, ``max_queue`` (beyond: 429) and ``speculative`` are the :class:`Scheduler`'s; ``max_tokens_cap``
    bounds a request's ``max_tokens`` (default: the context length); ``prefix_cache_mb`` (0: off) budgets a
    :class:`PrefixCache` across requests. Chat endpoints need the chat special tokens in the tokenizer (``chat`` is
    None without them, ``no_chat`` says why).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_id: str, max_batch: int = 8,
                 max_queue: int = 64, max_tokens_cap: int | None = None,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, speculative: bool = True) -> None:
        if (isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float))
                or not 0 <= prefix_cache_mb < float("inf")):
            raise ValueError(f"prefix_cache_mb must be a non-negative number of MiB (got {prefix_cache_mb!r})")
        cache = PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None
        self.scheduler = Scheduler(engine, tokenizer, max_batch, max_queue, prefix_cache=cache,
                                   speculative=speculative)
        self.tokenizer, self.model_id = tokenizer, model_id
        self.context_length = engine.context_length
        if max_tokens_cap is not None and (isinstance(max_tokens_cap, bool) or not isinstance(max_tokens_cap, int)
                                           or max_tokens_cap < 1):
            raise ValueError(f"max_tokens_cap must be a positive integer (got {max_tokens_cap!r})")
        self.max_tokens_cap = max_tokens_cap or self.context_length
        self.chat: ChatFormat | None = None
        self.no_chat = ""
        try:
            self.chat = ChatFormat(tokenizer)
        except ValueError as e:
            self.no_chat = (f"model {model_id!r} has no chat format ({e}); fine-tune it for chat (lmforge sft), or "
                            "use /v1/completions with a raw prompt")
        self.tool_text: dict[int, str] = {}  # special id -> its text in a reply: TOOL_TEXT's markup; a call's none
        if self.chat is not None:
            self.tool_text = {self.chat.ids[t]: text for t, text in TOOL_TEXT.items()}
            if self.chat.has_tools:
                self.tool_text.update({self.chat.ids[t]: "" for t in ("<|call_start|>", "<|call_end|>")})

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                 device: str = "auto", weight_dtype: str | None = None, **kw: Any) -> "ServedModel":
        """Load a run's model and tokenizer (as :meth:`Generator.from_run`); the model id is the run's folder name."""
        gen = Generator.from_run(run_dir, checkpoint, device=device, weight_dtype=weight_dtype)
        return cls(gen.engine, gen.tokenizer, Path(run_dir).resolve().name, **kw)

    # ---------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    error: Callable[[int | None, str], APIError] | None = None) -> list[int]:
        """Prompt ids of a conversation (ends with ``<|assistant_start|>``), each assistant message split at its
        calculator calls (:func:`messages_from_text`; its function calls stay on the last part), with the
        function definitions ``tools``. A conversation the renderer refuses raises ``error(k, why)``: ``k`` is the
        client's message at fault (None: the conversation as a whole), which ``why`` names ``message k``; by
        default a 400 naming ``messages``."""
        if self.chat is None:
            raise APIError(400, self.no_chat, "messages", "chat_not_supported")
        error = error or _messages_error
        try:
            check_conversation(messages, for_training=False)  # errors name the messages as the client sent them
        except ValueError as e:  # (a ConversationError names the message at fault; a malformed call does not)
            raise error(e.index if isinstance(e, ConversationError) else None, str(e)) from None
        split = []
        for m in messages:
            parts = messages_from_text(m["content"]) if m["role"] == "assistant" else [m]
            if m.get("tool_calls"):  # (only an assistant message has them: on its last part)
                parts[-1]["tool_calls"] = m["tool_calls"]
            split += parts
        try:
            return self.chat.render_for_completion(split, tools)
        except ValueError as e:  # (the split conversation, or its tools: no message of the client's to name)
            raise error(None, str(e)) from None

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The tokenizer's vocabulary for constrained decoding and its grammar cache (built on first use;
        ``ConstraintError`` without llguidance)."""
        return Grammars(self.tokenizer)

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """Each input's embedding: the mean over its tokens of the model's final-normed hidden state, divided by
        its L2 norm (computed between the scheduler's steps, under its ``engine_lock``)."""
        model = self.scheduler.engine.model
        out = []
        with self.scheduler.engine_lock, torch.inference_mode():
            for ids in inputs:
                h = model.hidden(torch.tensor([ids], device=self.scheduler.engine.device))[0].float()  # (T, C)
                out.append(torch.nn.functional.normalize(h.mean(dim=0), dim=0).tolist())
        return out

    def chat_tool(self) -> Callable[[int], list[int] | None]:
        """A fresh calculator state machine for one reply (its ``feed`` is the scheduler's forced-token hook)."""
        assert self.chat is not None
        return ToolUse(self.chat).feed

    def text_prompt(self, text: str) -> list[int]:
        """Prompt ids of a raw text; APIError 400 when it is empty or cannot be encoded (a lone surrogate)."""
        if not text:
            raise APIError(400, "prompt is empty; give some text to continue", "prompt")
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", "prompt") from None

    def max_tokens(self, asked: int | None, prompt_tokens: int, prompt_param: str, n: int = 1,
                   param: str = "max_tokens") -> int:
        """The request's ``max_tokens`` per choice (``param``: the parameter that asked, ``prompt_param`` the one
        holding the prompt): as asked (checked against the cap and the context), or by default what fits in the
        context (up to the cap). ``n`` choices share the cap (``n × max_tokens``) and need as many free rows."""
        if n > self.scheduler.max_batch:
            raise APIError(400, f"n is {n} but this server decodes at most {self.scheduler.max_batch} rows together "
                                "(--max-batch); ask for fewer choices", "n")
        room = self.context_length - prompt_tokens
        if room < 1:
            raise APIError(400, f"{prompt_param} has {prompt_tokens} tokens but the model's context length is "
                                f"{self.context_length}, leaving no room for a reply; shorten it",
                           prompt_param, "context_length_exceeded")
        if asked is None:
            return max(1, min(room, self.max_tokens_cap // n))
        try:
            self.scheduler.check(prompt_tokens, asked, f"the {prompt_param}", param)
        except ValueError as e:
            raise APIError(400, f"{e}; or lower {param}", param, "context_length_exceeded") from None
        if asked > self.max_tokens_cap:
            raise APIError(400, f"{param} is {asked} but this server allows at most {self.max_tokens_cap} "
                                "(--max-tokens-cap); ask for fewer", param)
        if n * asked > self.max_tokens_cap:
            raise APIError(400, f"n × {param} is {n} × {asked} = {n * asked} but this server allows at most "
                                f"{self.max_tokens_cap} tokens per request (--max-tokens-cap); ask for fewer", "n")
        return asked


def _messages_error(k: int | None, why: str) -> APIError:
    return APIError(400, f"messages: {why}", "messages")


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one; IPv6 if ``host`` has a colon). It names
    the TCP protocol, so asyncio turns Nagle's algorithm off on each accepted connection (``TCP_NODELAY``): else a
    reply written in two parts on a kept-alive connection waits for the client's delayed ACK (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5


def uvicorn_config(app: Any, header_timeout: float = HEADER_TIMEOUT_S, **kw: Any) -> Any:
    """A ``uvicorn.Config`` for ``app`` (``kw``: more of its settings) whose connections cannot be held open by
    a slow client: each request's headers must arrive within ``header_timeout`` seconds of the connection
    opening or of the previous response (else the connection is closed; uvicorn itself waits forever, even
    for a client that sends nothing), an idle connection closes after :data:`KEEP_ALIVE_S` seconds, and the app
    bounds the time a body may take (``create_app(body_timeout=...)``)."""
    import uvicorn  # the optional extra: pip install lmforge[serve]
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):  # type: ignore[misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_deadline()

        def on_response_complete(self) -> None:
            answered = self.cycle
            super().on_response_complete()
            if self.cycle is answered:  # no pipelined request started: wait for the next one's headers
                self._header_deadline()

        def _header_deadline(self) -> None:
            waiting = self.cycle  # a new request replaces it once its headers are in

            def expire() -> None:
                if self.cycle is waiting and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(header_timeout, expire)

    return uvicorn.Config(app, http=Protocol, timeout_keep_alive=KEEP_ALIVE_S, **kw)


def serve(served: ServedModel, host: str = "127.0.0.1", port: int = 8000, api_key: str | Sequence[str] | None = None,
          max_body: int = 1 << 20, on_ready: Callable[[str], None] | None = None,
          drain_timeout: float = 300.0, allowed_hosts: Sequence[str] = (),
          response_store: ResponseStore | None = None) -> None:
    """Serve ``served`` over HTTP until SIGTERM or Ctrl-C; requests in flight finish first (up to
    ``drain_timeout`` seconds). ``on_ready(url)`` is called once the socket listens. ``host`` is an allowed
    ``Host`` name besides ``allowed_hosts``; these and the other arguments are
    :func:`~lmforge.serve.app.create_app`'s, whose ``ValueError`` comes before the socket is bound."""
    import uvicorn  # the optional extra: pip install lmforge[serve]

    from lmforge.serve.app import create_app

    keys = None if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    app = create_app(served, api_key=keys, max_body=max_body, allowed_hosts=[host, *allowed_hosts],
                     response_store=response_store)  # (bad keys and hosts refused before binding)
    if (warning := exposure_warning(host, keys)) is not None:
        logger.warning("%s", warning)
    sock = bind(host, port)
    url = "http://%s:%d" % ((f"[{host}]" if ":" in host else host), sock.getsockname()[1])
    config = uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout, access_log=False)
    server = uvicorn.Server(config)
    # the startup's objects (the model, the libraries) frozen out of the collector's reach: a full collection
    # then walks only what serving allocates, so none pauses the event loop for hundreds of milliseconds
    gc.collect()
    gc.freeze()
    logger.info("serving %s on %s (web chat at %s/, API at %s/v1; %s)", served.model_id, url, url, url,
                f"{len(keys)} API key{'s' if len(keys) > 1 else ''} required" if keys else "no API key")
    if on_ready is not None:
        on_ready(url)
    # uvicorn re-raises the signal that stopped it once it has drained; no-op handlers make that a clean exit
    main = threading.current_thread() is threading.main_thread()  # signals can only be handled there
    old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        sock.close()
        gc.unfreeze()  # (a caller that goes on may collect them again)
    logger.info("lmforge serve: stopped")
