"""Re-probes quarantined replicas, so routing gets them back once they answer.

A replica is quarantined by the request path (``unicache.router.request_path.core``) when it refuses a
call or stalls before its first message; ``ClusterView`` schedules its probes with
bounded exponential backoff. This task sends each due probe, a one-token ``Generate``
(``ReplicaClients.probe``) on the router's own channel to the replica (same credentials
as forwarded requests), which must send its first message within the replica's current
first-token timeout, the bar a request would have to clear; it reports the result to
the cluster view. Client requests never serve as probes.

Invariants:
    * At most one probe per replica is in flight; each has a deadline (``timeout_for``).
    * With nothing quarantined the task sleeps until ``ClusterView.quarantine`` wakes it:
      an idle router's loop is not woken ten times a second for an empty schedule.
    * A probe's result applies only to the address it probed (a replica that restarted on
      a new address meanwhile was already released by its heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from unicache.router.cluster.view import ClusterView

log = logging.getLogger(__name__)


class QuarantineProber:
    """Args:
    cluster: the cluster view holding the quarantine schedule.
    clients: ``ReplicaClients`` (its ``probe`` is the probe, on the transport requests take).
    timeout_for: replica id -> deadline of its probe (seconds): the router passes the
        replica's first-token timeout.
    tick_s: longest sleep between looks at the schedule while a replica is quarantined
        (default 0.1 s).
    """

    def __init__(self, cluster: ClusterView, clients, timeout_for: Callable[[str], float], tick_s: float = 0.1):
        self.cluster = cluster
        self.clients = clients
        self.timeout_for = timeout_for
        self.tick_s = tick_s
        self.probes = 0

    async def probe_due(self) -> dict[str, bool]:
        """Probe every replica whose probe is due, concurrently; returns {id: answered}."""
        due = self.cluster.probes_due()
        if not due:
            return {}
        results = await asyncio.gather(*(self._probe(rid, addr, self.timeout_for(rid)) for rid, addr in due))
        out: dict[str, bool] = {}
        for (rid, addr), ok in zip(due, results):
            self.probes += 1
            rec = self.cluster.replicas.get(rid)
            if rec is None or rec.address != addr:
                continue
            if ok:
                self.cluster.probe_succeeded(rid)
                log.info("replica %s at %s answered its probe: back in routing", rid, addr)
            else:
                self.cluster.probe_failed(rid)
            out[rid] = ok
        return out

    async def _probe(self, replica_id: str, address: str, timeout_s: float) -> bool:
        rec = self.cluster.replicas.get(replica_id)
        hop_address = rec.hop_address if rec is not None else ""
        try:
            await self.clients.probe(address, timeout_s, hop_address, replica_id)
        except Exception:  # noqa: BLE001 - any failure (refused, deadline, error) is "not back yet"
            return False
        return True

    async def run(self) -> None:
        """Probe forever (cancel to stop)."""
        quarantined = asyncio.Event()
        self.cluster.on_quarantine.append(quarantined.set)
        try:
            while True:
                await self.probe_due()
                quarantined.clear()  # before reading the schedule: a quarantine after this wakes the wait
                nxt = self.cluster.next_probe_at()
                if nxt is None:
                    await quarantined.wait()
                else:
                    await asyncio.sleep(min(self.tick_s, max(0.0, nxt - self.cluster.clock())))
        finally:
            self.cluster.on_quarantine.remove(quarantined.set)
