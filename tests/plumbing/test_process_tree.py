"""unicache/plumbing/process_tree.py: a stop ends what the run started, orphans included, and
nothing that ran before it (``unicache up --engine vllm`` left an engine core behind when
its replica actor was killed mid-shutdown)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from unicache.plumbing.process_tree import Proc, alive, descendants, reap

# A child that starts a grandchild ignoring SIGTERM (a slow shutdown), prints its pid,
# then waits: killing the child orphans the grandchild.
TREE = textwrap.dedent("""
    import signal, subprocess, sys
    g = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    g.stdout.readline()
    print(g.pid, flush=True)
    g.wait()
""")


def _start_tree() -> tuple[subprocess.Popen, int]:
    child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    return child, int(child.stdout.readline())


def test_reap_ends_an_orphan_that_ignores_sigterm_and_spares_the_rest():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        before = set(descendants(os.getpid()))
        child, grandchild = _start_tree()
        tree = [p for p in descendants(os.getpid()) if p not in before]
        assert [p.pid for p in tree] == [child.pid, grandchild]  # parents first
        os.kill(child.pid, signal.SIGKILL)  # as Ray's kill does to an actor past its stop deadline
        child.wait()
        time.sleep(0.2)
        orphan = next(p for p in tree if p.pid == grandchild)
        assert alive(orphan) and orphan not in descendants(os.getpid())  # reparented: only the snapshot knows it
        left = reap(tree, grace_s=0.5)
        assert left == [orphan] and not alive(orphan)
        assert bystander.poll() is None  # not the run's: untouched
    finally:
        bystander.kill()
        bystander.wait()


def test_a_reused_pid_is_never_signalled():
    ghost = Proc(os.getpid(), start_ticks=1)  # this pid, another start time: not the process recorded
    assert not alive(ghost)
    assert reap([ghost], grace_s=0.1) == []


def test_local_cluster_stop_ends_what_its_backends_left_behind():
    from unicache.cli.local_cluster import ClusterSettings, LocalCluster

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # before the run
    cluster = LocalCluster(ClusterSettings(num_replicas=1))
    child, grandchild = _start_tree()  # a replica actor and its engine core, started by the run

    class LeakyLauncher:
        def stop(self):  # the actor killed before its engine core finished shutting down
            os.kill(child.pid, signal.SIGKILL)
            child.wait()

    try:
        cluster.launcher = LeakyLauncher()
        cluster.stop_backends()
        assert _gone(grandchild)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        if not _gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# Run as a launcher of its own (a subreaper must not be the test runner): snapshot, then a
# child starts a grandchild and exits before the stop, as Ray's raylet does with a worker
# it starts while it shuts down. Prints the grandchild's pid and what reap_below ended.
LATE_ORPHAN = textwrap.dedent("""
    import os, subprocess, sys, time
    from unicache.plumbing.process_tree import become_subreaper, descendants, reap_below
    print(int(become_subreaper()), flush=True)
    spare = frozenset(descendants(os.getpid()))
    snapshot = []
    child = subprocess.Popen([sys.executable, "-c", '''
    import signal, subprocess, sys
    g = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    g.stdout.readline()
    print(g.pid, flush=True)
    '''.replace("\\n    ", "\\n")], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    child.wait()
    assert grandchild in [p.pid for p in descendants(os.getpid())]  # handed to this process
    ended = reap_below(os.getpid(), spare, snapshot, grace_s=0.3)
    print(grandchild, [p.pid for p in ended], [p.pid for p in descendants(os.getpid())], flush=True)
""")


def test_a_subreaper_finds_an_orphan_no_snapshot_saw():
    out = subprocess.run([sys.executable, "-c", LATE_ORPHAN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flag, line = out.stdout.splitlines()
    assert flag == "1"
    grandchild, ended, left = line.split(" ", 1)[0], *line.split(" ", 1)[1].rsplit(" ", 1)
    assert ended == f"[{grandchild}]" and left == "[]"
    assert _gone(int(grandchild))
