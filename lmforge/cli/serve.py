"""``lmforge serve``: an OpenAI-compatible HTTP server and web chat page for a trained run."""

from __future__ import annotations

import argparse
import importlib.util
import os

from lmforge.cli import AddArgs, CLIError, Handler, positive_int


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run directory (config.yaml, tokenizer.json, checkpoints/)")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint file to load, or 'best' (default: the newest valid one in the run directory)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface, "
                        "then set an API key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (printable ASCII, no spaces); several keys "
                        "comma-separated, one per user: each key's stored responses and prefix-cache blocks are its "
                        "own. Prefer --api-key-file or the environment variable LMFORGE_API_KEY (comma-separated "
                        "too), the default: a key on the command line shows in `ps` to every user of the machine "
                        "(default: $LMFORGE_API_KEY, else no key)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API keys from PATH, one a line (blank lines and lines starting with # skipped); "
                        "with --api-key, both sets are accepted")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names (besides localhost, IP addresses and --host) that requests may "
                        "name in their Host header, e.g. chat.example.com for a server reached by that name; '*' "
                        "allows any (behind a proxy that checks it). Other names are refused, against DNS "
                        "rebinding (default: none)")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="requests decoded together, one batched step for all (default 8)")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests that may wait for a free batch slot; beyond, 429 with Retry-After (default 64)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=None,
                   help="largest max_tokens a request may ask for (default: the model's context length)")
    p.add_argument("--max-body", type=positive_int, default=1 << 20,
                   help="largest request body in bytes; beyond, 413 (default 1 MiB)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--weight-dtype", default=None, choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "int8"],
                   help="CPU only: store the decoder's weights as bf16/fp16/int8 (faster, rounded; default float32)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="keep the KV of prompts and replies across requests within MB MiB, so a conversation's next "
                        "turn or a shared system prompt is prefilled once (default 512; 0 = off)")
    p.add_argument("--speculative", choices=["auto", "off"], default="auto",
                   help="auto (default): a request decoding alone drafts its next tokens from its own context and "
                        "checks them in one pass where that pays (same replies); off: one token per step")
    p.add_argument("--responses-store-mb", type=float, default=64.0, metavar="MB",
                   help="the Responses API keeps each API key's stored responses (for previous_response_id and GET "
                        "/v1/responses/ID) within MB MiB of memory, at most 1,000, the oldest dropped first; a "
                        "response over MB alone is answered with store: false (default 64)")
    p.add_argument("--responses-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="a stored response is forgotten after SECONDS (default 3600)")


def _serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise CLIError(f"lmforge serve needs {' and '.join(missing)}: pip install 'lmforge[serve]'")
    from lmforge.serve import ServedModel, serve
    from lmforge.serve.access import AllowedHosts

    api_keys = _api_keys(args)  # before loading the model
    allowed = [h for h in args.allowed_hosts.split(",") if h.strip()]
    try:
        AllowedHosts(allowed)
    except ValueError as e:
        raise CLIError(f"--allowed-hosts: {e}") from None
    from lmforge.serve.response_store import ResponseStore
    from lmforge.serve.server import DEFAULT_PREFIX_CACHE_MB

    for flag, value in (("--responses-store-mb", args.responses_store_mb), ("--responses-ttl", args.responses_ttl)):
        if not 0 < value < float("inf"):
            raise CLIError(f"{flag} must be a positive number, got {value}")
    store = ResponseStore(max_bytes=max(1, int(args.responses_store_mb * 2**20)), ttl=args.responses_ttl)

    prefix_mb = DEFAULT_PREFIX_CACHE_MB if args.prefix_cache_mb is None else args.prefix_cache_mb
    if not prefix_mb >= 0 or prefix_mb == float("inf"):
        raise CLIError(f"--prefix-cache-mb must be a non-negative number of MiB, got {args.prefix_cache_mb}")
    served = ServedModel.from_run(args.run, args.checkpoint, device=args.device, weight_dtype=args.weight_dtype,
                                  max_batch=args.max_batch, max_queue=args.max_queue,
                                  max_tokens_cap=args.max_tokens_cap, prefix_cache_mb=prefix_mb,
                                  speculative=args.speculative == "auto")

    def ready(url: str) -> None:
        print(f"lmforge serve: {served.model_id} on {url}  (chat page: {url}/  API: {url}/v1)", flush=True)

    serve(served, args.host, args.port, api_key=api_keys, max_body=args.max_body, on_ready=ready,
          allowed_hosts=allowed, response_store=store)
    return 0


def _api_keys(args: argparse.Namespace) -> list[str] | None:
    """The keys of ``--api-key`` (comma-separated) and ``--api-key-file``, or else of ``$LMFORGE_API_KEY``; None
    for no key. CLIError (one line, never echoing a key) for an empty or malformed key or an unreadable file."""
    from lmforge.serve.access import API_KEY_ENV, check_api_key

    listed = args.api_key if args.api_key is not None or args.api_key_file else os.environ.get(API_KEY_ENV) or None
    source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
    named: list[tuple[str, str]] = []  # (where a key came from, the key)
    if listed is not None:
        if not listed.strip():
            raise CLIError(f"{source} is empty; give a key or leave the flag out")
        parts = listed.split(",")
        named += [(source if len(parts) == 1 else f"{source}, key {k} of {len(parts)}", part.strip())
                  for k, part in enumerate(parts, 1)]
    if args.api_key_file:
        path = args.api_key_file
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "it is not UTF-8 text"
            raise CLIError(f"--api-key-file {path}: cannot read it ({why})") from None
        keys = [(f"--api-key-file {path}, line {n}", line.strip()) for n, line in enumerate(lines, 1)
                if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise CLIError(f"--api-key-file {path} holds no key; write one key a line (blank lines and lines "
                           "starting with # are skipped)")
        named += keys
    for where, key in named:
        try:
            check_api_key(key)
        except ValueError as e:
            raise CLIError(f"{where}: {e}") from None
    return [key for _, key in named] or None


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"serve": (_serve_args, _serve)}
