"""Opt-in Prometheus metrics of a running node (``--metrics-port``), on 127.0.0.1 only.

A collector reads the node's status when scraped; each node gets its own registry, so several
nodes in one process (tests) never clash. The HTTP server runs on its own thread, so it never
calls ``Node.status()`` (which reads the event loop's SQLite connections: "A server error
occurred" before issue 15); it reads ``Node.status_snapshot``, which the event loop refreshes
every ``STATUS_SNAPSHOT_EVERY_S`` (``swarm_node_status_age_seconds`` says how old it is).

Role metrics (``role_status`` of the snapshot): a validator's judgements by outcome, refusals by
the check that decided (``swarm_node_validator_refusals_total{check}``), judge seconds, claims
and the trainer outbox; a worker's submissions; a trainer's queue; evidence bytes and objects;
engine restarts where the role reports them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.errors import NetworkError


class _NodeCollector:
    def __init__(self, node: Any) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        status = self.node.status_snapshot
        if status is None:
            return
        yield from self._node(status)
        yield from _role(status.get("role_status") or {})

    def _node(self, status: dict[str, Any]) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "swarm_node_status_age_seconds",
            "Seconds since the event loop took the status these metrics show",
            value=max(0.0, time.monotonic() - self.node.started_at - status["uptime_s"]),
        )
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


def _role(role: dict[str, Any]) -> Iterator[Any]:
    validator = role.get("validator")
    if validator is not None:
        judged = CounterMetricFamily(
            "swarm_node_validator_judged", "Submissions judged, by outcome", labels=["outcome"]
        )
        for outcome in ("accepted", "rejected_soft", "rejected_hard"):
            judged.add_metric([outcome], validator.get(outcome, 0))
        yield judged
        yield CounterMetricFamily(
            "swarm_node_validator_refused",
            "Submissions refused without a judgement",
            value=validator.get("refused", 0),
        )
        refusals = CounterMetricFamily(
            "swarm_node_validator_refusals",
            "Submissions refused before the judge, by the check that decided (a precheck, or"
            " 'newcomer share')",
            labels=["check"],
        )
        for check, n in sorted(validator.get("refusals", {}).items()):
            refusals.add_metric([check], n)
        yield refusals
        yield CounterMetricFamily(
            "swarm_node_validator_judge_seconds",
            "Seconds spent judging with the model",
            value=validator.get("judge_seconds", 0.0),
        )
        yield CounterMetricFamily(
            "swarm_node_validator_newcomer_judge_seconds",
            "Of the judge seconds, those on newcomers' work (keys with no accepted work)",
            value=validator.get("newcomer_judge_seconds", 0.0),
        )
        yield GaugeMetricFamily(
            "swarm_node_validator_claims",
            "Assignment claims held",
            value=validator.get("claims", 0),
        )
        yield CounterMetricFamily(
            "swarm_node_validator_rate_limited",
            "Submissions refused by a peer's rate limit",
            value=validator.get("rate_limited", 0),
        )
        yield GaugeMetricFamily(
            "swarm_node_validator_judge_queue",
            "Submissions past the precheck waiting for the judge",
            value=validator.get("judge_queue", 0),
        )
        for name in ("outbox", "dead_letters"):
            if name in validator:
                yield GaugeMetricFamily(
                    f"swarm_node_validator_{name}",
                    f"Trainer hand-offs: {name.replace('_', ' ')}",
                    value=len(validator[name])
                    if isinstance(validator[name], list)
                    else validator[name],
                )
    worker = role.get("worker")
    if worker is not None:
        submitted = CounterMetricFamily(
            "swarm_node_worker_submissions", "Submissions by outcome", labels=["outcome"]
        )
        for outcome in ("submitted", "accepted", "rejected"):
            submitted.add_metric([outcome], worker.get(outcome, 0))
        yield submitted
    trainer = role.get("trainer")
    if trainer is not None:
        yield GaugeMetricFamily(
            "swarm_node_trainer_queued",
            "Accepted samples waiting to train",
            value=trainer["queued"],
        )
    disk = role.get("disk")
    if disk is not None:
        usage = GaugeMetricFamily(
            "swarm_node_disk_bytes", "Bytes under the run's folder, by entry", labels=["entry"]
        )
        for entry, size in sorted(disk.items()):
            usage.add_metric([entry], size)
        yield usage
    evidence = role.get("evidence")
    if evidence is not None:
        for name in (
            "objects",
            "bytes",
            "pinned_objects",
            "pinned_bytes",
            "summarized_objects",
            "summarized_bytes_dropped",
            "repeats",
        ):
            yield GaugeMetricFamily(
                f"swarm_node_evidence_{name}",
                f"Evidence store: {name}",
                value=evidence.get(name, 0),
            )
    engine = (validator or {}).get("engine")
    if engine is not None:
        yield CounterMetricFamily(
            "swarm_node_engine_restarts", "Compute child restarts", value=engine["restarts"]
        )
        yield GaugeMetricFamily(
            "swarm_node_engine_failed",
            "1 once the compute child could not be brought back (the role is withdrawn)",
            value=0 if engine["failed"] is None else 1,
        )


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
