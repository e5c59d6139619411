"""The Responses API's stored responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}``
returns, kept in memory per tenant (:mod:`~lmforge.serve.access`), bounded and expiring.

Each entry holds a response object (the JSON the client got), its conversation so far (chat messages: the inputs of
every turn of the chain and the model's replies, without the ``instructions``, which are never carried over), so one
entry alone continues its chain, and the request's own input items. An entry is kept as compact UTF-8 JSON bytes,
read back on each use, so the budget counts the memory held: its bytes plus :data:`ENTRY_OVERHEAD`.

Every tenant has a shelf of its own, so one tenant's traffic never evicts another's, and an id stored by one tenant
is not found by another (the same None as an id never stored). The store lives on the server's event loop (one
thread): no locks.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ENTRY_OVERHEAD", "ResponseStore", "Stored"]

ENTRY_OVERHEAD = 512
"""Bytes counted per entry besides its JSON: the three bytes objects, the entry, its id and its slot in the shelf."""


def _pack(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored response (module docstring) as JSON bytes, and when it expires."""

    resource_json: bytes
    history_json: bytes
    inputs_json: bytes
    expires: float

    @property
    def size(self) -> int:
        """The bytes this entry is counted as: its JSON and :data:`ENTRY_OVERHEAD`."""
        return len(self.resource_json) + len(self.history_json) + len(self.inputs_json) + ENTRY_OVERHEAD

    @property
    def resource(self) -> dict[str, Any]:
        return json.loads(self.resource_json)

    @property
    def history(self) -> list[dict[str, Any]]:
        return json.loads(self.history_json)

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return json.loads(self.inputs_json)


class _Shelf:
    """One tenant's entries, oldest first (expiry order too), and their bytes."""

    def __init__(self) -> None:
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def drop(self, rid: str) -> None:
        self.bytes -= self.entries.pop(rid).size

    def expire(self, now: float) -> None:
        while self.entries and next(iter(self.entries.values())).expires <= now:
            self.drop(next(iter(self.entries)))


class ResponseStore:
    """Stored responses by tenant and id: per tenant at most ``max_items`` of them and ``max_bytes`` in all (a new
    entry drops its tenant's oldest until it fits), each for ``ttl`` seconds (``clock``: the monotonic time in
    seconds, for tests). ``ValueError`` for a bound that is not positive."""

    def __init__(self, max_items: int = 1000, max_bytes: int = 64 << 20, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("max_items", max_items), ("max_bytes", max_bytes), ("ttl", ttl)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ResponseStore: {name} must be a positive number (got {value!r})")
        self.max_items, self.max_bytes, self.ttl, self.clock = max_items, max_bytes, ttl, clock
        self._shelves: dict[str, _Shelf] = {}

    def __len__(self) -> int:
        """Entries held, over every tenant."""
        return sum(len(s.entries) for s in self._live())

    @property
    def bytes(self) -> int:
        """Bytes held (as entries are counted: :attr:`Stored.size`), over every tenant."""
        return sum(s.bytes for s in self._live())

    def put(self, tenant: str, rid: str, resource: dict[str, Any], history: list[dict[str, Any]],
            inputs: list[dict[str, Any]] | None = None) -> bool:
        """Store ``resource``, ``history`` and ``inputs`` under ``tenant`` and ``rid``, dropping the tenant's oldest
        entries until both bounds hold; False (nothing stored, nothing dropped) if this entry alone is over
        ``max_bytes``."""
        self.delete(tenant, rid)
        entry = Stored(_pack(resource), _pack(history), _pack(inputs or []), self.clock() + self.ttl)
        if entry.size > self.max_bytes:
            return False
        shelf = self._shelves.setdefault(tenant, _Shelf())  # (delete dropped its expired entries)
        while shelf.entries and (len(shelf.entries) >= self.max_items or shelf.bytes + entry.size > self.max_bytes):
            shelf.drop(next(iter(shelf.entries)))
        shelf.entries[rid] = entry
        shelf.bytes += entry.size
        return True

    def get(self, tenant: str, rid: str) -> Stored | None:
        """The entry ``tenant`` stored under ``rid``; None if there is none, it expired, or another tenant stored it."""
        shelf = self._shelf(tenant)
        return shelf.entries.get(rid) if shelf is not None else None

    def delete(self, tenant: str, rid: str) -> bool:
        """Forget ``tenant``'s ``rid``; False if it had not stored it (or it had expired)."""
        shelf = self._shelf(tenant)
        if shelf is None or rid not in shelf.entries:
            return False
        shelf.drop(rid)
        return True

    def _shelf(self, tenant: str) -> _Shelf | None:
        """``tenant``'s shelf once its expired entries are dropped; None (and the shelf dropped) if it holds none."""
        shelf = self._shelves.get(tenant)
        if shelf is not None:
            shelf.expire(self.clock())
            if not shelf.entries:
                del self._shelves[tenant]
                return None
        return shelf

    def _live(self) -> list[_Shelf]:
        """Every tenant's shelf that holds entries (:meth:`_shelf`)."""
        return [shelf for tenant in list(self._shelves) if (shelf := self._shelf(tenant)) is not None]
