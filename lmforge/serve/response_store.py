"""The Responses API's stored responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}``
returns, kept in memory, bounded and expiring.

Each entry holds a response object (the JSON the client got), its conversation so far (chat messages: the
inputs of every turn of the chain and the model's replies, without the ``instructions``, which are never carried
over), so one entry alone continues its chain, and the request's own input items (``GET
/v1/responses/{id}/input_items``). The store keeps at most ``max_items`` entries and ``max_bytes``
bytes (the entries' JSON sizes); a new entry drops the oldest until it fits, and an entry expires ``ttl`` seconds
after it was stored. An entry larger than the whole budget is not kept. The store lives on the server's event loop
(one thread): no locks.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ResponseStore", "Stored"]


@dataclass(frozen=True)
class Stored:
    """One stored response: its ``resource`` (the response object), its ``history`` (chat messages, the reply
    included), its ``inputs`` (the request's input items, with ids), when it expires and its size in bytes."""

    resource: dict[str, Any]
    history: list[dict[str, Any]]
    inputs: list[dict[str, Any]]
    expires: float
    size: int


class ResponseStore:
    """Stored responses by id, at most ``max_items`` of them and ``max_bytes`` in all, each for ``ttl`` seconds
    (``clock``: the monotonic time in seconds, for tests). ``ValueError`` for a bound that is not positive."""

    def __init__(self, max_items: int = 1000, max_bytes: int = 64 << 20, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("max_items", max_items), ("max_bytes", max_bytes), ("ttl", ttl)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ResponseStore: {name} must be a positive number (got {value!r})")
        self.max_items, self.max_bytes, self.ttl, self.clock = max_items, max_bytes, ttl, clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()  # oldest first: expiry order too
        self.bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, rid: str, resource: dict[str, Any], history: list[dict[str, Any]],
            inputs: list[dict[str, Any]] | None = None) -> bool:
        """Store ``resource``, ``history`` and ``inputs`` under ``rid``, dropping the oldest entries until both
        bounds hold; False (nothing stored) if this entry alone is over ``max_bytes``."""
        self.delete(rid)
        inputs = inputs or []
        size = len(json.dumps([resource, history, inputs], ensure_ascii=False).encode())
        if size > self.max_bytes:
            return False
        self._expire()
        while self._entries and (len(self._entries) >= self.max_items or self.bytes + size > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[rid] = Stored(resource, history, inputs, self.clock() + self.ttl, size)
        self.bytes += size
        return True

    def get(self, rid: str) -> Stored | None:
        """The entry stored under ``rid``; None if there is none or it expired."""
        self._expire()
        return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; False if it was not stored (or had expired)."""
        self._expire()
        if rid not in self._entries:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        self.bytes -= self._entries.pop(rid).size

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            rid, first = next(iter(self._entries.items()))
            if first.expires > now:
                break
            self._drop(rid)
