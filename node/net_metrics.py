"""Opt-in Prometheus metrics of a running node (``--metrics-port``), on 127.0.0.1 only.

A collector reads the node's status when scraped; each node gets its own registry, so several
nodes in one process (tests) never clash. The HTTP server runs on its own thread, so it never
calls ``Node.status()`` (which reads the event loop's SQLite connections: "A server error
occurred" before issue 15); it reads ``Node.status_snapshot``, which the event loop refreshes
every ``STATUS_SNAPSHOT_EVERY_S`` (``swarm_node_status_age_seconds`` says how old it is).

Role metrics (``role_status`` of the snapshot): a validator's judgements by outcome, refusals by
the check that decided (``swarm_node_validator_refusals_total{check}``), judge seconds, claims
and the trainer outbox; a worker's submissions by outcome (stale too), samples generated and
seconds; a trainer's samples in, steps, averaging rounds and seconds, versions published; every
node's policy fetches and publications (versions, bytes, seconds) and shard bytes served;
evidence bytes and objects; engine restarts (each role's child). A bootstrap peer
(``swarm-node bootstrap --metrics-port``) serves its connections, DHT peers, relay reservations,
circuits and bytes relayed. Names follow Prometheus' conventions: a unit suffix (``_seconds``,
``_bytes``), counters end in ``_total``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.errors import NetworkError

log = logging.getLogger(__name__)


class _NodeCollector:
    def __init__(self, node: Any) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        status = self.node.status_snapshot
        if status is None:
            return
        yield from self._node(status)
        yield from _role(status.get("role_status") or {})
        if status.get("role") == "bootstrap":
            yield from _bootstrap(status)

    def _node(self, status: dict[str, Any]) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "swarm_node_status_age_seconds",
            "Seconds since the event loop took the status these metrics show",
            value=max(0.0, time.monotonic() - self.node.started_at - status["uptime_s"]),
        )
        if "peers_by_role" in status:  # a node of a run (not a bootstrap peer)
            peers = GaugeMetricFamily(
                "swarm_node_peers", "Peers found in the run, by role", labels=["role"]
            )
            for role, ids in status["peers_by_role"].items():
                peers.add_metric([role], len(ids))
            yield peers
            version = status["policy_version"]
            yield GaugeMetricFamily(
                "swarm_node_policy_version",
                "Newest policy version known (-1: none)",
                value=-1 if version is None else version,
            )
        yield GaugeMetricFamily(
            "swarm_node_connected_peers", "Open libp2p connections", value=status["connected_peers"]
        )
        bounds = status.get("connections")
        if bounds is not None:  # a run node's connection marks (swarm.net.connections)
            yield GaugeMetricFamily(
                "swarm_node_connections_high",
                "High water mark of connections (the cap)",
                value=bounds["high"],
            )
            yield CounterMetricFamily(
                "swarm_node_connections_trimmed",
                "Connections closed to keep under the high water mark",
                value=bounds["trims"],
            )
        yield GaugeMetricFamily(
            "swarm_node_warnings",
            "Warnings in status (a library internal missing, an identity live elsewhere)",
            value=len(status.get("warnings") or []),
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
            "swarm_node_worker_submissions",
            "Submissions by outcome (stale: made on a version that left the async window first,"
            " dropped unsent)",
            labels=["outcome"],
        )
        for outcome, key in (
            ("submitted", "submitted"),
            ("accepted", "accepted"),
            ("rejected", "rejected"),
            ("stale", "dropped_stale"),
        ):
            submitted.add_metric([outcome], worker.get(key, 0))
        yield submitted
        yield CounterMetricFamily(
            "swarm_node_worker_samples_generated",
            "Completions generated (with their proofs)",
            value=worker.get("samples", 0),
        )
        yield CounterMetricFamily(
            "swarm_node_worker_generate_seconds",
            "Seconds spent generating",
            value=worker.get("generate_seconds", 0.0),
        )
        yield CounterMetricFamily(
            "swarm_node_worker_submit_seconds",
            "Seconds spent handing submissions to validators and waiting for their verdicts",
            value=worker.get("submit_seconds", 0.0),
        )
    trainer = role.get("trainer")
    if trainer is not None:
        yield GaugeMetricFamily(
            "swarm_node_trainer_version", "The policy version trained to", value=trainer["version"]
        )
        yield CounterMetricFamily(
            "swarm_node_trainer_submissions_in",
            "Accepted submissions queued to train",
            value=trainer["queued"],
        )
        yield CounterMetricFamily(
            "swarm_node_trainer_submissions_too_old",
            "Accepted submissions that arrived after they left the async window",
            value=trainer.get("too_old", 0),
        )
        yield CounterMetricFamily(
            "swarm_node_trainer_steps", "Optimizer steps taken", value=trainer.get("steps", 0)
        )
        yield CounterMetricFamily(
            "swarm_node_trainer_versions_published",
            "Policy versions this trainer announced",
            value=trainer.get("published", 0),
        )
        yield CounterMetricFamily(
            "swarm_node_trainer_busy_seconds",
            "Seconds spent stepping",
            value=trainer.get("busy_s", 0.0),
        )
        yield CounterMetricFamily(
            "swarm_node_trainer_rollbacks", "Collapse rollbacks", value=trainer.get("rollbacks", 0)
        )
        group = trainer.get("group")
        if group is not None:
            rounds = CounterMetricFamily(
                "swarm_node_trainer_rounds", "Averaging rounds by outcome", labels=["outcome"]
            )
            for outcome in ("averaged", "failed", "void"):
                rounds.add_metric([outcome], group.get(f"rounds_{outcome}", 0))
            yield rounds
            yield CounterMetricFamily(
                "swarm_node_trainer_averaging_seconds",
                "Seconds spent in averaging rounds",
                value=group.get("averaging_seconds", 0.0),
            )
            yield CounterMetricFamily(
                "swarm_node_trainer_averaged_bytes",
                "Gradient bytes averaged with the other trainers",
                value=group.get("bytes_averaged", 0),
            )
    shardcast = role.get("shardcast")
    if shardcast:
        totals = (shardcast.get("transfers") or {}).get("totals") or {}
        for name, what in (
            ("fetched_versions", "Policy versions fetched"),
            ("fetched_bytes", "Policy bytes fetched (a patch's, or a whole version's)"),
            ("fetch_seconds", "Seconds spent fetching policy versions"),
            ("published_versions", "Policy versions cut and published here"),
            ("published_bytes", "Bytes of the policy versions published here"),
        ):
            yield CounterMetricFamily(
                f"swarm_node_shardcast_{name}", what, value=totals.get(name, 0)
            )
        yield CounterMetricFamily(
            "swarm_node_shardcast_served_bytes",
            "Shard bytes served to peers",
            value=shardcast.get("served_bytes", 0),
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
    engine = next((r["engine"] for r in (validator, worker, trainer) if r and "engine" in r), None)
    if engine is not None:
        yield CounterMetricFamily(
            "swarm_node_engine_restarts",
            "Compute child restarts (the engine child; a trainer's training child)",
            value=engine["restarts"],
        )
        yield GaugeMetricFamily(
            "swarm_node_engine_failed",
            "1 once the compute child could not be brought back (the role is withdrawn)",
            value=0 if engine["failed"] is None else 1,
        )


STATUS_SNAPSHOT_EVERY_S = 1.0
"""How stale the metrics server's view of ``status()`` may be."""


