"""Run at the start of every Python process of a vLLM server ``VllmServer`` starts (its
directory is put first on the server's ``PYTHONPATH``): asks the Linux kernel for the AMX
tile state.

vLLM 0.32's CPU attention runs its ``amx`` kernels (bf16 KV, blocks of 32, a CPU with AMX)
without asking for that state, which Linux grants a process only on request
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). Unless an earlier op of the same
process happened to ask (oneDNN does, for a large enough bf16 GEMM), the worker dies of
SIGILL on its first attention: "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)".
Asking is harmless where AMX is absent (the call fails) and does nothing off x86-64.
"""

import ctypes
import platform

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass
