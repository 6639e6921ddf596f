"""Noticing that a node's producer stopped delivering, so it can ask the cluster where its partition is.

librdkafka finds a partition's new leader by itself after a broker restarts, and almost always within
seconds. Once, in a fault test that restarts a single broker, one node's producer kept every envelope
for minutes: during the broker's shutdown the metadata had named no leader for its partition
(leader -1), and the client never read the partition's leader again, while three other producers on
the same broker delivered again within seconds. An explicit metadata request makes the client read
the leaders again; it is one small request, and it is only sent when envelopes are waiting and none
has left the client for a while (a broker outage backs it off to once a minute). When the requests find no
broker at all while a new client reaches the cluster, the publisher replaces its client
(producer/clientswap.py says why).
"""
from __future__ import annotations

# The longest wait between two requests while the stall goes on (a broker that is down).
MAX_WAIT_S = 60.0


class DeliveryWatch:
    """Says when envelopes have waited `stall_s` in the client with none delivered or failed.

    Pure logic over two counters the publisher keeps anyway: `sent` (handed to the client) and
    `in_flight` (still in it). `sent - in_flight` grows each time one leaves the client, so a
    stall is that difference standing still while something is in flight.
    """

    def __init__(self, stall_s: float) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be positive, got {stall_s}")
        self.stall_s = stall_s
        self.nudges = 0
        self._left = 0  # sent - in_flight at the last progress
        self._since: float | None = None  # the last progress, or the last True
        self._from = 0.0  # the last progress
        self._wait = stall_s
        self.waited = 0.0  # how long the stall had lasted at the last True

    def stalled(self, now: float, sent: int, in_flight: int) -> bool:
        """True when the publisher should ask for fresh metadata now; counts it in `nudges`."""
        left = sent - in_flight
        if in_flight == 0 or left != self._left or self._since is None:
            self._left, self._since, self._from, self._wait = left, now, now, self.stall_s
            return False
        if now - self._since < self._wait:
            return False
        self.waited = round(now - self._from, 1)
        self._since = now
        self._wait = min(self._wait * 2, MAX_WAIT_S)
        self.nudges += 1
        return True
