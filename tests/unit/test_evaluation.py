"""Held-out evaluation: a replayed item scores what the batch gave it; the ledger gate takes an
Evaluation only from the validator due for a version at the cadence; the store keeps the first
record of a version; an evaluator evaluates each of its versions once, across restarts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from node.rl.evaluation import evaluate, evaluation_record, replay_item
from node.roles.evaluator import RETRIES, RETRY_S, Evaluator
from node.tasks.suite import default_suite
from swarm.identity import NodeKey
from swarm.ledger.evaluations import EvaluationStore
from swarm.messages import RunParams, Signed, eval_seed, eval_validator, sign
from swarm.net.gossip import GossipStats, LedgerGate, Refused

RUN = "run-under-test"
KEYS = [NodeKey.from_seed(bytes([40 + i]) * 32) for i in range(3)]
VALIDATORS = [k.peer_id for k in KEYS]
OUTSIDER = NodeKey.from_seed(b"\x63" * 32)
PARAMS = RunParams(max_tokens=12, eval_every=5, eval_size=8)


def key_due(version: int) -> NodeKey:
    due = eval_validator(RUN, version, VALIDATORS)
    return next(k for k in KEYS if k.peer_id == due)


def key_not_due(version: int) -> NodeKey:
    due = eval_validator(RUN, version, VALIDATORS)
    return next(k for k in KEYS if k.peer_id != due)


def record(version: int, key: NodeKey, scores: tuple[int, ...] = (1_000_000, 0)) -> Any:
    ids = tuple(range(100, 100 + len(scores)))
    return sign(evaluation_record(RUN, version, eval_seed(RUN, version), ids, scores, 1), key)


def test_an_item_replayed_alone_scores_what_the_batch_gave_it() -> None:
    from node.compute.torch_engine import TorchEngine
    from node.model import DEFAULT_MODEL_DIR

    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
    source = default_suite()
    ids = list(range(source.size - 16, source.size))
    seed = eval_seed(RUN, 5)
    batch = evaluate(engine, source, ids, PARAMS, seed)
    assert len(batch) == len(ids) and len(set(batch)) > 1  # not all the same score
    for i in (0, 7, 15):
        assert replay_item(engine, source, ids[i], PARAMS, seed) == batch[i]
    assert evaluate(engine, source, ids, PARAMS, seed + 1) != batch  # the seed matters


def gate() -> LedgerGate:
    return LedgerGate(RUN, VALIDATORS, GossipStats(), validators=VALIDATORS, eval_every=5)


def test_the_gate_takes_an_evaluation_from_the_due_validator_of_a_due_version() -> None:
    g = gate()
    for version in (0, 5, 10):
        assert g.accept(record(version, key_due(version)).raw) is not None
    assert g.stats.accepted["ledger"] == 3


@pytest.mark.parametrize(
    ("version", "signer", "reason"),
    [
        (5, key_not_due, "not-due"),  # a validator, but not the one due for v5
        (3, key_due, "not-due"),  # out of cadence (every 5)
        (5, lambda v: OUTSIDER, "not-authorized"),  # no genesis validator
    ],
)
def test_the_gate_refuses_a_forged_or_out_of_cadence_evaluation(
    version: int, signer: Any, reason: str
) -> None:
    g = gate()
    forged = record(version, signer(version))
    with pytest.raises(Refused) as caught:
        g.check(forged.raw)
    assert caught.value.reason == reason
    assert g.accept(forged.raw) is None
    assert g.stats.rejected["ledger", reason] == 1


def test_evaluation_off_refuses_every_evaluation() -> None:
    g = LedgerGate(RUN, VALIDATORS, GossipStats(), validators=VALIDATORS, eval_every=0)
    with pytest.raises(Refused, match="cadence off"):
        g.check(record(0, key_due(0)).raw)


def test_the_store_keeps_the_first_record_of_a_version_and_sets_a_second_aside(
    tmp_path: Path,
) -> None:
    store = EvaluationStore(tmp_path / "evaluations.db")
    first = record(0, key_due(0), (0, 500_000))
    assert store.add(first) == "stored"
    assert store.add(first) == "again"
    assert store.add(record(0, key_due(0), (1_000_000, 1_000_000))) == "conflict"
    assert store.add(record(5, key_due(5), (1_000_000, 500_000))) == "stored"
    assert store.records()[0].id == first.id
    summary = store.summary()
    assert summary["count"] == 2 and summary["conflicts"] == 1
    assert summary["first_mean"] == 0.25 and summary["latest_mean"] == 0.75
    assert summary["gain"] == pytest.approx(0.5)
    store.close()
    reader = EvaluationStore(tmp_path / "evaluations.db", read_only=True)
    assert [p["version"] for p in reader.curve()] == [0, 5]
    reader.close()


class Policy:
    """A policy tracker that announced versions 0..newest."""

    def __init__(self, newest: int | None) -> None:
        self.version = newest
        self._changed = trio.Event()

    def announce(self, version: int) -> None:
        self.version = version
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, version: int) -> Any:
        while self.version is None or version > self.version:
            await self._changed.wait()
        return SimpleNamespace(message=SimpleNamespace(version=self.version))


def evaluator(key: NodeKey, store: EvaluationStore, policy: Policy, log: list[Any]) -> Evaluator:
    async def on_version(version: int, work: Any) -> list[int]:
        log.append(version)
        return [version, 1_000_000]  # what "work" would score, without a model

    async def publish(signed: Signed[Any]) -> None:
        log.append(signed)

    async def hold(version: int) -> bool:
        return True

    return Evaluator(
        run_id=RUN,
        key=key,
        params=PARAMS,
        validators=VALIDATORS,
        source=default_suite(),
        item_ids=[7, 8],
        store=store,
        policy=policy,
        on_version=on_version,
        hold=hold,
        publish=publish,
    )


async def test_an_evaluator_evaluates_its_own_due_versions_once_across_restarts(
    tmp_path: Path,
) -> None:
    key = key_due(0)
    mine = [v for v in range(0, 31, 5) if eval_validator(RUN, v, VALIDATORS) == key.peer_id]
    assert 0 in mine and len(mine) < 7  # the others' versions are theirs
    store = EvaluationStore(tmp_path / "evaluations.db")
    for restart in range(2):
        log: list[Any] = []
        policy = Policy(None)
        ev = evaluator(key, store, policy, log)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ev.run)
            await trio.testing.wait_all_tasks_blocked()
            policy.announce(30)  # versions 0..30 announced at once
            await trio.testing.wait_all_tasks_blocked()  # all evaluated, waiting for v31
            nursery.cancel_scope.cancel()
        evaluated = [x for x in log if isinstance(x, int)]
        if restart == 0:
            assert evaluated == mine
            published = [x for x in log if not isinstance(x, int)]
            assert [p.message.version for p in published] == mine
            assert all(p.signer == key.peer_id for p in published)
        else:
            assert evaluated == []  # held in the store: never again
    assert [r.message.version for r in store.records()] == mine
    store.close()


async def test_a_missed_version_is_tried_again_and_given_up_after_the_retries(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """A due version whose weights could not be held (a fetch that timed out) is evaluated on a
    later try; one that never becomes holdable is given up after ``RETRIES`` more tries."""
    key = key_due(0)
    mine = [v for v in range(0, 31, 5) if eval_validator(RUN, v, VALIDATORS) == key.peer_id]
    store = EvaluationStore(tmp_path / "evaluations.db")
    log: list[Any] = []
    policy = Policy(None)
    ev = evaluator(key, store, policy, log)
    tries: dict[int, int] = {}
    never = mine[-1]

    async def flaky(version: int) -> bool:
        tries[version] = tries.get(version, 0) + 1
        return version != never and tries[version] > 1  # held from the second try on

    async def held_here_only_after(version: int, work: Any) -> list[int] | None:
        return [version, 1] if tries.get(version, 0) > 1 and version != never else None

    ev.hold = flaky
    ev.on_version = held_here_only_after
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ev.run)
        await trio.testing.wait_all_tasks_blocked()
        policy.announce(30)
        await trio.sleep(RETRY_S * (RETRIES + 2))  # every retry is due by then
        nursery.cancel_scope.cancel()
    assert [r.message.version for r in store.records()] == mine[:-1]
    assert tries[never] == RETRIES + 1 and all(tries[v] == 2 for v in mine[:-1])
    assert ev.stats.given_up == 1 and ev.stats.evaluated == len(mine) - 1
    store.close()


async def test_a_pull_keeps_only_gate_checked_evaluations(tmp_path: Path) -> None:
    import msgpack

    from node.roles.evaluation_sync import EvaluationSync
    from swarm.messages import Verdict

    verdict = sign(Verdict(RUN, bytes(32), KEYS[0].peer_id, True, "none", (), (), 1), KEYS[0])
    answer = [
        record(0, key_due(0)).raw,  # kept
        record(5, key_not_due(5)).raw,  # signed by a validator not due: refused
        record(3, key_due(3)).raw,  # not at the cadence: refused
        verdict.raw,  # passes the ledger gate, but is no evaluation: refused
        b"not an envelope",
    ]

    async def request(peer: str, name: str, body: bytes, limits: Any) -> bytes:
        assert msgpack.unpackb(body) == []  # we hold nothing yet
        return bytes(msgpack.packb(answer, use_bin_type=True))

    node = SimpleNamespace(request=request, ledger_gate=gate())
    store = EvaluationStore(tmp_path / "evaluations.db")
    sync = EvaluationSync(node, store)  # type: ignore[arg-type]
    assert await sync.pull("peer") == 1
    assert [r.message.version for r in store.records()] == [0]
    assert sync.refused == 4
    store.close()


def test_status_shows_the_held_out_curve_in_one_line(tmp_path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from cli.status import _role_rows

    store = EvaluationStore(tmp_path / "evaluations.db")
    store.add(record(0, key_due(0), (0, 1_000_000)))
    store.add(record(5, key_due(5), (1_000_000, 1_000_000)))
    table = Table(show_header=False)
    _role_rows(table, {"evaluation": store.summary()})
    store.close()
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "held-out evaluation" in text and "v0 0.500 -> v5 1.000 (+0.500)" in text
    assert "2 signed evaluations held" in text
