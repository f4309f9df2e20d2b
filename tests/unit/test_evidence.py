"""Evidence by content address within a disk budget, request claims with retention, and the
equivocation check (two signed submissions of one assignment)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from node.roles.claims import ClaimBook
from node.roles.evidence import cited
from node.roles.judge import OTHER_SUBMISSION, equivocation
from swarm.evidence import EvidenceStore, address_of
from swarm.identity import NodeKey
from swarm.ledger import EQUIVOCATION
from swarm.messages import LedgerEvent, RolloutSubmission, Sample, Verdict, sign

WORKER = NodeKey.from_seed(b"\x0a" * 32)
OTHER_WORKER = NodeKey.from_seed(b"\x0b" * 32)
VALIDATOR = NodeKey.from_seed(b"\x02" * 32)
RUN = "ab" * 16


def submission(counter: int = 0, created_at: int = 1, payload: int = 0) -> RolloutSubmission:
    sample = Sample("0", (payload,) * 4, 7, (b"p" * 258,), "length")
    return RolloutSubmission(RUN, 0, counter, ("0",), (sample,), created_at)


def test_objects_are_addressed_by_their_sha256_and_pinning_is_kept(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path / "e.db")
    signed = sign(submission(), WORKER)
    object_id = store.put(signed.raw, signed.envelope.kind, pinned=False)
    assert object_id == signed.id == address_of(signed.raw)
    assert store.get(object_id) == signed.raw and object_id in store
    assert not store.pinned(object_id)
    store.put(signed.raw, signed.envelope.kind, pinned=True)
    store.put(signed.raw, signed.envelope.kind, pinned=False)  # never unpins
    assert store.pinned(object_id)
    assert store.get(b"\x00" * 32) is None


def test_the_budget_drops_the_oldest_unpinned_evidence_never_pinned(tmp_path: Path) -> None:
    envelopes = [sign(submission(counter=i), WORKER) for i in range(6)]
    size = len(envelopes[0].raw)
    store = EvidenceStore(tmp_path / "e.db", budget_bytes=3 * size)
    pinned = store.put(envelopes[0].raw, "rollout-submission", pinned=True)
    kept = [store.put(e.raw, "rollout-submission", pinned=False) for e in envelopes[1:]]
    assert pinned in store
    assert [i in store for i in kept] == [False, False, True, True, True]
    usage = store.usage()
    assert usage["pinned_objects"] == 1 and usage["objects"] == 3
    assert usage["bytes"] <= 3 * size


def test_claims_are_shared_by_verdicts_and_pruned_outside_the_window(tmp_path: Path) -> None:
    book = ClaimBook(tmp_path / "c.db")
    first = sign(submission(), WORKER)
    book.claim(WORKER.peer_id, 0, 0, first.id, "me")
    copy = sign(submission(created_at=2), WORKER)
    verdict = sign(
        Verdict(RUN, copy.id, WORKER.peer_id, True, "none", (), (0,), 1, {}, 0, 0), VALIDATOR
    )
    book.note(verdict)
    book.claim(WORKER.peer_id, 0, 0, first.id, "me", b"v" * 32)  # completes, not a new claim
    claims = book.of(WORKER.peer_id, 0, 0)
    assert [(c.submission, c.validator) for c in claims] == [
        (first.id, "me"),
        (copy.id, VALIDATOR.peer_id),
    ]
    assert claims[0].verdict == b"v" * 32 and claims[1].verdict == verdict.id
    assert book.of(WORKER.peer_id, 0, 1) == []
    assert book.prune(1) == 2 and len(book) == 0


def test_two_signed_submissions_of_one_assignment_are_an_equivocation() -> None:
    a = sign(submission(created_at=1), WORKER)
    b = sign(submission(created_at=2, payload=1), WORKER)
    j = equivocation(b, a)
    assert j is not None and j.severity == "hard" and EQUIVOCATION in j.reasons
    assert j.metrics[OTHER_SUBMISSION] == a.id.hex()
    assert equivocation(a, a) is None  # the same envelope twice is a copy, not an equivocation
    assert equivocation(a, sign(submission(counter=1), WORKER)) is None  # another assignment
    assert equivocation(a, sign(submission(created_at=2), OTHER_WORKER)) is None


def test_evidence_cites_what_an_auditor_needs_next() -> None:
    a = sign(submission(), WORKER)
    b = sign(dataclasses.replace(submission(), created_at=5), WORKER)
    verdict = sign(
        Verdict(
            RUN,
            b.id,
            WORKER.peer_id,
            False,
            "hard",
            (EQUIVOCATION,),
            (),
            1,
            {OTHER_SUBMISSION: a.id.hex()},
            0,
            0,
        ),
        VALIDATOR,
    )
    assert cited(verdict) == [b.id, a.id]
    slash = sign(
        LedgerEvent(RUN, "slash", WORKER.peer_id, 1000, verdict.id, 1, related=(a.id,)), VALIDATOR
    )
    assert cited(slash) == [verdict.id, a.id]
    assert cited(a) == []
