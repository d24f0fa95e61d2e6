"""Transports to the backends: our replicas over gRPC or the framed hop, stock vLLM over HTTP.

Every transport yields the same ``replica_stream.ReplicaStream``, so the request path
retries, cancels and times out one way whatever carries the request.
"""
