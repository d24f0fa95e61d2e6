"""The baseline routing policies: round robin, least loaded, session affinity and SGLang's
cache-aware router. Each is a comparison point for ``cache_aware``; none imports it.
"""
