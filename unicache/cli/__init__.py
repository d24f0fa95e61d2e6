"""The ``unicache`` command (top layer): the entry point, ``unicache up`` and the demo.

May import every layer; nothing in the contract, router or replica imports it.
"""
