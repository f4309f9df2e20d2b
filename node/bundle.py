"""The proof-bundle file format, apart from the replay code so that a light process (the web
dashboard in a node's main process) can write bundles without loading torch.

A bundle is a msgpack map: ``format`` (``BUNDLE_FORMAT``), ``genesis``, ``submission`` and
``verdict`` (signed envelopes) and ``related`` (other submissions of the same assignment, the
earlier one of a replay). ``swarm-node audit BUNDLE`` replays it (``node.audit.audit_bundle``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

BUNDLE_FORMAT = "swarm-node/proof-bundle/1"


def pack_bundle(
    genesis: bytes, submission: bytes, verdict: bytes, related: Sequence[bytes]
) -> bytes:
    """The bundle's bytes; every argument is a signed envelope as stored."""
    bundle = {
        "format": BUNDLE_FORMAT,
        "genesis": genesis,
        "submission": submission,
        "verdict": verdict,
        "related": list(related),
    }
    return msgpack.packb(bundle, use_bin_type=True)  # type: ignore[no-any-return]
