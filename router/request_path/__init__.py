"""What one request goes through: authenticate, limit, tokenize, classify, hash, choose, forward.

``core.RouterCore`` is the path; ``auth``, ``limits``, ``classifier`` and ``first_token`` are
its steps. It reads the cluster (``unicache.router.cluster``), asks a routing policy
(``unicache.router.routing``) and forwards over a transport (``unicache.router.upstream``).
"""
