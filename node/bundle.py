"""The proof-bundle file format, apart from the replay code so that a light process (the web
dashboard in a node's main process) can write bundles without loading torch.

A bundle is a msgpack map: ``format`` (``BUNDLE_FORMAT``), ``genesis``, ``submission`` and
``verdict`` (signed envelopes), ``related`` (other submissions of the same assignment, the
earlier one of a replay) and, only when there is one to give, ``policy``: a list of signed
``PolicyAnnouncement`` envelopes of the submission's policy version. A run with a quota assigns
prompts and seeds from that version's manifest id, so a bundle with it replays alone; without
the key (a run without a quota, or an announcement nobody kept) a bundle has the exact bytes of
a bundle from before the key existed. ``policy_of`` picks what goes there: the announcement the
audit would count (of this run, signed by a genesis trainer, the first held of the version).
``swarm-node audit BUNDLE`` replays it (``node.audit.audit_bundle``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgpack

from swarm.errors import SwarmError
from swarm.messages import PolicyAnnouncement, RunGenesis, Signed, decode, run_id_of

BUNDLE_FORMAT = "swarm-node/proof-bundle/1"


def pack_bundle(
    genesis: bytes,
    submission: bytes,
    verdict: bytes,
    related: Sequence[bytes],
    policy: Sequence[bytes] = (),
) -> bytes:
    """The bundle's bytes; every argument is a signed envelope as stored (``policy``: written
    only when not empty, see the module docstring)."""
    bundle = {
        "format": BUNDLE_FORMAT,
        "genesis": genesis,
        "submission": submission,
        "verdict": verdict,
        "related": list(related),
    }
    if policy:
        bundle["policy"] = list(policy)
    return msgpack.packb(bundle, use_bin_type=True)  # type: ignore[no-any-return]


def trainer_announcements(
    genesis: Signed[RunGenesis], raws: Iterable[bytes]
) -> Iterator[tuple[bytes, PolicyAnnouncement]]:
    """The announcements among ``raws`` (read lazily) that count for ``genesis``: of this run,
    signed by one of its genesis trainers (what the validators' gate accepts); anything else,
    undecodable bytes included, is skipped. What the audit's manifest ids and ``policy_of``
    both read."""
    run_id = run_id_of(genesis)
    trainers = set(genesis.message.trainers)
    for raw in raws:
        try:
            announcement = decode(raw, PolicyAnnouncement)
        except SwarmError:
            continue
        if announcement.signer in trainers and announcement.message.run_id == run_id:
            yield raw, announcement.message


def policy_of(genesis: Signed[RunGenesis], version: int, raws: Iterable[bytes]) -> list[bytes]:
    """What a bundle of a submission of ``version`` holds as ``policy``, of the announcements
    ``raws`` (read lazily, up to the first that counts): that one alone, or nothing when none
    counts or the run has no quota (its assignment does not mix the manifest id)."""
    if not genesis.message.params.quota:
        return []
    for raw, announcement in trainer_announcements(genesis, raws):
        if announcement.version == version:
            return [raw]
    return []
