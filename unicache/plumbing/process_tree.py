"""The processes a launcher started, and making sure none outlives it (Linux ``/proc``).

``unicache up`` starts Redis and Ray; Ray starts the replica actors; a vLLM replica starts
its engine-core (and worker) processes. A clean stop ends them all, but when an actor is
killed before its engine finished shutting down (Ray's ``kill`` after the stop deadline)
its engine core is orphaned and nothing ends it. ``descendants`` snapshots the tree before
the stop; ``reap`` then ends whatever of it is still alive. A process is named by pid and
start time, so a pid reused meanwhile by another program is never signalled.

A snapshot misses what starts after it and is orphaned before the stop ends (a worker
Ray's raylet starts when an actor dies, orphaned when the raylet dies in ``ray.shutdown``;
an engine core's worker whose engine core was killed): such a process goes to init, out
of every later look too, and can outlive the leader. ``become_subreaper`` makes the
launcher the parent of every orphan below it, so ``reap_below`` looks again after the
stop and finds them all.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat: when it started, in clock ticks since boot


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) of ``pid``, None when it is gone (or no /proc)."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[Proc]:
    """Every live process below ``pid`` (children, their children, ...), parents first."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    try:
        entries = [int(e.name) for e in PROC.iterdir() if e.name.isdigit()]
    except OSError:
        return []
    for child in entries:
        st = _stat(child)
        if st is None or st[0] == "Z":
            continue
        children.setdefault(st[1], []).append(child)
        starts[child] = st[2]
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(Proc(p, starts[p]))
        todo.extend(children.get(p, []))
    return out


def alive(proc: Proc) -> bool:
    st = _stat(proc.pid)
    return st is not None and st[0] != "Z" and st[2] == proc.start_ticks


def reap(procs: list[Proc], grace_s: float = 5.0, poll_s: float = 0.05) -> list[Proc]:
    """End every process of ``procs`` still alive: SIGTERM, then SIGKILL after ``grace_s``.
    Returns those that had to be signalled (what a clean stop left behind)."""
    left = [p for p in procs if alive(p)]
    for p in left:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(poll_s)
    killed = [p for p in left if alive(p)]
    for p in killed:
        _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + 2.0  # SIGKILL is delivered asynchronously
    while any(alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return left


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the parent of every orphan below it (Linux ``PR_SET_CHILD_SUBREAPER``),
    so ``descendants`` still lists a process whose parent died. Returns False where the
    kernel has no such call (then only the snapshot knows an orphan)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_below(pid: int, spare: frozenset[Proc], known: list[Proc], grace_s: float = 5.0, rounds: int = 5) -> list[Proc]:
    """End every process below ``pid`` but ``spare`` (what ran before the launcher started
    anything), and every process of ``known`` (an earlier snapshot: orphans that went to init
    when this process is no subreaper); look again until a look finds none, at most
    ``rounds`` times (a process may start another while it is ended). Orphans that died as
    this process's children are waited for, so none stays a zombie. Returns what had to be
    signalled, in the order it was."""
    ended: list[Proc] = []
    todo = list(known)
    for _ in range(rounds):
        seen = set(ended)
        todo = [p for p in dict.fromkeys(todo + [p for p in descendants(pid) if p not in spare]) if p not in seen]
        left = reap(todo, grace_s=grace_s)
        ended += left
        for p in todo:
            _wait_child(p)
        todo = []
        if not left and not [p for p in descendants(pid) if p not in spare]:
            break
    return ended


def _wait_child(proc: Proc) -> None:
    """Collect ``proc``'s exit status when it is this process's own child (an orphan handed
    to a subreaper, or a child nobody waited for), so it leaves no zombie."""
    try:
        os.waitpid(proc.pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def _signal(proc: Proc, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
