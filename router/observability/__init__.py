"""What the router shows about itself: Prometheus metrics, the dashboard and its history,
the cluster-state snapshot, and ``unicache status``.
"""
