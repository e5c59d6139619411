"""The Responses API's store: per tenant bounded by count and bytes, oldest out first, expiring, never over its
budget, and the budget is the memory the entries hold."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from lmforge.serve.response_store import ENTRY_OVERHEAD, ResponseStore

A, B = "tenant-a", "tenant-b"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _size(store: ResponseStore, resource: dict, history: list) -> int:
    probe = ResponseStore(clock=store.clock)
    probe.put("probe", "x", resource, history)
    return probe.bytes


def test_count_bound_drops_the_oldest_and_get_delete():
    store = ResponseStore(max_items=2)
    for k in range(3):
        assert store.put(A, f"r{k}", {"id": f"r{k}"}, [{"role": "user", "content": str(k)}])
    assert store.get(A, "r0") is None and store.get(A, "r1").resource == {"id": "r1"} and len(store) == 2
    assert store.get(A, "r2").history == [{"role": "user", "content": "2"}]
    assert store.delete(A, "r1") and not store.delete(A, "r1") and len(store) == 1
    assert store.put(A, "r2", {"id": "again"}, []) and len(store) == 1 and store.get(A, "r2").resource == {"id": "again"}


def test_byte_bound_holds_whatever_the_sizes():
    history = [{"role": "user", "content": "é" * 100}]
    one = _size(ResponseStore(), {"id": "x"}, history)
    assert one > ENTRY_OVERHEAD + 200  # (the JSON's UTF-8 bytes and the overhead)
    store = ResponseStore(max_bytes=3 * one)
    for k in range(10):
        assert store.put(A, f"r{k}", {"id": "x"}, history)
        assert store.bytes <= store.max_bytes and store.bytes == len(store) * one
    assert len(store) == 3 and [store.get(A, f"r{k}") is not None for k in (6, 7, 8, 9)] == [False, True, True, True]
    # an entry over the whole budget is not kept, and evicts nothing
    assert not store.put(A, "big", {"id": "x"}, [{"role": "user", "content": "x" * 4 * one}])
    assert store.get(A, "big") is None and len(store) == 3


def test_tenants_never_see_or_evict_each_others_entries():
    """B floods its shelf (count and bytes): A's entries stay; neither finds, nor deletes, the other's ids."""
    store = ResponseStore(max_items=3, max_bytes=20_000)
    store.put(A, "a1", {"id": "a1"}, [])
    store.put(A, "shared-id", {"id": "mine"}, [])
    for k in range(50):
        store.put(B, f"b{k}", {"id": f"b{k}"}, [{"role": "user", "content": "y" * (k * 97 % 3000)}])
    assert store.get(A, "a1").resource == {"id": "a1"} and store.get(A, "shared-id").resource == {"id": "mine"}
    assert store.get(B, "a1") is None and not store.delete(B, "a1") and store.get(A, "a1") is not None
    assert store.get(A, "b49") is None and store.get(B, "b49") is not None
    store.put(B, "shared-id", {"id": "theirs"}, [])
    assert store.get(A, "shared-id").resource == {"id": "mine"} and store.get(B, "shared-id").resource == {"id": "theirs"}
    assert len(store) == 2 + 3


def test_the_budget_is_the_memory_the_entries_hold():
    """Responses with 20 alternatives per token (the heaviest kind: many small objects) fill a 256 KiB budget: the
    memory the store then holds, as ``tracemalloc`` traces it, is within the budget (parsed dicts took ~7x)."""
    def heavy(k: int) -> dict:  # (each object its own, as a response parsed from JSON has them)
        lps = [{"token": "x", "logprob": -0.5 - i, "bytes": [120], "top_logprobs": [
            {"token": f"t{j}", "logprob": -1.0 - j / 7 - i, "bytes": [116, 48 + j % 10]} for j in range(20)]}
            for i in range(16)]
        return {"id": f"resp_{k:032d}", "output": [{"type": "message", "content": [
            {"type": "output_text", "text": "x", "logprobs": lps}]}]}

    budget = 1 << 18
    store = ResponseStore(max_bytes=budget)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for k in range(24):  # more than fit: the oldest are dropped
            assert store.put(A, f"resp_{k:032d}", heavy(k), [{"role": "user", "content": "hi"}])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.get(A, f"resp_{0:032d}") is None and len(store) > 5
    assert store.bytes <= budget and held <= budget, (held, store.bytes, len(store))
    assert store.get(A, f"resp_{23:032d}").resource == heavy(23)


def test_entries_expire_after_ttl():
    clock = Clock()
    store = ResponseStore(ttl=10, clock=clock)
    store.put(A, "a", {}, [])
    clock.now = 5
    store.put(B, "b", {}, [])
    clock.now = 9.9
    assert store.get(A, "a") is not None
    clock.now = 10
    assert store.get(A, "a") is None and store.get(B, "b") is not None and store.bytes == _size(store, {}, [])
    clock.now = 15
    assert store.get(B, "b") is None and len(store) == 0 and store.bytes == 0


@pytest.mark.parametrize("bad", [{"max_items": 0}, {"max_bytes": -1}, {"ttl": 0}, {"max_items": True}])
def test_bounds_must_be_positive(bad):
    with pytest.raises(ValueError, match="must be a positive number"):
        ResponseStore(**bad)
