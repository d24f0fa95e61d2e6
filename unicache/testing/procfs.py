"""Process facts from Linux /proc, for tests and benchmarks of multi-process routers."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (grpc's too)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    """Resident set size of process ``pid`` in KiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def child_pids(pid: int) -> list[int]:
    """Live children of ``pid`` (multiprocessing's resource tracker left out), by pid."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z" and b"resource_tracker" not in cmd:
            out.append(int(d.name))
    return sorted(out)


def session_processes(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live (non-zombie) process of session ``sid``, by pid."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # fields[0] is the state; the session id is field 6 of stat, index 3 after the name.
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append((int(entry.name), cmd))
    return sorted(out)


def session_pids(sid: int) -> list[int]:
    """Pids of every live (non-zombie) process of session ``sid``."""
    return [pid for pid, _ in session_processes(sid)]
