"""The one definition of a KV tier, shared by replica events, the wire format and the router.

``GPU`` is the engine's device pool (the pool the forward pass reads; CPU memory on a CPU
replica); ``HOST`` is the optional host-memory tier under it, whose blocks must be copied
back into the GPU pool (promoted) before a request can use them. The integer values are
the ``KVTier`` values of ``proto/unicache/v1`` (0 is the default, so a sender that never
sets the field means GPU).
"""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    GPU = 0
    HOST = 1

    @property
    def label(self) -> str:
        """Lower-case name for tables, metrics labels and JSON (``gpu`` / ``host``)."""
        return self.name.lower()
