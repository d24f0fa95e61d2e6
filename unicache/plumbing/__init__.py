"""Plumbing: asyncio, gRPC, TLS, settings, registries and child processes.

Nothing here knows about caches, requests or replicas; it imports only itself.
"""