async def keep_status_snapshot(owner: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Keep ``owner.status_snapshot`` fresh for readers on other threads (the metrics server):
    ``status()`` reads SQLite connections and structures that belong to this event loop, so
    only the loop calls it; a reader takes the last snapshot (a deep copy, replaced in one
    assignment), at most ``STATUS_SNAPSHOT_EVERY_S`` old. ``owner``: a node or a bootstrap
    peer."""
    started = False
    while True:
        try:
            owner.status_snapshot = copy.deepcopy(owner.status())
        except Exception as exc:  # a status section that fails must not end the node
            log.warning("status snapshot failed: %s", exc)
        if not started:
            task_status.started()
            started = True
        await trio.sleep(STATUS_SNAPSHOT_EVERY_S)


def _bootstrap(status: dict[str, Any]) -> Iterator[Any]:
    yield GaugeMetricFamily(
        "swarm_node_bootstrap_dht_peers",
        "Peers in the DHT routing table",
        value=status.get("dht_routing_table", 0),
    )
    yield GaugeMetricFamily(
        "swarm_node_bootstrap_runs_routed",
        "Runs whose gossip this peer routes",
        value=len(status.get("runs_routed") or []),
    )
    relay = status.get("relay")
    if relay is not None:
        yield GaugeMetricFamily(
            "swarm_node_relay_reservations",
            "Circuit relay reservations held (nodes behind NAT reachable through this peer)",
            value=relay.get("reservations", 0),
        )
        yield GaugeMetricFamily(
            "swarm_node_relay_circuits", "Relayed circuits open", value=relay.get("circuits", 0)
        )
        yield CounterMetricFamily(
            "swarm_node_relay_bytes",
            "Bytes relayed through circuits (both directions)",
            value=relay.get("relayed_bytes", 0),
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
