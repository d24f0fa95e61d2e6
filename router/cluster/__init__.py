"""The cluster as the router knows it: membership, loads and the locality index.

``view.ClusterView`` holds replicas, loads and the ``index.LocalityIndex``; the Redis
``subscriber`` and the ``prober`` keep it current; ``session_store`` and ``terms_exchange``
share placement and routing terms between routers.
"""
