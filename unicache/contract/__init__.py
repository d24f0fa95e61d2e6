"""The contract: what the router and the replicas both speak, so neither imports the other.

The chained block hash, the request class, KV tiers and cache events (ours and vLLM's),
the Redis key schema and its signed envelopes, the domain types <-> protobuf, the framed
hop, the tokenizer and chat template both sides render with, default addresses, the model name.
Imports only the contract, ``unicache.plumbing`` and the generated stubs (``unicache.v1``).
"""
