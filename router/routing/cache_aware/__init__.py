"""``cache_aware``, the project's routing policy: the policy (``policy``) and its stages'
building blocks (candidate window, TTFT admission, decaying totals, queue share).

The baselines it is measured against live in ``unicache.router.routing.baselines``.
"""
