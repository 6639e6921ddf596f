"""A local KRaft cluster on loopback: `brokers` combined broker+controller nodes, one JVM each.

Layout (`kvpipe infra up --brokers 3`): node k (1-based) listens on `kafka_port + 2(k-1)` and its
controller on `kafka_controller_port + 2(k-1)` (defaults: 19092/19093, 19094/19095, 19096/19097),
and keeps its files under `<state>/kafka-cluster/node-<k>/` — apart from the single broker's
`<state>/kafka/`, whose storage is formatted for a one-voter quorum and cannot join a cluster.
All nodes share one cluster id (`<state>/kafka-cluster/cluster.id`).

Every node is one `LocalKafka`, so pid checks, locking and log tails are the single broker's. The
differences: every node is started before any is waited for (a node answers only once a majority
of the quorum runs), and `down` signals all nodes at once (a node's controlled shutdown waits for
the quorum, which the nodes stopped before it would no longer have).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
from dataclasses import replace

from kvpipe.infra.errors import InfraError
from kvpipe.infra.kafka import config as kconfig
from kvpipe.infra.kafka.config import BrokerConfig
from kvpipe.infra.kafka.local import BrokerStatus, LocalKafka

CLUSTER_SUBDIR = "kafka-cluster"


def node_configs(base: BrokerConfig, brokers: int) -> list[BrokerConfig]:
    """The configs of a `brokers`-node cluster derived from the single broker's (ports, heap, state dir)."""
    if brokers < 2:
        raise ValueError(f"a cluster needs at least 2 nodes, got {brokers}")
    if base.secure:
        raise InfraError("the secured listeners (--secure) are for the single local broker; "
                         "run the cluster (--brokers > 1) without --secure")
    voters = tuple((k + 1, base.controller_port + 2 * k) for k in range(brokers))
    return [replace(base, node_id=k + 1, port=base.port + 2 * k, controller_port=base.controller_port + 2 * k,
                    voters=voters, kafka_subdir=f"{CLUSTER_SUBDIR}/node-{k + 1}")
            for k in range(brokers)]


def present_nodes(base: BrokerConfig) -> int:
    """How many nodes a cluster under this state dir was created with (0: none)."""
    root = base.state_dir / CLUSTER_SUBDIR
    ids = [int(m.group(1)) for p in root.glob("node-*") if (m := re.fullmatch(r"node-(\d+)", p.name))]
    return max(ids, default=0)


def bootstrap(configs: list[BrokerConfig]) -> str:
    return ",".join(c.bootstrap for c in configs)


class LocalCluster:
    def __init__(self, base: BrokerConfig, brokers: int) -> None:
        self.nodes = [LocalKafka(c) for c in node_configs(base, brokers)]
        self.root = base.state_dir / CLUSTER_SUBDIR

    @property
    def bootstrap(self) -> str:
        return bootstrap([n.cfg for n in self.nodes])

    def _share_cluster_id(self) -> None:
        shared = self.root / "cluster.id"
        self.root.mkdir(parents=True, exist_ok=True)
        if not shared.is_file():
            shared.write_text(kconfig.new_cluster_id() + "\n")
        cid = shared.read_text()
        for node in self.nodes:
            node.cfg.kafka_dir.mkdir(parents=True, exist_ok=True)
            node.cfg.cluster_id_file.write_text(cid)

    def up(self, timeout: float = 120.0) -> list[BrokerStatus]:
        self._share_cluster_id()
        started: list[BrokerStatus] = []
        try:
            for node in self.nodes:
                started.append(node.start())
            for node, st in zip(self.nodes, started):
                node.wait_ready(st.pid, timeout)
        except InfraError:
            self._stop([st.pid for st in started if st.started], grace=10.0)
            raise
        return started

    def pids(self) -> list[int | None]:
        return [n.running_pid() for n in self.nodes]

    def _stop(self, pids: list[int], grace: float) -> list[int]:
        """SIGTERM to every node at once, then wait; SIGKILL what is left after `grace`. Returns
        the pids that needed SIGKILL."""
        by_pid = {n.running_pid(): n for n in self.nodes}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        killed = []
        for pid in pids:
            node = by_pid.get(pid)
            if node is not None and node._stop(pid, grace):  # already signalled: this only waits (and escalates)
                killed.append(pid)
        for node in self.nodes:
            node.running_pid()  # drops the pid files of the stopped nodes
        return killed

    def down(self, purge: bool = False, grace: float = 30.0) -> str:
        pids = [p for p in self.pids() if p is not None]
        killed = self._stop(pids, grace)
        msg = (f"stopped {len(pids)} Kafka cluster node(s), pids {', '.join(map(str, pids))}"
               + (f" (SIGKILL for {', '.join(map(str, killed))})" if killed else "")) if pids \
            else f"no Kafka cluster node running for {self.root}"
        if purge:
            shutil.rmtree(self.root, ignore_errors=True)
            msg += f"; deleted {self.root}"
        return msg

