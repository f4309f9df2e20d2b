"""A small signed manifest rides in the policy announcement (``inline_manifest``), so no
receiver asks the trainer for it; a receiver checks it as one fetched from a peer
(``announced_manifest``)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from swarm.errors import MalformedError, NotAuthorizedError, ValidationError
from swarm.messages import PolicyAnnouncement, decode, sign
from swarm.messages._base import Fields
from swarm.messages.membership import INLINE_MANIFEST_MAX
from swarm.shardcast import announced_manifest, inline_manifest
from tests.shardcast_util import MALLORY, TRAINER, published


def test_an_announcement_carries_a_small_manifest_and_decodes_it(tmp_path: Path) -> None:
    g, manifest, _store = published(tmp_path)
    carried = inline_manifest(manifest)
    assert carried == manifest.raw
    ann = sign(PolicyAnnouncement(manifest.message.run_id, 1, manifest.id, 5, carried), TRAINER)
    back = decode(ann.raw, PolicyAnnouncement)
    assert back.message.manifest == manifest.raw
    checked = announced_manifest(back, g)
    assert checked is not None and checked.id == manifest.id


def test_without_a_manifest_the_wire_is_as_before(tmp_path: Path) -> None:
    """Announcements that carry none keep the fields (and so the ids) they always had."""
    g, manifest, _store = published(tmp_path)
    bare = PolicyAnnouncement(manifest.message.run_id, 1, manifest.id, 5)
    assert set(bare.to_wire()) == {"run_id", "version", "manifest_id", "issued_at"}
    assert announced_manifest(sign(bare, TRAINER), g) is None


def test_an_inline_manifest_that_is_not_the_named_one_is_malformed(tmp_path: Path) -> None:
    _g, manifest, _store = published(tmp_path)
    wire = PolicyAnnouncement(manifest.message.run_id, 1, b"\x07" * 32, 5).to_wire()
    wire["manifest"] = manifest.raw
    with pytest.raises(MalformedError, match="not the one manifest_id names"):
        PolicyAnnouncement.from_wire(Fields(PolicyAnnouncement.KIND, wire))


def test_an_oversized_inline_manifest_is_malformed() -> None:
    blob = bytes(INLINE_MANIFEST_MAX + 1)
    with pytest.raises(MalformedError, match="at most"):
        PolicyAnnouncement("ab" * 16, 1, hashlib.sha256(blob).digest(), 5, blob)


def test_a_large_manifest_is_not_carried(tmp_path: Path) -> None:
    """Past ``INLINE_MANIFEST_MAX`` the receivers ask peers for it by id, as before."""
    _g, manifest, _store = published(tmp_path)
    shards = INLINE_MANIFEST_MAX // 32 + 8
    big = dataclasses.replace(
        manifest.message,
        files=(dataclasses.replace(manifest.message.files[0], size=shards),),
        shard_size=1,
        shard_hashes=(bytes(32),) * shards,
        total_size=shards,
    )
    assert inline_manifest(sign(big, TRAINER)) == b""


def test_a_carried_manifest_is_checked_like_a_fetched_one(tmp_path: Path) -> None:
    """Signed by the announcing trainer, the announcement may still carry a manifest that is
    not a genesis trainer's, or of another version: refused, never used."""
    g, manifest, _store = published(tmp_path)
    forged = sign(manifest.message, MALLORY)
    ann = sign(PolicyAnnouncement(manifest.message.run_id, 1, forged.id, 5, forged.raw), TRAINER)
    with pytest.raises(NotAuthorizedError, match="not a trainer"):
        announced_manifest(ann, g)
    other = sign(
        PolicyAnnouncement(manifest.message.run_id, 2, manifest.id, 5, manifest.raw), TRAINER
    )
    with pytest.raises(ValidationError, match="asked for version 2"):
        announced_manifest(other, g)
