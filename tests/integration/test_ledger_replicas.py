"""Ledger replicas on real libp2p hosts (127.0.0.1): gossip brings verdicts and events, the
ledger-sync protocol repairs what a replica missed, and an event with a changed amount is refused
by every replica, which says why and counts it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import trio

from node.roles.ledger_sync import LedgerReplica
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, Signed, Verdict, run_id_of, sign
from tests.netfactory import NetFactory, wait_until


def credits(
    key: NodeKey, run: str, workers: list[str], first: int, n: int
) -> list[tuple[Signed[Verdict], Signed[LedgerEvent]]]:
    out = []
    for i in range(first, first + n):
        worker = workers[i % len(workers)]
        sub = hashlib.sha256(f"{worker}/{i}".encode()).digest()
        v = sign(Verdict(run, sub, worker, True, "none", (), (1, 1), i, {}, 0, i), key)
        out.append((v, sign(LedgerEvent(run, "credit", worker, 2, v.id, i), key)))
    return out


async def test_replicas_converge_by_gossip_and_sync_and_all_refuse_a_changed_amount(
    tmp_path: Path,
) -> None:
    async with NetFactory(trainers=1, validators=2) as net:
        await net.bootstrap()
        v0 = await net.node("validator", net.validator_keys[0])
        v1 = await net.node("validator", net.validator_keys[1])
        trainer = await net.node("trainer")
        nodes = (v0, v1, trainer)
        run = run_id_of(net.genesis)
        workers = [f"12D3KooWworker{i}" for i in range(7)]
        stores = [LedgerStore(tmp_path / f"{i}.db", net.genesis) for i in range(3)]
        # Validator 0 judged 600 submissions before the others came up: only sync brings them.
        before = credits(net.validator_keys[0], run, workers, 0, 600)
        stores[0].add([e for _, e in before], verdicts=[v for v, _ in before])
        replicas = [LedgerReplica(n, s, every_s=0.3) for n, s in zip(nodes, stores, strict=True)]
        async with trio.open_nursery() as nursery:
            for r in replicas:
                nursery.start_soon(r.run)
            await wait_until(
                lambda: all(len(n.peers_by_role()["validator"]) >= 1 for n in nodes), 20
            )
            await wait_until(lambda: all(len(s) == 600 for s in stores), 60, poll=0.2)
            # Live: validator 1 gossips a verdict, then its credit; and a credit whose amount
            # was changed after its verdict was signed.
            ((live_v, live_e),) = credits(net.validator_keys[1], run, workers, 1000, 1)
            forged_v, _ = credits(net.validator_keys[1], run, workers, 2000, 1)[0]
            forged = sign(
                LedgerEvent(run, "credit", forged_v.message.worker, 200, forged_v.id, 1),
                net.validator_keys[1],
            )
            stores[1].add([live_e], verdicts=[live_v])
            stores[1].add_verdict(forged_v)
            await wait_until(lambda: len(v1.peers_by_role()["trainer"]) >= 1, 20)
            for signed in (live_v, live_e, forged_v, forged):
                await v1.publish_ledger(signed)
            await wait_until(lambda: all(len(s) == 601 for s in stores), 30, poll=0.2)
            await wait_until(lambda: all(r.refused >= 1 for r in replicas[::2]), 30, poll=0.2)
            nursery.cancel_scope.cancel()
        ids = [s.ids() for s in stores]
        assert ids[0] == ids[1] == ids[2] and forged.id not in ids[0]
        assert stores[0].stored_balances() == stores[1].stored_balances()
        assert stores[1].stored_balances() == stores[2].stored_balances()
        for r in replicas[::2]:  # the two that got the forged event by gossip
            assert "earn 2" in r.last_refusal and r.status()["refused"] >= 1
        assert sum(r.synced_events for r in replicas[1:]) >= 600
        for s in stores:
            s.close()
