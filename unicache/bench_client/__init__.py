"""``unicache bench`` (top layer): replay a trace against any OpenAI-compatible endpoint.

The client (``client``), the prompts it sends (``prompts``) and what it measured (``stats``).
"""
