"""Block copies between the GPU pool and the host tier, and how to batch them.

The store queues a ``Transfer`` per demotion and promotion (``KVStore.take_transfers``);
the engine runs them before the next forward pass. ``transfer_runs`` groups them into
batched copies whose result equals running the copies one by one in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from unicache.contract.kv_tier import Tier


@dataclass(slots=True, frozen=True)
class Transfer:
    """One block copy.

    ``tier`` is where the bytes go: ``Tier.HOST`` is a demotion (GPU block ``gpu_block``
    to host slot ``host_slot``), ``Tier.GPU`` a promotion (the reverse).
    """

    tier: Tier
    gpu_block: int
    host_slot: int


@dataclass(slots=True, frozen=True)
class TransferRun:
    """One batched copy: ``dst[i] <- src[i]`` for all i at once, ``src`` ids in the source
    tier, ``dst`` ids in ``tier``. Destinations are distinct."""

    tier: Tier
    src: tuple[int, ...]
    dst: tuple[int, ...]


def transfer_runs(transfers: list[Transfer]) -> list[TransferRun]:
    """Batch ``transfers`` (in the order queued) into runs of one direction.

    Invariant: applying the runs in order, each as a gather of all its sources then a
    scatter to its destinations, leaves both tiers exactly as the copies one by one
    would. It holds because a run only reads one tier and writes the other (no copy in
    it reads what another writes), and of copies to one destination only the last is
    kept (the earlier ones' results were overwritten anyway).
    """
    runs: list[TransferRun] = []
    i, n = 0, len(transfers)
    while i < n:
        tier = transfers[i].tier
        last: dict[int, int] = {}  # destination -> source, insertion order = first write
        while i < n and transfers[i].tier is tier:
            t = transfers[i]
            if tier is Tier.HOST:
                last.pop(t.host_slot, None)
                last[t.host_slot] = t.gpu_block
            else:
                last.pop(t.gpu_block, None)
                last[t.gpu_block] = t.host_slot
            i += 1
        runs.append(TransferRun(tier, tuple(last.values()), tuple(last)))
    return runs
