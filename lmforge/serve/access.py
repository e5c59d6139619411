"""Who may use the server: the API keys and the tenant each one is (:class:`Keys`, :func:`check_api_key`), the
``Host`` a request may name (:class:`AllowedHosts`, enforced by the middleware :class:`HostCheck`) and the warning
for a server open beyond this machine (:func:`exposure_warning`).

Tenancy: each key is one tenant, whose id is a keyed hash of the key under a secret drawn when the server starts
(stable while it runs, telling nothing about the key); it keeps the tenant's stored responses and prefix-cache
blocks apart from every other's. Without keys there is one tenant, :data:`PUBLIC`.

The ``Host`` check stops DNS rebinding: a web page on ``evil.example`` whose name the attacker re-points at
127.0.0.1 makes the browser send its requests here, same-origin, with ``Host: evil.example``. A rebinding
always carries the attacker's host *name*, so a request naming an IP address, ``localhost``, the bound host or
a name allowed by ``--allowed-hosts`` is served and any other name is refused (``*`` allows every name, for a
deployment behind a proxy that checks it).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
from typing import Any, Iterable

from lmforge.serve.errors import error_body, shown

__all__ = ["API_KEY_ENV", "AllowedHosts", "HostCheck", "Keys", "PUBLIC", "check_api_key", "exposure_warning"]

API_KEY_ENV = "LMFORGE_API_KEY"
PUBLIC = ""
"""The one tenant of a server without API keys."""


def check_api_key(key: str) -> None:
    """``ValueError`` unless ``key`` can be sent in an ``Authorization: Bearer KEY`` header and match: printable
    ASCII without spaces (a key with spaces or other characters could never be matched)."""
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if not key or bad is not None:
        what = "is empty" if not key else f"holds {'a space' if bad == ' ' else repr(bad)}"
        raise ValueError(f"the API key {what}; a key must be printable ASCII without spaces (letters, digits, "
                         "punctuation), since clients send it in an HTTP header, e.g. from `openssl rand -hex 24`")


class Keys:
    """The API keys a server accepts (each checked by :func:`check_api_key`, duplicates dropped; ``ValueError``
    for a bad one or none): :meth:`tenant` tells which key an ``Authorization`` header holds."""

    def __init__(self, keys: Iterable[str]) -> None:
        keys = list(dict.fromkeys(keys))
        if not keys:
            raise ValueError("no API key given")
        for k in keys:
            check_api_key(k)
        self._secret = secrets.token_bytes(32)
        self._digests = [self._digest(k) for k in keys]

    def _digest(self, token: str) -> bytes:
        return hmac.new(self._secret, token.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()

    def tenant(self, authorization: str) -> str | None:
        """The tenant id (32 hex digits) of the key an ``Authorization`` header value sends as ``Bearer KEY``;
        None if it is no key of these. The token is compared with every key, in constant time (digests of one
        length, no early exit), so the time taken tells neither which key nor how much of one matched."""
        scheme, _, token = authorization.partition(" ")
        mine = self._digest(token.strip())
        matched = [hmac.compare_digest(mine, d) for d in self._digests]
        if scheme.lower() != "bearer" or not any(matched):
            return None
        return mine.hex()[:32]


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def exposure_warning(host: str, api_key: Any) -> str | None:
    """The warning for listening on ``host`` without a key (``api_key``: falsy when there is none), when ``host``
    is not a loopback address."""
    if api_key or host == "localhost" or ((ip := _ip(host)) is not None and ip.is_loopback):
        return None
    return (f"listening on {host} without an API key: anyone who can reach this address can use the model; "
            f"pass --api-key (or set {API_KEY_ENV}), or bind 127.0.0.1")


def host_name(header: str) -> str:
    """The name in a ``Host`` header, lower case, without its port, IPv6 brackets or a final dot:
    ``[::1]:8000`` -> ``::1``, ``LocalHost.:80`` -> ``localhost``."""
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1:].partition("]")[0]
    elif h.count(":") == 1:
        h = h.partition(":")[0]
    return h.rstrip(".")


class AllowedHosts:
    """The ``Host`` names this server answers (module docstring): IP addresses, ``localhost`` and ``names`` (the
    bound host, ``--allowed-hosts``; ``*`` allows every name); ``ValueError`` for a malformed name."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        names = [n.strip() for n in names]
        bad = [n for n in names if not n or any(c.isspace() or c in "/@" for c in n)]
        if bad:
            raise ValueError(f"allowed host {bad[0]!r} is not a host name; give names like 'chat.example.com' "
                             "(comma-separated), or '*' to allow any")
        self.any = "*" in names
        self.names = {"localhost"} | {host_name(n) for n in names if n != "*"}

    def allows(self, header: str | None) -> bool:
        """Whether a request whose ``Host`` header is ``header`` may be served (no header: an HTTP/1.0 client,
        never a browser, allowed)."""
        if self.any or not header:
            return True
        name = host_name(header)
        return name in self.names or _ip(name) is not None


class HostCheck:
    """ASGI middleware: a request naming a ``Host`` that ``hosts`` does not allow is answered 400 in the OpenAI
    error shape before the app sees it."""

    def __init__(self, app: Any, hosts: AllowedHosts) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None)
        if scope["type"] != "http" or self.hosts.allows(host):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(
            f"Host {shown(host, 100)} is not allowed: this server answers requests addressed to localhost, an IP "
            "address or its --host (a guard against DNS rebinding); start it with --allowed-hosts NAME to "
            "allow a name, or '*' behind a proxy that checks it", param="Host", code="invalid_host")).encode()
        await send({"type": "http.response.start", "status": 400, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
