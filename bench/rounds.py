"""Interleaved rounds: benchmarks that compare variants on a shared, drifting machine run
every variant once per round, in an order that turns each round."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` rotated left by ``round_index`` (mod their count): over ``len(items)``
    rounds each runs first once and in every position once, so a slow drift of the
    machine does not favour the variant that always runs first."""
    k = round_index % len(items) if items else 0
    return list(items[k:]) + list(items[:k])
