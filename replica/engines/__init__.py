"""Serving engines behind the ``ServingEngine`` interface: the built-in PyTorch engine
(``builtin``) and vLLM in-process with UniCache choosing its victims (``vllm``);
``registry`` maps ``--engine`` names to them.
"""
