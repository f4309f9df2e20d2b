"""Opt-in Prometheus metrics of a running node (``--metrics-port``), on 127.0.0.1 only.

A collector reads the node's status when scraped; each node gets its own registry, so several
nodes in one process (tests) never clash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.errors import NetworkError


class _NodeCollector:
    def __init__(self, node: Any) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        status = self.node.status()
        peers = GaugeMetricFamily(
            "swarm_node_peers", "Peers found in the run, by role", labels=["role"]
        )
        for role, ids in status["peers_by_role"].items():
            peers.add_metric([role], len(ids))
        yield peers
        yield GaugeMetricFamily(
            "swarm_node_connected_peers", "Open libp2p connections", value=status["connected_peers"]
        )
        version = status["policy_version"]
        yield GaugeMetricFamily(
            "swarm_node_policy_version",
            "Newest policy version known (-1: none)",
            value=-1 if version is None else version,
        )
        yield GaugeMetricFamily("swarm_node_uptime_seconds", "Uptime", value=status["uptime_s"])
        accepted = CounterMetricFamily(
            "swarm_node_gossip_accepted", "Gossip messages accepted", labels=["topic"]
        )
        for topic, n in status["gossip"]["accepted"].items():
            accepted.add_metric([topic], n)
        yield accepted
        rejected = CounterMetricFamily(
            "swarm_node_gossip_rejected", "Gossip messages rejected", labels=["topic", "reason"]
        )
        for topic, reasons in status["gossip"]["rejected"].items():
            for reason, n in reasons.items():
                rejected.add_metric([topic, reason], n)
        yield rejected


@contextlib.contextmanager
def serve_metrics(node: Any, port: int) -> Iterator[int]:
    """Serve metrics on 127.0.0.1:``port`` (0 picks a free port) until the block ends."""
    registry = CollectorRegistry()
    registry.register(_NodeCollector(node))
    try:
        server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise NetworkError(
            f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc}"
        ) from exc
    node.metrics_port = server.server_port
    try:
        yield int(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=2)
