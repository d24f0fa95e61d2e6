"""The router's memory budget: every router-side table's cap, in entries and in bytes.

One router process keeps these tables; each is capped (oldest / least recently used
dropped first) so RSS stays under ``memory_budget_mib`` (default 256 MiB) however long it
runs and however many distinct prompts and sessions it sees:

=====================  ==============================================  ====================
table                  what one entry is                               cap
=====================  ==============================================  ====================
classifier.blocks      a block hash's popularity (template detection)  budget share 15%
classifier.prompts     a prompt's last hash -> its (inferred) session  budget share 5%
classifier.sessions    an explicit (tenant, session id) -> session     budget share 3%
policy.sessions        a session's latest turn (replica, hashes)       share 7%, counted
                                                                       per held hash
policy.inflight        an unfinished request's hashes (only with       ``max_in_flight``
                       ``track_inflight``)                              requests
policy.queued          a request without its first token yet:          ``max_in_flight``
                       (replica, uncached, whole prompt tokens)         requests
index                  a (block, replica) holding                      ``max_index_blocks``
                                                                       per replica, and the
                                                                       replica's capacity
=====================  ==============================================  ====================

The rest of the budget (70%) is the process itself (interpreter, grpc, uvicorn, numpy:
about 58 MiB), in-flight requests (bounded by ``max_in_flight``), the allocator's slack
and the index (in the soak, 4 replicas x 32,768 blocks
at ~550 bytes per entry took ~70 MiB). The index's bound is the fleet's (replicas x their KV capacity, which their signed heartbeats
announce, and ``max_index_blocks`` per replica); it is sized with the fleet, not here.

Bytes per entry (``BYTES_PER_ENTRY``) are CPython 3.11 64-bit sizes of one entry of each
table with its key and value objects, measured by ``measure_bytes_per_entry`` on a filled
router (``bench.router_soak`` reports both; ``tests/router/test_router_memory.py`` fails if a
measured size exceeds its constant). A block hash shared by several tables is counted
in each, so the caps are conservative.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

MIB = 1 << 20
DEFAULT_BUDGET_MIB = 256

# Budget shares of the capped tables (the rest: the process, in-flight work, the index).
SHARES = {
    "classifier.blocks": 0.15,
    "classifier.prompts": 0.05,
    "classifier.sessions": 0.03,
    "policy.session_blocks": 0.07,
}
# Upper bounds of one entry's bytes (see the module docstring); policy.session_blocks is
# per hash a remembered session holds, its session's own objects spread over its hashes
# (policy sessions are also capped in number, at the classifier's session cap).
BYTES_PER_ENTRY = {
    "classifier.blocks": 240,
    "classifier.prompts": 400,
    "classifier.sessions": 520,
    "policy.session_blocks": 80,
}


@dataclass(frozen=True, slots=True)
class TableCaps:
    """Entry caps derived from a budget (``for_budget``)."""

    classifier_blocks: int
    classifier_prompts: int
    classifier_sessions: int
    policy_session_blocks: int

    @classmethod
    def for_budget(cls, budget_mib: int) -> "TableCaps":
        if budget_mib < 64:
            raise ValueError(f"memory budget must be >= 64 MiB, got {budget_mib}")
        b = budget_mib * MIB

        def cap(name: str) -> int:
            return int(b * SHARES[name] / BYTES_PER_ENTRY[name])

        return cls(cap("classifier.blocks"), cap("classifier.prompts"), cap("classifier.sessions"), cap("policy.session_blocks"))


def table_entries(app) -> dict[str, int]:  # noqa: ANN001 - a RouterApp (no import: layers)
    """Current entry counts of the router's tables."""
    c = app.core.classifier
    p = app.policy
    out = {
        "classifier.blocks": len(c._blocks),
        "classifier.prompts": len(c._prompts),
        "classifier.sessions": len(c._labelled),
    }
    if hasattr(p, "_sessions"):
        out["policy.sessions"] = len(p._sessions)
        out["policy.session_blocks"] = p.session_blocks
    out["index"] = sum(len(app.index.holdings(r).blocks) for r in app.cluster.replicas)
    return out


def deep_size(obj, seen: set[int]) -> int:
    """Bytes of ``obj`` and what it references (containers, slots dataclasses), each object
    once (``seen``)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_size(x, seen) for x in obj)
    elif hasattr(type(obj), "__slots__"):
        size += sum(deep_size(getattr(obj, s), seen) for s in type(obj).__slots__ if hasattr(obj, s))
    return size


def _per_entry(table, sample: int, per_item=None) -> float:  # noqa: ANN001
    """Mean bytes of one entry: the table's own per-slot share plus a sample of entries
    (key and value, deep; nothing shared between sampled entries is counted twice)."""
    n = len(table)
    if n == 0:
        return 0.0
    own = sys.getsizeof(table) / n
    items = list(table.items())[-sample:]
    seen: set[int] = set()
    total = sum(deep_size(k, seen) + deep_size(v, seen) for k, v in items)
    units = sum(per_item(v) for _, v in items) if per_item else len(items)
    return own * len(items) / max(1, units) + total / max(1, units)


def measure_bytes_per_entry(app, sample: int = 2000) -> dict[str, float]:  # noqa: ANN001
    """Measured bytes per entry of each capped table (see ``BYTES_PER_ENTRY``)."""
    c = app.core.classifier
    out = {
        "classifier.blocks": _per_entry(c._blocks, sample),
        "classifier.prompts": _per_entry(c._prompts, sample),
        "classifier.sessions": _per_entry(c._labelled, sample),
    }
    p = app.policy
    if hasattr(p, "_sessions"):
        out["policy.session_blocks"] = _per_entry(p._sessions, sample, lambda s: len(s.hashes))
    return {k: round(v, 1) for k, v in out.items()}


def index_bytes_per_entry(index, sample: int = 2000) -> float:  # noqa: ANN001
    """Measured bytes per (block, replica) entry of a ``LocalityIndex``: a sample of its
    hash -> holders map (deep), plus each replica's own hash -> entry slot."""
    holders = index._holders
    if not holders:
        return 0.0
    items = list(holders.items())[-sample:]
    seen: set[int] = set()
    total = sum(deep_size(k, seen) + deep_size(v, seen) for k, v in items)
    entries = sum(len(v) for _, v in items)
    per_slot = sys.getsizeof(holders) / len(holders) * len(items) / entries
    reps = list(index._replicas.values())
    n = sum(len(h.blocks) for h in reps)
    own = sum(sys.getsizeof(h.blocks) for h in reps) / max(1, n)
    return round(total / entries + per_slot + own, 1)


def table_caps(app) -> dict[str, dict]:  # noqa: ANN001
    """Each capped table's cap: entries, measured bytes per entry, and MiB at the cap."""
    caps = app.table_caps
    entries = {
        "classifier.blocks": caps.classifier_blocks,
        "classifier.prompts": caps.classifier_prompts,
        "classifier.sessions": caps.classifier_sessions,
        "policy.session_blocks": caps.policy_session_blocks,
    }
    measured = measure_bytes_per_entry(app)
    return {
        name: {"entries": n, "bytes_per_entry": measured.get(name, 0.0), "bound_bytes_per_entry": BYTES_PER_ENTRY[name],
               "mib": n * BYTES_PER_ENTRY[name] / MIB}
        for name, n in entries.items()
    }
