"""UniCache Serving: one import root, ``unicache``, in layers (bottom to top).

- ``unicache.plumbing``: asyncio, gRPC, TLS, settings, child processes; imports only itself.
- ``unicache.contract`` (and the generated stubs ``unicache.v1``): what the router and the
  replicas share; imports plumbing.
- ``unicache.router`` (folder ``router/``) and ``unicache.replica`` (folder ``replica/``):
  each imports the contract and plumbing, never the other.
- the top layer, ``unicache.cli``, ``unicache.bench_client``, ``unicache.sim`` and
  ``unicache.testing``: may import anything; the layers below never import it.

tests/repo/test_layers.py checks these rules from the folders.
"""
