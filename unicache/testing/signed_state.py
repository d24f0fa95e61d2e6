"""Sealing replica state as a replica would, for tests that write Redis directly or stand
in for a replica's ``GetCacheSummary`` (unicache/contract/state_auth.py)."""

from __future__ import annotations

import time

from unicache.contract.block_hash import BlockHash
from unicache.contract.state_auth import StateSigner, parse_cluster_key
from unicache.v1 import cache_pb2

# A fixed test cluster key (hex, 32 bytes); settings take it as text.
CLUSTER_KEY = "5e" * 32
SIGNER = StateSigner(parse_cluster_key(CLUSTER_KEY))


def sealed(kind: str, msg, signer: StateSigner = SIGNER) -> bytes:
    return signer.seal(kind, msg.SerializeToString())


class ReplicaTruth:
    """What a fake replica really holds, and its sealed ``GetCacheSummary`` answers.

    ``fetch(address, nonce, timeout_s)`` is a subscriber's ``fetch_summary``: it answers
    for the replica registered at ``address`` (an unknown address raises ConnectionError,
    as an unreachable one does) and records each call in ``calls``.
    """

    def __init__(self, signer: StateSigner = SIGNER):
        self.signer = signer
        self.by_address: dict[str, tuple[str, int, int, list[BlockHash], list[bytes]]] = {}
        self.calls: list[tuple[str, str]] = []

    def set(self, address: str, replica_id: str, epoch: int, seq: int, blocks: list[BlockHash],
            parents: list[BlockHash | None] = ()) -> None:
        """``parents``: parallel to ``blocks`` (None: a first block), or () as an older
        replica answers."""
        self.by_address[address] = (replica_id, epoch, seq, list(blocks), [p or b"" for p in parents])

    def forget(self, address: str) -> None:
        """The replica at ``address`` died: nothing answers there any more."""
        self.by_address.pop(address, None)

    async def fetch(self, address: str, nonce: bytes, timeout_s: float) -> bytes:  # noqa: ARG002
        if address not in self.by_address:
            raise ConnectionError(address)
        rid, epoch, seq, blocks, parents = self.by_address[address]
        self.calls.append((address, rid))
        summary = cache_pb2.CacheSummary(
            replica_id=rid, epoch=epoch, seq=seq, block_hashes=blocks, block_size=16, timestamp=time.time(), nonce=nonce,
            parents=parents,
        )
        return sealed("rpc-summary", summary, self.signer)


def call_metadata() -> tuple[tuple[str, str], ...]:
    """The cluster credential a router's call to a replica carries (test key)."""
    from unicache.contract.state_auth import CallCredential

    return CallCredential(parse_cluster_key(CLUSTER_KEY)).metadata()
