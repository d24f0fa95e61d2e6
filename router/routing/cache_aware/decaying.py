"""Per-replica totals that all decay by one factor per routed request, at O(1) per request.

``cache_aware``'s churn inflow and session footprint decay every replica's total at every
routed request. Multiplying each total costs O(replicas) per request (about 100 µs at
1,024 replicas with a total for each); ``DecayingTotals`` keeps instead each total scaled
by one shared growth factor, so a decay step multiplies one float.

Invariants:
    * The true total of key k is ``raw[k] * unit`` (``unit`` = 1 / the product of the
      decay factors applied since the last renormalisation); ratios of ``raw`` values
      are ratios of true totals, so a term that compares totals with their mean reads
      ``raw`` directly.
    * ``unit`` stays above ``1 / RENORMALISE_AT``: before it would fall below, every raw
      value is scaled back to its true total (O(keys), once per ln(1e100) / -ln(factor)
      steps: about 59,000 routed requests at a window of 256).
    * A total never goes below 0 (``subtract`` clamps).
    * ``total`` is the sum of every raw value (kept as they change, so a mean over every
      key costs O(1); summed afresh where a running sum could lose precision: after a
      ``pop`` and at renormalisation).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

RENORMALISE_AT = 1e100


class DecayingTotals:
    """Totals keyed by replica id, decaying together (see the module docstring)."""

    __slots__ = ("raw", "total", "unit", "_grow")

    def __init__(self) -> None:
        self.raw: dict[Hashable, float] = {}
        self.total = 0.0  # the sum of the raw values
        self.unit = 1.0  # true total = raw value * unit
        self._grow = 1.0  # 1 / unit

    def decay(self, factor: float) -> None:
        """Multiply every total by ``factor`` (in (0, 1])."""
        grow = self._grow / factor
        if grow > RENORMALISE_AT:
            raw, unit = self.raw, self.unit * factor
            for k in raw:
                raw[k] *= unit
            self.total = sum(raw.values())
            grow = 1.0
        self._grow = grow
        self.unit = 1.0 / grow

    def add(self, key: Hashable, amount: float) -> None:
        raw, scaled = self.raw, amount * self._grow
        raw[key] = raw.get(key, 0.0) + scaled
        self.total += scaled

    def subtract(self, key: Hashable, amount: float) -> None:
        """Take ``amount`` off ``key``'s total, never below 0 (nothing when it has none)."""
        raw = self.raw
        old = raw.get(key)
        if old is not None:
            v = old - amount * self._grow
            v = v if v > 0.0 else 0.0
            raw[key] = v
            self.total -= old - v

    def get(self, key: Hashable, default: float = 0.0) -> float:
        v = self.raw.get(key)
        return default if v is None else v * self.unit

    def pop(self, key: Hashable, default: float | None = None) -> float | None:
        v = self.raw.pop(key, None)
        if v is None:
            return default
        self.total = sum(self.raw.values())
        return v * self.unit

    def as_dict(self) -> dict:
        """Every true total."""
        unit = self.unit
        return {k: v * unit for k, v in self.raw.items()}

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def __iter__(self) -> Iterator:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)
