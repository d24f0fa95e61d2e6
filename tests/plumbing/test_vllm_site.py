"""The vLLM servers of the test harness ask the kernel for the AMX tile state in every
process (unicache/testing/vllm_site/sitecustomize.py): vLLM's CPU attention uses it
without asking, and a worker that was not granted it dies of SIGILL on its first request."""

import os
import platform
import subprocess
import sys

from unicache.testing.vllm_servers import VLLM_SITE

XTILEDATA = 1 << 18
# arch_prctl(ARCH_GET_XCOMP_PERM, &mask): the extended states this process may use
PERMITTED = ("import ctypes; m = ctypes.c_uint64(); ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(m)); "
             "print(m.value)")


def _permitted(extra_path: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    out = subprocess.run([sys.executable, "-c", PERMITTED if platform.machine() == "x86_64" else "print(0)"],
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    return int(out.stdout)


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " amx_tile" in line for line in f)


def test_a_server_process_is_granted_the_amx_state_exactly_where_the_cpu_has_it():
    granted = bool(_permitted(VLLM_SITE) & XTILEDATA)
    assert granted == (platform.machine() == "x86_64" and _cpu_has_amx())
    # a plain process is not: without the harness's site folder nothing asks for it
    assert not _permitted(None) & XTILEDATA
