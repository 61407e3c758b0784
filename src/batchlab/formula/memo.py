"""Memoised sub-results of the calculator, keyed on exactly the config fields each one reads.

``batchlab fit`` and ``estimate --vary`` price hundreds of configs that share most of their parts (the
micro-batch's op list does not depend on accum, dp or ZeRO; the optimizer's ops only on the model and the
optimizer).  The cached values are immutable (tuples of frozen OpCounts), so a hit returns exactly what a
fresh computation gives.  ``uncached()`` turns every cache off (and empties them): the reference that
tests/formula/test_memo.py compares against.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

T = TypeVar("T")
LIMIT = 256  # entries per cache before it is emptied (an op list is a few hundred OpCounts: ~50 KB)


class Cache(dict):
    """A dict emptied when it reaches ``limit`` entries."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit


_caches: list[Cache] = []
_enabled = [True]


def cache(limit: int = LIMIT) -> Cache:
    """A new cache, registered so that ``uncached()`` and ``clear()`` reach it."""
    d = Cache(limit)
    _caches.append(d)
    return d


def lookup(store: Cache, key: Hashable, build: Callable[[], T]) -> T:
    """``store[key]``, built by ``build()`` on a miss; ``build()`` every time while caching is off."""
    if not _enabled[0]:
        return build()
    try:
        return store[key]
    except KeyError:
        if len(store) >= store.limit:
            store.clear()
        value = store[key] = build()
        return value


def clear() -> None:
    for d in _caches:
        d.clear()


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Every calculator cache off (and emptied) inside the block: each call computes afresh."""
    before = _enabled[0]
    clear()
    _enabled[0] = False
    try:
        yield
    finally:
        _enabled[0] = before
