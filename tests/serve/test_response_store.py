"""The Responses API's store: bounded by count and bytes, oldest out first, expiring, never over its budget."""

from __future__ import annotations

import json

import pytest

from lmforge.serve.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _size(resource: dict, history: list) -> int:
    return len(json.dumps([resource, history, []], ensure_ascii=False).encode())


def test_count_bound_drops_the_oldest_and_get_delete():
    store = ResponseStore(max_items=2)
    for k in range(3):
        assert store.put(f"r{k}", {"id": f"r{k}"}, [{"role": "user", "content": str(k)}])
    assert store.get("r0") is None and store.get("r1").resource == {"id": "r1"} and len(store) == 2
    assert store.get("r2").history == [{"role": "user", "content": "2"}]
    assert store.delete("r1") and not store.delete("r1") and len(store) == 1
    assert store.put("r2", {"id": "again"}, []) and len(store) == 1 and store.get("r2").resource == {"id": "again"}


def test_byte_bound_holds_whatever_the_sizes():
    one = _size({"id": "x"}, [{"role": "user", "content": "é" * 100}])
    store = ResponseStore(max_bytes=3 * one)
    for k in range(10):
        assert store.put(f"r{k}", {"id": "x"}, [{"role": "user", "content": "é" * 100}])
        assert store.bytes <= store.max_bytes and store.bytes == len(store) * one
    assert len(store) == 3 and [store.get(f"r{k}") is not None for k in (6, 7, 8, 9)] == [False, True, True, True]
    # an entry over the whole budget is not kept, and evicts nothing
    assert not store.put("big", {"id": "x"}, [{"role": "user", "content": "x" * 4 * one}])
    assert store.get("big") is None and len(store) == 3


def test_entries_expire_after_ttl():
    clock = Clock()
    store = ResponseStore(ttl=10, clock=clock)
    store.put("a", {}, [])
    clock.now = 5
    store.put("b", {}, [])
    clock.now = 9.9
    assert store.get("a") is not None
    clock.now = 10
    assert store.get("a") is None and store.get("b") is not None and store.bytes == _size({}, [])
    clock.now = 15
    assert store.get("b") is None and len(store) == 0 and store.bytes == 0


@pytest.mark.parametrize("bad", [{"max_items": 0}, {"max_bytes": -1}, {"ttl": 0}, {"max_items": True}])
def test_bounds_must_be_positive(bad):
    with pytest.raises(ValueError, match="must be a positive number"):
        ResponseStore(**bad)
