"""``map_in_workers``: one definition of how a bench spreads independent replays over
worker processes.

Invariant: the results are in the order of ``items``, and equal to ``[fn(x) for x in
items]`` (each item runs alone in a forked worker, one at a time per worker, so a long
replay never holds others back; with ``workers`` <= 1, in this process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from multiprocessing import get_context
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_in_workers(fn: Callable[[T], R], items: Sequence[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]``, over ``workers`` forked processes when > 1."""
    if workers <= 1:
        return [fn(x) for x in items]
    with get_context("fork").Pool(workers) as pool:
        return pool.map(fn, items, chunksize=1)
