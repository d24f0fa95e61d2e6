"""Fault injection for reliability tests: make a replica answer slowly. Off by default.

``FaultInjection`` is read by the gRPC servicer on every ``Generate`` call, so a test (or
an operator rehearsing failures) can turn delays on and off while the replica runs
(``ReplicaActor.set_faults``), or start a replica slow (``--fault-first-token-delay-s``).

Invariant: with every delay at 0 (the default) the servicer's behaviour and timing are
unchanged; delays only postpone messages, they never change what is sent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FaultInjection:
    """Delays applied by the replica's ``Generate`` handler.

    Attributes:
        first_token_delay_s: sleep before the request enters the engine (a replica
            that accepts calls but answers late; the router's forward deadline fires).
        token_delay_s: sleep before each streamed message after the first (long-lived
            streams, e.g. to kill a replica while streams are under way).
    """

    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.first_token_delay_s < 0 or self.token_delay_s < 0:
            raise ValueError("fault delays must be >= 0")
