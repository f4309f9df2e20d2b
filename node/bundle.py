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

from collections.abc import Iterable, Sequence

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


def policy_of(genesis: Signed[RunGenesis], version: int, raws: Iterable[bytes]) -> list[bytes]:
    """What a bundle of a submission of ``version`` holds as ``policy``, of the announcements
    ``raws`` (read lazily, up to the first that counts): that one alone, or nothing when none
    counts or the run has no quota (its assignment does not mix the manifest id)."""
    g = genesis.message
    if not g.params.quota:
        return []
    run_id = run_id_of(genesis)
    for raw in raws:
        try:
            announcement = decode(raw, PolicyAnnouncement)
        except SwarmError:
            continue
        a = announcement.message
        if a.version == version and a.run_id == run_id and announcement.signer in g.trainers:
            return [raw]
    return []
