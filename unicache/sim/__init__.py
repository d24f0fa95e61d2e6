"""Trace-replay simulator: replays a trace through simulated replicas running the real KV
store (metadata only) and eviction policies, and reports hit ratios and TTFT."""
