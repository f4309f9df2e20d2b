"""The evidence protocol between real hosts on 127.0.0.1: any holder serves an envelope by its
id; an unknown id or a malformed request is refused with a reason; bytes that do not hash to the
asked id are never kept, and the asker moves on to the next holder; an id a budget summarized is
refused as such and the summary recorded by the asker; ``keep`` follows what a
slash cites (its verdict, the verdict's submission, the other submission of an equivocation);
``lookup`` tells a holder's denial from its silence and asks the silent ones again."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.roles.evidence import EvidenceService
from node.roles.judge import OTHER_SUBMISSION
from swarm.errors import PeerError
from swarm.evidence import EvidenceStore, Summary
from swarm.ledger import EQUIVOCATION
from swarm.messages import LedgerEvent, RolloutSubmission, Sample, Verdict, sign
from swarm.net.names import EVIDENCE
from swarm.net.protocols import EVIDENCE_LIMITS
from tests.netfactory import FAST_DIAL, NetFactory, key_named, wait_until

WORKER = key_named("worker")


def _submission(run_id: str, created_at: int) -> RolloutSubmission:
    sample = Sample("0", (1, 2, 3), 7, (b"p" * 258,), "length")
    return RolloutSubmission(run_id, 0, 0, ("0",), (sample,), created_at)


async def test_evidence_is_served_by_id_checked_and_followed(tmp_path: Path) -> None:
    async with NetFactory(validators=1) as net:
        holder = await net.node("validator", bootstrap=[], connect_found_peers=False)
        addr = holder.overlay.addrs()[:1]
        liar = await net.node("inference", bootstrap=addr, connect_found_peers=False)
        asker = await net.node("inference", bootstrap=addr, connect_found_peers=False)
        await wait_until(lambda: len(holder.overlay.connected_peers()) == 2, 10)
        await asker.overlay.dial(liar.overlay.addrs()[:1], FAST_DIAL)

        run_id = holder.run_id
        first = sign(_submission(run_id, 1), WORKER)
        copy = sign(_submission(run_id, 2), WORKER)
        verdict = sign(
            Verdict(
                run_id,
                copy.id,
                WORKER.peer_id,
                False,
                "hard",
                (EQUIVOCATION,),
                (),
                3,
                {OTHER_SUBMISSION: first.id.hex()},
                0,
                0,
            ),
            net.validator_keys[0],
        )
        slash = sign(
            LedgerEvent(run_id, "slash", WORKER.peer_id, 1000, verdict.id, 3, related=(first.id,)),
            net.validator_keys[0],
        )
        served = EvidenceService(holder, EvidenceStore(tmp_path / "holder.db"))
        served.serve()
        for signed in (first, copy, verdict):
            served.store.put(signed.raw, signed.envelope.kind, pinned=True)

        async def lie(peer: str, body: bytes) -> bytes:
            return first.raw  # whatever was asked: the wrong bytes

        liar.handle(EVIDENCE, lie, EVIDENCE_LIMITS)

        # Refusals carry a reason.
        with pytest.raises(PeerError, match="not held"):
            await asker.request(holder.peer_id, EVIDENCE, b"\x00" * 32, EVIDENCE_LIMITS)
        with pytest.raises(PeerError, match="32-byte"):
            await asker.request(holder.peer_id, EVIDENCE, b"short", EVIDENCE_LIMITS)

        fetcher = EvidenceService(asker, EvidenceStore(tmp_path / "asker.db"))
        fetcher.serve()
        # The liar is asked first and answers other bytes: skipped, the holder serves.
        got = await fetcher.fetch(copy.id, [liar.peer_id, holder.peer_id])
        assert got is not None and got.id == copy.id
        assert first.id not in fetcher.store  # the liar's bytes were not kept
        assert await fetcher.fetch(b"\x01" * 32, [liar.peer_id, holder.peer_id]) is None

        # A denial is an answer; other bytes, a busy refusal or no host at all are silence
        # (an audit may not call an object unknown on them), and the silent are asked again.
        nobody = key_named("evidence-nobody").peer_id
        found = await fetcher.lookup(
            b"\x01" * 32, [liar.peer_id, holder.peer_id, nobody], tries=2, pause=0.01
        )
        assert found.signed is None and found.denied == {holder.peer_id}
        assert set(found.silent) == {liar.peer_id, nobody}
        assert "other bytes" in found.silent[liar.peer_id]
        calls = []
        only_liar = sign(_submission(run_id, 5), WORKER)

        async def busy_once(peer: str, body: bytes) -> bytes:
            calls.append(body)
            if len(calls) == 1:
                raise PeerError("busy: try again")
            return only_liar.raw

        liar.handle(EVIDENCE, busy_once, EVIDENCE_LIMITS)
        late = EvidenceService(asker, EvidenceStore(tmp_path / "late.db"))
        found = await late.lookup(only_liar.id, [liar.peer_id], tries=1)
        assert found.signed is None and "busy" in found.silent[liar.peer_id], found
        calls.clear()
        found = await late.lookup(only_liar.id, [liar.peer_id], tries=2, pause=0.01)
        assert found.signed is not None and found.signed.id == only_liar.id, found
        assert len(calls) == 2 and holder.peer_id in found.denied
        # Only the holders whose answer matters are asked again (``retry``).
        calls.clear()
        found = await EvidenceService(asker, EvidenceStore(tmp_path / "once.db")).lookup(
            only_liar.id, [liar.peer_id], tries=3, pause=0.01, retry=[holder.peer_id]
        )
        assert found.signed is None and len(calls) == 1 and liar.peer_id in found.silent

        # Keeping a slash's evidence follows what it cites, and pins it.
        held = await fetcher.keep(
            [slash.message.evidence, *slash.message.related], [holder.peer_id], pinned=True
        )
        assert {s.id for s in held} == {verdict.id, copy.id, first.id}
        assert all(fetcher.store.pinned(i) for i in (verdict.id, copy.id, first.id))
        # Now the asker is a holder too.
        assert await holder.request(asker.peer_id, EVIDENCE, verdict.id, EVIDENCE_LIMITS) == (
            verdict.raw
        )
        assert isinstance(held[0].message, Verdict)
        assert isinstance(held[1].message, RolloutSubmission)

        # Evidence a holder's budget summarized (issue 15): refused as summarized, and the asker
        # records the summary, so an audit names it instead of calling it missing.
        dropped = sign(_submission(run_id, 9), WORKER)
        served.store.note_summary(
            Summary(dropped.id, dropped.envelope.kind, len(dropped.raw), None, 2)
        )
        with pytest.raises(PeerError, match=r"summarized rollout-submission \d+ 2"):
            await asker.request(holder.peer_id, EVIDENCE, dropped.id, EVIDENCE_LIMITS)
        assert await fetcher.fetch(dropped.id, [holder.peer_id]) is None
        noted = fetcher.store.summary(dropped.id)
        assert noted is not None and noted.size == len(dropped.raw) and noted.seen == 2
