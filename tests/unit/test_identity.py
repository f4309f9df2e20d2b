from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import (
    KeyCorruptError,
    KeyExistsError,
    KeyPermissionError,
    MalformedError,
    WrongPassphraseError,
)
from swarm.identity import NodeKey, load_key, peer_id_from_public, public_from_peer_id, write_key


@settings(max_examples=50)
@given(seed=st.binary(min_size=32, max_size=32))
def test_peer_id_is_exactly_what_libp2p_derives(seed: bytes) -> None:
    from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pKey
    from libp2p.peer.id import ID

    key = NodeKey.from_seed(seed)
    theirs = Libp2pKey.from_bytes(seed).get_public_key()
    assert theirs.to_bytes() == key.public
    assert key.peer_id == ID.from_pubkey(theirs).to_base58()
    assert public_from_peer_id(key.peer_id) == key.public


def test_peer_id_of_a_non_ed25519_id_is_malformed() -> None:
    with pytest.raises(MalformedError):
        public_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # an RSA-style id
    with pytest.raises(MalformedError):
        public_from_peer_id("not base58 0OIl")
    with pytest.raises(MalformedError):
        peer_id_from_public(b"short")


def test_key_round_trips_through_a_0600_file(tmp_path: Path) -> None:
    key = NodeKey.generate()
    path = tmp_path / "node.key"
    write_key(key, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_key(path).peer_id == key.peer_id


def test_write_key_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first = NodeKey.generate()
    write_key(first, path)
    with pytest.raises(KeyExistsError):
        write_key(NodeKey.generate(), path)
    assert load_key(path).peer_id == first.peer_id


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_key_readable_by_others_is_refused_with_the_chmod_to_run(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "node.key"
    write_key(NodeKey.generate(), path)
    path.chmod(mode)
    with pytest.raises(KeyPermissionError, match=f"chmod 600 {path}"):
        load_key(path)


def test_corrupt_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(b"-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----\n")
    path.chmod(0o600)
    with pytest.raises(KeyCorruptError):
        load_key(path)
    path.write_bytes(os.urandom(100))
    with pytest.raises(KeyCorruptError):
        load_key(path)


def test_encrypted_key_needs_the_right_passphrase(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    key = NodeKey.generate()
    write_key(key, path, b"correct horse")
    assert b"ENCRYPTED" in path.read_bytes()
    with pytest.raises(WrongPassphraseError, match="encrypted"):
        load_key(path)
    with pytest.raises(WrongPassphraseError, match="wrong passphrase"):
        load_key(path, b"battery staple")
    assert load_key(path, b"correct horse").peer_id == key.peer_id


def test_a_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = tmp_path / "node.key"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    with pytest.raises(KeyCorruptError, match="not Ed25519"):
        load_key(path)
