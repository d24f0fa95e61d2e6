"""Which backend serves which model: the base models and LoRA adapters each vLLM backend
lists in its ``/v1/models``, and the group of backends a request naming a model may go to.

The router's own replicas serve one model, the router's ``served_model_name`` (its
*alias*). A vLLM backend serves the names its ``/v1/models`` lists: base models (``parent``
null) and adapters (``parent`` names the base). A request naming

* an adapter or a base model some backend lists goes only to the backends listing it;
* the alias goes to the router's replicas, to backends listing the alias itself, and, while
  every vLLM backend lists the same base models (one fleet of one model, the common case),
  to all of them: a fleet of one model keeps answering to the router's name;
* anything else is unknown (the front doors answer 404 ``model_not_found``).

Invariants:
    * A backend's names are replaced whole by each ``set_backend`` (adapters loaded or
      unloaded at run time come and go with the next poll) and leave with ``drop_backend``.
    * ``outside`` answers the replica ids a request may not go to, from the replica ids it
      is given: a backend that joins later is outside every name it does not list.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One name a backend serves, as its ``/v1/models`` lists it."""

    name: str
    parent: str | None = None  # the base model of a LoRA adapter; None for a base model
    max_model_len: int | None = None

    @property
    def is_adapter(self) -> bool:
        return self.parent is not None


def cards_from_models_list(data: list) -> list[ModelCard]:
    """The cards of a vLLM ``/v1/models`` answer's ``data``; entries without a string
    ``id`` are skipped."""
    out = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            continue
        parent = item.get("parent")
        max_len = item.get("max_model_len")
        out.append(ModelCard(item["id"], parent if isinstance(parent, str) and parent else None,
                             max_len if isinstance(max_len, int) and max_len > 0 else None))
    return out


class ServedModels:
    """The names every vLLM backend serves (see the module docstring).

    Args:
        alias: the router's ``served_model_name``.
    """

    def __init__(self, alias: str = "unicache-default"):
        self.alias = alias
        self._backends: dict[str, dict[str, ModelCard]] = {}
        self._single: bool | None = None  # _one_model()'s answer, None: to compute
        self._named: dict[str, ModelCard] | None = None  # a card of every name served (None: to compute)

    def set_backend(self, backend_id: str, cards: Iterable[ModelCard]) -> bool:
        """Record what ``backend_id`` serves now; True when that changed."""
        new = {card.name: card for card in cards}
        if self._backends.get(backend_id) == new:
            return False
        self._backends[backend_id] = new
        self._single = self._named = None
        return True

    def drop_backend(self, backend_id: str) -> None:
        if self._backends.pop(backend_id, None) is not None:
            self._single = self._named = None

    def backend(self, backend_id: str) -> dict[str, ModelCard]:
        """The names ``backend_id`` serves ({} when none are known)."""
        return self._backends.get(backend_id, {})

    def _one_model(self) -> bool:
        """Whether every backend lists the same base models (or there is none)."""
        if self._single is None:
            bases = {frozenset(n for n, c in cards.items() if not c.is_adapter) for cards in self._backends.values()}
            self._single = len(bases) <= 1
        return self._single

    def _names(self) -> dict[str, ModelCard]:
        """A card of every name some backend serves (kept until what they serve changes:
        the request path asks per request)."""
        if self._named is None:
            self._named = {name: card for cards in self._backends.values() for name, card in cards.items()}
        return self._named

    def knows(self, name: str) -> bool:
        return name == self.alias or name in self._names()

    def adapter(self, name: str) -> str:
        """``name`` when it is a LoRA adapter some backend serves, else "" (a base model)."""
        card = self._names().get(name)
        return name if card is not None and card.is_adapter else ""

    def outside(self, name: str, replica_ids: Iterable[str]) -> frozenset[str]:
        """The ids among ``replica_ids`` a request naming ``name`` may not go to."""
        backends = self._backends
        if name == self.alias or not name:
            name = self.alias  # naming none is naming the router's own
            if self._one_model():
                return frozenset()
            return frozenset(rid for rid in replica_ids if rid in backends and name not in backends[rid])
        return frozenset(rid for rid in replica_ids if rid not in backends or name not in backends[rid])

    def longest_context(self) -> int | None:
        """The longest ``max_model_len`` any backend lists for a base model (None: none lists one)."""
        lens = [c.max_model_len for cards in self._backends.values() for c in cards.values() if not c.is_adapter and c.max_model_len]
        return max(lens) if lens else None

    def cards(self, alias_max_model_len: int | None = None) -> list[ModelCard]:
        """One card per name served, the alias first (its ``max_model_len`` given: the
        replicas'), then every backend's names sorted; a name several backends serve gets
        the smallest ``max_model_len`` among them, an adapter listed without one its base
        model's."""
        merged: dict[str, ModelCard] = {}
        for cards in self._backends.values():
            for card in cards.values():
                seen = merged.get(card.name)
                if seen is None or (card.max_model_len and card.max_model_len < (seen.max_model_len or card.max_model_len + 1)):
                    merged[card.name] = card
        for name, card in merged.items():
            parent = merged.get(card.parent) if card.parent else None
            if card.max_model_len is None and parent is not None and parent.max_model_len:
                # NOTE: vLLM lists an adapter's max_model_len as null: it is its base model's.
                merged[name] = ModelCard(card.name, card.parent, parent.max_model_len)
        alias = merged.pop(self.alias, None)
        lens = [n for n in (alias_max_model_len, alias.max_model_len if alias else None) if n]
        if not lens and self._backends and self._one_model():
            bases = [c.max_model_len for cards in self._backends.values() for c in cards.values() if not c.is_adapter and c.max_model_len]
            lens = bases
        head = ModelCard(self.alias, None, min(lens) if lens else None)
        return [head, *(merged[n] for n in sorted(merged))]


def fleet_context(cluster) -> int | None:
    """The longest context the fleet reports: our replicas' heartbeats (``max_model_len``)
    and the vLLM backends' ``/v1/models``; None while none reports one. A prompt up to it
    fits at least one backend (``cluster``: a ``ClusterView``)."""
    lens = [rec.heartbeat.max_model_len for rec in cluster.replicas.values()
            if rec.heartbeat is not None and rec.heartbeat.max_model_len]
    vllm = cluster.models.longest_context()
    if vllm:
        lens.append(vllm)
    return max(lens) if lens else None
