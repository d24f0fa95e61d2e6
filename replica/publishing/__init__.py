"""What a replica tells the world: cache events and load to Redis (``publisher``) and
Prometheus metrics (``metrics``, served by ``metrics_server``).
"""
