"""vLLM's KV-cache events inside the replica: the shared decoder and translator of
``unicache.contract.vllm_events`` (the router following stock vLLM servers uses the same), bound on
ipc:// endpoints inside the replica, so nothing listens on the network."""

from __future__ import annotations

from unicache.contract.vllm_events import EventTranslator, KVEventSubscriber

__all__ = ["EventTranslator", "KVEventSubscriber"]
