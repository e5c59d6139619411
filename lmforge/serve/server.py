"""A run loaded for serving (:class:`ServedModel`) and the process that serves it (:func:`serve`).

:class:`ServedModel` holds the engine, the tokenizer and the :class:`~lmforge.generate.scheduler.Scheduler`
that batches every request on it; it turns API requests into prompt ids (chat messages through the one chat
renderer, :class:`~lmforge.chat.format.ChatFormat`) and checks their limits. :func:`serve` binds the socket
(127.0.0.1 unless told otherwise), runs uvicorn on :func:`~lmforge.serve.app.create_app`, and on SIGTERM or
Ctrl-C stops taking connections, lets the requests in flight finish, and returns.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable

from lmforge.chat.format import ChatFormat
from lmforge.chat.tools import ToolUse
from lmforge.generate import Generator
from lmforge.generate.engine import Engine
from lmforge.generate.scheduler import Scheduler
from lmforge.serve.api import APIError
from lmforge.tokenizer import Tokenizer

logger = logging.getLogger("lmforge")

__all__ = ["ServedModel", "bind", "exposure_warning", "serve"]

API_KEY_ENV = "LMFORGE_API_KEY"


class ServedModel:
    """An engine and tokenizer behind the API, under the model id ``model_id``.

    ``max_batch`` requests decode together, ``max_queue`` more may wait (beyond: 429);
    ``max_tokens_cap`` bounds a request's ``max_tokens`` (default: the context length).
    Chat endpoints need the chat special tokens in the tokenizer (``chat`` is None without them,
    ``no_chat`` says why).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_id: str, max_batch: int = 8,
                 max_queue: int = 64, max_tokens_cap: int | None = None) -> None:
        self.scheduler = Scheduler(engine, tokenizer, max_batch, max_queue)
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
        self.eot_id = tokenizer.eot_id

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                 device: str = "auto", weight_dtype: str | None = None, **kw: Any) -> "ServedModel":
        """Load a run's model and tokenizer (as :meth:`Generator.from_run`); the model id is the run's folder name."""
        gen = Generator.from_run(run_dir, checkpoint, device=device, weight_dtype=weight_dtype)
        return cls(gen.engine, gen.tokenizer, Path(run_dir).resolve().name, **kw)

    # ---------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids of a conversation (ends with ``<|assistant_start|>``); APIError 400 when it is not valid."""
        if self.chat is None:
            raise APIError(400, self.no_chat, "messages", "chat_not_supported")
        try:
            return self.chat.render_for_completion(messages)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None

    def chat_stops(self) -> list[int]:
        """Ids that end a reply: ``<|assistant_end|>`` (and the document separator)."""
        assert self.chat is not None
        return [self.chat.assistant_end_id] + ([self.eot_id] if self.eot_id is not None else [])

    def chat_tool(self) -> Callable[[int], list[int] | None]:
        """A fresh calculator state machine for one reply (its ``feed`` is the scheduler's forced-token hook)."""
        assert self.chat is not None
        return ToolUse(self.chat).feed

    def text_prompt(self, text: str) -> list[int]:
        """Prompt ids of a raw text; APIError 400 when it is empty."""
        if not text:
            raise APIError(400, "prompt is empty; give some text to continue", "prompt")
        return self.tokenizer.encode(text)

    def max_tokens(self, asked: int | None, prompt_tokens: int, prompt_param: str) -> int:
        """The request's ``max_tokens``: as asked (checked against the cap and the context), or by default
        what fits in the context (up to the cap)."""
        room = self.context_length - prompt_tokens
        if room < 1:
            raise APIError(400, f"{prompt_param} has {prompt_tokens} tokens but the model's context length is "
                                f"{self.context_length}, leaving no room for a reply; shorten it",
                           prompt_param, "context_length_exceeded")
        if asked is None:
            return min(room, self.max_tokens_cap)
        try:
            self.scheduler.check(prompt_tokens, asked, f"the {prompt_param}")
        except ValueError as e:
            raise APIError(400, f"{e}; or lower max_tokens", "max_tokens", "context_length_exceeded") from None
        if asked > self.max_tokens_cap:
            raise APIError(400, f"max_tokens is {asked} but this server allows at most {self.max_tokens_cap} "
                                "(--max-tokens-cap); ask for fewer", "max_tokens")
        return asked


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for listening on ``host`` without a key, when ``host`` is not a loopback address."""
    if api_key:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if loopback:
        return None
    return (f"listening on {host} without an API key: anyone who can reach this address can use the model; "
            f"pass --api-key (or set {API_KEY_ENV}), or bind 127.0.0.1")


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one; IPv6 if ``host`` has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(served: ServedModel, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body: int = 1 << 20, on_ready: Callable[[str], None] | None = None,
          drain_timeout: float = 300.0) -> None:
    """Serve ``served`` over HTTP until SIGTERM or Ctrl-C; requests in flight finish first (up to
    ``drain_timeout`` seconds). ``on_ready(url)`` is called once the socket listens."""
    import uvicorn  # the optional extra: pip install lmforge[serve]

    from lmforge.serve.app import create_app

    warning = exposure_warning(host, api_key)
    if warning:
        logger.warning("%s", warning)
    sock = bind(host, port)
    url = "http://%s:%d" % ((f"[{host}]" if ":" in host else host), sock.getsockname()[1])
    app = create_app(served, api_key=api_key, max_body=max_body)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout, access_log=False)
    server = uvicorn.Server(config)
    logger.info("serving %s on %s (web chat at %s/, API at %s/v1; %s)", served.model_id, url, url, url,
                "API key required" if api_key else "no API key")
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
    logger.info("lmforge serve: stopped")
